"""The per-device training step, written once: compute -> all-reduce -> update.

Pure functions with no jit and no knowledge of devices: `jdp.parallel` runs them under shard_map
or pmap (with `axis_name="data"`, one call per device on its slice of the batch) or under jit
(with `axis_name=None`, one call on the whole global batch; XLA inserts the all-reduce).
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable
from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jdp import zero

Tree = Any


class TrainState(NamedTuple):
    step: jax.Array  # int32 scalar: training steps taken (the next batch's index)
    params: Tree  # trainable parameters (float32 masters), a pure dict
    model_state: Tree  # non-trainable model state (BatchNorm statistics), a pure dict
    opt_state: optax.OptState
    skipped: jax.Array  # int32 scalar: steps whose update was dropped as non-finite
    loss_scale: jax.Array  # float32 [scale, finite steps since it last changed, overflowed steps]; fp16 only
    halted: jax.Array  # int32 scalar, 1 once on_nonfinite=halt froze this process's state (reset on restore)


def forward(graphdef: nnx.GraphDef, params: Tree, model_state: Tree, x: jax.Array, train: bool,
            groups: int = 1) -> tuple[jax.Array, Tree]:
    """Runs the NNX model functionally; returns logits and the updated model state.

    `groups > 1` cuts the batch into that many equal groups of rows, each normalised by its own
    BatchNorm statistics: per-device ("ghost") BatchNorm for the jit backend, which sees the global
    batch. The groups' new running statistics are averaged.
    """
    if groups > 1:
        x_GxBx = x.reshape(groups, -1, *x.shape[1:])
        logits_GxBxC, states = jax.vmap(lambda xi: forward(graphdef, params, model_state, xi, train))(x_GxBx)
        return logits_GxBxC.reshape(x.shape[0], -1), jax.tree.map(lambda s: s.mean(0), states)
    model = nnx.merge(graphdef, params, model_state)
    logits = model(x, train=train)
    return logits, nnx.to_pure_dict(nnx.state(model, nnx.Not(nnx.Param)))


def cross_entropy(logits_BxC: jax.Array, labels_B: jax.Array) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(logits_BxC.astype(jnp.float32), labels_B)


def all_reduce_mean(tree: Tree, axis_name: str | None) -> Tree:
    """The data-parallel all-reduce: average over the `data` axis (a no-op under jit, where the
    arrays are already global and XLA inserts the collective itself). One call is one collective."""
    return tree if axis_name is None else jax.lax.pmean(tree, axis_name)


@dataclasses.dataclass(frozen=True)
class StepOptions:
    """How the one step runs; every field has the plain data-parallel default."""

    axis_name: str | None = None  # "data" under shard_map/pmap, None under jit
    bn_groups: int = 1  # see `forward`
    on_nonfinite: str = "halt"  # halt | skip
    precision: str = "fp32"  # fp32 | bf16 | fp16 (fp16 adds dynamic loss scaling)
    grad_accum_steps: int = 1  # micro-batches per step, all-reduced once
    allreduce_dtype: str = "fp32"  # fp32 | bf16: what the gradient all-reduce sends
    log_grad_norm: bool = False  # report the averaged gradient's norm (one more pass over the gradients)
    sync_every: int = 1  # local SGD: average parameters every H steps instead of gradients every step
    shard_optimizer: bool = False  # ZeRO-1: reduce-scatter, update this device's slice, all-gather (jdp.zero)
    loss_scale_growth_interval: int = 2000  # fp16: finite steps before the loss scale doubles
    # The model's input from a batch, on the device: the batch's 'x' as it is, or e.g. uint8 pixels ->
    # cropped, normalised floats (a source's `device_input`).
    prepare_input: Callable[[dict[str, jax.Array]], jax.Array] = operator.itemgetter("x")


COMPUTE_DTYPES = {"fp32": jnp.float32, "bf16": jnp.bfloat16, "fp16": jnp.float16}


def _cast(tree: Tree, dtype: jnp.dtype) -> Tree:
    return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)


def _all_finite(tree: Tree) -> jax.Array:
    return jnp.stack([jnp.isfinite(x).all() for x in jax.tree.leaves(tree)]).all()


def train_step(state: TrainState, batch: dict[str, jax.Array], *, graphdef: nnx.GraphDef,
               tx: optax.GradientTransformation, schedule: optax.Schedule,
               options: StepOptions) -> tuple[TrainState, dict[str, jax.Array]]:
    """One data-parallel step on this device's slice of the global batch (step 1, the split,
    happened before: `batch` is already this device's rows).

    Non-finite guard: an update whose averaged loss or gradient is not finite is dropped on every
    replica alike. With `on_nonfinite="skip"` training goes on; with "halt" the state freezes from
    then on, so the host, which learns of it a step later, still finds the state from before.
    fp16 gradient overflows are not failures: dynamic loss scaling halves the scale and skips the step.
    """
    o = options
    compute_dtype = COMPUTE_DTYPES[o.precision]
    scale = state.loss_scale[0] if o.precision == "fp16" else 1.0

    def local_loss(params: Tree, model_state: Tree, micro: dict[str, jax.Array]):
        # Mixed precision: float32 master parameters, cast for the forward; gradients come back float32.
        x = o.prepare_input(micro).astype(compute_dtype)
        logits_BxC, new_model_state = forward(graphdef, _cast(params, compute_dtype), model_state, x, train=True,
                                              groups=o.bn_groups)
        new_model_state = jax.tree.map(lambda new, old: new.astype(old.dtype), new_model_state, model_state)
        loss = cross_entropy(logits_BxC, micro["y"]).mean()
        accuracy = jnp.mean(jnp.argmax(logits_BxC, -1) == micro["y"])
        return loss * scale, (loss, accuracy, new_model_state)

    grad_fn = jax.value_and_grad(local_loss, has_aux=True)

    # 2. compute: forward and backward on the local slice, in `grad_accum_steps` micro-batches.
    if o.grad_accum_steps == 1:
        (_, (loss, accuracy, model_state)), grads = grad_fn(state.params, state.model_state, batch)
    else:
        micro_batches = jax.tree.map(lambda a: a.reshape(o.grad_accum_steps, -1, *a.shape[1:]), batch)

        def accumulate(carry, micro):
            grads_sum, model_state, loss_sum, accuracy_sum = carry
            (_, (loss, accuracy, model_state)), grads = grad_fn(state.params, model_state, micro)
            return (jax.tree.map(jnp.add, grads_sum, grads), model_state, loss_sum + loss,
                    accuracy_sum + accuracy), None

        zeros = jax.tree.map(jnp.zeros_like, state.params)
        (grads, model_state, loss, accuracy), _ = jax.lax.scan(
            accumulate, (zeros, state.model_state, 0.0, 0.0), micro_batches, unroll=True)
        grads, loss, accuracy = jax.tree.map(lambda x: x / o.grad_accum_steps, (grads, loss, accuracy))
    if o.precision == "fp16":
        grads = jax.tree.map(lambda g: g / scale, grads)

    # 3. all-reduce: every device now holds the gradient of the mean loss over the global batch
    # (with a sharded optimizer, only its own slice of it; under local SGD, nothing: the
    # parameters are averaged every `sync_every` steps instead, below).
    # Model state is averaged too: a no-op for synced BatchNorm, and it keeps per-device
    # ("ghost") BatchNorm running statistics identical across replicas.
    local_sgd = o.sync_every > 1
    if o.shard_optimizer:
        grads = zero.reduce_scatter_mean(grads, o.axis_name)
    averaged = {"model_state": model_state, "metrics": {"loss": loss, "accuracy": accuracy}}
    if not (o.shard_optimizer or local_sgd):  # one collective for all of it: each costs a rendezvous
        averaged["grads"] = grads if o.allreduce_dtype == "fp32" else _cast(grads, jnp.bfloat16)
    averaged = all_reduce_mean(averaged, o.axis_name)
    model_state, metrics = averaged["model_state"], averaged["metrics"]
    if "grads" in averaged:
        grads = _cast(averaged["grads"], jnp.float32)
    if o.log_grad_norm:  # the norm the update sees, before clipping (local SGD: mean of the local norms)
        metrics["grad_norm"] = zero.global_norm(grads, o.axis_name if o.shard_optimizer else None)
        if local_sgd:
            metrics["grad_norm"] = all_reduce_mean(metrics["grad_norm"], o.axis_name)

    # 4. update: the same optax update on every replica keeps the parameters in sync.
    if o.shard_optimizer:  # each device updates its slice, then every device gathers the whole
        params_slice = zero.local_slice(state.params, o.axis_name)
        updates, opt_state = tx.update(grads, state.opt_state, params_slice)
        params = zero.all_gather_like(optax.apply_updates(params_slice, updates), state.params, o.axis_name)
    else:
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
    if local_sgd:
        at_sync = (state.step + 1) % o.sync_every == 0
        # Step counts in the optimizer state are identical everywhere; the float leaves are averaged.
        average = partial(jax.tree.map, lambda x: all_reduce_mean(x, o.axis_name)
                          if jnp.issubdtype(x.dtype, jnp.floating) else x)
        params, opt_state = jax.lax.cond(at_sync, average, lambda t: t, (params, opt_state))

    grads_finite = _all_finite(grads)
    if (local_sgd or o.shard_optimizer) and o.axis_name is not None:  # per-device gradients: decide alike
        grads_finite = jax.lax.pmin(grads_finite.astype(jnp.int32), o.axis_name).astype(bool)
    updated = state._replace(step=state.step + 1, params=params, model_state=model_state, opt_state=opt_state)
    new_state, guard_metrics = _guard(state, updated, jnp.isfinite(metrics["loss"]), grads_finite, o)
    metrics.update(guard_metrics, lr=schedule(_updates_applied(state)))
    return new_state, metrics


def _updates_applied(state: TrainState) -> jax.Array:
    """optax's own update count, the argument its schedule sees: skipped updates do not advance it."""
    schedules = optax.tree_utils.tree_get_all_with_path(state.opt_state, "ScaleByScheduleState")
    return schedules[0][1].count if schedules else state.step


