"""Hybrid sharding (HSDP, PyTorch FSDP's HYBRID_SHARD): ZeRO-3 or ZeRO-1 inside groups of k devices (the mesh's `data`
axis), one mean all-reduce of each device's 1/k gradient slice across them (docs/communication.md).
"""

from __future__ import annotations

from typing import Any

import jax
import optax
from jax.sharding import Mesh

from jdp.layers import LayerView
from jdp.sync.base import Local, Reduced, Sync, Tree, all_reduce_mean, averaged_sums, checked_group_size, group_mesh
from jdp.sync.zero1 import ZeRO1, global_norm
from jdp.sync.zero3 import ZeRO3


class HybridShard(ZeRO3):
    """ZeRO-`stage` (3: parameters, gradients and optimizer state sharded; 1: the optimizer state) inside groups of
    `group_size` devices, which must divide the device count (None: one process's devices)."""

    def __init__(self, group_size: int | None = None, stage: int = 3) -> None:
        super().__init__()
        if isinstance(stage, bool) or stage not in (1, 3):
            raise ValueError(f"stage={stage!r} is not one of 1, 3 (ZeRO-1 or ZeRO-3 in a group)")
        self.group_size, self.stage = checked_group_size(group_size), int(stage)
        self.shards_params = self.stage == 3

    def params(self) -> dict[str, Any]:
        return {"group_size": self.group_size, "stage": self.stage}

    def for_inference(self) -> Sync:
        return ZeRO3() if self.stage == 3 else ZeRO1()  # the same logical state, on any device count

    mesh_shape = group_mesh

    def check(self, options: dict[str, Any], view: Any, what: str, require: Any) -> None:
        require(options["backend"] == "shard_map", f"{what} (hybrid sharding) runs on a two-axis mesh under "
                f"shard_map only (jit and pmap are refused); use {view.use('backend', 'shard_map')}")
        super().check(options, view, what, require)  # ZeRO-3's: no noise scale

    def shard_axes(self, abstract_state: Any, num_devices: int) -> Any:
        return (ZeRO3 if self.stage == 3 else ZeRO1).shard_axes(self, abstract_state, num_devices)

    def params_view(self, params: Tree, axis_name: Any) -> Tree:
        return super().params_view(params, axis_name and axis_name[-1]) if self.stage == 3 else params

    def layer_view(self, axis_name: Any, mesh: Mesh | None = None) -> LayerView | None:
        return super().layer_view(axis_name and axis_name[-1], mesh) if self.stage == 3 else None

    def reduce(self, local: Local, state: Any, axis_name: Any, collective: bool = True) -> Reduced:
        groups, inner = axis_name
        grads = (ZeRO3 if self.stage == 3 else ZeRO1).sliced_mean(self, local.grads, inner)
        payload = averaged_sums(local, inner if collective else None)
        if collective:  # across the groups: one all-reduce of the slices, the group's sums riding in it
            payload = all_reduce_mean({**payload, "grads": grads}, groups)
            grads = payload.pop("grads")
        return self._reduced(grads, local, payload)

    def update(self, tx: optax.GradientTransformation, grads: Tree, state: Any, axis_name: Any
               ) -> tuple[Tree, Any]:
        return (ZeRO3 if self.stage == 3 else ZeRO1).update(self, tx, grads, state, axis_name and axis_name[-1])

    def grad_norm(self, grads: Tree, axis_name: Any, collective: bool = True) -> jax.Array:
        return global_norm(grads, axis_name and axis_name[-1])  # the group's slices; every group holds the same ones
