"""`python -m jdp.bench --predict --validate`: the scaling model, nothing fitted, against published results (weak
scaling, as in the sources: efficiency is per-GPU throughput at `gpus` over that at `baseline_gpus`).
"""

from __future__ import annotations

import dataclasses

from jdp.perf.scaling import BACKWARD_SHARE, INTER_LINKS, INTRA_LINKS, Topology, predict

# Each figure's source: docs/benchmarks.md, "Validation against published scaling results". Parameter counts: the
# Keras Applications table; gradients are all-reduced in float32 in every case (AMP keeps float32 parameters).
RESNET50, RESNET101, INCEPTION_V3, VGG16 = 25.6e6, 44.7e6, 23.9e6, 138.4e6

# (model, parameters, one P100's images/s), tf_cnn_benchmarks at batch 64 (TensorFlow's published benchmarks, DGX-1,
# May 2017). ResNet-101 is not in that table: interpolated between ResNet-50 and ResNet-152 by GFLOPs (He et al. 2016).
_T50, _T152 = 1 / 219, 1 / 91.8
P100_TF = (("Inception V3", INCEPTION_V3, 142.0),
           ("ResNet-101", RESNET101, 1 / (_T50 + (7.6 - 3.8) / (11.3 - 3.8) * (_T152 - _T50))),
           ("VGG-16", VGG16, 154.0))

# Goyal et al. 2017 (arXiv:1706.02677): the baseline, 90 ImageNet epochs on 8 GPUs in 29 hours, per GPU.
GOYAL_IMAGES_PER_S = 90 * 1_281_167 / (29 * 3600) / 8


@dataclasses.dataclass(frozen=True)
class Published:
    name: str
    source: str
    params: float
    batch: int  # per GPU
    images_per_s: float  # one GPU's throughput at that batch: the input
    gpus: int
    baseline_gpus: int
    per_node: int
    intra: str  # a jdp.perf.scaling link profile
    inter: str
    efficiency: float  # what the source reports


def _horovod(source: str, gpus: int, efficiencies: tuple[float, float, float]) -> list[Published]:
    # Batch 64 per GPU: the docs' tf_cnn_benchmarks command. The servers' GPU interconnect is not stated: PCIe 3.
    return [Published(f"Horovod {name}", source, params, 64, rate, gpus, 1, 4, "pcie3", "net-25g", eff)
            for (name, params, rate), eff in zip(P100_TF, efficiencies, strict=True)]


CASES = [
    Published("Goyal et al. 2017 ResNet-50", "arXiv:1706.02677, 8 -> 256 P100, 50 Gb/s Ethernet", RESNET50, 32,
              GOYAL_IMAGES_PER_S, 256, 8, 8, "nvlink-p100", "net-50g", 0.90),
    *_horovod("Horovod README (2017): 32 servers x 4 Pascal GPUs, RoCE 25 Gbit/s", 128, (0.90, 0.90, 0.79)),
    *_horovod("Horovod docs/benchmarks: 128 servers x 4 Pascal GPUs, RoCE 25 Gbit/s", 512, (0.90, 0.90, 0.68)),
    Published("NVIDIA ResNet-50 v1.5, mixed precision", "DeepLearningExamples, DGX A100", RESNET50, 256, 2470.0,
              8, 1, 8, "nvlink-a100", "net-200g", 16621 / (8 * 2470)),
    Published("NVIDIA ResNet-50 v1.5, TF32", "DeepLearningExamples, DGX A100", RESNET50, 256, 938.0,
              8, 1, 8, "nvlink-a100", "net-200g", 7248 / (8 * 938)),
]


def validate() -> list[dict]:
    """Each case's efficiency as `--predict` computes it (weak scaling), relative to its baseline GPU count."""
    rows = []
    for c in CASES:
        topo = Topology(c.per_node, INTRA_LINKS[c.intra], INTER_LINKS[c.inter])
        base, scaled = predict(c.params * 4, c.batch / c.images_per_s, c.batch, [c.baseline_gpus, c.gpus], topo,
                               "weak")
        rows.append({"case": c, "no_overlap": scaled["efficiency"] / base["efficiency"],
                     "overlap": scaled["efficiency_overlap"] / base["efficiency_overlap"]})
    return rows


def to_markdown(rows: list[dict]) -> str:
    lines = ["| case | source | GPUs (per node) | batch/GPU, img/s/GPU | gradient MB | links | published | "
             f"predicted, no overlap (error) | predicted, overlap {BACKWARD_SHARE:.2f} (error) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        c = r["case"]
        base = f" vs {c.baseline_gpus}" if c.baseline_gpus > 1 else ""
        lines.append(f"| {c.name} | {c.source} | {c.gpus}{base} ({c.per_node}) | {c.batch}, {c.images_per_s:.0f} | "
                     f"{c.params * 4 / 1e6:.0f} | {c.intra}, {c.inter} | {c.efficiency:.1%} | "
                     f"{r['no_overlap']:.1%} ({(r['no_overlap'] - c.efficiency) * 100:+.1f}) | "
                     f"{r['overlap']:.1%} ({(r['overlap'] - c.efficiency) * 100:+.1f}) |")
    return "\n".join(lines) + "\n"
