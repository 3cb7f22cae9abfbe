"""The host's ceiling for ImageNet-style training input: JPEG decode + random-resized crop + resize + flip, in
images/sec, through the function jdp's tfds source runs per row (`jdp.data.augment.decode_crop` with
`random_resized_box`), on worker threads cut into contiguous chunks as the source cuts a batch.

    python benchmarks/bench_decode.py [--threads 1,16] [--images 256] [--size 224] [--repeats 5] [--json out.json]

Images: synthetic 500x375 JPEGs (ImageNet's typical size), quality 90, photo-like (ramps, smooth blobs, noise).
Each thread count runs with reduced-size decoding (`augment.reduction`: 1/2, 1/4 or 1/8 of the stored size
when the crop box allows it) and with full-size decoding, interleaved; medians of `--repeats` passes.
ResNet-50 on one H100/H200 in bf16 consumes about 3,000 images/sec: that is the figure to reach.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

from jdp.data import augment  # noqa: E402


def synthetic_jpegs(count: int, height: int = 375, width: int = 500) -> list[bytes]:
    from PIL import Image

    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    out = []
    for seed in range(count):
        rng = np.random.default_rng(seed)
        blobs = sum(np.sin(x / rng.uniform(5, 40) + rng.uniform(0, 6)) * np.cos(y / rng.uniform(5, 40))
                    for _ in range(4))
        rgb = np.stack([255 * x / width, 255 * y / height, 128 + 30 * blobs], -1) + rng.normal(0, 8, (height, width, 3))
        buffer = io.BytesIO()
        Image.fromarray(np.clip(rgb, 0, 255).astype(np.uint8)).save(buffer, format="JPEG", quality=90)
        out.append(buffer.getvalue())
    return out


def one_pass(images: list[bytes], params: augment.BatchParams, size: int, pool: ThreadPoolExecutor,
             threads: int) -> float:
    """Seconds to decode and crop every image, `threads` contiguous chunks at once."""
    out = np.empty((len(images), size, size, 3), np.uint8)

    def task(lo: int, hi: int) -> None:
        for i in range(lo, hi):
            box_of = lambda h, w, i=i: augment.random_resized_box(h, w, params.uniforms[i])  # noqa: E731
            out[i] = augment.decode_crop(images[i], 3, box_of, size, bool(params.flips[i]))

    bounds = np.linspace(0, len(images), threads + 1).astype(int)
    t0 = time.perf_counter()
    for f in [pool.submit(task, lo, hi) for lo, hi in zip(bounds[:-1], bounds[1:], strict=True)]:
        f.result()
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", default="1,16")
    parser.add_argument("--images", type=int, default=256)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    images = synthetic_jpegs(args.images)
    params = augment.batch_params(0, 0, args.images)
    decoder = "OpenCV" if augment._opencv() is not None else "PIL"
    results = {}
    for threads in (int(t) for t in args.threads.split(",")):
        times = {"reduced": [], "full": []}
        with ThreadPoolExecutor(threads) as pool:
            one_pass(images[: 2 * threads], params, args.size, pool, threads)  # warm the threads and the decoder
            for _ in range(args.repeats):
                times["reduced"].append(one_pass(images, params, args.size, pool, threads))
                with mock.patch.object(augment, "reduction", lambda box, size: 1):
                    times["full"].append(one_pass(images, params, args.size, pool, threads))
        results[threads] = {mode: args.images / statistics.median(t) for mode, t in times.items()}
    print(f"JPEG decode + random-resized crop to {args.size}, {args.images} synthetic 500x375 images, {decoder}, "
          f"{os.cpu_count()} cores; medians of {args.repeats} passes")
    print("| threads | img/s reduced-size decode | img/s full decode | ratio |\n|---|---|---|---|")
    for threads, r in results.items():
        print(f"| {threads} | {r['reduced']:,.0f} | {r['full']:,.0f} | {r['reduced'] / r['full']:.2f} |")
    if args.json:
        args.json.write_text(json.dumps({"decoder": decoder, "cores": os.cpu_count(), "size": args.size,
                                         "img_per_s": {str(t): r for t, r in results.items()}}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
