"""What the input pipeline costs: training throughput with the real pipeline vs with batches already on the
device (a few batches reused), for the same model and step.

    python benchmarks/bench_input.py [--run_seconds 0.5] [--repeats 7] [--only SUBSTRING]

Workloads: the MNIST-1D CNN (configs/mnist1d_cnn.py, in-memory source) and two small-image CNNs (cnn2d: the
synthetic_cnn2d config's conv32-conv64-pool-dense128, and a light conv8-conv16-pool-dense64 whose step is
short enough to show the pipeline) on the committed tfds fixture tests/fixtures/tfds/tiny_cifar (PNG-encoded
32x32x3, cycled: a new epoch permutation every 200 examples), with and without the decoded-image cache
(without it every image is decoded every time, as in a first epoch), with a background thread that
puts the next batch on the devices (measured, not used by jdp.cli.train), and, against the same step
without its on-device crop, flip and normalisation, fed float32 inputs prepared on the host (what the
on-device preprocessing costs the step). Pillow's figures: run with opencv-python-headless uninstalled.

Each mode runs the trainer's loop (`jdp.train.run`: read and shard the batch, dispatch the step, fetch the
previous step's metrics) for about `--run_seconds`. Modes are interleaved; a run during which other
processes used more than `--max_foreign` of the machine's CPU (from /proc/stat) is thrown away and
repeated, and the median of `--repeats` clean runs is reported as a markdown table. Run it without
simulated devices (one CPU device).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from unittest import mock

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jdp.cli.train import build  # noqa: E402
from jdp.configs import base, mnist1d_cnn  # noqa: E402
from jdp.data import TfdsSource, tfds_source  # noqa: E402

FIXTURE_DIR = ROOT / "tests" / "fixtures" / "tfds"
ON_DEVICE = "batches on device"
PIPELINE = "input pipeline"
NO_CACHE = "input pipeline, no decoded-image cache (first epoch)"
PREFETCH = "input pipeline + device-prefetch thread (not used)"
HOST_PREPARED = "float32 batches on device, prepared on the host (no crop, flip, normalise in the step)"


def _cnn2d_tiny_cifar(channels: tuple[int, ...], dense: int):
    def get_config():
        c = base.get_config()
        c.model.update(name="cnn2d", kwargs={"channels": channels, "dense_sizes": (dense,)})
        c.data.update(name="tfds:tiny_cifar", data_dir=str(FIXTURE_DIR))
        c.optim.update(name="sgd", lr=0.05)
        return c

    return get_config


WORKLOADS = {
    "MNIST-1D CNN (cnn1d), mnist1d in memory": mnist1d_cnn.get_config,
    "cnn2d conv32-conv64-dense128, tfds:tiny_cifar": _cnn2d_tiny_cifar((32, 64), 128),
    "cnn2d conv8-conv16-dense64 (light), tfds:tiny_cifar": _cnn2d_tiny_cifar((8, 16), 64),
}


class ForeignLoad:
    """The share of the machine's CPU used by other processes between start() and stop() (Linux)."""

    def start(self) -> None:
        self._t, self._stat, self._own = time.perf_counter(), self._busy(), self._own_cpu()

    def stop(self) -> float:
        wall = time.perf_counter() - self._t
        busy = self._busy() - self._stat
        own = self._own_cpu() - self._own
        return max(0.0, (busy - own) / (wall * (os.cpu_count() or 1)))

    @staticmethod
    def _busy() -> float:
        try:
            fields = [int(v) for v in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
        except OSError:
            return 0.0
        idle = fields[3] + fields[4]  # idle + iowait
        return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")

    @staticmethod
    def _own_cpu() -> float:
        t = os.times()
        return t.user + t.system


def _loop(parallel, state, batches, steps: int, start: int):
    """The trainer's loop for `steps` steps; `batches(i)` gives step i's device batch."""
    pending = None
    for i in range(start, start + steps):
        state, metrics = parallel.train_step(state, batches(i))
        if pending is not None:
            parallel.fetch(pending)
        pending = metrics
    parallel.fetch(pending)
    return state


def _loop_prefetched(parallel, state, source, steps: int, start: int):
    """The loop with a device-prefetch thread (measured, not used by jdp.cli.train): it reads step i+1's
    batch and puts it on the devices while step i runs."""
    pending = None
    with ThreadPoolExecutor(1) as pool:
        def load(i: int):
            return parallel.shard_batch(source.train_batch(i))

        upcoming = pool.submit(load, start)
        for i in range(start, start + steps):
            batch = upcoming.result()
            if i + 1 < start + steps:
                upcoming = pool.submit(load, i + 1)
            state, metrics = parallel.train_step(state, batch)
            if pending is not None:
                parallel.fetch(pending)
            pending = metrics
        parallel.fetch(pending)
    return state


def bench(name: str, make_config, args) -> list[tuple]:
    cfg = make_config()
    cfg.train.global_batch_size = args.batch
    cfg.compile_cache_dir = ""
    b = build(cfg)
    parallel, source = b.parallel, b.source
    modes = [ON_DEVICE, PIPELINE]
    uncached = None
    if isinstance(source, TfdsSource):
        no_cache = cfg.data.copy_and_resolve_references()
        no_cache.cache_decoded_mb = 0
        uncached = TfdsSource(no_cache, seed=cfg.seed, global_batch_size=args.batch, eval_batch_size=args.batch)
        modes.append(NO_CACHE)
    modes.append(PREFETCH)
    rows = [source.train_batch(i) for i in range(4)]
    resident = [parallel.shard_batch(r) for r in rows]
    jax.block_until_ready(resident)
    plain_state = None
    if uncached:  # the same model and step without device preprocessing, fed the model's input itself
        modes.append(HOST_PREPARED)
        with mock.patch.object(tfds_source, "ImageInput", lambda *_: lambda batch: batch):
            plain = build(cfg)
        plain.source.close()
        prepared = [plain.parallel.shard_batch({"x": np.asarray(source.device_input(r)["x"]), "y": r["y"]})
                    for r in rows]
        plain_state = plain.parallel.to_devices(plain.init_state())
        plain_state = _loop(plain.parallel, plain_state, lambda i: prepared[i % 4], 3, 0)  # compile, warm up

    def run_mode(mode: str, state, start: int):
        nonlocal plain_state
        if mode == ON_DEVICE:
            return _loop(parallel, state, lambda i: resident[i % 4], steps, start)
        if mode == HOST_PREPARED:
            plain_state = _loop(plain.parallel, plain_state, lambda i: prepared[i % 4], steps, start)
            return state
        if mode == PREFETCH:
            return _loop_prefetched(parallel, state, source, steps, start)
        reader = uncached if mode == NO_CACHE else source
        return _loop(parallel, state, lambda i: parallel.shard_batch(reader.train_batch(i)), steps, start)

    state = parallel.to_devices(b.init_state())
    state = _loop(parallel, state, lambda i: resident[i % 4], 3, 0)  # compile, warm up
    t = time.perf_counter()
    state = _loop(parallel, state, lambda i: resident[i % 4], 5, 0)
    steps = int(min(2000, max(5, round(args.run_seconds * 5 / (time.perf_counter() - t)))))

    def host_ms(reader) -> float:
        """The host's cost of one batch, alone (no training running; a decoded-image cache is warm)."""
        times = []
        for i in range(20):
            t = time.perf_counter()
            reader.train_batch(10_000 + i % 2)
            times.append((time.perf_counter() - t) * 1e3)
        return statistics.median(times)

    host = dict.fromkeys(modes, host_ms(source))
    host.update({ON_DEVICE: 0.0, HOST_PREPARED: 0.0})
    if uncached:
        host[NO_CACHE] = host_ms(uncached)

    times: dict[str, list[float]] = {mode: [] for mode in modes}
    load, step, discarded, foreign = ForeignLoad(), 0, 0, []
    while min(len(ts) for ts in times.values()) < args.repeats:
        for mode in modes:
            if len(times[mode]) >= args.repeats:
                continue
            load.start()
            t = time.perf_counter()
            state = run_mode(mode, state, step)
            dt = time.perf_counter() - t
            step += steps
            share = load.stop()
            if share > args.max_foreign and discarded < args.max_discards:
                discarded += 1
                continue
            times[mode].append(dt)
            foreign.append(share)
    device = statistics.median(times[ON_DEVICE])
    print(f"  {name}: host time per batch alone {host[PIPELINE]:.1f} ms, device-only step "
          f"{device / steps * 1e3:.1f} ms, {steps} steps per run, {discarded} runs discarded for foreign load, "
          f"median foreign load in the kept runs {statistics.median(foreign):.0%}",
          file=sys.stderr)
    source.close()
    if uncached:
        uncached.close()
    return [(name, host[mode], device / steps * 1e3, mode,
             steps * args.batch / statistics.median(ts), statistics.median(ts) / device - 1)
            for mode, ts in times.items()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run_seconds", type=float, default=0.5, help="about this long per timed run")
    parser.add_argument("--repeats", type=int, default=7, help="clean interleaved runs per mode; the median is shown")
    parser.add_argument("--batch", type=int, default=128, help="global batch size")
    parser.add_argument("--only", default="", help="run only the workloads whose name contains this")
    parser.add_argument("--max_discards", type=int, default=150, help="then keep loaded runs too")
    parser.add_argument("--max_foreign", type=float, default=0.15,
                        help="discard a run if other processes used more than this share of the CPU")
    args = parser.parse_args()
    print(f"jax {jax.__version__}, {jax.device_count()} {jax.devices()[0].platform} device(s), "
          f"{os.cpu_count()} CPU cores; global batch {args.batch}, ~{args.run_seconds} s x {args.repeats} runs "
          "per mode",
          file=sys.stderr)
    table = []
    for name, make_config in WORKLOADS.items():
        if args.only in name:
            table += bench(name, make_config, args)
    print("| workload | host ms / batch (alone) | device-only ms / step | mode | examples/s | cost vs on-device |")
    print("|---|---|---|---|---|---|")
    for name, host, device, mode, rate, cost in table:
        cost_text = "—" if mode == ON_DEVICE else f"{cost * 100:+.1f}%"
        print(f"| {name} | {host:.2f} | {device:.1f} | {mode} | {rate:,.0f} | {cost_text} |")


if __name__ == "__main__":
    main()
