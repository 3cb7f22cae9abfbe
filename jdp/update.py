"""Step 4's guard: which state every replica keeps after the optax update, decided alike on every replica."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax


def updates_applied(state: Any) -> jax.Array:
    """optax's own update count, the argument its schedule sees: skipped updates do not advance it."""
    schedules = optax.tree_utils.tree_get_all_with_path(state.opt_state, "ScaleByScheduleState")
    return schedules[0][1].count if schedules else state.step


def guard(state: Any, updated: Any, loss_finite: jax.Array, grads_finite: jax.Array,
           empty: jax.Array, o: Any) -> tuple[Any, dict[str, jax.Array]]:
    """Which state every replica keeps (the flags must be replica-identical): the updated one; the old one on a
    non-finite loss or gradient; the old one a step on for a batch weighing nothing or only fp16's gradient overflow."""
    loss_scale = state.loss_scale
    if o.fit.precision == "fp16":  # the guard sees the loss; gradient overflow only lowers the loss scale
        scale, good, overflows = loss_scale[0], loss_scale[1], loss_scale[2]
        overflow = loss_finite & ~grads_finite
        good = jnp.where(grads_finite, good + 1, 0)
        grow = good >= o.fit.loss_scale_growth_interval
        loss_scale = jnp.stack([jnp.where(overflow, scale / 2, jnp.where(grow, scale * 2, scale)),
                                jnp.where(grow, 0, good).astype(scale.dtype), overflows + overflow])
        finite = loss_finite
        metrics = {"loss_scale": scale, "overflow_steps": loss_scale[2], "overflow": overflow.astype(jnp.float32)}
    else:
        overflow, finite, metrics = jnp.bool_(False), loss_finite & grads_finite, {}
    halt = o.fit.on_nonfinite == "halt"
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
