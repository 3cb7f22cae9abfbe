"""What gradient accumulation costs at start-up: the seconds to trace and lower, then to compile, the train step of a
small GPT (4 layers, width 64, block 32, characters) on 2 simulated CPU devices, for each `train.grad_accum_steps`
(docs/benchmarks.md, "Accumulation at start-up"). Medians of `--repeats`, the counts interleaved:

    python benchmarks/accum_trace.py --accum 1,8 --repeats 3
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import jax


def timed(text_file: Path, k: int) -> tuple[float, float]:
    from jdp.cli.train import build
    from jdp.configs import base

    cfg = base.get_config()
    cfg.model.update(name="gpt", kwargs={"num_layers": 4, "num_heads": 4, "embed_dim": 64})
    cfg.data.update(name=f"text:{text_file}", block_size=32)
    cfg.task.loss = "lm"
    cfg.train.update(global_batch_size=8 * k, grad_accum_steps=k, steps=1)
    cfg.parallel.num_devices, cfg.compile_cache_dir = 2, ""
    b = build(cfg)
    state = b.parallel.to_devices(b.init_state())
    batch = b.parallel.shard_batch(b.source.train_batch(0))
    t0 = time.perf_counter()
    lowered = b.parallel.lower_train(state, batch)
    t1 = time.perf_counter()
    lowered.compile()
    return t1 - t0, time.perf_counter() - t1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--accum", default="1,8", help="comma-separated grad_accum_steps")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    jax.config.update("jax_num_cpu_devices", 2)
    counts = [int(k) for k in args.accum.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        text = Path(tmp) / "text.txt"
        text.write_text("the quick brown fox jumps over the lazy dog. " * 400)
        runs: dict[int, list[tuple[float, float]]] = {k: [] for k in counts}
        for _ in range(args.repeats):
            for k in counts:
                runs[k].append(timed(text, k))
    for k, times in runs.items():
        trace, compile_s = (statistics.median(t[i] for t in times) for i in (0, 1))
        print(f"grad_accum_steps={k}: trace+lower {trace:.2f} s, compile {compile_s:.2f} s (median of {len(times)})")


if __name__ == "__main__":
    main()
