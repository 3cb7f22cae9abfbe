"""The per-device training step, written once: compute -> all-reduce -> update.

Pure functions with no jit and no knowledge of devices: `jdp.parallel` runs them under shard_map
or pmap (with `axis_name="data"`, one call per device on its slice of the batch) or under jit
(with `axis_name=None`, one call on the whole global batch; XLA inserts the all-reduce).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jdp import zero
from jdp.mesh import DATA_AXIS
from jdp.modeldef import LossFn, ModelDef, call_loss
from jdp.precision import cast_floating as _cast

Tree = Any


class TrainState(NamedTuple):
    step: jax.Array  # int32 scalar: training steps taken (the next batch's index)
    params: Tree  # trainable parameters (float32 masters), a pure dict
    model_state: Tree  # non-trainable model state (BatchNorm statistics), a pure dict
    rng_state: Tree  # {"keys": raw key data, "counts": counters} of the model's RNG streams (jdp.modeldef)
    opt_state: optax.OptState
    skipped: jax.Array  # int32 scalar: steps whose update was dropped as non-finite
    loss_scale: jax.Array  # float32 [scale, finite steps since it last changed, overflowed steps]; fp16 only
    halted: jax.Array  # int32 scalar, 1 once on_nonfinite=halt froze this process's state (reset on restore)


def weighted_sums(outputs: dict[str, jax.Array], mask_B: jax.Array | None = None
                  ) -> tuple[dict[str, jax.Array], jax.Array]:
    """The loss contract: `outputs` holds one value per example (or per example and token) under each
    key, `"loss"` among them, and optionally a `"weight"` of the same shape. Returns each key's
    weighted sum (float32) and the weight total; `mask_B` zeroes padding rows."""
    outputs = dict(outputs)
    weight = outputs.pop("weight", None)
    weight = jnp.ones(outputs["loss"].shape, jnp.float32) if weight is None else weight.astype(jnp.float32)
    if mask_B is not None:
        weight = weight * mask_B.reshape(mask_B.shape + (1,) * (weight.ndim - 1))
    return {k: jnp.sum(v.astype(jnp.float32) * weight) for k, v in outputs.items()}, jnp.sum(weight)


def all_reduce_mean(tree: Tree, axis_name: str | None) -> Tree:
    """The data-parallel all-reduce: average over the `data` axis (a no-op under jit, where the
    arrays are already global and XLA inserts the collective itself). One call is one collective."""
    return tree if axis_name is None else jax.lax.pmean(tree, axis_name)


@dataclasses.dataclass(frozen=True)
class StepOptions:
    """How the one step runs; every field has the plain data-parallel default."""

    axis_name: str | None = None  # "data" under shard_map/pmap, None under jit
    bn_groups: int = 1  # jit with per-device BatchNorm: normalise the global batch in this many groups of rows
    # jit with grad_accum_steps > 1: the device count. The micro-batch loop then runs one lane per device
    # (vmapped over a `data` axis laid on the devices), so each device sums its own gradients and XLA
    # all-reduces once, instead of once per micro-batch. 0: no lanes (the other backends, or k = 1).
    accum_lanes: int = 0
    on_nonfinite: str = "halt"  # halt | skip
    precision: str = "fp32"  # fp32 | bf16 | fp16 (fp16 adds dynamic loss scaling)
    keep_fp32: tuple[str, ...] = ()  # batch keys never cast to the compute dtype (e.g. regression targets)
    grad_accum_steps: int = 1  # micro-batches per step, all-reduced once
    allreduce_dtype: str = "fp32"  # fp32 | bf16: what the gradient all-reduce sends
    all_reduce: bool = True  # False compiles the step without its collective (jdp.bench's with/without)
    log_grad_norm: bool = False  # report the averaged gradient's norm (one more pass over the gradients)
    # For `jdp.noise_scale`: report the squared norms of the small-batch gradients and of the global one
    # (riding in the one collective). The small batches are "devices" (each device's slice) or
    # "micro_batches" (each gradient-accumulation micro-batch: one device); "" reports nothing.
    noise_small_batches: str = ""
    sync_every: int = 1  # local SGD: average parameters every H steps instead of gradients every step
    shard_optimizer: bool = False  # ZeRO-1: reduce-scatter, update this device's slice, all-gather (jdp.zero)
    loss_scale_growth_interval: int = 2000  # fp16: finite steps before the loss scale doubles
    # The batch the loss sees, made on the device from the batch that was sent: as it is, or e.g. uint8
    # pixels -> cropped, normalised floats (a source's `device_input`).
    device_input: Callable[[dict[str, jax.Array]], dict[str, jax.Array]] = lambda batch: batch


COMPUTE_DTYPES = {"fp32": jnp.float32, "bf16": jnp.bfloat16, "fp16": jnp.float16}  # the precisions
ALLREDUCE_DTYPES = ("fp32", "bf16")
NONFINITE_POLICIES = ("halt", "skip")


def _sum_sq(tree: Tree) -> jax.Array:
    return sum((jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(tree)), jnp.float32(0))


def _all_finite(tree: Tree) -> jax.Array:
    return jnp.stack([jnp.isfinite(x).all() for x in jax.tree.leaves(tree)] or [jnp.bool_(True)]).all()


def _floating(tree: Tree) -> Tree:
    """The floating leaves of `tree` (others None): what may be averaged across replicas."""
    return jax.tree.map(lambda x: x if jnp.issubdtype(x.dtype, jnp.floating) else None, tree)


def _merge_floating(averaged: Tree, tree: Tree) -> Tree:
    return jax.tree.map(lambda a, x: x if a is None else a, averaged, tree, is_leaf=lambda x: x is None)


def run_loss(model: ModelDef, loss_fn: LossFn, params: Tree, model_state: Tree, rng_state: Tree,
             batch: dict[str, jax.Array], *, train: bool, folds: tuple[jax.Array, ...] = (), groups: int = 1,
             micro: jax.Array | int = 0) -> tuple[dict[str, jax.Array], Tree, Tree]:
    """`loss_fn` on the model merged from its state; returns its outputs, the new model state and RNG counts.

    `folds` (the step, then the device or group) go into every RNG stream's key; a loss's call-time `rngs` get
    the seed with the step, the micro-batch index `micro` and the rest of `folds`, so no two micro-batches,
    steps or devices draw the same masks.

    `groups > 1` cuts the batch into that many equal groups of rows, each run as its own model, so
    BatchNorm normalises each group alone: per-device ("ghost") BatchNorm for the jit backend, which sees
    the global batch. Group g folds g into its RNG keys, as device g does under shard_map; the groups'
    new running statistics are averaged.
    """
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


def micro_batches(batch: dict[str, jax.Array], k: int) -> dict[str, jax.Array]:
    """(rows, ...) -> (k, rows / k, ...): row i of every block of rows goes to micro-batch i mod k, so a
    micro-batch is the same set of global rows whether the step sees one device's block or the whole batch."""
    return jax.tree.map(lambda a: a.reshape(-1, k, *a.shape[1:]).swapaxes(0, 1), batch)


