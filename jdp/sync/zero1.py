"""ZeRO-1, the sharded optimizer ("cross-replica weight-update sharding", Xu et al. 2020): each device updates its
1/N slice of the parameters and optimizer state from its slice of the reduce-scattered gradient."""

from __future__ import annotations

import functools
from collections.abc import Callable
from contextvars import ContextVar
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jdp.errors import FitError
from jdp.layers import context
from jdp.mesh import DATA_AXIS
from jdp.sync.base import (
    AllReduce,
    DDPTwin,
    Local,
    Reduced,
    Sync,
    Tree,
    averaged_sums,
    is_sharded,
    padded,
    shard_axis,
    sum_of_squares,
    unpadded,
)


def local_slice(tree: Tree, axis_name: str) -> Tree:
    """This device's slice of each (replicated) leaf; scalars whole, like their optimizer state."""
    n, i = jax.lax.psum(1, axis_name), jax.lax.axis_index(axis_name)

    def cut(x: jax.Array) -> jax.Array:
        if not is_sharded(x):
            return x
        axis = shard_axis(x.shape, n)
        size = -(-x.shape[axis] // n)
        return jax.lax.dynamic_slice_in_dim(padded(x, n, axis), i * size, size, axis=axis)

    return jax.tree.map(cut, tree)


def all_gather_like(slices: Tree, like: Tree, axis_name: str, axes: Tree = None,
                    all_gather: Callable = jax.lax.all_gather) -> Tree:
    """Whole leaves shaped like `like` from every device's slice (a scalar as it is); `axes`: each leaf's split axis
    (default: `shard_axis`); `all_gather`: lax's, or one of its signature."""
    n = jax.lax.psum(1, axis_name)

    def gather(s: jax.Array, x: Any, axis: int | None) -> jax.Array:
        if not is_sharded(x):
            return s
        axis = shard_axis(x.shape, n) if axis is None else axis
        return unpadded(all_gather(s, axis_name, axis=axis, tiled=True), x)

    return jax.tree.map(gather, slices, like, jax.tree.map(lambda _: None, like) if axes is None else axes)


def global_norm(tree: Tree, axis_name: str | None = None) -> jax.Array:
    """The L2 norm of all leaves; with `axis_name`, of the whole leaves whose slices the devices hold."""
    if axis_name is None:
        return jnp.sqrt(sum_of_squares(tree))
    leaves = jax.tree.leaves(tree)
    return jnp.sqrt(jax.lax.psum(sum_of_squares([x for x in leaves if is_sharded(x)]), axis_name)
                    + sum_of_squares([x for x in leaves if not is_sharded(x)]))


class ZeRO1(Sync):
    """ZeRO-1, its gradient reduce-scattered in `dtype` ("fp32" or "bf16"), its parameters then all-gathered."""

    per_device_update = True
    shards_optimizer = True

    def record(self) -> dict[str, Any]:
        # Sharding changes where the state lives, not what is computed (a subclass written elsewhere may differ).
        if type(self).__module__.startswith("jdp.sync."):
            return AllReduce(self.dtype_name).record()
        return super().record()

    def ddp_twin(self) -> DDPTwin | None:
        return AllReduce(self.dtype_name).ddp_twin()

    def check(self, options: dict[str, Any], view: Any, what: str, require: Any) -> None:
        require(options["backend"] == "shard_map", f"{what} needs {view.use('backend', 'shard_map')}")

    def optimizer_sees_slices(self, backend: str) -> bool:
        return backend != "jit"  # under jit (ZeRO-3's) the optimizer updates global arrays

    def check_optimizer(self, tx: optax.GradientTransformation, abstract_params: Tree, num_devices: int,
                        backend: str, what: str) -> None:
        check_sliceable(tx, abstract_params, self.mesh_shape(num_devices)[DATA_AXIS], what,
                        self.optimizer_sees_slices(backend))

    def sliced_mean(self, grads: Tree, axis_name: str | None) -> Tree:
        """This device's slice of each leaf's cross-device mean gradient (of a scalar: all of it), float32."""
        n = jax.lax.psum(1, axis_name)

        def scatter(g: jax.Array) -> jax.Array:
            if not is_sharded(g):
                return jax.lax.pmean(g, axis_name)
            axis = shard_axis(g.shape, n)
            return jax.lax.psum_scatter(padded(g, n, axis), axis_name, scatter_dimension=axis, tiled=True) / n

        return optax.tree.cast(jax.tree.map(scatter, optax.tree.cast(grads, self.dtype)), jnp.float32)

    def reduce(self, local: Local, state: Any, axis_name: str | None, collective: bool = True) -> Reduced:
        return self._reduced(self.sliced_mean(local.grads, axis_name), local,
                             averaged_sums(local, axis_name if collective else None))

    def update(self, tx: optax.GradientTransformation, grads: Tree, state: Any, axis_name: str | None
               ) -> tuple[Tree, Any]:
        params_slice = local_slice(state.params, axis_name)
        updates, opt_state = tx.update(grads, state.opt_state, params_slice)
        return all_gather_like(optax.apply_updates(params_slice, updates), state.params, axis_name), opt_state

    def grad_norm(self, grads: Tree, axis_name: str | None, collective: bool = True) -> jax.Array:
        return global_norm(grads, axis_name)  # of the slices' squares: with the layout, kept without collectives


class Sliceable(optax.GradientTransformation):
    """A transform that is right on ZeRO slices (element-wise, its clipping summing norms across devices, as
    `clip_by_global_norm(max_norm, "data")`): `jdp.fit` skips its slicing probe. `Sliceable(*tx)` vouches for `tx`."""


# `Sync.optimizer_sees_slices` in the step, read by `clip_by_global_norm`: one chain clips right under every strategy.
_optimizer_sees_slices: ContextVar[bool] = ContextVar("jdp_optimizer_sees_slices", default=True)
optimizer_sees_slices = functools.partial(context, _optimizer_sees_slices)  # (sliced) -> a context and a decorator


def clip_by_global_norm(max_norm: float, axis_name: str | None = None) -> optax.GradientTransformation:
    """optax's global-norm clipping; with `axis_name`, the squared norms of each device's slices are summed across
    devices, unless the `jdp.fit` step's optimizer sees whole leaves (no sharding, or ZeRO-3 under jit)."""
    if axis_name is None:
        return optax.clip_by_global_norm(max_norm)

    def update(updates, state, params=None):
        norm = global_norm(updates, axis_name if _optimizer_sees_slices.get() else None)
        factor = jnp.minimum(1.0, max_norm / jnp.maximum(norm, 1e-12))
        return jax.tree.map(lambda u: u * factor, updates), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def check_sliceable(tx: optax.GradientTransformation, abstract_params: Any, n: int, what: str, sliced: bool) -> None:
    """Refuses a transform whose first two updates on each device's slice of every leaf (`sliced`), or on the leaves
    zero-padded to a multiple of `n`, differ from those on the logical leaves (two: Adam's first is blind to scale)."""
    if isinstance(tx, Sliceable):
        return
    rng = np.random.default_rng(0)
    axes = jax.tree.map(lambda x: shard_axis(x.shape, n) if is_sharded(x) else None, abstract_params)
    # Small stand-ins, padded as the real leaves are: the split axis keeps the real length's remainder mod n.
    params = jax.tree.map(lambda x, axis: rng.standard_normal(
        [(n + d % n if d >= n else d) if a == axis else min(d, 3) for a, d in enumerate(x.shape)]).astype(np.float32),
        abstract_params, axes, is_leaf=lambda x: x is None)
    grads = [jax.tree.map(lambda x: 100 * rng.standard_normal(x.shape).astype(np.float32), params) for _ in range(2)]

    @optimizer_sees_slices(False)  # on one host: clip_by_global_norm(..., "data") left unwrapped sums nothing
    def two_updates(params: Tree, grads: list[Tree]) -> list[Tree]:
        state, updates = tx.init(params), []
        for g in grads:
            update, state = tx.update(g, state, params)
            params = optax.apply_updates(params, update)
            updates.append(update)
        return updates

    parts = n if sliced else 1  # what device i's optimizer sees: part i of the padded leaf

    def on_device(tree: Tree, i: int) -> Tree:
        return jax.tree.map(lambda x, axis: x if axis is None else np.split(np.asarray(padded(x, n, axis)), parts,
                                                                            axis=axis)[i],
                            tree, axes, is_leaf=lambda x: x is None)

    expected, real = two_updates(params, grads), jax.tree.map(np.ones_like, params)  # real: 0 on the padding
    for i in sorted({0, parts - 1}):  # the first device, and the last, which holds most padding
        seen = two_updates(on_device(params, i), [on_device(g, i) for g in grads])
        mask = jax.tree.leaves(on_device(real, i))
        if not all(np.allclose(np.asarray(a)[m > 0], np.asarray(b)[m > 0], rtol=1e-4, atol=1e-5) for step in range(2)
                   for a, b, m in zip(jax.tree.leaves(on_device(expected[step], i)), jax.tree.leaves(seen[step]), mask,
                                      strict=True)):
            examples = "optax's global-norm clipping, LAMB, LARS, " if sliced else ""
            clip = (", clip with jdp.sync.clip_by_global_norm(max_norm, 'data') in a chain wrapped as "
                    "jdp.sync.Sliceable(*chain)," if sliced else "")
            raise FitError(f"{what} runs the optimizer on {'slices' if sliced else 'zero-padded copies'} of each "
                           f"parameter, and this optimizer updates them differently from whole parameters ({examples}"
                           "per-leaf means as Adafactor's, shape-dependent masks); use an element-wise one (sgd, "
                           f"momentum, adam, adamw){clip} or another sync strategy")
