"""Streaming DiLoCo (Douillard et al. 2025, "Streaming DiLoCo with overlapping communication"): DiLoCo whose model
is split into F fragments synced in turn, so that a round's bytes are spread over it instead of sent at once.

    fragment f (of F) is synced at inner steps f H/F + k H:  outer gradient = global_f - mean(local_f);
    global_f = outer_step_f(global_f, outer gradient);  local_f = global_f (on every device)

Each fragment has its own outer optimizer state, over its leaves. The leaves are split in order into F groups of
about equal size. With F = 1 it is DiLoCo, bit for bit.

No step has all replicas agree, so the state keeps both: `TrainState.params` holds the global (outer) parameters,
replicated, and the strategy's state each device's own (`local`, per device), with the inner optimizer state per
device as under DiLoCo. The step computes on the local ones (`Sync.forward_state`); evals, export and the result
see the global ones; the replica check covers them and the outer optimizer state. Every step's state is whole, so
checkpoints may come at any step and resume bitwise, on the same device count; on another, the inner optimizer
state starts afresh and every device's parameters from the global ones.

Built from the paper: fragments, their schedule, the per-fragment outer step, quantized outer gradients (`bits`).
Not built: the overlap (a fragment's all-reduce here depends on its sync step's update and is applied at once,
tau = 0) and the merge of the arriving global fragment with the local one (alpha = 1 here).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jdp.sync.base import PER_DEVICE, REPLICATED, Tree
from jdp.sync.diloco import DiLoCo


def fragments_of(tree: Tree, count: int) -> list[list[int]]:
    """The indices of `tree`'s leaves in each of `count` fragments: the leaves in order, cut into groups of about
    equal size (each leaf in the group its middle element falls in)."""
    sizes = [x.size for x in jax.tree.leaves(tree)]
    total, starts = sum(sizes), [sum(sizes[:i]) for i in range(len(sizes))]
    owner = [min(count - 1, int(count * (start + size / 2) / total)) for start, size in zip(starts, sizes,
                                                                                         strict=True)]
    return [[i for i, o in enumerate(owner) if o == f] for f in range(count)]


class StreamingDiLoCo(DiLoCo):
    """`StreamingDiLoCo(every=H, fragments=F, outer_lr=0.7, outer_momentum=0.9, outer="nesterov", bits=32)`: F must
    divide H. Its state: `{"local": each device's parameters, "outer": each fragment's outer optimizer state}`."""

    def __init__(self, every: int, fragments: int = 2, outer_lr: float = 0.7, outer_momentum: float = 0.9,
                 outer: str = "nesterov", bits: int = 32, block: int = 256) -> None:
        super().__init__(every, outer_lr, outer_momentum, outer, bits, block)
        if isinstance(fragments, bool) or not isinstance(fragments, int) or fragments < 1 or every % fragments:
            raise ValueError(f"fragments={fragments!r} must be a positive int that divides every={every}")
        self.fragments = fragments

    agrees_every = 1  # each step's state is whole: a signal or a halt saves at once

    def params(self) -> dict[str, Any]:
        return {**super().params(), "fragments": self.fragments}

    def check(self, options: dict[str, Any], view: Any, what: str, require: Any) -> None:
        # The state is whole at every step: evals, checkpoints and replica checks may come at any.
        require(options["backend"] in ("shard_map", "pmap"),
                f"{what} keeps each device's own parameters; use {view.use('backend', 'shard_map')} or pmap")

    def init_state(self, params: Tree, num_devices: int) -> Tree:
        leaves = jax.tree.leaves(params)
        return {"local": jax.tree.map(lambda p: jnp.broadcast_to(p, (num_devices, *p.shape)), params),
                "outer": tuple(self.outer.init([leaves[i] for i in fragment])
                               for fragment in fragments_of(params, self.fragments))}

    def layouts(self, abstract_state: Any) -> Any:
        layouts = super().layouts(abstract_state)
        sync = abstract_state.sync
        return layouts._replace(sync={"local": jax.tree.map(lambda _: PER_DEVICE, sync["local"]),
                                      "outer": jax.tree.map(lambda _: REPLICATED, sync["outer"])})

    def restart(self, restored: Any, fresh: Any) -> Any:
        state = super().restart(restored, fresh)  # each device's parameters restart from the global ones
        local = jax.tree.map(lambda g, new: jax.device_put(jnp.broadcast_to(g, new.shape), new.sharding),
                             state.params, fresh.sync["local"])
        return state._replace(sync={**state.sync, "local": local})

    def forward_state(self, state: Any) -> Any:
        """The step computes on each device's own parameters; the global ones ride in the strategy's state."""
        return state._replace(params=state.sync["local"], sync={**state.sync, "global": state.params})

    def after_update(self, state: Any, previous: Any, axis_name: str | None) -> Any:
        """Fragment f's outer step at the steps f H/F + k H (counted from the step before, whatever the guard
        kept); then back to the stored layout: the global parameters in `params`."""
        global_leaves, treedef = jax.tree.flatten(state.sync["global"])
        local_leaves, outers = jax.tree.leaves(state.params), list(state.sync["outer"])

        def sync_fragment(carry: tuple) -> tuple:
            anchor, local, outer_state = carry  # DiLoCo's outer step: one fragment is DiLoCo bit for bit
            anchor, outer_state = self.outer_step(anchor, local, outer_state, axis_name)
            return anchor, anchor, outer_state

        done = previous.step + 1
        for f, fragment in enumerate(fragments_of(state.params, self.fragments)):
            at = done % self.every == f * (self.every // self.fragments)
            carry = ([global_leaves[i] for i in fragment], [local_leaves[i] for i in fragment], outers[f])
            anchor, local, outers[f] = jax.lax.cond(at, sync_fragment, lambda carry: carry, carry)
            for i, new_global, new_local in zip(fragment, anchor, local, strict=True):
                global_leaves[i], local_leaves[i] = new_global, new_local
        return state._replace(params=jax.tree.unflatten(treedef, global_leaves),
                              sync={"local": jax.tree.unflatten(treedef, local_leaves), "outer": tuple(outers)})
