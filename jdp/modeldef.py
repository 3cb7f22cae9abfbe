"""Any Flax NNX model as pure data for the compiled step: its graphs in train and eval mode and three pure dicts,
`params`, `model_state` (the rest but RNG streams) and `rng_state` (counters, and keys as raw `key_data`: plain
uint32 for checkpoints and collectives). Sown values are dropped. A loss taking `rngs`: docs/api.md, "Randomness".
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jdp.errors import FitError

Tree = Any
LossFn = Callable[..., dict[str, jax.Array]]  # (model, batch) or (model, batch, rngs) -> per-example outputs
# split order: params, keys, counts, sown values (dropped), the rest
_GROUPS = (nnx.Param, nnx.RngKey, nnx.RngCount, nnx.Intermediate, ...)
_MODE_ATTRIBUTES = ("deterministic", "use_running_average")  # what `Module.train()` / `.eval()` set


def call_loss(loss_fn: LossFn, module: nnx.Module, batch: dict[str, jax.Array], key: jax.Array) -> dict:
    """`loss_fn(module, batch)`, with an `nnx.Rngs` of `key` when it takes one as `rngs=` or third (made inside the
    differentiated function, as NNX requires)."""
    try:
        parameters = list(inspect.signature(loss_fn).parameters.values())
    except (TypeError, ValueError):  # a builtin or C callable: the two-argument form
        return loss_fn(module, batch)
    if any(p.name == "rngs" and p.kind != p.VAR_POSITIONAL for p in parameters):
        return loss_fn(module, batch, rngs=nnx.Rngs(default=key))
    positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)]
    if len(positional) >= 3 or any(p.kind == p.VAR_POSITIONAL for p in positional):
        return loss_fn(module, batch, nnx.Rngs(default=key))
    return loss_fn(module, batch)


def fold_in(key: jax.Array, value: jax.Array | int) -> jax.Array:
    """`jax.random.fold_in` for a key array of any shape: each key of vmapped or scanned layers alike."""
    return jax.random.fold_in(key, value) if key.ndim == 0 else jax.vmap(lambda k: fold_in(k, value))(key)


def set_batchnorm_axis(model: nnx.Module, axis_name: str | None) -> None:
    """Point every `nnx.BatchNorm` of `model` at `axis_name` (like torch's `convert_sync_batchnorm`)."""
    for _, module in nnx.iter_modules(model):
        if isinstance(module, nnx.BatchNorm):
            module.axis_name = axis_name


def _key_impl(key: Any) -> Any:
    """The PRNG implementation of a key, or of an abstract one (from `nnx.eval_shape`) of the default kind."""
    if isinstance(key, jax.ShapeDtypeStruct):
        default = jax.random.key(0)
        if key.dtype != default.dtype:
            raise FitError(f"an RNG stream of the model uses {key.dtype}, not JAX's default PRNG; pass the model "
                             "as an instance rather than a function")
        return jax.random.key_impl(default)
    return jax.random.key_impl(key)


@dataclasses.dataclass(frozen=True, eq=False)
class ModelDef:
    """Static description of a model: what the compiled step closes over."""

    train_graph: nnx.GraphDef
    eval_graph: nnx.GraphDef
    key_impls: tuple[Any, ...]  # the PRNG implementation of each RNG key, in tree order
    seed: int = 0  # of the call-time `rngs` a loss may take

    @classmethod
    def of(cls, model: nnx.Module, bn_axis: str | None, seed: int = 0) -> ModelDef:
        """The graphs of `model` (concrete or abstract), BatchNorms on `bn_axis`; FitError for a non-float parameter."""
        for path, leaf in jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(nnx.state(model, nnx.Param)))[0]:
            if not jnp.issubdtype(leaf.dtype, jnp.inexact):
                raise FitError(f"model parameter {jax.tree_util.keystr(path, simple=True, separator='.')} is "
                                 f"{leaf.dtype}, and parameters are trained by their gradient, which needs a float "
                                 "dtype; hold it as an nnx.Variable (model state) or a plain attribute")
        nnx.pop(model, nnx.Intermediate)
        kept = {(module, name): getattr(module, name) for _, module in nnx.iter_modules(model)
                for name in (*_MODE_ATTRIBUTES, "axis_name") if hasattr(module, name)}
        set_batchnorm_axis(model, bn_axis)
        try:
            model.train()
            train_graph = nnx.graphdef(model)
            model.eval()
            eval_graph = nnx.graphdef(model)
        finally:
            for (module, name), value in kept.items():  # the caller's model keeps its mode and BatchNorm axes
                setattr(module, name, value)
        keys = jax.tree.leaves(nnx.to_pure_dict(nnx.state(model, nnx.RngKey)))
        return cls(train_graph, eval_graph, tuple(_key_impl(k) for k in keys), seed)

    @staticmethod
    def split(model: nnx.Module, seed: int) -> tuple[Tree, Tree, Tree]:
        """(params, model_state, rng_state) of `model` as pure dicts; `seed` is folded into every stream."""
        _, params, keys, counts, _, rest = nnx.split(model, *_GROUPS)
        keys = jax.tree.map(lambda k: jax.random.key_data(fold_in(k, seed)), nnx.to_pure_dict(keys))
        return nnx.to_pure_dict(params), nnx.to_pure_dict(rest), {"keys": keys, "counts": nnx.to_pure_dict(counts)}

    def call_key(self, folds: tuple[jax.Array, ...]) -> jax.Array:
        """The key of a loss's call-time `rngs`: the seed with `folds` (step, micro-batch, device...) folded in."""
        return functools.reduce(jax.random.fold_in, folds, jax.random.key(self.seed))

    def _keys(self, key_data: Tree, folds: tuple[jax.Array, ...]) -> Tree:
        leaves, treedef = jax.tree.flatten(key_data)
        keys = [jax.random.wrap_key_data(data, impl=impl) for data, impl in zip(leaves, self.key_impls, strict=True)]
        return jax.tree.unflatten(treedef, [functools.reduce(fold_in, folds, key) for key in keys])

    def module(self, params: Tree, model_state: Tree, rng_state: Tree, *, train: bool,
               folds: tuple[jax.Array, ...] = ()) -> nnx.Module:
        """The model, merged from its state; each RNG key has `folds` folded in (step, device...)."""
        graph = self.train_graph if train else self.eval_graph
        return nnx.merge(graph, params, self._keys(rng_state["keys"], folds), rng_state["counts"], model_state)

    @staticmethod
    def updated_state(module: nnx.Module) -> tuple[Tree, Tree]:
        """(model_state, rng counts) of a module after it ran; what it sowed is dropped."""
        _, _, _, counts, _, rest = nnx.split(module, *_GROUPS)
        return nnx.to_pure_dict(rest), nnx.to_pure_dict(counts)

    def load_into(self, model: nnx.Module, params: Tree, model_state: Tree, rng_state: Tree) -> None:
        """Writes the state into the caller's model, as writable copies (a train call updates some in place)."""
        keys = self._keys(jax.tree.map(jnp.asarray, rng_state["keys"]), ())
        replace_state(model, params, jax.tree.map(np.array, model_state), keys,
                      jax.tree.map(np.array, rng_state["counts"]))


def replace_state(model: nnx.Module, params: Tree, model_state: Tree, keys: Tree | None = None,
                  counts: Tree | None = None) -> None:
    """Set `model`'s parameters and other state (and, if given, its RNG keys and counters) from pure dicts."""
    _, param_state, key_state, count_state, _, other_state = nnx.split(model, *_GROUPS)
    for state, values in zip((param_state, key_state, count_state, other_state), (params, keys, counts, model_state),
                             strict=True):
        if values is not None:
            nnx.replace_by_pure_dict(state, values)
            nnx.update(model, state)


def state_groups(model: nnx.Module) -> tuple[Tree, Tree]:
    """(params, model_state) of `model` as pure dicts, without its RNG streams."""
    _, params, _, _, _, rest = nnx.split(model, *_GROUPS)
    return nnx.to_pure_dict(params), nnx.to_pure_dict(rest)
