"""DiLoCo (Douillard et al., 2023): `every` inner steps per device, then an outer optimizer step on the outer
gradient, anchor - mean(parameters after the round), from which every device goes on (docs/communication.md).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.flatten_util import ravel_pytree

from jdp.sync.base import PER_DEVICE, Tree, all_reduce_mean, checked_group_size, group_mesh, real_number
from jdp.sync.local_sgd import LocalSGD
from jdp.sync.quantized import check_block, quantized_mean
from jdp.sync.zero1 import all_gather_like, local_slice


class DiLoCo(LocalSGD):
    """`outer` "sgd": anchor - outer_lr * g, "nesterov": the paper's outer Nesterov momentum (optax's); `bits` 8 or 4:
    the outer gradient block-quantized per `block` values; `group_size` k: a learner is k devices (None: a process)."""

    def __init__(self, every: int, outer_lr: float = 0.7, outer_momentum: float = 0.9, outer: str = "nesterov",
                 bits: int = 32, block: int = 256, group_size: int | None = 1) -> None:
        super().__init__(every)
        self.group_size = checked_group_size(group_size)
        self.bits, self.block = (bits, block) if bits == 32 else check_block(bits, block)
        if outer not in ("nesterov", "sgd"):
            raise ValueError(f"outer={outer!r} is not one of nesterov, sgd")
        outer_lr, outer_momentum = real_number("outer_lr", outer_lr), real_number("outer_momentum", outer_momentum)
        if not (0 < outer_lr < math.inf and 0 <= outer_momentum < 1):
            raise ValueError(f"outer_lr={outer_lr} must be positive and finite, and outer_momentum={outer_momentum} "
                             "in [0, 1)")
        self.outer_name, self.outer_lr, self.outer_momentum = outer, outer_lr, outer_momentum
        self.outer = optax.sgd(outer_lr, outer_momentum if outer == "nesterov" else None, nesterov=True)

    def params(self) -> dict[str, Any]:
        # Left out at their defaults: a record without them still matches on resume.
        quantized = {"bits": self.bits, "block": self.block} if self.bits != 32 else {}
        grouped = {"group_size": self.group_size} if self.group_size != 1 else {}
        return {"every": self.every, "outer_lr": self.outer_lr, "outer_momentum": self.outer_momentum,
                "outer": self.outer_name, **quantized, **grouped}

    def mesh_shape(self, num_devices: int) -> dict[str, int]:
        return super().mesh_shape(num_devices) if self.group_size == 1 else group_mesh(self, num_devices)

    def check(self, options: dict[str, Any], view: Any, what: str, require: Any) -> None:
        super().check(options, view, what, require)
        require(self.group_size == 1 or options["backend"] == "shard_map", f"{what} (DiLoCo across groups) runs on "
                f"a two-axis mesh under shard_map only; use {view.use('backend', 'shard_map')}")

    def init_state(self, params: Tree, num_devices: int) -> Tree:
        return {"anchor": params, "outer": self.outer.init(params)}

    def init_opt_state(self, opt_state: Any, num_devices: int) -> Any:
        return jax.tree.map(lambda x: jnp.broadcast_to(x, (num_devices, *x.shape)), opt_state)

    def layouts(self, abstract_state: Any) -> Any:
        layouts = super().layouts(abstract_state)
        return layouts._replace(opt_state=jax.tree.map(lambda _: PER_DEVICE, abstract_state.opt_state))

    def outer_step(self, anchor: Tree, params: Tree, outer_state: Any, axis_name: str | None) -> tuple[Tree, Any]:
        """(the new anchor, the outer optimizer's state) from the devices' `params` after a round."""
        if isinstance(axis_name, tuple):  # groups x data: across the groups each device sends its 1/k slice
            groups, inner = axis_name
            flat, unravel = ravel_pytree(jax.tree.map(lambda a, p: a - p, anchor, params))
            mine = local_slice(flat.astype(jnp.float32), inner)
            mean = (all_reduce_mean(mine, groups) if self.bits == 32
                    else quantized_mean([mine], groups, self.bits, self.block)[0][0])
            gradient = unravel(all_gather_like(mean, flat, inner))
        elif self.bits == 32:
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
