"""The training step, written once: compute (`jdp.gradients`) -> sync (`jdp.sync`) -> update, guard (`jdp.update`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jdp.errors import FitError
from jdp.gradients import local_gradients, micro_batches
from jdp.layers import LayerView, viewing
from jdp.loss import run_loss, weighted_sums
from jdp.modeldef import LossFn, ModelDef
from jdp.options import FitOptions
from jdp.sync import Sync
from jdp.sync.base import Reduced, sum_of_squares
from jdp.sync.zero1 import optimizer_sees_slices
from jdp.update import guard, updates_applied

__all__ = ["StepOptions", "TrainState", "eval_step", "micro_batches", "run_loss", "train_step", "weighted_sums"]

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
    sync: Tree = {}  # the sync strategy's own state (jdp.sync: an error feedback, an outer optimizer's); {} for most


@dataclasses.dataclass(frozen=True)
class StepOptions:
    """How the one step runs: `fit`'s options, and what jdp derives from them, the backend and the mesh."""

    fit: FitOptions = FitOptions()
    # "data" under shard_map/pmap (a hybrid mesh's tuple of axes, ("groups", "data")), None under jit
    axis_name: str | tuple[str, ...] | None = None
    mesh: Any = None  # under jit, the devices (for the sharding constraints of a sync strategy's layer view)
    bn_groups: int = 1  # jit with per-device BatchNorm: normalise the global batch in this many groups of rows
    # jit with grad_accum_steps > 1: the device count, one accumulation lane each (`jdp.gradients`); 0: no lanes.
    accum_lanes: int = 0
    all_reduce: bool = True  # False compiles the step without its collective (jdp.bench's with/without)
    # `jdp.noise_scale`'s small batches: "devices" (each device's slice), "micro_batches" (on one device), "": none.
    noise_small_batches: str = ""
    # The batch the loss sees, made on the device from the one sent (a source's `device_input`).
    device_input: Callable[[dict[str, jax.Array]], dict[str, jax.Array]] = lambda batch: batch


def train_step(state: TrainState, batch: dict[str, jax.Array], *, model: ModelDef, loss_fn: LossFn,
               tx: optax.GradientTransformation, sync: Sync, schedule: optax.Schedule | None,
               options: StepOptions) -> tuple[TrainState, dict[str, jax.Array]]:
    """One data-parallel step on this device's rows: the gradient of the loss's weighted mean over the global batch."""
    o, axis = options, options.axis_name
    collective = axis if o.all_reduce else None  # None: jdp.bench's step compiled without its collectives
    stored, state = state, sync.forward_state(state)
    # 2. compute: forward and backward on the local slice, in `grad_accum_steps` micro-batches.
    local = local_gradients(state, batch, model=model, loss_fn=loss_fn, options=o,
                            params_view=lambda params: sync.params_view(params, axis),
                            layer_view=sync.layer_view(axis, o.mesh))
    # 3. all-reduce: the sync strategy turns the local gradient into the update's input.
    reduced = sync.reduce(local, state, axis, collective=o.all_reduce)
    _check_reduced(sync, reduced, state.params, local.small_sq is not None)
    # 4. update, then the guard chooses the state every replica keeps.
    with optimizer_sees_slices(axis is not None and sync.optimizer_sees_slices(o.fit.backend)):
        params, opt_state = sync.update(tx, reduced.grads, state, axis)
    empty = reduced.weight <= 0
    metrics = {k: v / reduced.weight for k, v in reduced.sums.items()}
    grads_finite = jnp.all(jnp.array([jnp.isfinite(g).all() for g in jax.tree.leaves(reduced.grads)]))
    if sync.per_device_update and collective:  # per-device gradients: decide alike
        grads_finite = jax.lax.pmin(grads_finite.astype(jnp.int32), collective).astype(bool)
    updated = state._replace(step=state.step + 1, params=params, model_state=reduced.model_state,
                             rng_state={**state.rng_state, "counts": local.counts}, opt_state=opt_state,
                             sync=state.sync if reduced.sync_state is None else reduced.sync_state)
    _check_kept(sync, state, updated, "reduce and update")
    new_state, guard_metrics = guard(state, updated, jnp.isfinite(metrics["loss"]) | empty, grads_finite, empty, o)
    new_state = _check_kept(sync, stored, sync.after_update(new_state, state, collective), "after_update")

    metrics["weight"] = reduced.weight * (jax.lax.psum(1, collective) if collective else 1)  # the global total
    if local.small_sq is not None:  # the global gradient's norm needs no collective: every device holds it whole
        metrics.update(noise_small_sq=reduced.small_sq, noise_big_sq=sum_of_squares(reduced.grads),
                       noise_small_batch=reduced.weight / (o.fit.grad_accum_steps if o.noise_small_batches
                                                           == "micro_batches" else 1))
    if o.fit.log_grad_norm:  # the norm the update sees, before clipping
        metrics["grad_norm"] = sync.grad_norm(reduced.grads, axis, collective=o.all_reduce)
    metrics.update(guard_metrics)
    if schedule is not None:
        metrics["lr"] = schedule(updates_applied(state))
    return new_state, metrics


