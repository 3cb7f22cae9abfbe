"""ZeRO-3, fully sharded data parallelism (Rajbhandari et al. 2020; PyTorch's FSDP): the forward all-gathers the
parameters (a scanned model's layers one at a time), whose transpose reduce-scatters the gradient (docs/performance.md).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import jax
from flax import nnx
from jax.sharding import Mesh

from jdp.layers import LayerView, Stack
from jdp.mesh import data_sharded
from jdp.sync.base import DDPTwin, Sync, Tree, is_sharded, path_keys, shard_axis, unpadded
from jdp.sync.quantized import check_block, quantized_all_gather
from jdp.sync.zero1 import ZeRO1, all_gather_like


class ZeRO3(ZeRO1):
    """ZeRO-1 plus sharded parameters, gathered for each forward; `weight_bits`, `grad_bits` 8 or 4 block-quantize (per
    `block` values) the gather and its reduce-scatter, as ZeRO++'s qwZ and qgZ (32: not)."""

    shards_params = True
    abstract_params: Tree = None
    per_layer: Tree = None

    def __init__(self, weight_bits: int = 32, grad_bits: int = 32, block: int = 256) -> None:
        super().__init__()  # the reduce-scatter is the gather's transpose: it sends the parameters' dtype
        checked = [bits if bits == 32 else check_block(bits, block)[0] for bits in (weight_bits, grad_bits)]
        self.weight_bits, self.grad_bits, self.block = *checked, block
        self.quantized = checked != [32, 32]

    def params(self) -> dict[str, Any]:
        return {"weight_bits": self.weight_bits, "grad_bits": self.grad_bits, "block": self.block} if (
            self.quantized) else {}

    def record(self) -> dict[str, Any]:  # quantized collectives change the numerics
        return Sync.record(self) if self.quantized else super().record()

    def ddp_twin(self) -> DDPTwin | None:
        return None if self.quantized else super().ddp_twin()

    def _all_gather(self) -> Callable:
        if not self.quantized:
            return jax.lax.all_gather
        return lambda x, axis_name, axis, tiled: quantized_all_gather(x, axis_name, axis, self.weight_bits,
                                                                      self.grad_bits, self.block)

    def bind(self, model: Any, seed: int) -> ZeRO3:
        bound = copy.copy(self)
        bound.abstract_params = jax.tree.map(lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype),
                                             nnx.to_pure_dict(nnx.state(model, nnx.Param)))
        # A `Stack`'s leaf with an axis besides the layer axis splits on one of those and is gathered per layer.
        stacked = [(*path, "layers") for path, module in nnx.iter_modules(model) if isinstance(module, Stack)]
        bound.per_layer = jax.tree_util.tree_map_with_path(
            lambda path, x: x.ndim >= 2 and any(path_keys(path)[:len(p)] == p for p in stacked), bound.abstract_params)
        return bound

    def check(self, options: dict[str, Any], view: Any, what: str, require: Any) -> None:
        require(options["backend"] != "pmap", f"{what} needs {view.use('backend', 'shard_map')} or jit: pmap keeps "
                                              "a whole copy of the state on every device")
        require(not options["log_noise_scale"], f"{view('log_noise_scale')} needs each device's whole gradient, "
                f"which {what} never holds; set {view.use('log_noise_scale', False)}")
        require(not self.quantized or options["backend"] == "shard_map", f"{what} quantizes what it gathers and "
                f"reduce-scatters, which it does itself under shard_map only; use {view.use('backend', 'shard_map')}")

    def _param_axes(self, n: int) -> Tree:
        return jax.tree.map(lambda x, layer: shard_axis(x.shape, n, 1 if layer else 0) if is_sharded(x) else None,
                            self.abstract_params, self.per_layer)

    def shard_axes(self, abstract_state: Any, num_devices: int) -> Any:
        """As ZeRO-1, but a stacked leaf splits on a non-layer axis, as does each optimizer leaf mirroring one."""
        axes = super().shard_axes(abstract_state, num_devices)
        params = {path_keys(path): (x.shape, axis) for (path, x), axis in zip(
            jax.tree_util.tree_flatten_with_path(self.abstract_params)[0],
            jax.tree.leaves(self._param_axes(num_devices), is_leaf=lambda a: a is None), strict=True)}

        def mirrored(path: tuple, x: Any, axis: int | None) -> int | None:
            path = path_keys(path)
            matches = [params[path[i:]] for i in range(len(path)) if path[i:] in params]
            return matches[0][1] if matches and matches[0][0] == x.shape else axis

        opt_axes = jax.tree_util.tree_map_with_path(mirrored, abstract_state.opt_state, axes.opt_state)
        return axes._replace(params=self._param_axes(num_devices), opt_state=opt_axes)

    def params_view(self, params: Tree, axis_name: str | None) -> Tree:
        if axis_name is None:  # global arrays: XLA gathers them where the forward needs them
            return jax.tree.map(unpadded, params, self.abstract_params)
        n = jax.lax.psum(1, axis_name)
        whole = all_gather_like(params, self.abstract_params, axis_name, self._param_axes(n), self._all_gather())
        # A scanned model's stacked layers stay split: `layer_view` gathers them inside the scan.
        return jax.tree.map(lambda w, s, layer: s if layer else w, whole, params, self.per_layer)

    def layer_view(self, axis_name: str | None, mesh: Mesh | None = None) -> LayerView | None:
        if axis_name is None:  # the batch stays split in the loop, so that XLA gathers the weights, not activations
            return None if mesh is None else LayerView(carry=lambda x: jax.lax.with_sharding_constraint(
                x, data_sharded(mesh)))

        # Every leaf but a scalar or empty one is split (even a size-1 axis, padded to n).
        return LayerView(params=lambda leaves, shapes: all_gather_like(
            leaves, [jax.ShapeDtypeStruct(s, x.dtype) for x, s in zip(leaves, shapes, strict=True)], axis_name,
            all_gather=self._all_gather()))

    def sliced_mean(self, grads: Tree, axis_name: str | None) -> Tree:
        # A sliced leaf's gradient is summed over the devices already (the all-gather's transpose); a scalar's is not.
        if axis_name is None:
            return grads
        n = jax.lax.psum(1, axis_name)
        return jax.tree.map(lambda g: g / n if is_sharded(g) else jax.lax.pmean(g, axis_name), grads)

    update = Sync.update  # on the slices; the next forward gathers them
