"""Step 3 of data parallelism, the gradient sync, as strategies behind one interface (`jdp.sync.base.Sync`), like
DDP's communication hooks: the mean all-reduce (float32 or bfloat16), ZeRO-1's reduce-scatter, local SGD,
DiLoCo, PowerSGD, ZeRO-3's sharded parameters. A new strategy is one file of this package and one line of
`STRATEGIES`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jdp.sync.base import Local, Reduced, Sync
from jdp.sync.diloco import DiLoCo, outer_optimizer
from jdp.sync.local_sgd import LocalSGD
from jdp.sync.powersgd import PowerSGD
from jdp.sync.zero1 import ShardedOptimizer
from jdp.sync.zero3 import FullySharded, stacked_paths

__all__ = ["STRATEGIES", "Local", "Reduced", "Sync", "strategy"]

ALLREDUCE_DTYPES = {"fp32": jnp.float32, "bf16": jnp.bfloat16}

# name -> a function of (fit's options, the model: an nnx.Module, maybe abstract) giving the strategy
STRATEGIES: dict[str, Callable[[Any, Any], Sync]] = {
    "allreduce": lambda o, model: Sync(ALLREDUCE_DTYPES[o.allreduce_dtype]),
    "zero1": lambda o, model: ShardedOptimizer(ALLREDUCE_DTYPES[o.allreduce_dtype]),
    "local_sgd": lambda o, model: LocalSGD(o.sync_every),
    "diloco": lambda o, model: DiLoCo(o.sync_every, outer_optimizer(o.outer_optimizer, o.outer_lr, o.outer_momentum)),
    "powersgd": lambda o, model: PowerSGD(model, nnx.to_pure_dict(nnx.state(model, nnx.Param)), o.powersgd_rank,
                                          o.powersgd_start_step, o.seed),
    "zero3": lambda o, model: FullySharded(jax.tree.map(lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype),
                                                        nnx.to_pure_dict(nnx.state(model, nnx.Param))),
                                           stacked_paths(model)),
}


def strategy_name(o: Any) -> str:
    """The strategy `fit`'s options name (checked there): `sync` when it names one, else local SGD when
    `sync_every` > 1 (DiLoCo with an `outer_optimizer`), ZeRO-3 with `shard_params`, ZeRO-1 with `shard_optimizer`,
    else the mean all-reduce (sending `allreduce_dtype`)."""
    if o.sync != "allreduce":
        return o.sync
    if o.sync_every > 1:
        return "local_sgd" if o.outer_optimizer == "none" else "diloco"
    if o.shard_params:
        return "zero3"
    return "zero1" if o.shard_optimizer else "allreduce"


def optimizer_sees_slices(shard_optimizer: bool, shard_params: bool, backend: str) -> bool:
    """Whether each device's optimizer updates flat slices of the leaves (ZeRO-1; ZeRO-3 under shard_map), so that
    its global-norm clipping sums the slices' squares across devices. ZeRO-3 under jit updates global arrays."""
    return shard_optimizer or (shard_params and backend != "jit")


def strategy(o: Any, model: Any = None) -> Sync:
    return STRATEGIES[strategy_name(o)](o, model)
