"""Interleaved throughput of config variants against the first one, measured in the same run.

    python benchmarks/bench_variants.py --config configs/synthetic_mlp.py --devices 2 \
        --variant base: --variant accum4:train.grad_accum_steps=4 --variant bf16ar:parallel.allreduce_dtype=bf16

Each --variant is NAME:KEY=VALUE[,KEY=VALUE...] (config overrides). Prints a markdown table of median
examples/sec, step time and the ratio to the first variant, plus per-device optimizer-state memory.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jdp.mesh import simulate_cpu_devices  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, required=True)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--variant", action="append", required=True)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    simulate_cpu_devices(args.devices)

    from jdp.cli import config as config_lib
    from jdp.perf import measure

    variants = {}
    for spec in args.variant:
        name, _, overrides = spec.partition(":")
        items = re.split(r",(?=[\w.]+=)", overrides) if overrides else []  # commas inside (a, b) values stay
        pairs = config_lib.parse_overrides([f"--config.{item}" for item in items])
        variants[name] = config_lib.apply_overrides(config_lib.load_config_file(args.config), pairs)
    built = {name: measure.Variant(cfg, args.devices) for name, cfg in variants.items()}  # each compiled once
    results = {name: [] for name in variants}
    for _ in range(args.repeats):
        for name, variant in built.items():
            results[name].append(variant.row(variant.time(args.steps)))
    first = statistics.median(r["examples_per_sec"] for r in next(iter(results.values())))
    print(f"{args.config.name}, {args.devices} devices, global batch "
          f"{next(iter(variants.values())).train.global_batch_size}, medians of {args.repeats} interleaved runs\n")
    print("| variant | examples/s | step ms | ratio | opt state MB/device |\n|---|---|---|---|---|")
    for name, rows in results.items():
        eps = statistics.median(r["examples_per_sec"] for r in rows)
        step = statistics.median(r["step_s"] for r in rows)
        print(f"| {name} | {eps:,.0f} | {step * 1e3:.2f} | {eps / first:.3f} | "
              f"{rows[0]['opt_state_bytes'] / 2**20:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
