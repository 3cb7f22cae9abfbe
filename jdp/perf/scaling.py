"""The alpha-beta model behind `python -m jdp.bench --predict` (docs/benchmarks.md, "Scaling prediction before
hardware"): a step's time and efficiency on N devices. Plain arithmetic: no JAX, no config.
"""

from __future__ import annotations

import dataclasses

BACKWARD_SHARE = 2 / 3  # the overlap: backward FLOPs are 2x the forward's (Kaplan et al. 2020, C ~ 6N per token)
# A strategy's dtype -> bytes per gradient element sent; int8 and int4 add a float32 scale per 256 values (their
# default block), and their all-to-all and all-gather move what a ring all-reduce of as many bytes moves.
ALLREDUCE_BYTES = {"fp32": 4, "bf16": 2, "int8": 1 + 4 / 256, "int4": 0.5 + 4 / 256}
DEFAULT_DEVICES = (1, 8, 64, 512)


@dataclasses.dataclass(frozen=True)
class Link:
    """Achieved bus bandwidth (bytes/s; per GPU within a node, per node between nodes), latency per ring step (s)."""

    bandwidth: float
    latency: float
    about: str


GB = 1e9
GBIT = 1e9 / 8
# The sources of these figures: docs/benchmarks.md, "Scaling prediction before hardware". Latency per ring step:
# NCCL's own tuning model (src/graph/tuning.cc, hwLat, Ring, Simple protocol).
NVLINK_LAT, PCIE_LAT, NET_LAT = 5.7e-6, 5.7e-6, 6.6e-6
NVLINK_ACHIEVED = 230 / 300  # DGX A100: nccl-tests' ~230 GB/s all-reduce bus bandwidth / NVLink3's 300 per direction
NET_ACHIEVED = 0.9  # NCCL over RDMA (InfiniBand, RoCE) against the line rate: assumed, not measured

INTRA_LINKS = {
    "nvlink-a100": Link(230 * GB, NVLINK_LAT, "A100 NVLink3 + NVSwitch (DGX A100): 300 GB/s per direction "
                                              "(datasheet), ~230 GB/s all-reduce bus bandwidth (nccl-tests)"),
    "nvlink-h100": Link(450 * GB * NVLINK_ACHIEVED, NVLINK_LAT,
                        "H100 NVLink4 + NVSwitch (DGX H100): 450 GB/s per direction (datasheet) x the A100's "
                        "achieved share 0.77 (derived, not measured)"),
    "nvlink-p100": Link(2 * 20 * GB * NVLINK_ACHIEVED, NVLINK_LAT,
                        "P100 NVLink1 hybrid cube mesh (DGX-1, Big Basin): 20 GB/s per link and direction "
                        "(datasheet: 4 links, 160 GB/s bidirectional), two rings x 0.77 achieved"),
    **{f"pcie{gen}": Link(rate * GB * NVLINK_ACHIEVED, PCIE_LAT, f"PCIe {gen}.0 x16: {rate} GB/s per direction "
                          "(PCI-SIG) x 0.77 achieved") for gen, rate in ((3, 15.75), (4, 31.5))},
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
    """Ring all-reduce of `nbytes` over `n` devices: 2(n-1) steps, each sending nbytes/n (none on one device)."""
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
               # the per-device batch below which, and the gradient bytes above which, the all-reduce outlasts compute
               "threshold_batch": comm / per_example,
               "threshold_bytes": max(compute - latency, 0.0) / per_byte if n > 1 else float("inf")}
        for name, overlap in (("", 0.0), ("_overlap", BACKWARD_SHARE)):  # overlap x compute hides the all-reduce
            row["step_s" + name] = compute + max(comm - overlap * compute, 0.0)
            row["efficiency" + name] = compute / row["step_s" + name]
        rows.append(row)
    return rows
