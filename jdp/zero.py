"""Sharded optimizer state (ZeRO-1; "cross-replica weight-update sharding", Xu et al. 2020).

Every leaf with at least one axis is flattened and zero-padded to a multiple of N devices; device i
owns the i-th 1/N slice of it. Scalar leaves stay whole: every device updates them, with their mean
gradient. Gradients are reduce-scattered into those slices, each device updates its slice of the
parameters and optimizer state, and the parameters are all-gathered. Checkpoints hold the gathered,
unpadded ("logical") optimizer state, so they restore on any N.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

Tree = Any


def is_sharded(leaf: Any) -> bool:
    """Which leaves are split: arrays with at least one axis (scalars such as step counts stay whole)."""
    return len(leaf.shape) > 0


def _flat_padded(x: jax.Array, n: int) -> jax.Array:
    flat = x.reshape(-1)
    return jnp.pad(flat, (0, (-flat.size) % n))


def _unpadded(flat: jax.Array, like: Any) -> jax.Array:
    return flat[: math.prod(like.shape)].reshape(like.shape)


def global_norm(tree: Tree, axis_name: str | None = None) -> jax.Array:
    """The L2 norm of all leaves; with `axis_name`, of the whole leaves whose slices the devices hold."""
    def squares(leaves: list[jax.Array]) -> jax.Array:
        return sum((jnp.sum(jnp.square(x)) for x in leaves), jnp.float32(0))

    leaves = jax.tree.leaves(tree)
    if axis_name is None:
        return jnp.sqrt(squares(leaves))
    sliced = jax.lax.psum(squares([x for x in leaves if is_sharded(x)]), axis_name)
    return jnp.sqrt(sliced + squares([x for x in leaves if not is_sharded(x)]))


def reduce_scatter_mean(grads: Tree, axis_name: str) -> Tree:
    """Each device receives the cross-device mean of its own slice of every gradient (of a scalar: all of it)."""
    n = jax.lax.psum(1, axis_name)

    def scatter(g: jax.Array) -> jax.Array:
        if not is_sharded(g):
            return jax.lax.pmean(g, axis_name)
        return jax.lax.psum_scatter(_flat_padded(g, n), axis_name, tiled=True) / n

    return jax.tree.map(scatter, grads)


def local_slice(tree: Tree, axis_name: str) -> Tree:
    """This device's slice of each (replicated) leaf; scalars whole, like their optimizer state."""
    n, i = jax.lax.psum(1, axis_name), jax.lax.axis_index(axis_name)

    def cut(x: jax.Array) -> jax.Array:
        if not is_sharded(x):
            return x
        flat = _flat_padded(x, n)
        size = flat.size // n
        return jax.lax.dynamic_slice(flat, (i * size,), (size,))

    return jax.tree.map(cut, tree)


def all_gather_like(slices: Tree, like: Tree, axis_name: str) -> Tree:
    """Reassemble full leaves shaped like `like` from every device's slice (a scalar every device updated whole)."""
    def gather(s: jax.Array, x: jax.Array) -> jax.Array:
        return _unpadded(jax.lax.all_gather(s, axis_name, tiled=True), x) if is_sharded(x) else s

    return jax.tree.map(gather, slices, like)


def shard_layout(tree: Tree, n: int) -> Tree:
    """Logical leaves -> flat, padded leaves (to be placed split along `data`); scalars unchanged."""
    return jax.tree.map(lambda x: _flat_padded(x, n) if is_sharded(x) else x, tree)


def logical_layout(tree: Tree, like: Tree) -> Tree:
    """Flat, padded leaves -> leaves shaped like `like` (the inverse of `shard_layout`)."""
    return jax.tree.map(lambda x, y: _unpadded(x, y) if is_sharded(y) else x, tree, like)
