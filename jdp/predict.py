"""`python -m jdp.bench --predict`: a config's step time and scaling efficiency on 1, 8, 64 and 512 devices,
predicted before the hardware exists, from three numbers: the gradient's bytes, one device's step time, and
an alpha-beta model of the gradient all-reduce on named links.

- all-reduce within a node (NCCL's ring): 2(n-1)/n * bytes / bandwidth + 2(n-1) * latency;
- across nodes (hierarchical): reduce-scatter within the node, a ring across the nodes on the inter-node link
  (each GPU carries 1/g of the bytes, and the node's g GPUs share its link), all-gather within the node;
- compute scales with the per-device batch (linear: optimistic for small per-device batches);
- the all-reduce overlaps the backward pass by 0 (none), or by the backward's share of the step, 2/3 (its FLOPs
  are twice the forward's): a value fixed beforehand, never fitted. The truth lies between the two.

`--validate` runs the same model, with nothing fitted, on published scaling results (their own per-GPU
throughput, batch and network as inputs) and prints predicted against published efficiency.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
from pathlib import Path

from jdp import config as config_lib

BACKWARD_SHARE = 2 / 3  # the overlap: backward FLOPs are 2x the forward's (Kaplan et al. 2020, C ~ 6N per token)
ALLREDUCE_BYTES = {"fp32": 4, "bf16": 2}  # parallel.allreduce_dtype -> bytes per gradient element sent
DEFAULT_DEVICES = (1, 8, 64, 512)


@dataclasses.dataclass(frozen=True)
class Link:
    """One link of the alpha-beta model: achieved bus bandwidth (bytes/s; per GPU within a node, per node
    between nodes) and latency per ring step (seconds)."""

    bandwidth: float
    latency: float
    about: str


GB = 1e9
GBIT = 1e9 / 8
# Latency per ring step: NCCL's own tuning model (src/graph/tuning.cc, hwLat, Ring with the Simple protocol,
# used for large messages): NVLink 5.7 us, PCIe 5.7 us, network 6.6 us. TCP without RDMA has higher latency
# (tens of us), which matters only for small gradients.
NVLINK_LAT, PCIE_LAT, NET_LAT = 5.7e-6, 5.7e-6, 6.6e-6
# Achieved share of the datasheet's one-direction bandwidth, from DGX A100: NVIDIA's nccl-tests all-reduce bus
# bandwidth of about 230 GB/s against NVLink3's 300 GB/s per direction (600 GB/s bidirectional, A100 datasheet).
NVLINK_ACHIEVED = 230 / 300
# Between nodes, NCCL over RDMA (InfiniBand or RoCE) is assumed to reach 90% of the line rate (protocol headers);
# an assumption, not measured here. TCP Ethernet without RDMA reaches less.
NET_ACHIEVED = 0.9

INTRA_LINKS = {
    "nvlink-a100": Link(230 * GB, NVLINK_LAT, "A100 NVLink3 + NVSwitch (DGX A100): 300 GB/s per direction "
                                              "(datasheet), ~230 GB/s all-reduce bus bandwidth (nccl-tests)"),
    "nvlink-h100": Link(450 * GB * NVLINK_ACHIEVED, NVLINK_LAT,
                        "H100 NVLink4 + NVSwitch (DGX H100): 450 GB/s per direction (datasheet) x the A100's "
                        "achieved share 0.77 (derived, not measured)"),
    "nvlink-p100": Link(2 * 20 * GB * NVLINK_ACHIEVED, NVLINK_LAT,
                        "P100 NVLink1 hybrid cube mesh (DGX-1, Big Basin): 20 GB/s per link and direction "
                        "(datasheet: 4 links, 160 GB/s bidirectional), two rings x 0.77 achieved"),
    "pcie3": Link(15.75 * GB * NVLINK_ACHIEVED, PCIE_LAT,
                  "PCIe 3.0 x16: 15.75 GB/s per direction (PCI-SIG) x 0.77 achieved"),
    "pcie4": Link(31.5 * GB * NVLINK_ACHIEVED, PCIE_LAT,
                  "PCIe 4.0 x16: 31.5 GB/s per direction (PCI-SIG) x 0.77 achieved"),
}
INTER_LINKS = {  # one NIC per node at the line rate named (a DGX A100 has 8 x 200 Gb/s: pass --inter net-1600g)
    f"net-{rate}g": Link(rate * GBIT * NET_ACHIEVED, NET_LAT,
                         f"{rate} Gb/s Ethernet (RoCE) or InfiniBand per node, x {NET_ACHIEVED} achieved")
    for rate in (25, 50, 100, 200, 400, 1600)
}


@dataclasses.dataclass(frozen=True)
class Topology:
    per_node: int  # devices per node
    intra: Link
    inter: Link


def ring_allreduce_s(nbytes: float, n: int, link: Link) -> float:
    """Ring all-reduce of `nbytes` over `n` devices: 2(n-1) steps, each sending nbytes/n."""
    if n <= 1:
        return 0.0
    return 2 * (n - 1) / n * nbytes / link.bandwidth + 2 * (n - 1) * link.latency


def hierarchical_allreduce_s(nbytes: float, n: int, topo: Topology) -> float:
    """All-reduce over `n` devices, `topo.per_node` per node: a plain ring within one node; across nodes a
    reduce-scatter within each node, a ring across the nodes, then an all-gather within each node."""
    g = topo.per_node
    if n <= g:
        return ring_allreduce_s(nbytes, n, topo.intra)
    if n % g:
        raise ValueError(f"{n} devices do not fill nodes of {g}; use a multiple of --per_node")
    nodes = n // g
    in_node_half = (g - 1) / g * nbytes / topo.intra.bandwidth + (g - 1) * topo.intra.latency  # reduce-scatter
    shard = nbytes / g  # each GPU's part after the reduce-scatter; the node's g rings share its link
    across = 2 * (nodes - 1) / nodes * shard / (topo.inter.bandwidth / g) + 2 * (nodes - 1) * topo.inter.latency
    return in_node_half + across + in_node_half  # all-gather costs what the reduce-scatter did


def step_s(compute_s: float, allreduce_s: float, overlap: float) -> float:
    """A step: compute, plus the part of the all-reduce not hidden behind `overlap` x compute (the backward)."""
    return compute_s + max(allreduce_s - overlap * compute_s, 0.0)


def predict(grad_bytes: float, one_device_step_s: float, batch: int, devices: list[int], topo: Topology,
            scaling: str = "strong") -> list[dict]:
    """One row per device count. `one_device_step_s` is one device's step on `batch` examples; `strong` keeps
    the global batch (jdp's contract: each device gets batch/N), `weak` gives each device `batch`."""
    rows = []
    per_example = one_device_step_s / batch
    for n in devices:
        per_device = batch / n if scaling == "strong" else batch
        compute = per_example * per_device
        comm = hierarchical_allreduce_s(grad_bytes, n, topo)
        latency = hierarchical_allreduce_s(0.0, n, topo)
        per_byte = hierarchical_allreduce_s(1.0, n, topo) - latency
        row = {"devices": n, "nodes": max(n // topo.per_node, 1), "per_device_batch": per_device,
               "compute_s": compute, "allreduce_s": comm,
               # below this per-device batch the all-reduce takes longer than the compute
               "threshold_batch": comm / per_example,
               # above this many gradient bytes (at this per-device batch) the all-reduce takes longer
               "threshold_bytes": max(compute - latency, 0.0) / per_byte if n > 1 else float("inf")}
        for name, overlap in (("", 0.0), ("_overlap", BACKWARD_SHARE)):
            row["step_s" + name] = step_s(compute, comm, overlap)
            row["efficiency" + name] = compute / row["step_s" + name]
        rows.append(row)
    return rows


def to_markdown(rows: list[dict], grad_bytes: float, topo_names: str) -> str:
    lines = [f"gradient {grad_bytes / 1e6:,.2f} MB per all-reduce; {topo_names}", "",
             "| devices | nodes | batch/device | compute ms | all-reduce ms | step ms (no overlap) | efficiency | "
             f"step ms (overlap {BACKWARD_SHARE:.2f}) | efficiency | all-reduce > compute below batch/device "
             "| all-reduce > compute above gradient MB |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        small = " (under 1 example: not runnable)" if r["per_device_batch"] < 1 else ""
        one = r["devices"] == 1  # no all-reduce: no threshold
        lines.append(f"| {r['devices']} | {r['nodes']} | {r['per_device_batch']:g}{small} | {r['compute_s'] * 1e3:.3f} "
                     f"| {r['allreduce_s'] * 1e3:.3f} | {r['step_s'] * 1e3:.3f} | {r['efficiency']:.1%} "
                     f"| {r['step_s_overlap'] * 1e3:.3f} | {r['efficiency_overlap']:.1%} "
                     f"| {'—' if one else format(r['threshold_batch'], ',.1f')} "
                     f"| {'—' if one else format(r['threshold_bytes'] / 1e6, ',.2f')} |")
    return "\n".join(lines) + "\n"


def gradient_bytes(cfg, input_shape: tuple[int, ...] | None = None, num_classes: int = 0) -> tuple[int, int]:
    """(parameters, bytes one gradient all-reduce sends) of the config's model, built abstractly through jdp's
    own task building; without `input_shape` and `num_classes` they come from the config's data."""
    import jax
    from flax import nnx

    from jdp import task

    if input_shape is None or not num_classes:
        try:
            make_model = task.build_task(cfg).make_model
        except config_lib.ConfigError as e:
            raise config_lib.ConfigError(f"{e} (or predict without the data: pass --step_ms, --input_shape and "
                                         "--num_classes)") from None
    else:
        task.check_names(cfg)
        make_model = task.model_maker(cfg, input_shape, num_classes)
    params = sum(leaf.size for leaf in jax.tree.leaves(nnx.state(task.abstract_model(make_model), nnx.Param)))
    return params, params * ALLREDUCE_BYTES[cfg.parallel.allreduce_dtype]


def measure_step_s(cfg, steps: int, repeats: int) -> float:
    """Median over `repeats` of jdp.bench's single-device step time at the config's global batch (compiled once)."""
    from jdp import bench

    variant = bench.Variant(cfg, 1)
    return statistics.median(variant.time(steps) for _ in range(repeats))


def _shape(text: str) -> tuple[int, ...]:
    return tuple(int(d) for d in text.split(","))


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m jdp.bench --predict", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", type=Path, default=config_lib.DEFAULT_CONFIG)
    p.add_argument("--step_ms", type=float, default=0.0,
                   help="one device's step time at the config's global batch (default: measured here by jdp.bench)")
    p.add_argument("--devices", default=",".join(map(str, DEFAULT_DEVICES)))
    p.add_argument("--per_node", type=int, default=8, help="devices per node (default 8)")
    p.add_argument("--intra", default="nvlink-a100", choices=sorted(INTRA_LINKS), help="link within a node")
    p.add_argument("--inter", default="net-100g", choices=sorted(INTER_LINKS), help="link between nodes")
    p.add_argument("--scaling", default="strong", choices=("strong", "weak"),
                   help="strong: the config's global batch split over the devices (jdp's contract); weak: each "
                        "device keeps the config's global batch (the global batch grows N-fold)")
    p.add_argument("--input_shape", type=_shape, help="one example's shape, e.g. 224,224,3: with --num_classes, "
                   "the model is built without reading the config's data")
    p.add_argument("--num_classes", type=int, default=0)
    p.add_argument("--steps", type=int, default=20, help="timed steps per measurement (without --step_ms)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--validate", action="store_true",
                   help="predict published scaling results instead (no config) and print the error")
    return p


def main(argv: list[str]) -> int:
    args, rest = parser().parse_known_args(argv)
    if args.validate:
        from jdp import predict_validation

        print(predict_validation.to_markdown(predict_validation.validate()))
        return 0
    try:
        devices = [int(d) for d in args.devices.split(",")]
        if min(devices) < 1 or args.per_node < 1 or args.step_ms < 0:
            raise ValueError("--devices, --per_node and --step_ms must be positive")
        cfg = config_lib.load_config_file(args.config)
        cfg = config_lib.apply_overrides(cfg, config_lib.parse_overrides(rest))
        topo = Topology(args.per_node, INTRA_LINKS[args.intra], INTER_LINKS[args.inter])
        for n in devices:
            hierarchical_allreduce_s(0.0, n, topo)  # device counts that do not fill nodes, refused up front
        params, nbytes = gradient_bytes(cfg, args.input_shape, args.num_classes)
        one_step = args.step_ms / 1e3 if args.step_ms else measure_step_s(cfg, args.steps, args.repeats)
    except (config_lib.ConfigError, ValueError) as e:
        print(f"jdp.bench --predict: {e}", file=sys.stderr)
        return 2
    batch = cfg.train.global_batch_size
    rows = predict(nbytes, one_step, batch, devices, topo, args.scaling)
    measured = "given" if args.step_ms else "measured here by jdp.bench"
    print(f"{args.config.name}: {cfg.model.name}, {params:,} parameters, all-reduce in {cfg.parallel.allreduce_dtype}; "
          f"one device's step {one_step * 1e3:.3f} ms at batch {batch} ({measured}); {args.scaling} scaling")
    print(f"links: {args.intra}: {topo.intra.about}; {args.inter}: {topo.inter.about}")
    print(to_markdown(rows, nbytes, f"{args.per_node} devices per node, {args.intra} within, {args.inter} between"))
    return 0
