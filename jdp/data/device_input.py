"""Image preprocessing inside the compiled step: the pad-crop-flip and normalisation of the tfds source's uint8
pixels (a quarter of float32's bytes to send), from the host's offsets and flips for the whole global batch."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

CROP_PADDING = 4  # small images: crop a window of the image zero-padded by this many pixels on each side


def pad_crop_flip(x_BxHxWxC: jax.Array, offsets_Bx2: jax.Array, flips_B: jax.Array) -> jax.Array:
    """Row i: the HxW window at offsets[i] = (y, x) of the zero-padded image, mirrored where flips[i]."""
    _, h, w, c = x_BxHxWxC.shape
    p = CROP_PADDING
    padded = jnp.pad(x_BxHxWxC, ((0, 0), (p, p), (p, p), (0, 0)))
    crops = jax.vmap(lambda image, at: jax.lax.dynamic_slice(image, (at[0], at[1], 0), (h, w, c)))(
        padded, offsets_Bx2)
    return jnp.where(flips_B[:, None, None, None], crops[:, :, ::-1], crops)


@dataclasses.dataclass(frozen=True)
class ImageInput:
    """A batch {'x': uint8 (B, H, W, C)[, 'crop': int (B, 2), 'flip': bool (B,)], ...} -> the batch the loss
    sees: 'x' cropped and flipped if the batch says so, then (x / 255 - mean) / std per channel, float32."""

    mean: tuple[float, ...]
    std: tuple[float, ...]

    def __call__(self, batch: dict[str, jax.Array]) -> dict[str, jax.Array]:
        rows = {k: v for k, v in batch.items() if k not in ("crop", "flip")}
        x = batch["x"]
        if "crop" in batch:
            x = pad_crop_flip(x, batch["crop"], batch["flip"])
        std = jnp.asarray(self.std, jnp.float32)
        rows["x"] = x.astype(jnp.float32) * (1 / (255 * std)) - jnp.asarray(self.mean, jnp.float32) / std
        return rows
