"""The jdp side of a comparison, in its own process for its own simulated device count:
`python -m jdp.compare.jdp_side init|parity CFG.json DIR` (`write_init`, `parity`).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np


def write_init(cfg, out: Path) -> None:
    """OUT/init.npz (jdp.export's keys) and OUT/lrs.json (each step's learning rate, for the DDP side) on one device."""
    from jdp.cli.build import build
    from jdp.cli.optim import learning_rate
    from jdp.params_file import flatten

    one = cfg.copy_and_resolve_references()
    one.parallel.num_devices, one.init_from = 1, ""
    state = build(one).init_state()
    arrays = {**flatten(state.params, "params"), **flatten(state.model_state, "model_state"), "step": np.int64(0)}
    np.savez(out / "init.npz", **arrays)
    schedule = learning_rate(cfg.optim, cfg.train.global_batch_size, cfg.train.steps)
    (out / "lrs.json").write_text(json.dumps([float(schedule(t)) for t in range(cfg.train.steps)]))


def parity(cfg, out: Path) -> None:
    """`write_init`, then `jdp.train.run` from init.npz: OUT/jdp_result.json (per-step losses and gradient norms
    before clipping) and OUT/jdp_final.npz."""
    from jdp.cli.train import enable_compilation_cache, run
    from jdp.mesh import simulate_cpu_devices
    from jdp.metrics import read_metrics
    from jdp.params_file import flatten

    simulate_cpu_devices(cfg.parallel.cpu_devices)  # 0 (cuda): the real devices
    enable_compilation_cache(cfg.compile_cache_dir)
    write_init(cfg, out)
    cfg.init_from = str(out / "init.npz")
    workdir = out / "jdp_run"
    result = run(cfg, workdir)
    lines = read_metrics(workdir)
    train = sorted((r for r in lines if r["split"] == "train"), key=lambda r: r["step"])
    summary = next(r for r in lines if r["split"] == "summary")
    losses = [r["loss"] for r in train]
    if len(losses) != cfg.train.steps or losses != result.losses:
        raise RuntimeError(f"metrics.jsonl has {len(losses)} per-step losses for {cfg.train.steps} steps "
                           "(is train.log_every 1, and was no step skipped?)")
    np.savez(out / "jdp_final.npz", **flatten(result.params, "params"), **flatten(result.model_state, "model_state"))
    (out / "jdp_result.json").write_text(json.dumps({
        "losses": losses, "grad_norms": [r["grad_norm"] for r in train], "eval_loss": result.eval_loss,
        "eval_accuracy": result.eval_accuracy, "comm_bytes_per_step": summary.get("comm_bytes_per_step")}))


def main(argv: list[str] | None = None) -> int:
    command, config, out = sys.argv[1:] if argv is None else argv
    from jdp import UsageError
    from jdp.cli import config as config_lib

    cfg = config_lib.load_saved_config(Path(config))
    try:
        (write_init if command == "init" else parity)(cfg, Path(out))
    except UsageError as e:  # the config's own checks, which need its data: one line, as jdp.train's
        print(f"jdp: error: {e}", file=sys.stderr)  # read back by `procs.run`
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
