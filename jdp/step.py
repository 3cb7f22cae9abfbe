"""The per-device training step, written once: compute -> all-reduce -> update.

Pure functions with no jit and no knowledge of devices: `jdp.parallel` runs them under shard_map
or pmap (with `axis_name="data"`, one call per device on its slice of the batch) or under jit
(with `axis_name=None`, one call on the whole global batch; XLA inserts the all-reduce).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

Tree = Any


class TrainState(NamedTuple):
    step: jax.Array  # int32 scalar: training steps taken (the next batch's index)
    params: Tree  # trainable parameters, a pure dict
    model_state: Tree  # non-trainable model state (BatchNorm statistics), a pure dict
    opt_state: optax.OptState
    skipped: jax.Array  # int32 scalar: steps whose update was dropped as non-finite


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
    arrays are already global and XLA inserts the collective itself)."""
    return tree if axis_name is None else jax.lax.pmean(tree, axis_name)


def train_step(state: TrainState, batch: dict[str, jax.Array], *, graphdef: nnx.GraphDef,
               tx: optax.GradientTransformation, schedule: optax.Schedule, axis_name: str | None,
               on_nonfinite: str = "halt", bn_groups: int = 1) -> tuple[TrainState, dict[str, jax.Array]]:
    """One data-parallel step on this device's slice of the global batch (step 1, the split,
    happened before: `batch` is already this device's rows). `bn_groups`: see `forward`.

    Non-finite guard: an update whose averaged loss or gradient is not finite is dropped on every
    replica alike. With `on_nonfinite="skip"` training goes on; with "halt" the state freezes from
    then on, so the host, which learns of it a step later, still finds the state from before.
    """

    def local_loss(params: Tree) -> tuple[jax.Array, tuple[jax.Array, Tree]]:
        logits_BxC, model_state = forward(graphdef, params, state.model_state, batch["x"], train=True,
                                          groups=bn_groups)
        return cross_entropy(logits_BxC, batch["y"]).mean(), (logits_BxC, model_state)

    # 2. compute: forward and backward on the local slice.
    (loss, (logits_BxC, model_state)), grads = jax.value_and_grad(local_loss, has_aux=True)(state.params)
    accuracy = jnp.mean(jnp.argmax(logits_BxC, -1) == batch["y"])

    # 3. all-reduce: every device now holds the gradient of the mean loss over the global batch.
    # Model state is averaged too: a no-op for synced BatchNorm, and it keeps per-device
    # ("ghost") BatchNorm running statistics identical across replicas.
    grads, model_state, metrics = all_reduce_mean(
        (grads, model_state, {"loss": loss, "accuracy": accuracy}), axis_name)

    # 4. update: the same optax update on every replica keeps the parameters in sync.
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)

    finite = jnp.isfinite(metrics["loss"]) & jnp.stack([jnp.isfinite(g).all() for g in jax.tree.leaves(grads)]).all()
    apply = finite if on_nonfinite == "skip" else finite & (state.skipped == 0)
    updated = TrainState(state.step + 1, params, model_state, opt_state, state.skipped)
    dropped = TrainState(state.step + (on_nonfinite == "skip"), state.params, state.model_state, state.opt_state,
                         state.skipped + 1)
    new_state = jax.tree.map(lambda new, old: jnp.where(apply, new, old), updated, dropped)
    metrics.update(lr=schedule(state.step), nonfinite=1.0 - apply.astype(jnp.float32))
    return new_state, metrics


def eval_step(state: TrainState, batch: dict[str, jax.Array], *, graphdef: nnx.GraphDef,
              axis_name: str | None) -> dict[str, jax.Array]:
    """Sums of loss, correct predictions and real (unpadded) examples over the global batch."""
    logits_BxC, _ = forward(graphdef, state.params, state.model_state, batch["x"], train=False)
    mask_B = batch["mask"]
    sums = {
        "loss_sum": jnp.sum(cross_entropy(logits_BxC, batch["y"]) * mask_B),
        "correct": jnp.sum((jnp.argmax(logits_BxC, -1) == batch["y"]) * mask_B),
        "count": jnp.sum(mask_B),
    }
    return sums if axis_name is None else jax.lax.psum(sums, axis_name)
