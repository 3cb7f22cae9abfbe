"""Hybrid sharding (HSDP: PyTorch FSDP's HYBRID_SHARD, FSDP2's 2-D mesh): ZeRO-3 (or ZeRO-1, `stage=1`) inside groups
of k devices on a groups x `data` mesh, and across the groups one mean all-reduce of each device's 1/k gradient
slice, the loss sums riding in it. The sharded state is split on `data` alone (`shard_axis` with N = k) and
replicated across the groups; a scalar parameter, held whole, crosses whole. Stage 1 keeps the parameters whole:
each device updates its slice of them and of the optimizer state, then all-gathers them in the group.
Mesh, bytes and what is refused: docs/communication.md, 'Hybrid sharding (HSDP)'.
"""

from __future__ import annotations

from typing import Any

import jax
import optax
from jax.sharding import Mesh

from jdp.layers import LayerView
from jdp.mesh import DATA_AXIS
from jdp.sync.base import (
    Local,
    Reduced,
    Sync,
    Tree,
    all_reduce_mean,
    check_group_size,
    floating,
    group_mesh,
)
from jdp.sync.zero1 import ZeRO1, check_sliceable, global_norm
from jdp.sync.zero3 import ZeRO3

STAGES = (1, 3)


def _inner(axis_name: Any) -> str | None:
    """The in-group axis of the step's axis name (the tuple ("groups", "data")): `data`."""
    return None if axis_name is None else axis_name[-1]


class HybridShard(ZeRO3):
    """ZeRO-`stage` (3: parameters, gradients and optimizer state sharded; 1: the optimizer state) inside groups of
    `group_size` devices, which must divide the device count (None: one process's devices, a node; on one process
    it must be given). Config: `parallel.shard_group=k` (with `parallel.shard_optimizer=True` for stage 1)."""

    def __init__(self, group_size: int | None = None, stage: int = 3) -> None:
        super().__init__()
        check_group_size(group_size)
        if stage not in STAGES:
            raise ValueError(f"stage={stage!r} is not one of {', '.join(map(str, STAGES))} (ZeRO-1 or ZeRO-3 in a "
                             "group)")
        self.group_size, self.stage = group_size, stage

    def params(self) -> dict[str, Any]:
        return {"group_size": self.group_size, "stage": self.stage}

    # The record (what a resume compares) is ZeRO's: the mean all-reduce's, so a run resumes under any strategy.

    def for_inference(self) -> Sync:
        return ZeRO3() if self.stage == 3 else ZeRO1()  # the same logical state, on any device count

    def mesh_shape(self, num_devices: int) -> dict[str, int]:
        return group_mesh(self, self.group_size, num_devices)

    def check(self, options: dict[str, Any], view: Any, what: str, require: Any) -> None:
        require(options["backend"] == "shard_map", f"{what} (hybrid sharding) runs on a two-axis mesh under "
                f"shard_map only (jit and pmap are refused); use {view.use('backend', 'shard_map')}")
        require(not options["log_noise_scale"], f"{view('log_noise_scale')} needs each device's whole gradient, "
                f"which {what} never holds; set {view.use('log_noise_scale', False)}")

    def optimizer_sees_slices(self, backend: str) -> bool:
        return True

    def check_optimizer(self, tx: optax.GradientTransformation, abstract_params: Tree, num_devices: int,
                        backend: str, what: str) -> None:
        check_sliceable(tx, abstract_params, self.mesh_shape(num_devices)[DATA_AXIS], what)

    def layouts(self, abstract_state: Any) -> Any:
        return (ZeRO3 if self.stage == 3 else ZeRO1).layouts(self, abstract_state)

    def shard_axes(self, abstract_state: Any, num_devices: int) -> Any:
        return (ZeRO3 if self.stage == 3 else ZeRO1).shard_axes(self, abstract_state, num_devices)

    def params_view(self, params: Tree, axis_name: Any) -> Tree:
        return super().params_view(params, _inner(axis_name)) if self.stage == 3 else params

    def layer_view(self, axis_name: Any, mesh: Mesh | None = None) -> LayerView | None:
        return super().layer_view(_inner(axis_name), mesh) if self.stage == 3 else None

    def reduce(self, local: Local, state: Any, axis_name: Any, collective: bool = True) -> Reduced:
        groups, inner = axis_name
        # In the group: each device's slice of the group's mean gradient (stage 3: the gathers' transpose summed it).
        grads = (ZeRO3 if self.stage == 3 else ZeRO1).sliced_mean(self, local.grads, inner)
        payload = {"model_state": floating(local.model_state), "sums": local.sums, "weight": local.weight}
        if collective:  # (jdp.bench compiles the step without the sums' and the cross-group collectives)
            payload = all_reduce_mean(payload, inner)
            # Across the groups: one all-reduce of the slices, the group's sums riding in it.
            payload = all_reduce_mean({**payload, "grads": grads}, groups)
            grads = payload.pop("grads")
        return self._reduced(grads, local, payload)

    def update(self, tx: optax.GradientTransformation, grads: Tree, state: Any, axis_name: Any
               ) -> tuple[Tree, Any]:
        if self.stage == 3:
            return Sync.update(self, tx, grads, state, axis_name)  # on the slices; the next forward gathers them
        return ZeRO1.update(self, tx, grads, state, _inner(axis_name))  # then all-gathered in the group

    def grad_norm(self, grads: Tree, axis_name: Any, collective: bool = True) -> jax.Array:
        return global_norm(grads, _inner(axis_name))  # the group's slices; every group holds the same ones
