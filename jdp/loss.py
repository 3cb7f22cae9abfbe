"""The loss contract: `loss_fn(model, batch)` returns one value per example (or per example and token) under each
key, `"loss"` among them, and optionally a `"weight"` of the same shape; jdp averages their weighted sums."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jdp.modeldef import LossFn, ModelDef, Tree, call_loss


def weighted_sums(outputs: dict[str, jax.Array], mask_B: jax.Array | None = None
                  ) -> tuple[dict[str, jax.Array], jax.Array]:
    """Each key's weighted sum (float32) and the weight total; `mask_B` zeroes padding rows."""
    weight = (outputs["weight"] if "weight" in outputs else jnp.ones(outputs["loss"].shape)).astype(jnp.float32)
    if mask_B is not None:
        weight = weight * mask_B.reshape(mask_B.shape + (1,) * (weight.ndim - 1))
    return {k: jnp.sum(v.astype(jnp.float32) * weight) for k, v in outputs.items() if k != "weight"}, jnp.sum(weight)


def run_loss(model: ModelDef, loss_fn: LossFn, params: Tree, model_state: Tree, rng_state: Tree,
             batch: dict[str, jax.Array], *, train: bool, folds: tuple[jax.Array, ...] = (), groups: int = 1,
             micro: jax.Array | int = 0) -> tuple[dict[str, jax.Array], Tree, Tree]:
    """(`loss_fn`'s outputs, the new model state, the RNG counts). `folds` (the step, then the device or group)
    and, for a loss's `rngs`, the micro-batch `micro` go into the keys. `groups > 1` runs that many groups of rows
    as separate models (jit's per-device BatchNorm), group g folding g as device g does under shard_map."""
    if groups > 1:
        grouped = jax.tree.map(lambda a: a.reshape(groups, -1, *a.shape[1:]), batch)

        def one_group(g, rows):
            return run_loss(model, loss_fn, params, model_state, rng_state, rows, train=train, folds=(*folds, g),
                            micro=micro)

        outputs, states, counts = jax.vmap(one_group)(jnp.arange(groups), grouped)
        outputs = jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), outputs)
        return outputs, jax.tree.map(lambda s: s.mean(0).astype(s.dtype), states), jax.tree.map(lambda c: c[0], counts)
    module = model.module(params, model_state, rng_state, train=train, folds=folds)
    outputs = call_loss(loss_fn, module, batch, model.call_key((*folds[:1], micro, *folds[1:])))
    new_model_state, counts = model.updated_state(module)
    return outputs, new_model_state, counts
