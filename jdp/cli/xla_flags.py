"""The XLA communication knobs that matter for data parallelism, as config with sane defaults.

- `parallel.allreduce_combine_threshold_bytes`: XLA combines small all-reduces into buckets up to
  this size (DDP's bucket size, 25 MB there); 0 keeps XLA's default.
- `parallel.latency_hiding_scheduler`: on GPU, lets XLA overlap the gradient all-reduce with the
  backward pass.

They are GPU flags (XLA:CPU runs collectives in-process). Flags already in XLA_FLAGS win, so a user
can always override. Must run before JAX initialises its backends.
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
