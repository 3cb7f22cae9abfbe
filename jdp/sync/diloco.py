"""DiLoCo (Douillard et al., 2023): each device runs `every` inner steps of the optimizer on its own data, then the
change of the round, averaged over the devices, is applied by an outer optimizer:

    outer gradient = anchor - mean(parameters after the round);  anchor = outer_step(anchor, outer gradient);
    parameters = anchor (on every device)

The inner optimizer's state stays with each device (per-device leaves: it restores on the same device count, and
starts afresh on another); the anchor and the outer optimizer's state are replicated. Checkpoints, evals and
replica checks come at round ends, as under local SGD, so a resume there is bitwise. With outer SGD at learning
rate 1 and a stateless inner optimizer it is local SGD.

`bits` 8 or 4 sends the outer gradient block-quantized, as INTELLECT-1 sends int8 pseudo-gradients: each device's
anchor - parameters through `jdp.sync.quantized.quantized_mean` (an all-to-all and an all-gather of integers with
a float32 scale per `block` values) instead of the float32 all-reduce of the parameters.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from jdp.sync.base import PER_DEVICE, Tree, all_reduce_mean
from jdp.sync.local_sgd import LocalSGD
from jdp.sync.quantized import check_block, quantized_mean

OUTER_OPTIMIZERS = ("nesterov", "sgd")


class DiLoCo(LocalSGD):
    """`DiLoCo(every=H, outer_lr=0.7, outer_momentum=0.9, outer="nesterov", bits=32, block=256)`; `outer` "sgd":
    anchor - lr * g, "nesterov": the paper's outer Nesterov momentum (optax's); `bits` 8 or 4: the outer gradient
    quantized. Its state: `{"anchor": the parameters at the round's start, "outer": the outer optimizer's state}`."""

    def __init__(self, every: int, outer_lr: float = 0.7, outer_momentum: float = 0.9, outer: str = "nesterov",
                 bits: int = 32, block: int = 256) -> None:
        super().__init__(every)
        if bits != 32:
            check_block(bits, block)
        self.bits, self.block = bits, block
        if outer not in OUTER_OPTIMIZERS:
            raise ValueError(f"outer={outer!r} is not one of {', '.join(OUTER_OPTIMIZERS)}")
        if not (outer_lr > 0 and 0 <= outer_momentum < 1):
            raise ValueError(f"outer_lr={outer_lr} must be positive and outer_momentum={outer_momentum} in [0, 1)")
        self.outer_name, self.outer_lr, self.outer_momentum = outer, float(outer_lr), float(outer_momentum)
        self.outer = (optax.sgd(outer_lr, momentum=outer_momentum, nesterov=True) if outer == "nesterov"
                      else optax.sgd(outer_lr))

    def params(self) -> dict[str, Any]:
        quantized = {"bits": self.bits, "block": self.block} if self.bits != 32 else {}  # float32 runs' records
        return {"every": self.every, "outer_lr": self.outer_lr, "outer_momentum": self.outer_momentum,
                "outer": self.outer_name, **quantized}

    def init_state(self, params: Tree, num_devices: int) -> Tree:
        return {"anchor": params, "outer": self.outer.init(params)}

    def init_opt_state(self, opt_state: Any, num_devices: int) -> Any:
        return jax.tree.map(lambda x: jnp.broadcast_to(x, (num_devices, *x.shape)), opt_state)

    def layouts(self, abstract_state: Any) -> Any:
        layouts = super().layouts(abstract_state)
        return layouts._replace(opt_state=jax.tree.map(lambda _: PER_DEVICE, abstract_state.opt_state))

    def outer_step(self, anchor: Tree, params: Tree, outer_state: Any, axis_name: str | None) -> tuple[Tree, Any]:
        """(the new anchor, the outer optimizer's state) from the devices' `params` after a round: the outer
        gradient anchor - mean(params), in float32 or quantized at `bits`."""
        if self.bits == 32:
            gradient = jax.tree.map(lambda a, p: a - p, anchor, all_reduce_mean(params, axis_name))
        else:
            gradient, _ = quantized_mean(jax.tree.map(lambda a, p: (a - p).astype(jnp.float32), anchor, params),
                                         axis_name, self.bits, self.block)
        updates, outer_state = self.outer.update(gradient, outer_state, anchor)
        return optax.apply_updates(anchor, updates), outer_state

    def after_update(self, state: Any, previous: Any, axis_name: str | None) -> Any:
        """At a round's end (counted from the step before, whatever the guard kept): the outer step."""
        def outer_step(state: Any) -> Any:
            anchor, outer = self.outer_step(state.sync["anchor"], state.params, state.sync["outer"], axis_name)
            return state._replace(params=anchor, sync={"anchor": anchor, "outer": outer})

        return jax.lax.cond((previous.step + 1) % self.every == 0, outer_step, lambda s: s, state)