def _leaves(tree: Tree) -> dict[str, Any]:
    return {jax.tree_util.keystr(path).lstrip("."): x for path, x in jax.tree_util.tree_leaves_with_path(tree)}


def _shown(x: Any) -> str:
    return "missing" if x is None else f"{jnp.result_type(x)}{list(jnp.shape(x))}"  # float32[4, 8], as held


def _check_reduced(sync: Sync, reduced: Any, params: Tree, noise_scale: bool) -> None:
    """FitError unless `reduce` kept its contract (docs/communication.md): optax would broadcast or promote."""
    if not isinstance(reduced, Reduced):
        raise FitError(f"{sync!r}.reduce returned {type(reduced).__name__}; it returns a jdp.sync.Reduced")
    if noise_scale and reduced.small_sq is None:
        raise FitError(f"{sync!r} has noise_scale = True, but its reduce returned no small_sq; return "
                       "averaged_sums(local, ...)['small_sq'] in its Reduced, or set noise_scale = False")
    grads, wanted = _leaves(reduced.grads), _leaves(params)
    for path in [*wanted, *(grads.keys() - wanted.keys())]:
        g, p = grads.get(path), wanted.get(path)
        if g is None or p is None or jnp.ndim(g) != jnp.ndim(p) or not jnp.issubdtype(jnp.result_type(g),
                                                                                        jnp.floating):
            raise FitError(f"{sync!r}.reduce returned the gradient of {path} as {_shown(g)}, for a parameter of "
                           f"{_shown(p)}: Reduced.grads has the parameters' tree, each leaf floating and of its "
                           "parameter's rank")


def _check_kept(sync: Sync, before: TrainState, after: TrainState, by: str) -> TrainState:
    """`after`, or FitError naming a leaf `by` changed in dtype or shape (the guard's select would hide it)."""
    was, now = _leaves(before), _leaves(after)
    for path in [*was, *(now.keys() - was.keys())]:
        if _shown(was.get(path)) != _shown(now.get(path)):
            raise FitError(f"the step ({sync!r}.{by}, the optimizer, the model) leaves the train state's {path} as "
                           f"{_shown(now.get(path))}; it was {_shown(was.get(path))}: each keeps a leaf's dtype and "
                           "shape (a strategy returns its own state's successor as Reduced.sync_state)")
    return after


def eval_step(state: TrainState, batch: dict[str, jax.Array], *, model: ModelDef, loss_fn: LossFn,
              axis_name: str | None, device_input: Callable[[dict[str, jax.Array]], dict[str, jax.Array]],
              params_view: Callable[[Tree], Tree], layer_view: LayerView | None) -> dict[str, jax.Array]:
    """Weighted sums of `loss_fn`'s outputs and the weight total over the global batch, padding rows weighing 0."""
    rows = {k: v for k, v in batch.items() if k != "mask"}
    with viewing(layer_view):
        outputs, _, _ = run_loss(model, loss_fn, params_view(state.params), state.model_state, state.rng_state,
                                 device_input(rows), train=False)
    sums, weight = weighted_sums(outputs, batch["mask"])
    sums["weight"] = weight
    return sums if axis_name is None else jax.lax.psum(sums, axis_name)
