"""Hybrid sharding (HSDP: PyTorch FSDP's HYBRID_SHARD, FSDP2's 2-D mesh): ZeRO inside groups of k devices (a node's),
plain data parallelism across the groups, so that 1/k of data parallelism's gradient crosses between groups.

The mesh is groups x `data` (G x k, `jdp.mesh.GROUPS_AXIS` x `DATA_AXIS`, `mesh_shape`): group g is the devices
g*k .. g*k + k - 1 of the 1-D mesh, in its order, so the batch, split over both axes, gives device (g, i) the rows
device g*k + i has on the 1-D mesh. The step's axis name is the tuple ("groups", "data"): the loss sums, the device
count, synced BatchNorm and the device index folded into RNG keys all span every device, as on the 1-D mesh, and
G x k devices train as one device does. The sharded state is split on `data` alone, as ZeRO's over k devices
(`jdp.sync.base.shard_axis` with N = k), and replicated across the groups; outside the step it keeps its logical
shapes, so a checkpoint restores on any device count and under any strategy.

Each step, stage 3 (the default: ZeRO-3 inside the group):
- in the group: the forward all-gathers the parameters (a scanned model's layer by layer, `jdp.sync.zero3`), the
  backward reduce-scatters the gradient (the gathers' transpose), and the loss sums are all-reduced;
- across the groups: one all-reduce (mean) of each device's 1/k slice of the gradient, the group's loss sums, weight
  total and floating model state riding in it: 4 P / k bytes for P float32 parameters (P counted with each leaf
  zero-padded to a multiple of k on its split axis; a scalar parameter, held whole, sends its 4 bytes) plus those
  sums. Beside it, the non-finite guard's 4-byte pmin over every device (the slices' updates decide alike), and,
  with synced BatchNorm, each BatchNorm's statistics in the forward.
Stage 1 (ZeRO-1 inside the group): the parameters stay whole; the gradient is reduce-scattered in the group and its
slice all-reduced across groups as above; each device updates its slice of the parameters and optimizer state, and
the parameters are all-gathered in the group.

shard_map only (jit and pmap are refused in one line: the two-axis mesh and its collectives are explicit); element-
wise optimizers only, as ZeRO's; no noise scale (no device holds a whole gradient).
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
    `group_size` devices, data parallelism's mean all-reduce of each device's 1/k gradient slice across the groups.
    `group_size` None: one process's devices (`jax.local_device_count()`, a node), in a multi-process run; on one
    process it must be given. It must divide the device count. Config: `parallel.shard_group=k` (with
    `parallel.shard_optimizer=True` for stage 1)."""

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