def _guard(state: TrainState, updated: TrainState, loss_finite: jax.Array, grads_finite: jax.Array,
           o: StepOptions) -> tuple[TrainState, dict[str, jax.Array]]:
    """Which state every replica keeps: the updated one; the old one when the loss or gradient is not
    finite (the non-finite guard); or, under fp16, the old one with a halved loss scale when only the
    gradients overflowed (dynamic loss scaling, not a failure). The flags are replica-identical."""
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
        metrics.update(loss_scale=scale, overflow_steps=loss_scale[2])
    else:
        overflow, finite = jnp.bool_(False), loss_finite & grads_finite
    halt = o.on_nonfinite == "halt"
    apply = finite & (state.halted == 0) if halt else finite
    updated = updated._replace(loss_scale=loss_scale)
    dropped = state._replace(step=state.step + (not halt), skipped=state.skipped + 1,
                             halted=jnp.ones_like(state.halted) if halt else state.halted)
    overflowed = state._replace(step=state.step + 1, loss_scale=loss_scale)
    new_state = jax.tree.map(lambda new, old, over: jnp.where(apply, jnp.where(overflow, over, new), old),
                             updated, dropped, overflowed)
    metrics.update(nonfinite=1.0 - apply.astype(jnp.float32), skipped_steps=new_state.skipped)
    return new_state, metrics


def eval_step(state: TrainState, batch: dict[str, jax.Array], *, graphdef: nnx.GraphDef, axis_name: str | None,
              prepare_input: Callable[[dict[str, jax.Array]], jax.Array] = operator.itemgetter("x")
              ) -> dict[str, jax.Array]:
    """Sums of loss, correct predictions and real (unpadded) examples over the global batch."""
    logits_BxC, _ = forward(graphdef, state.params, state.model_state, prepare_input(batch), train=False)
    mask_B = batch["mask"]
    sums = {
        "loss_sum": jnp.sum(cross_entropy(logits_BxC, batch["y"]) * mask_B),
        "correct": jnp.sum((jnp.argmax(logits_BxC, -1) == batch["y"]) * mask_B),
        "count": jnp.sum(mask_B),
    }
    return sums if axis_name is None else jax.lax.psum(sums, axis_name)
