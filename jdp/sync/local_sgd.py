"""Local SGD (DDP's post-local-SGD): each device updates from its own gradient, and every `every` steps the
parameters and the optimizer state's floating leaves are averaged, so the replicas agree at sync points."""

from __future__ import annotations

from typing import Any

import jax

from jdp.sync.base import (
    Local,
    Reduced,
    Sync,
    Tree,
    all_reduce_mean,
    averaged_sums,
    floating,
    merge_floating,
    whole_number,
)


class LocalSGD(Sync):
    """`LocalSGD(every=H)`: H local steps per device, then the average; evals, checkpoints, replica checks there."""

    per_device_update = True

    def __init__(self, every: int) -> None:
        super().__init__()
        self.every = whole_number("every", every, 2, " (steps between syncs)")

    def params(self) -> dict[str, Any]:
        return {"every": self.every}

    def check(self, options: dict[str, Any], view: Any, what: str, require: Any) -> None:
        require(options["backend"] in ("shard_map", "pmap"),
                f"{what} keeps each device's own parameters; use {view.use('backend', 'shard_map')} or pmap")

    def reduce(self, local: Local, state: Any, axis_name: str | None, collective: bool = True) -> Reduced:
        """The gradient stays the learner's own (a device's; on DiLoCo's groups x `data` mesh, its group's mean),
        scaled by the learner's weight; the sums are still all-reduced for the metrics."""
        own = {"grads": local.grads, "weight": local.weight}
        if isinstance(axis_name, tuple):
            own = all_reduce_mean(own, axis_name[-1] if collective else None)
        averaged = averaged_sums(local, axis_name if collective else None)
        return Reduced(self._of_mean(own["grads"], local.rows, own["weight"]), averaged["sums"], averaged["weight"],
                       merge_floating(averaged["model_state"], local.model_state), None)

    def after_update(self, state: Any, previous: Any, axis_name: str | None) -> Any:
        """At a sync point (counted from the step before, whatever the guard kept) the floating leaves averaged."""
        params, opt_state = jax.lax.cond((previous.step + 1) % self.every == 0,
                                         lambda t: merge_floating(all_reduce_mean(floating(t), axis_name), t),
                                         lambda t: t, (state.params, state.opt_state))
        return state._replace(params=params, opt_state=opt_state)

    def grad_norm(self, grads: Tree, axis_name: str | None, collective: bool = True) -> jax.Array:
        return all_reduce_mean(super().grad_norm(grads, axis_name), axis_name if collective else None)
