"""Streaming DiLoCo (Douillard et al. 2025): DiLoCo whose leaves are cut in order into F fragments of about equal
size, fragment f synced at inner steps f H/F + k H with its own outer optimizer state (F = 1 is DiLoCo, bit for bit).
The state, the overlap and what it does not model: docs/communication.md, 'Streaming DiLoCo'.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jdp.errors import FitError
from jdp.sync.base import Tree, real_number, whole_number
from jdp.sync.diloco import DiLoCo


def fragments_of(tree: Tree, count: int) -> list[list[int]]:
    """The indices of `tree`'s leaves in each of `count` fragments of about equal size (by each leaf's middle)."""
    sizes = [x.size for x in jax.tree.leaves(tree)]
    total, starts = sum(sizes), [sum(sizes[:i]) for i in range(len(sizes))]
    owner = [min(count - 1, int(count * (start + size / 2) / total)) for start, size in zip(starts, sizes,
                                                                                         strict=True)]
    return [[i for i, o in enumerate(owner) if o == f] for f in range(count)]


class StreamingDiLoCo(DiLoCo):
    """F `fragments` must divide H (`every`), and the `overlap` tau is below H. Its state: `{"local": each device's
    parameters, "outer": each fragment's outer optimizer state}`."""

    def __init__(self, every: int, fragments: int = 2, outer_lr: float = 0.7, outer_momentum: float = 0.9,
                 outer: str = "nesterov", bits: int = 32, block: int = 256, overlap: int = 0,
                 local_weight: float = 0.0) -> None:
        super().__init__(every, outer_lr, outer_momentum, outer, bits, block)
        fragments, every = whole_number("fragments", fragments, 1), self.every
        if every % fragments:
            raise ValueError(f"fragments={fragments!r} must be a positive int that divides every={every}")
        overlap = whole_number("overlap", overlap, 0, " (steps)")
        if overlap >= every:
            raise ValueError(f"overlap={overlap!r} must be an int from 0 to every - 1 = {every - 1} (steps)")
        local_weight = real_number("local_weight", local_weight)
        if not 0 <= local_weight < 1 or (local_weight and not overlap):
            raise ValueError(f"local_weight={local_weight!r} must be in [0, 1), and 0 without an overlap")
        self.fragments, self.overlap, self.local_weight = fragments, overlap, local_weight

    agrees_every = 1  # each step's state is whole: a signal or a halt saves at once
    per_device_state = ("local",)  # each device's parameters its own; the outer states replicated

    def params(self) -> dict[str, Any]:
        overlap = {"overlap": self.overlap, "local_weight": self.local_weight} if self.overlap else {}
        return {**super().params(), "fragments": self.fragments, **overlap}

    def init_state(self, params: Tree, num_devices: int) -> Tree:
        leaves, fragments = jax.tree.leaves(params), fragments_of(params, self.fragments)
        if not all(fragments):
            sizes = [x.size for x in leaves]
            raise FitError(f"{self!r}: this model's {len(sizes)} parameter leaves ({sum(sizes):,} values, the "
                           f"largest {max(sizes):,}) leave a fragment with none of them to sync; use fewer fragments")
        return {"local": jax.tree.map(lambda p: jnp.broadcast_to(p, (num_devices, *p.shape)), params),
                "outer": tuple(self.outer.init([leaves[i] for i in fragment]) for fragment in fragments)}

    def restart(self, restored: Any, fresh: Any) -> Any:
        state = super().restart(restored, fresh)  # each device's parameters restart from the global ones
        local = jax.tree.map(lambda g, new: jax.device_put(jnp.broadcast_to(g, new.shape), new.sharding),
                             state.params, fresh.sync["local"])
        return state._replace(sync={**state.sync, "local": local})

    def forward_state(self, state: Any) -> Any:
        """The step computes on each device's own parameters; the global ones ride in the strategy's state."""
        return state._replace(params=state.sync["local"], sync={**state.sync, "global": state.params})

    def after_update(self, state: Any, previous: Any, axis_name: str | None) -> Any:
        """Fragment f's outer step once its round ends at step f H/F + k H, merged at once or tau steps later."""
        # The global parameters and outer states as the step began: an overlapped sync reads nothing it computed.
        global_leaves, treedef = jax.tree.flatten(previous.sync["global"])
        local_leaves, outers = jax.tree.leaves(state.params), list(previous.sync["outer"])
        began = jax.tree.leaves(previous.params)  # each device's own, as this step began

        def merge(anchor: list, local: list) -> list:
            w = self.local_weight
            return [a if not w else w * x + (1 - w) * a for a, x in zip(anchor, local, strict=True)]

        done, tau = previous.step + 1, self.overlap
        ended, sent = (done - 1, began) if tau else (done, local_leaves)  # the steps done when `sent` was
        for f, fragment in enumerate(fragments_of(state.params, self.fragments)):
            end = f * (self.every // self.fragments)  # fragment f's rounds end at steps end + k H
            anchor, outers[f] = jax.lax.cond((ended % self.every == end) & (ended > 0),
                                             lambda *carry: self.outer_step(*carry, axis_name),
                                             lambda anchor, _, outer: (anchor, outer),
                                             [global_leaves[i] for i in fragment], [sent[i] for i in fragment],
                                             outers[f])
            merged = jax.lax.cond(((done - tau) % self.every == end) & (done > tau), merge, lambda _, local: local,
                                  anchor, [local_leaves[i] for i in fragment])
            for i, new_global, new_local in zip(fragment, anchor, merged, strict=True):
                global_leaves[i], local_leaves[i] = new_global, new_local
        return state._replace(params=jax.tree.unflatten(treedef, global_leaves),
                              sync={"local": jax.tree.unflatten(treedef, local_leaves), "outer": tuple(outers)})
