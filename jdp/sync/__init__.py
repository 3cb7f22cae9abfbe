"""Step 3 of data parallelism, the gradient sync, as strategies behind one interface (`jdp.sync.base.Sync`), like
DDP's communication hooks: the mean all-reduce (float32 or bfloat16), ZeRO-1's reduce-scatter, local SGD. A new
strategy is one file of this package and one line of `STRATEGIES`."""

from __future__ import annotations

from collections.abc import Callable

import jax.numpy as jnp

from jdp.sync.base import Local, Reduced, Sync
from jdp.sync.local_sgd import LocalSGD
from jdp.sync.zero1 import ShardedOptimizer

__all__ = ["STRATEGIES", "Local", "Reduced", "Sync", "strategy"]

ALLREDUCE_DTYPES = {"fp32": jnp.float32, "bf16": jnp.bfloat16}

# name -> a function of (allreduce dtype, local SGD period) giving the strategy
STRATEGIES: dict[str, Callable[[object, int], Sync]] = {
    "allreduce": lambda dtype, every: Sync(dtype),
    "zero1": lambda dtype, every: ShardedOptimizer(dtype),
    "local_sgd": lambda dtype, every: LocalSGD(every),
}


def strategy(*, allreduce_dtype: str = "fp32", shard_optimizer: bool = False, sync_every: int = 1) -> Sync:
    """The strategy `fit`'s options name (checked there): local SGD when `sync_every` > 1, ZeRO-1 with
    `shard_optimizer`, else the mean all-reduce; the gradient collective sends `allreduce_dtype`."""
    name = "local_sgd" if sync_every > 1 else "zero1" if shard_optimizer else "allreduce"
    return STRATEGIES[name](ALLREDUCE_DTYPES[allreduce_dtype], sync_every)
