"""Step 2, compute: forward and backward on this device's slice, plain or accumulated over micro-batches, of its
weighted loss sum / its static row count (the weight total is known only after the collective: the sync rescales).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jdp.layers import LayerView, viewing
from jdp.loss import run_loss, weighted_sums
from jdp.mesh import DATA_AXIS
from jdp.modeldef import LossFn, ModelDef
from jdp.precision import COMPUTE_DTYPES, cast_floating
from jdp.sync.base import Local, Tree, sum_of_squares


def micro_batches(batch: dict[str, jax.Array], k: int) -> dict[str, jax.Array]:
    """(rows, ...) -> (k, rows / k, ...): row i of every block of rows goes to micro-batch i mod k, so a
    micro-batch is the same set of global rows whether the step sees one device's block or the whole batch."""
    return jax.tree.map(lambda a: a.reshape(-1, k, *a.shape[1:]).swapaxes(0, 1), batch)


def local_gradients(state: Any, batch: dict[str, jax.Array], *, model: ModelDef, loss_fn: LossFn, options: Any,
                    params_view: Callable[[Tree], Tree], layer_view: LayerView | None) -> Local:
    """The gradient of this device's slice (`params_view`, `layer_view`: the sync strategy's). With `accum_lanes`
    (jit) the micro-batch loop runs one vmapped lane per device, so that XLA all-reduces once, not per micro-batch."""
    o = options
    dtype = COMPUTE_DTYPES[o.fit.precision]
    scale = state.loss_scale[0] if o.fit.precision == "fp16" else 1.0
    k = o.fit.grad_accum_steps
    rows = jax.tree.leaves(batch)[0].shape[0] // k  # of each micro-batch
    folds = (state.step,) if o.axis_name is None else (state.step, jax.lax.axis_index(o.axis_name))
    if o.accum_lanes and layer_view is not None:  # the lanes' vmap lays the rows on the devices already: JAX refuses
        layer_view = layer_view._replace(carry=None)  # a sharding constraint on its spmd axis inside it

    def loss(params: Tree, model_state: Tree, counts: Tree, micro: dict[str, jax.Array], index: jax.Array | int,
             folds: tuple[jax.Array, ...], groups: int):
        micro = o.device_input(micro)
        micro = {key: v if key in o.fit.keep_fp32 else cast_floating(v, dtype) for key, v in micro.items()}
        with viewing(layer_view):
            outputs, new_model_state, counts = run_loss(
                model, loss_fn, cast_floating(params_view(params), dtype), model_state,
                {**state.rng_state, "counts": counts}, micro, train=True, folds=folds, groups=groups, micro=index)
        new_model_state = jax.tree.map(lambda new, old: new.astype(old.dtype), new_model_state, model_state)
        sums, weight = weighted_sums(outputs)
        return sums["loss"] / rows * scale, (sums, weight, new_model_state, counts)

    grad_fn = jax.value_and_grad(loss, has_aux=True)

    def mean_grad_sq(grads: Tree, weight: jax.Array) -> jax.Array:
        """|gradient of the weighted mean|^2 from d(weighted sum)/rows (float32, loss scale removed)."""
        return sum_of_squares(grads) * (rows / scale / jnp.where(weight > 0, weight, 1.0)) ** 2

    def accumulate_all(micros: dict[str, jax.Array], folds: tuple[jax.Array, ...], groups: int):
        """The micro-batches one after another: the sums, the state after the last, each one's |gradient|^2. The
        first is traced alone and the rest once, in an unrolled scan (a Python loop would trace each)."""
        def one(model_state: Tree, counts: Tree, index: jax.Array | int):
            (_, (sums, weight, model_state, counts)), grads = grad_fn(
                state.params, model_state, counts, jax.tree.map(lambda a: a[index], micros), index, folds, groups)
            micro_sq = mean_grad_sq(grads, weight) if o.noise_small_batches == "micro_batches" else jnp.float32(0)
            return (grads, sums, weight), model_state, counts, micro_sq

        def accumulate(carry, index):
            added, model_state, counts, micro_sq = one(*carry[1:], index)
            return (jax.tree.map(jnp.add, carry[0], added), model_state, counts), micro_sq

        total, model_state, counts, first_sq = one(state.model_state, state.rng_state["counts"], 0)
        (total, model_state, counts), micro_sqs = jax.lax.scan(accumulate, (total, model_state, counts),
                                                               jnp.arange(1, k), unroll=True)
        return (total[0], model_state, counts, total[1], total[2]), jnp.concatenate([first_sq[None], micro_sqs])

    if not o.accum_lanes:
        (grads, model_state, counts, sums, weight), micro_sqs = accumulate_all(micro_batches(batch, k), folds,
                                                                                o.bn_groups)
    else:
        lanes = jax.tree.map(lambda a: a.reshape(a.shape[0], o.accum_lanes, -1, *a.shape[2:]),
                             micro_batches(batch, k))
        (grads, model_state, counts, sums, weight), micro_sqs = jax.vmap(
            lambda rows: accumulate_all(rows, (state.step, jax.lax.axis_index(DATA_AXIS)), 1),
            in_axes=1, axis_name=DATA_AXIS, spmd_axis_name=DATA_AXIS)(lanes)
        grads, sums, weight = jax.tree.map(lambda a: a.sum(0), (grads, sums, weight))
        model_state = jax.tree.map(lambda s: s.mean(0).astype(s.dtype), model_state)
        counts, micro_sqs = jax.tree.map(lambda c: c[0], (counts, micro_sqs))  # micro-batch noise: on one device
    small_sq = (jnp.mean(micro_sqs) if o.noise_small_batches == "micro_batches"
                else mean_grad_sq(grads, weight) if o.noise_small_batches else None)
    if o.fit.precision == "fp16":
        grads = jax.tree.map(lambda g: g / scale, grads)
    return Local(grads, sums, weight, model_state, counts, rows, small_sq)

