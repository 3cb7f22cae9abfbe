"""Cost of the per-leaf digests of a checkpoint save: jdp's save (a host copy on the training thread, the digests
on orbax's save thread) against the same orbax save without them (jdp's save before digests), interleaved and
repeated, medians. `stall` is the time the training thread spends in save(); `total` adds the wait for the
background write to finish.

    python benchmarks/bench_checkpoint_digest.py --config synthetic_mlp --repeats 7
    python benchmarks/bench_checkpoint_digest.py --config synthetic_mlp --repeats 7 --devices 8 --shard_params

With `--shard_params` the state is ZeRO-3's, split across `--devices` simulated devices: its digests are word sums
computed on the devices (`jdp.digest.pending`), and orbax writes each device's parts.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import jax
import orbax.checkpoint as ocp

from jdp import digest
from jdp.checkpoint import FORMAT, Checkpointer
from jdp.cli import config as config_lib
from jdp.cli.build import build
from jdp.mesh import simulate_cpu_devices


def timed_save(save, wait) -> tuple[float, float]:
    t0 = time.perf_counter()
    save()
    stall = time.perf_counter() - t0
    wait()
    return stall, time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="synthetic_mlp")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--shard_params", action="store_true")
    args = parser.parse_args()
    simulate_cpu_devices(args.devices if args.devices > 1 else 0)
    cfg = config_lib.load_config_file(args.config)
    cfg.parallel.num_devices, cfg.parallel.shard_params = args.devices, args.shard_params
    engine = build(cfg)
    state = engine.parallel.to_logical(engine.parallel.to_devices(engine.init_state()))
    jax.block_until_ready(state)
    megabytes = sum(x.nbytes for x in jax.tree.leaves(state)) / 2**20
    root = Path(tempfile.mkdtemp(prefix="jdp-digest-bench-"))
    with_digests = Checkpointer(root / "with", keep=2, every_steps=0)
    without = ocp.CheckpointManager(root / "without", options=ocp.CheckpointManagerOptions(
        max_to_keep=2, enable_async_checkpointing=True, create=True))
    data = {"step": 0, "epoch": 0, "format": FORMAT}
    rows = {"with digests": [], "without": [], "digests alone": []}
    for step in range(1, args.repeats + 2):  # the first round warms up and is left out
        a = timed_save(lambda step=step: with_digests.save(step, state, {"step": step, "epoch": 0}), with_digests.wait)
        b = timed_save(lambda step=step: without.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data)), force=True), without.wait_until_finished)
        t0 = time.perf_counter()
        digest.pending(state)()
        alone = time.perf_counter() - t0
        if step > 1:
            rows["with digests"].append(a)
            rows["without"].append(b)
            rows["digests alone"].append((None, alone))  # no save: no stall
    with_digests.close()
    without.close()
    shutil.rmtree(root)
    print(f"{args.config}: train state {megabytes:.1f} MiB on {args.devices} device(s)"
          f"{', ZeRO-3' if args.shard_params else ''}, {args.repeats} interleaved saves each, medians")
    print("| save | stall ms | total ms |\n|---|---|---|")
    for name, times in rows.items():
        stall = "—" if times[0][0] is None else f"{statistics.median(t[0] for t in times) * 1e3:.1f}"
        print(f"| {name} | {stall} | {statistics.median(t[1] for t in times) * 1e3:.1f} |")


if __name__ == "__main__":
    main()
