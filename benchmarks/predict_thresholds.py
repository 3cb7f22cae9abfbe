"""When data parallelism stops paying, for every shipped config: the gradient all-reduce's time on named links
(jdp/predict.py's alpha-beta model), which is the least compute per step at which the all-reduce does not
exceed the compute.

    python benchmarks/predict_thresholds.py

A device doing E examples/s on the model passes that point at a per-device batch of (all-reduce time) x E.
The tfds configs' models are built from their known input shapes, without the data.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jdp.cli import config as config_lib  # noqa: E402
from jdp.perf.predict import gradient_bytes  # noqa: E402
from jdp.perf.scaling import INTER_LINKS, INTRA_LINKS, Topology, hierarchical_allreduce_s  # noqa: E402

SHAPES = {"tfds:cifar10": ((32, 32, 3), 10), "tfds:imagenet2012": (None, 1000)}  # None: data.image_size square
LINKS = [(8, "nvlink-a100", "net-100g"), (8, "pcie4", "net-100g"), (64, "nvlink-a100", "net-25g"),
         (64, "nvlink-a100", "net-100g"), (64, "nvlink-a100", "net-400g")]


def main() -> int:
    root = Path(__file__).resolve().parents[1] / "configs"
    heads = [f"{n} GPUs, {intra}" + (f" + {inter}" if n > 8 else "") for n, intra, inter in LINKS]
    print("| config | model | parameters | gradient MB (fp32) | global batch | " + " | ".join(heads) + " |")
    print("|---" * (5 + len(LINKS)) + "|")
    for path in sorted(root.glob("*.py")):
        if path.stem in ("base", "__init__"):
            continue
        cfg = config_lib.load_config_file(path)
        shape, classes = SHAPES.get(cfg.data.name, (None, 0))
        if classes and shape is None:
            shape = (cfg.data.image_size, cfg.data.image_size, 3)
        params, nbytes = gradient_bytes(cfg, shape, classes)
        times = [hierarchical_allreduce_s(nbytes, n, Topology(8, INTRA_LINKS[intra], INTER_LINKS[inter]))
                 for n, intra, inter in LINKS]
        print(f"| {path.name} | {cfg.model.name} | {params:,} | {nbytes / 1e6:.2f} | {cfg.train.global_batch_size} | "
              + " | ".join(f"{t * 1e3:.3f} ms" for t in times) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
