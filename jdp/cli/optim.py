"""Config -> optax: the only place that maps optimizer settings to optax."""

from __future__ import annotations

from collections.abc import Callable

import jax
import ml_collections
import optax

from jdp.registry import Registry
from jdp.sync.zero1 import Sliceable, clip_by_global_norm


def learning_rate(cfg: ml_collections.ConfigDict, global_batch_size: int, total_steps: int) -> optax.Schedule:
    """Linear warmup from 0, then cosine or linear decay to `min_lr`, or constant."""
    peak = cfg.lr * global_batch_size / 256 if cfg.scale_lr_by_batch else cfg.lr
    warmup = cfg.warmup_steps
    decay_steps = total_steps - warmup
    after = {"cosine": lambda: optax.cosine_decay_schedule(peak, decay_steps, alpha=cfg.min_lr / peak),
             "linear": lambda: optax.linear_schedule(peak, cfg.min_lr, decay_steps),
             "constant": lambda: optax.constant_schedule(peak)}[cfg.schedule]()  # only the chosen one is built
    if warmup == 0:
        return after
    return optax.join_schedules([optax.linear_schedule(0.0, peak, warmup), after], [warmup])


# optim.name -> (schedule, optim section, weight-decay mask) -> optax transform
OPTIMIZERS: Registry[Callable[..., optax.GradientTransformation]] = Registry("optim.name")
for _name, _momentum, _nesterov in (("sgd", False, False), ("momentum", True, False), ("nesterov", True, True)):
    OPTIMIZERS.register(_name)(lambda lr, cfg, mask, momentum=_momentum, nesterov=_nesterov: optax.chain(
        optax.add_decayed_weights(cfg.weight_decay, mask),
        optax.sgd(lr, momentum=cfg.momentum if momentum else None, nesterov=nesterov)))
OPTIMIZERS.register("adamw")(lambda lr, cfg, mask: optax.adamw(lr, b1=cfg.momentum, b2=cfg.b2,
                                                               weight_decay=cfg.weight_decay, mask=mask))
OPTIMIZERS.register("lamb")(lambda lr, cfg, mask: optax.lamb(lr, b1=cfg.momentum, b2=cfg.b2,
                                                             weight_decay=cfg.weight_decay, mask=mask))
OPTIMIZERS.register("lars")(lambda lr, cfg, mask: optax.lars(lr, weight_decay=cfg.weight_decay, weight_decay_mask=mask,
                                                             trust_ratio_mask=mask, momentum=cfg.momentum))


def build_optimizer(cfg: ml_collections.ConfigDict, global_batch_size: int, total_steps: int, params: optax.Params,
                    sharded_axis: str | None = None) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """The optax transform and its schedule (also logged as `lr`). It runs after the all-reduce, so clipping sees
    the averaged gradient; `params` (shapes suffice) fixes the decay mask before a sharded optimizer slices them."""
    lr = learning_rate(cfg, global_batch_size, total_steps)
    # Decay for parameters of 2+ dimensions (kernels, embeddings: nanoGPT's rule), not biases or norm scales.
    tx = OPTIMIZERS.get(cfg.name)(lr, cfg, jax.tree.map(lambda p: p.ndim > 1, params))
    if cfg.grad_clip_norm > 0:
        tx = optax.chain(clip_by_global_norm(cfg.grad_clip_norm, sharded_axis), tx)
    return (Sliceable(*tx) if sharded_axis else tx), lr
