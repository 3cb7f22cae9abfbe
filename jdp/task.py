"""The built-in tasks' losses (`task.loss` of a config, or any `jdp.fit` loss): per-example outputs of
(model, batch), and the eval metrics derived from their means."""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jdp.modeldef import LossFn
from jdp.registry import Registry

# task.loss -> loss function (model, batch) -> per-example outputs (see jdp.fit)
LOSSES: Registry[LossFn] = Registry("task.loss")


@LOSSES.register("classification")
def classification_loss(model: nnx.Module, batch: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """Integer-label cross-entropy and accuracy per example, the loss of every shipped config."""
    logits_BxC = model(batch["x"]).astype(jnp.float32)
    return {"loss": optax.softmax_cross_entropy_with_integer_labels(logits_BxC, batch["y"]),
            "accuracy": (jnp.argmax(logits_BxC, -1) == batch["y"]).astype(jnp.float32)}


@LOSSES.register("lm")
def language_model_loss(model: nnx.Module, batch: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """Next-token cross-entropy and accuracy per token (B, T): the classification loss over the vocabulary."""
    return classification_loss(model, batch)


def perplexity(metrics: dict[str, float]) -> dict[str, float]:
    """exp(mean next-token loss): an eval metric of the whole split, not a mean of per-batch values."""
    return {"perplexity": math.exp(metrics["loss"]) if metrics["loss"] < 700 else math.inf}


# task.loss -> eval metrics computed from the eval means
DERIVED_EVAL_METRICS: dict[str, Callable[[dict[str, float]], dict[str, float]]] = {"lm": perplexity}
