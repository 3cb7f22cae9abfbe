"""Why the tfds source reads with its own thread pool rather than through grain: host time to read and
decode one 128-image batch of the committed CIFAR-format fixture, no decoded-image cache, the same rows
(jdp's (seed, epoch) order) both ways.

    python benchmarks/probe_grain.py [--batches 40] [--repeats 5]     # needs grain: pip install grain

Modes: jdp's `TfdsSource.train_batch`; grain per-row (`MapDataset` of rows -> decode -> `to_iter_dataset`
with N read threads -> `batch`); grain batch-first (`MapDataset ... .batch` -> `to_iter_dataset`, one
batch per read thread). Interleaved; medians of `--repeats` runs of `--batches` batches each.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import grain  # noqa: E402
import numpy as np  # noqa: E402

from jdp.configs import base  # noqa: E402
from jdp.data import TfdsSource, augment  # noqa: E402

BATCH = 128


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    cfg = base.get_config().data
    cfg.update(name="tfds:tiny_cifar", data_dir=str(ROOT / "tests" / "fixtures" / "tfds"), cache_decoded_mb=0)
    source = TfdsSource(cfg, seed=0, global_batch_size=BATCH, eval_batch_size=BATCH)
    records, order = source._train, source._order  # the same reader and row order as train_batch
    rows_of = functools.lru_cache(4)(order.train_rows)

    def decode(row: int) -> tuple[np.ndarray, int]:
        ((image, label),) = records.__getitems__(np.array([row]))
        return augment.decode(image, 3), label

    rows = grain.MapDataset.range(10**6).map(lambda k: int(rows_of(k // BATCH)[k % BATCH])).map(decode)

    def jdp_reader(start: int):
        return (source.train_batch(step) for step in range(start, start + args.batches))

    def grain_per_row(threads: int):
        def reader(start: int):
            it = iter(rows.slice(slice(start * BATCH, None)).to_iter_dataset(
                grain.ReadOptions(num_threads=threads, prefetch_buffer_size=2 * BATCH)).batch(BATCH))
            return (next(it) for _ in range(args.batches))
        return reader

    def grain_batch_first(threads: int):
        def reader(start: int):
            it = iter(rows.batch(BATCH).slice(slice(start, None)).to_iter_dataset(
                grain.ReadOptions(num_threads=threads, prefetch_buffer_size=2)))
            return (next(it) for _ in range(args.batches))
        return reader

    modes = {"jdp TfdsSource (thread pool)": jdp_reader}
    for threads in (1, 2):
        modes[f"grain per-row, {threads} read thread(s)"] = grain_per_row(threads)
        modes[f"grain batch-first, {threads} read thread(s)"] = grain_batch_first(threads)
    times: dict[str, list[float]] = {mode: [] for mode in modes}
    start = 0
    for _ in range(args.repeats):
        for mode, reader in modes.items():
            t = time.perf_counter()
            for _batch in reader(start):
                pass
            times[mode].append((time.perf_counter() - t) / args.batches * 1e3)
            start += args.batches
    source.close()
    print(f"grain {getattr(grain, '__version__', '?')}, batch {BATCH}, {args.repeats} x {args.batches} batches")
    print("| reader | ms per batch (median) |\n|---|---|")
    for mode, ts in times.items():
        print(f"| {mode} | {statistics.median(ts):.2f} |")


if __name__ == "__main__":
    main()
