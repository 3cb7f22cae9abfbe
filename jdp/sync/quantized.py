"""The mean all-reduce with int8 or int4 gradients, as ZeRO++'s qgZ (Wang et al. 2023) sends them, and qwZ's
quantized all-gather of ZeRO-3's weights (docs/communication.md, 'Quantized gradients').
"""

from __future__ import annotations

import functools
import math
import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree

from jdp.sync.base import Local, Reduced, Sync, Tree, averaged_sums

LARGEST = {8: 127, 4: 7}  # the largest integer a value is quantized to, symmetric around 0


def check_block(bits: Any, block: Any) -> tuple[int, int]:
    """(bits, block) as ints; ValueError in one line for settings the quantizer cannot run."""
    if isinstance(bits, bool) or bits not in LARGEST:
        raise ValueError(f"bits={bits!r}: choose 8 or 4")
    if isinstance(block, bool) or not isinstance(block, numbers.Integral) or block < 2 or block % 2:
        raise ValueError(f"block={block!r}: give an even block size of at least 2 (int4 packs two values a byte)")
    return int(bits), int(block)


def quantize(x: jax.Array, bits: int) -> tuple[jax.Array, jax.Array]:
    """x (..., block) float32 -> (integers, int8 or int4 packed two to a uint8; one float32 scale per block)."""
    scale = jnp.max(jnp.abs(x), axis=-1) / LARGEST[bits]
    q = jnp.round(x / jnp.where(scale > 0, scale, 1.0)[..., None]).astype(jnp.int8)
    if bits == 4:  # [-7, 7] -> [1, 15], two to a byte
        nibbles = (q + 8).astype(jnp.uint8)
        q = nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)
    return q, scale


def dequantize(q: jax.Array, scale: jax.Array, bits: int) -> jax.Array:
    if bits == 4:
        q = jnp.stack([q & 15, q >> 4], axis=-1).reshape(*q.shape[:-1], -1).astype(jnp.int8) - 8
    return q.astype(jnp.float32) * scale[..., None]


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4, 5))
def quantized_all_gather(x: jax.Array, axis_name: Any, axis: int, bits: int, grad_bits: int, block: int
                         ) -> jax.Array:
    """`lax.all_gather(x, axis_name, axis=axis, tiled=True)` sending `x` block-quantized at `bits` (qwZ; 32: as is),
    its gradient's reduce-scatter at `grad_bits` (quantized through an all-to-all, as qgZ)."""
    if bits == 32:
        return jax.lax.all_gather(x, axis_name, axis=axis, tiled=True)
    moved = jnp.moveaxis(x, axis, 0)
    flat = moved.reshape(-1)
    blocks = jnp.pad(flat, (0, -flat.size % block)).reshape(-1, block)
    q, scale = (jax.lax.all_gather(part, axis_name) for part in quantize(blocks.astype(jnp.float32), bits))
    whole = dequantize(q, scale, bits).reshape(q.shape[0], -1)[:, :flat.size].astype(x.dtype)
    return jnp.moveaxis(whole.reshape(-1, *moved.shape[1:]), 0, axis)


def _gather_backward(axis_name: Any, axis: int, bits: int, grad_bits: int, block: int, _: None,
                     cotangent: jax.Array) -> tuple[jax.Array]:
    if grad_bits == 32:
        return (jax.lax.psum_scatter(cotangent, axis_name, scatter_dimension=axis, tiled=True),)
    n = jax.lax.psum(1, axis_name)
    moved = jnp.moveaxis(cotangent, axis, 0)  # device i's part: rows i*a .. (i+1)*a - 1
    parts = moved.reshape(n, -1)
    blocks = jnp.pad(parts, ((0, 0), (0, -parts.shape[1] % block))).reshape(n, -1, block)
    q, scale = (jax.lax.all_to_all(x, axis_name, 0, 0, tiled=True) for x in quantize(blocks.astype(jnp.float32),
                                                                                     grad_bits))
    mine = jnp.sum(dequantize(q, scale, grad_bits), axis=0).reshape(-1)[:parts.shape[1]]
    return (jnp.moveaxis(mine.reshape(-1, *moved.shape[1:]), 0, axis).astype(cotangent.dtype),)


# The forward keeps nothing for the backward, which needs only the settings.
quantized_all_gather.defvjp(lambda *args: (quantized_all_gather(*args), None), _gather_backward)


def quantized_mean(tree: Tree, axis_name: str | None, bits: int, block: int) -> tuple[Tree, Tree]:
    """(the mean over `axis_name` of each device's `tree` of float32 leaves, sent as qgZ sends it: a reduce-scatter
    through an all-to-all, then an all-gather; what this device's own quantization lost)."""
    flat, unflatten = ravel_pytree(tree)
    n = jax.lax.psum(1, axis_name) if axis_name else 1
    chunk = math.ceil(flat.size / (n * block)) * block
    chunks = jnp.pad(flat, (0, n * chunk - flat.size)).reshape(n, chunk // block, block)
    sent = quantize(chunks, bits)
    q, scale = (jax.lax.all_to_all(x, axis_name, 0, 0, tiled=True) for x in sent) if axis_name else sent
    mine = quantize(jnp.mean(dequantize(q, scale, bits), axis=0), bits)  # the mean of chunk i
    q, scale = (jax.lax.all_gather(x, axis_name, tiled=True) for x in mine) if axis_name else mine
    mean = dequantize(q.reshape(n, -1, q.shape[-1]), scale.reshape(n, -1), bits).reshape(-1)[:flat.size]
    return unflatten(mean), unflatten(flat - dequantize(*sent, bits).reshape(-1)[:flat.size])


class QuantizedAllReduce(Sync):
    """The mean all-reduce sending `bits`-bit integers (8 or 4) with a float32 scale per `block` values;
    `error_feedback`: each device adds what its quantization lost to its next gradient (per-device state)."""

    noise_scale = True  # each device holds its whole gradient, and the mean it decodes
    per_device_state = ("error",)  # the error feedback, where kept

    def __init__(self, bits: int = 8, block: int = 256, error_feedback: bool = False) -> None:
        super().__init__()
        self.bits, self.block = check_block(bits, block)
        if not isinstance(error_feedback, bool | np.bool_):
            raise ValueError(f"error_feedback={error_feedback!r} must be True or False")
        self.error_feedback = bool(error_feedback)
        self.dtype_name = f"int{bits}"  # what it sends (`jdp.bench --predict`); its collectives carry integers

    def params(self) -> dict[str, Any]:
        return {"bits": self.bits, "block": self.block, "error_feedback": self.error_feedback}

    def check(self, options: dict[str, Any], view: Any, what: str, require: Any) -> None:
        require(options["backend"] in ("shard_map", "pmap"), f"{what} quantizes each device's gradient before its "
                f"collectives; use {view.use('backend', 'shard_map')}")

    def init_state(self, params: Tree, num_devices: int) -> Tree:
        if not self.error_feedback:
            return {}
        return {"error": jax.tree.map(lambda p: jnp.zeros((num_devices, *p.shape), jnp.float32), params)}

    def reduce(self, local: Local, state: Any, axis_name: str | None, collective: bool = True) -> Reduced:
        grads = jax.tree.map(jnp.add, local.grads, state.sync["error"]) if self.error_feedback else local.grads
        mean, lost = quantized_mean(grads, axis_name if collective else None, self.bits, self.block)
        return self._reduced(mean, local, averaged_sums(local, axis_name if collective else None),
                             {"error": lost} if self.error_feedback else None)
