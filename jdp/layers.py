"""Layers that make a deep model fit: activation checkpointing (`remat`) and scanned layers (`Stack`), whose layers
a trainer splitting the parameters gathers one at a time (`viewing`); docs/performance.md, 'Making a model fit'.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import io
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import jax
from flax import nnx
from jax.ad_checkpoint import print_saved_residuals

from jdp import hlo

REMAT_POLICIES: dict[str, Callable[..., bool] | None] = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}

class LayerView(NamedTuple):
    """How a trainer has each layer of a `Stack` computed (None: as held): `params` maps (its Param values as held,
    their logical shapes) to those it computes with (gathered); `carry` maps the carry entering it (a constraint)."""

    params: Callable[[list[jax.Array], tuple[tuple[int, ...], ...]], list[jax.Array]] | None = None
    carry: Callable[[jax.Array], jax.Array] | None = None

_layer_view: contextvars.ContextVar[LayerView | None] = contextvars.ContextVar("jdp_layer_view", default=None)


def check_remat(remat: str) -> str:
    if remat not in REMAT_POLICIES:
        raise ValueError(f"remat={remat!r} is not one of {tuple(REMAT_POLICIES)}; set e.g. "
                         "--config.model.kwargs.remat=full")
    return remat


def remat(fn: Callable, policy: str) -> Callable:
    """`fn` under `nnx.remat` with the named policy ("none": `fn` itself)."""
    return fn if check_remat(policy) == "none" else nnx.remat(fn, policy=REMAT_POLICIES[policy])


def saved_residual_bytes(fn: Callable, *args: Any) -> int:
    """Bytes of what JAX saves from the forward of `fn(*args)` for its backward, before XLA's buffer assignment."""
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        print_saved_residuals(fn, *args)
    return hlo.shape_bytes(printed.getvalue())


@contextlib.contextmanager
def context(var: contextvars.ContextVar, value: Any) -> Iterator[None]:
    """`var` set to `value` inside the block (usable as a decorator too)."""
    token = var.set(value)
    try:
        yield
    finally:
        var.reset(token)


# (view) -> a context in which every `Stack` traced computes each layer with `view` of its parameters (None: as held)
viewing = functools.partial(context, _layer_view)


class Stack(nnx.Module):
    """`depth` layers of `make_layer(rngs)`, stacked on axis 0 of every leaf, run in order by `nnx.scan`.

    `stack(x, *xs, call=...)` runs `call(layer, x, *xs_i)` -> (x, out) for each layer i, where `xs` are per-layer
    inputs stacked on axis 0 (a KV cache); it returns the last x and the layers' outs stacked on axis 0. `call`
    defaults to `layer(x, *xs_i)`, which must then return (x, out). `remat`: "none", "full" or "dots".
    """

    def __init__(self, make_layer: Callable[[nnx.Rngs], nnx.Module], depth: int, *, rngs: nnx.Rngs,
                 remat: str = "none"):
        # Through a lambda: nnx.vmap refuses a bound method (a model's own `self.make_block`).
        self.layers = nnx.split_rngs(splits=depth)(nnx.vmap(lambda r: make_layer(r), in_axes=(0,), out_axes=0))(rngs)
        self.depth, self.remat = depth, check_remat(remat)
        # Static: the logical shape of each of one layer's parameters, in leaf order (a view may get them split).
        self.layer_shapes = tuple(tuple(x.shape[1:]) for x in jax.tree.leaves(nnx.state(self.layers, nnx.Param)))

    def __call__(self, x: jax.Array, *xs: Any, call: Callable[..., tuple[jax.Array, Any]] | None = None
                 ) -> tuple[jax.Array, Any]:
        call = call or (lambda layer, x, *xs_i: layer(x, *xs_i))
        view, shapes = _layer_view.get() or LayerView(), self.layer_shapes

        def body(layer: nnx.Module, x: jax.Array, *xs_i: Any) -> tuple[jax.Array, Any]:
            if view.carry is not None:
                x = view.carry(x)
            if view.params is None:
                return call(layer, x, *xs_i)
            graph, params, rest = nnx.split(layer, nnx.Param, ...)
            leaves, treedef = jax.tree.flatten(params)
            whole = nnx.merge(graph, jax.tree.unflatten(treedef, view.params(leaves, shapes)), rest)
            out = call(whole, x, *xs_i)
            nnx.update(layer, nnx.state(whole, nnx.Not(nnx.Param)))  # RNG counts, statistics
            return out

        policy = REMAT_POLICIES[self.remat]

        def never_saving_gathers(prim: Any, *avals: Any, **params: Any) -> bool:
            """`remat`'s policy, but never saving the all-gathers and slices: the backward gathers a layer again."""
            return prim.name not in ("all_gather", "slice") and (policy is None or policy(prim, *avals, **params))

        body = remat(body, self.remat) if view.params is None else nnx.remat(body, policy=never_saving_gathers)

        return nnx.scan(body, in_axes=(0, nnx.Carry, *(0,) * len(xs)), out_axes=(nnx.Carry, 0))(self.layers, x, *xs)
