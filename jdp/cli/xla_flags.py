"""The parallel section's XLA flags, for GPUs (XLA:CPU runs collectives in-process): the all-reduce combine
threshold (DDP's bucket size, 25 MB there; 0 keeps XLA's default) and the latency-hiding scheduler, which overlaps
the gradient all-reduce with the backward. Flags already in XLA_FLAGS win. Apply before JAX starts its backends.
"""

from __future__ import annotations

import os

import ml_collections


def communication_flags(parallel: ml_collections.ConfigDict) -> dict[str, str]:
    flags = {}
    if parallel.allreduce_combine_threshold_bytes:
        flags["--xla_gpu_all_reduce_combine_threshold_bytes"] = str(parallel.allreduce_combine_threshold_bytes)
    flags["--xla_gpu_enable_latency_hiding_scheduler"] = str(parallel.latency_hiding_scheduler).lower()
    return flags


def apply_communication_flags(parallel: ml_collections.ConfigDict) -> None:
    """Adds the knobs to XLA_FLAGS unless set there already."""
    current = os.environ.get("XLA_FLAGS", "")
    present = {flag.split("=", 1)[0] for flag in current.split()}
    added = [f"{k}={v}" for k, v in communication_flags(parallel).items() if k not in present]
    os.environ["XLA_FLAGS"] = " ".join([current, *added]).strip()