def train_step(state: TrainState, batch: dict[str, jax.Array], *, model: ModelDef, loss_fn: LossFn,
               tx: optax.GradientTransformation, schedule: optax.Schedule | None,
               options: StepOptions) -> tuple[TrainState, dict[str, jax.Array]]:
    """One data-parallel step on this device's slice of the global batch (step 1, the split,
    happened before: `batch` is already this device's rows).

    The gradient is that of the weighted mean of the loss over the whole global batch: each device
    sends its weighted sums and weight total with its gradient in the one collective, so devices
    holding different numbers of real entries (tokens) still give the one-device gradient.

    Non-finite guard: an update whose averaged loss or gradient is not finite is dropped on every
    replica alike. With `on_nonfinite="skip"` training goes on; with "halt" the state freezes from
    then on, so the host, which learns of it a step later, still finds the state from before.
    fp16 gradient overflows are not failures: dynamic loss scaling halves the scale and skips the step.
    A global weight total of 0 makes no update and is not a failure.
    """
    o = options
    compute_dtype = COMPUTE_DTYPES[o.precision]
    scale = state.loss_scale[0] if o.precision == "fp16" else 1.0
    # Dropout masks differ across steps and devices, and are reproducible from (seed, step, device count).
    folds = (state.step,) if o.axis_name is None else (state.step, jax.lax.axis_index(o.axis_name))

    def local_loss(params: Tree, model_state: Tree, counts: Tree, micro: dict[str, jax.Array],
                   folds: tuple[jax.Array, ...] = folds, groups: int = o.bn_groups, index: jax.Array | int = 0):
        # Mixed precision: float32 master parameters, cast for the forward; gradients come back float32.
        micro = o.device_input(micro)
        micro = {k: v if k in o.keep_fp32 else _cast(v, compute_dtype) for k, v in micro.items()}
        outputs, new_model_state, counts = run_loss(
            model, loss_fn, _cast(params, compute_dtype), model_state, {**state.rng_state, "counts": counts},
            micro, train=True, folds=folds, groups=groups, micro=index)
        new_model_state = jax.tree.map(lambda new, old: new.astype(old.dtype), new_model_state, model_state)
        sums, weight = weighted_sums(outputs)
        # Divided by the static row count, not the weight: the weight total is global, known only after
        # the collective. Keeps gradients near the scale of a mean (fp16 loss scaling, bf16 all-reduce).
        return sums["loss"] / rows * scale, (sums, weight, new_model_state, counts)

    def mean_grad_sq(grads: Tree, weight: jax.Array) -> jax.Array:
        """|gradient of the weighted mean|^2 from d(weighted sum)/rows (float32, loss scale removed)."""
        return _sum_sq(grads) * (rows / scale / jnp.where(weight > 0, weight, 1.0)) ** 2

    grad_fn = jax.value_and_grad(local_loss, has_aux=True)

    # 2. compute: forward and backward on the local slice, in `grad_accum_steps` micro-batches.
    counts = state.rng_state["counts"]
    rows = jax.tree.leaves(batch)[0].shape[0] // o.grad_accum_steps  # of each micro-batch
    if o.grad_accum_steps == 1:
        (_, (sums, weight, model_state, counts)), grads = grad_fn(state.params, state.model_state, counts, batch)
    else:
        def accumulate_all(micros: dict[str, jax.Array], **loss_options: Any):
            """The micro-batches one after another: summed gradients, weighted sums and weight; the state
            after the last; each micro-batch's |gradient|^2 (for `noise_small_batches`)."""
            def accumulate(carry, indexed):
                grads_sum, model_state, counts, sums_sum, weight_sum = carry
                index, micro = indexed
                (_, (sums, weight, model_state, counts)), grads = grad_fn(
                    state.params, model_state, counts, micro, index=index, **loss_options)
                micro_sq = mean_grad_sq(grads, weight) if o.noise_small_batches == "micro_batches" else jnp.float32(0)
                return (jax.tree.map(jnp.add, grads_sum, grads), model_state, counts,
                        jax.tree.map(jnp.add, sums_sum, sums), weight_sum + weight), micro_sq

            first = jax.tree.map(lambda a: a[0], micros)
            sums_shape = jax.eval_shape(lambda: grad_fn(state.params, state.model_state, counts, first,
                                                        **loss_options)[0][1][0])
            zeros = jax.tree.map(jnp.zeros_like, (state.params, sums_shape))
            return jax.lax.scan(accumulate, (zeros[0], state.model_state, counts, zeros[1], jnp.float32(0)),
                                (jnp.arange(o.grad_accum_steps), micros), unroll=True)

        micros = micro_batches(batch, o.grad_accum_steps)
        if not o.accum_lanes:
            (grads, model_state, counts, sums, weight), micro_sqs = accumulate_all(micros)
        else:
            # jit: XLA would all-reduce each micro-batch's gradient (a partial sum over the devices' rows)
            # before adding them up, k times the bytes of one all-reduce. One lane per device, each on
            # its own rows with its own RNG fold (as under shard_map; synced BatchNorm reduces over the
            # lanes' axis), keeps the partial sums on their devices; summing the lanes is the one
            # all-reduce. Per-device BatchNorm is then simply each lane's own.
            def lane(rows: dict[str, jax.Array]):
                lane_folds = (state.step, jax.lax.axis_index(DATA_AXIS))
                return accumulate_all(rows, folds=lane_folds, groups=1)

            lanes = jax.tree.map(lambda a: a.reshape(a.shape[0], o.accum_lanes, -1, *a.shape[2:]), micros)
            (grads, model_state, counts, sums, weight), micro_sqs = jax.vmap(
                lane, in_axes=1, axis_name=DATA_AXIS, spmd_axis_name=DATA_AXIS)(lanes)
            grads, sums, weight = jax.tree.map(lambda a: a.sum(0), (grads, sums, weight))
            model_state = jax.tree.map(lambda s: s.mean(0).astype(s.dtype), model_state)
            counts = jax.tree.map(lambda c: c[0], counts)
            micro_sqs = micro_sqs[0]  # per micro-batch noise is asked for on one device only: one lane
    per_micro_batch = o.noise_small_batches == "micro_batches"
    if o.noise_small_batches:
        small_sq = jnp.mean(micro_sqs) if per_micro_batch else mean_grad_sq(grads, weight)
    if o.precision == "fp16":
        grads = jax.tree.map(lambda g: g / scale, grads)

    # 3. all-reduce: one collective carries the gradient, the weighted sums and the weight total
    # (with a sharded optimizer the gradient is reduce-scattered instead; under local SGD it stays
    # local: the parameters are averaged every `sync_every` steps, below).
    # Model state is averaged too: a no-op for synced BatchNorm, and it keeps per-device
    # ("ghost") BatchNorm running statistics identical across replicas.
    axis = o.axis_name if o.all_reduce else None
    local_sgd = o.sync_every > 1
    local_weight = weight
    sent = grads if o.allreduce_dtype == "fp32" else _cast(grads, jnp.bfloat16)
    if o.shard_optimizer:  # the layout of the update, kept even when the bench compiles the collective out
        grads = _cast(zero.reduce_scatter_mean(sent, o.axis_name), jnp.float32)
    averaged = {"model_state": _floating(model_state), "sums": sums, "weight": weight}
    if o.noise_small_batches:
        averaged["noise_small_sq"] = small_sq
    if not (o.shard_optimizer or local_sgd):  # one collective for all of it: each costs a rendezvous
        averaged["grads"] = sent
    averaged = all_reduce_mean(averaged, axis)
    model_state = _merge_floating(averaged["model_state"], model_state)
    weight = averaged["weight"]
    if "grads" in averaged:
        grads = _cast(averaged["grads"], jnp.float32)
    # grads hold (the mean over devices of) d(weighted sum)/rows: rescale to d(weighted mean).
    denominator = local_weight if local_sgd else weight
    grads = jax.tree.map(lambda g: g * (rows / jnp.where(denominator > 0, denominator, 1.0)), grads)
    empty = weight <= 0
    metrics = {k: v / weight for k, v in averaged["sums"].items()}
    metrics["weight"] = weight * (jax.lax.psum(1, axis) if axis else 1)  # the global total, on every backend
    if o.noise_small_batches:  # the global gradient's norm needs no collective: every device holds it whole
        metrics.update(noise_small_sq=averaged["noise_small_sq"], noise_big_sq=_sum_sq(grads),
                       noise_small_batch=weight / o.grad_accum_steps if per_micro_batch else weight)
    if o.log_grad_norm:  # the norm the update sees, before clipping (local SGD: mean of the local norms)
        metrics["grad_norm"] = zero.global_norm(grads, o.axis_name if o.shard_optimizer else None)
        if local_sgd:
            metrics["grad_norm"] = all_reduce_mean(metrics["grad_norm"], axis)

    # 4. update: the same optax update on every replica keeps the parameters in sync.
    if o.shard_optimizer:  # each device updates its slice, then every device gathers the whole
        params_slice = zero.local_slice(state.params, o.axis_name)
        updates, opt_state = tx.update(grads, state.opt_state, params_slice)
        params = zero.all_gather_like(optax.apply_updates(params_slice, updates), state.params, o.axis_name)
    else:
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)

    grads_finite = _all_finite(grads)
    if (local_sgd or o.shard_optimizer) and axis is not None:  # per-device gradients: decide alike
        grads_finite = jax.lax.pmin(grads_finite.astype(jnp.int32), axis).astype(bool)
    rng_state = {**state.rng_state, "counts": counts}
    updated = state._replace(step=state.step + 1, params=params, model_state=model_state, rng_state=rng_state,
                             opt_state=opt_state)
    new_state, guard_metrics = _guard(state, updated, jnp.isfinite(metrics["loss"]) | empty, grads_finite, empty, o)
    if local_sgd:  # after the guard, so that a sync step whose update was dropped or held still syncs
        at_sync = (state.step + 1) % o.sync_every == 0
        # Step counts in the optimizer state are identical everywhere; the float leaves are averaged.
        average = partial(jax.tree.map, lambda x: all_reduce_mean(x, axis)
                          if jnp.issubdtype(x.dtype, jnp.floating) else x)
        params, opt_state = jax.lax.cond(at_sync, average, lambda t: t, (new_state.params, new_state.opt_state))
        new_state = new_state._replace(params=params, opt_state=opt_state)
    metrics.update(guard_metrics)
    if schedule is not None:
        metrics["lr"] = schedule(_updates_applied(state))
    return new_state, metrics


