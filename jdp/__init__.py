"""jdp: data-parallel training of Flax NNX models in JAX. `jdp.fit` trains any model with any loss on any data;
`python -m jdp.train` does the same from a config file."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

# Imported on first use: `python -m jdp.train` installs its signal handler before JAX's seconds of imports.
_EXPORTS = {"Batcher": "jdp.data.batching", "TrainState": "jdp.step",
            **{name: "jdp.errors" for name in ("DiskError", "FitError", "NonFiniteLossError", "Preempted",
                                               "ReplicaMismatchError", "UsageError")},
            "Callback": "jdp.callbacks", "FitOptions": "jdp.options",
            **{name: "jdp.trainer" for name in ("FitResult", "Source", "fit")},
            **{name: "jdp.reopen" for name in ("evaluate", "export_params", "restore")}}

if TYPE_CHECKING:
    from jdp.callbacks import Callback
    from jdp.data.batching import Batcher
    from jdp.errors import DiskError, FitError, NonFiniteLossError, Preempted, ReplicaMismatchError, UsageError
    from jdp.options import FitOptions
    from jdp.reopen import evaluate, export_params, restore
    from jdp.step import TrainState
    from jdp.trainer import FitResult, Source, fit

__all__ = ["Batcher", "Callback", "DiskError", "FitError", "FitOptions", "FitResult", "NonFiniteLossError",
           "Preempted", "ReplicaMismatchError", "Source", "TrainState", "UsageError", "evaluate", "export_params",
           "fit", "initialize", "restore"]


_SUBPACKAGES = ("layers", "sync")  # reached after `import jdp` alone, as the docs write them


def __getattr__(name: str) -> object:
    if name in _SUBPACKAGES:
        return importlib.import_module(f"jdp.{name}")
    if name not in _EXPORTS:
        raise AttributeError(f"module 'jdp' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)


def initialize(*, coordinator: str | None = None, num_processes: int | None = None, process_id: int | None = None,
               init_timeout_s: float = 120.0, heartbeat_timeout_s: float = 60.0, bind_address: str = "") -> None:
    """Join a multi-process run (`jax.distributed`) from these arguments or the environment (JAX_*, torchrun's
    MASTER_ADDR/RANK/WORLD_SIZE, SLURM) before any other JAX work (JAX cannot join after); alone, nothing happens.
    `bind_address` (HOST:PORT): where process 0's coordinator listens ("0.0.0.0:PORT" or "[::]:PORT": every
    interface); "" = JAX_COORDINATOR_BIND_ADDRESS, else the address the processes connect to (docs/cluster.md)."""
    from jdp import distributed

    job = distributed.resolve(coordinator=coordinator, num_processes=num_processes, process_id=process_id)
    if job is not None:
        distributed.initialize(job, init_timeout_s=init_timeout_s, heartbeat_timeout_s=heartbeat_timeout_s,
                               bind_address=bind_address)
