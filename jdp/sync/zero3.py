"""ZeRO-3, fully sharded data parallelism (Rajbhandari et al. 2020; PyTorch's FSDP): the parameters, their
gradients and the optimizer state live as 1/N slices, and the whole parameters exist only while the step uses them.
Each device still computes on its own rows: this is data parallelism whose state is split.

Every leaf with an axis is flattened and zero-padded to a multiple of N (`jdp.sync.base.SHARDED`), so any size
splits; device i holds the i-th slice. Under shard_map the forward gathers the whole parameters (`params_view`, an
all-gather per leaf), and differentiating through the all-gather gives its transpose, the reduce-scatter: each
device's gradient arrives summed over the devices and already sliced, so the strategy adds no collective of its own
but the one all-reduce of the weighted sums. Under jit the slices carry their NamedSharding and XLA places the
gathers and the reduce-scatter. Each device updates its own slices (element-wise optimizers, as under ZeRO-1), and
nothing gathers the new parameters: the next forward does.

With gradient accumulation each micro-batch gathers the parameters and reduce-scatters its gradient (shard_map):
the gradient being summed is 1/N of the model, at the price of k gathers and k reduce-scatters a step. (Holding the
whole local gradient until one reduce-scatter, as jit's lanes do, sends once but holds a whole gradient per device.)
"""

from __future__ import annotations

from typing import Any

import jax
import optax

from jdp.sync.base import Sync, Tree, is_sharded, sharded_where, unpadded
from jdp.sync.zero1 import ShardedOptimizer, all_gather_like


class FullySharded(ShardedOptimizer):
    """ZeRO-1's sharded optimizer state, plus sharded parameters gathered for each forward. `abstract_params`: the
    parameters' logical shapes (what the forward sees)."""

    def __init__(self, abstract_params: Tree) -> None:
        super().__init__()  # the reduce-scatter is the gather's transpose: it sends the parameters' dtype
        self.abstract_params = abstract_params

    def layouts(self, abstract_state: Any) -> Any:
        return super().layouts(abstract_state)._replace(params=sharded_where(abstract_state.params))

    def params_view(self, params: Tree, axis_name: str | None) -> Tree:
        if axis_name is None:  # global arrays: XLA gathers them where the forward needs them
            return jax.tree.map(lambda x, like: unpadded(x, like) if is_sharded(like) else x, params,
                                self.abstract_params)
        return all_gather_like(params, self.abstract_params, axis_name)

    def sliced_mean(self, grads: Tree, axis_name: str | None) -> Tree:
        # A sliced leaf's gradient is already summed over the devices (the all-gather's transpose); a scalar
        # parameter, used whole, has each device's own gradient. Under jit the arrays are global already.
        if axis_name is None:
            return grads
        n = jax.lax.psum(1, axis_name)
        return jax.tree.map(lambda g: g / n if is_sharded(g) else jax.lax.pmean(g, axis_name), grads)

    def update(self, tx: optax.GradientTransformation, grads: Tree, state: Any, axis_name: str | None
               ) -> tuple[Tree, Any]:
        return Sync.update(self, tx, grads, state, axis_name)  # on the slices; the next forward gathers them