def _updates_applied(state: TrainState) -> jax.Array:
    """optax's own update count, the argument its schedule sees: skipped updates do not advance it."""
    schedules = optax.tree_utils.tree_get_all_with_path(state.opt_state, "ScaleByScheduleState")
    return schedules[0][1].count if schedules else state.step


def _guard(state: TrainState, updated: TrainState, loss_finite: jax.Array, grads_finite: jax.Array,
           empty: jax.Array, o: StepOptions) -> tuple[TrainState, dict[str, jax.Array]]:
    """Which state every replica keeps: the updated one; the old one when the loss or gradient is not
    finite (the non-finite guard); the old one a step on when the batch weighed nothing (`empty`); or,
    under fp16, the old one with a halved loss scale when only the gradients overflowed (dynamic loss
    scaling, not a failure). The flags are replica-identical."""
    metrics = {}
    loss_scale = state.loss_scale
    if o.precision == "fp16":  # the guard sees the loss; gradient overflow only lowers the loss scale
        scale, good, overflows = loss_scale[0], loss_scale[1], loss_scale[2]
        overflow = loss_finite & ~grads_finite
        good = jnp.where(grads_finite, good + 1, 0)
        grow = good >= o.loss_scale_growth_interval
        loss_scale = jnp.stack([jnp.where(overflow, scale / 2, jnp.where(grow, scale * 2, scale)),
                                jnp.where(grow, 0, good).astype(scale.dtype), overflows + overflow])
        finite = loss_finite
        metrics.update(loss_scale=scale, overflow_steps=loss_scale[2], overflow=overflow.astype(jnp.float32))
    else:
        overflow, finite = jnp.bool_(False), loss_finite & grads_finite
    halt = o.on_nonfinite == "halt"
    apply = finite & (state.halted == 0) if halt else finite
    updated = updated._replace(loss_scale=loss_scale)
    # skip: the step is dropped and counted. halt: the state from before the bad step freezes, uncounted, as the
    # steps already dispatched after it find it; a resumed run retries that step.
    dropped = (state._replace(halted=jnp.ones_like(state.halted)) if halt
               else state._replace(step=state.step + 1, skipped=state.skipped + 1))
    held = state._replace(step=state.step + 1, loss_scale=loss_scale)
    new_state = jax.tree.map(lambda new, old, hold: jnp.where(apply, jnp.where(overflow | empty, hold, new), old),
                             updated, dropped, held)
    metrics.update(nonfinite=1.0 - apply.astype(jnp.float32), skipped_steps=new_state.skipped)
    return new_state, metrics


def eval_step(state: TrainState, batch: dict[str, jax.Array], *, model: ModelDef, loss_fn: LossFn,
              axis_name: str | None, device_input: Callable[[dict[str, jax.Array]], dict[str, jax.Array]]
              ) -> dict[str, jax.Array]:
    """Weighted sums of `loss_fn`'s outputs and the weight total over the global batch, the model in eval
    mode; padding rows (`mask` 0) weigh nothing."""
    rows = {k: v for k, v in batch.items() if k != "mask"}
    outputs, _, _ = run_loss(model, loss_fn, state.params, state.model_state, state.rng_state,
                             device_input(rows), train=False)
    sums, weight = weighted_sums(outputs, batch["mask"])
    sums["weight"] = weight
    return sums if axis_name is None else jax.lax.psum(sums, axis_name)
