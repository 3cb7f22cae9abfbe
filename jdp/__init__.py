"""jdp: data-parallel training of Flax NNX models in JAX. `jdp.fit` trains any model with any loss on any data;
`python -m jdp.train` does the same from a config file."""

from __future__ import annotations

__version__ = "0.1.0"

from jdp.data.batching import Batcher
from jdp.errors import DiskError, NonFiniteLossError, Preempted, ReplicaMismatchError, UsageError
from jdp.step import TrainState
from jdp.trainer import Callback, FitError, FitOptions, FitResult, Source, fit

__all__ = ["Batcher", "Callback", "DiskError", "FitError", "FitOptions", "FitResult", "NonFiniteLossError", "Preempted",
           "ReplicaMismatchError", "Source", "TrainState", "UsageError", "fit", "initialize"]


def initialize(*, coordinator: str | None = None, num_processes: int | None = None, process_id: int | None = None,
               init_timeout_s: float = 120.0, heartbeat_timeout_s: float = 60.0) -> None:
    """Join a multi-process run (`jax.distributed`) from these arguments or the environment (JAX_*, torchrun's
    MASTER_ADDR/RANK/WORLD_SIZE, SLURM), as `python -m jdp.train` does; alone, nothing happens. Call it before
    any other JAX work: JAX refuses to join once it has started."""
    from jdp import distributed

    job = distributed.resolve(coordinator=coordinator, num_processes=num_processes, process_id=process_id)
    if job is not None:
        distributed.initialize(job, init_timeout_s=init_timeout_s, heartbeat_timeout_s=heartbeat_timeout_s)
