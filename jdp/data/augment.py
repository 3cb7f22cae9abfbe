"""Image preprocessing for the tfds source (docs/datasets.md). On the host: decode, random numbers drawn from (seed,
step) for the whole global batch, and large images' crops. In the compiled step: small images' pad-crop-flip and the
normalisation of uint8 pixels (a quarter of float32's bytes to send)."""

from __future__ import annotations

import dataclasses
import functools
import io
import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

CROP_PADDING = 4  # small images: crop a window of the image zero-padded by this many pixels on each side
SMALL_IMAGE_MAX_HEIGHT = 64
EVAL_CROP_FRACTION = 0.875
RRC_SCALE = (0.08, 1.0)
RRC_RATIO = (3 / 4, 4 / 3)
RRC_TRIES = 10

# Per-channel mean and std of pixels in [0, 1] by the tfds name's first matching prefix; others get 0.5 / 0.5.
_CHANNEL_STATS = (("cifar100", ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762))),
                  ("cifar10", ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616))),
                  ("imagenet", ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))))
_AUGMENT_STREAM = 0x617567  # "aug": keeps these draws apart from the (seed, epoch) permutation's


def channel_stats(dataset: str, channels: int) -> tuple[np.ndarray, np.ndarray]:
    """(mean, std) per channel for a tfds name such as `cifar10`, `imagenet2012/subset:5.0.0`."""
    mean, std = next((stats for prefix, stats in _CHANNEL_STATS if dataset.startswith(prefix) and channels == 3),
                     ((0.5,) * channels, (0.5,) * channels))
    return np.asarray(mean, np.float32), np.asarray(std, np.float32)


class BatchParams(NamedTuple):
    """Random numbers for rows of one global batch."""

    uniforms: np.ndarray  # (B, 2 * RRC_TRIES + 2): RRC scale and log-ratio tries, then top and left
    offsets: np.ndarray  # (B, 2) int: small-image crop offsets in [0, 2 * CROP_PADDING]
    flips: np.ndarray  # (B,) bool


def batch_params(seed: int, step: int, global_batch_size: int, rows: slice = slice(None)) -> BatchParams:
    """The numbers drawn for the whole global batch at `step`, of its `rows` (this process's)."""
    rng = np.random.default_rng([seed, step, _AUGMENT_STREAM])
    return BatchParams(
        uniforms=rng.random((global_batch_size, 2 * RRC_TRIES + 2))[rows],
        offsets=rng.integers(0, 2 * CROP_PADDING + 1, (global_batch_size, 2))[rows],
        flips=(rng.random(global_batch_size) < 0.5)[rows],
    )


def random_resized_box(height: int, width: int, uniforms: np.ndarray) -> tuple[float, float, float, float]:
    """torchvision's RandomResizedCrop box (left, top, right, bottom), from pre-drawn uniforms in [0, 1)."""
    area = height * width
    lo, hi = math.log(RRC_RATIO[0]), math.log(RRC_RATIO[1])
    for t in range(RRC_TRIES):
        target = area * (RRC_SCALE[0] + (RRC_SCALE[1] - RRC_SCALE[0]) * uniforms[t])
        aspect = math.exp(lo + (hi - lo) * uniforms[RRC_TRIES + t])
        w = round(math.sqrt(target * aspect))
        h = round(math.sqrt(target / aspect))
        if 0 < w <= width and 0 < h <= height:
            top = int(uniforms[-2] * (height - h + 1))
            left = int(uniforms[-1] * (width - w + 1))
            return left, top, left + w, top + h
    # Fallback: the centre crop with the aspect ratio clamped into range.
    w, h = min(width, round(height * RRC_RATIO[1])), min(height, round(width / RRC_RATIO[0]))
    top, left = (height - h) // 2, (width - w) // 2
    return left, top, left + w, top + h


def center_box(height: int, width: int) -> tuple[float, float, float, float]:
    """The centre square of side EVAL_CROP_FRACTION x the shorter side, as (left, top, right, bottom)."""
    side = EVAL_CROP_FRACTION * min(height, width)
    top, left = (height - side) / 2, (width - side) / 2
    return left, top, left + side, top + side


@functools.cache
def _opencv():
    """OpenCV if installed (the tfds extra: ~2.5x faster than PIL on small PNGs, and without the GIL), else None."""
    try:
        import cv2
    except ImportError:
        return None
    return cv2


def decode(value: bytes | np.ndarray, channels: int, k: int = 1) -> np.ndarray:
    """An encoded image or a decoded array -> (H, W, channels) uint8; with k > 1, a JPEG decoded at about 1/k of its
    size. EXIF orientation is ignored, as tfds's decoders do."""
    if not isinstance(value, bytes | bytearray | memoryview):
        image = np.asarray(value, np.uint8)
        return image if image.ndim == 3 else image[..., None]
    cv2 = _opencv()
    if cv2 is not None:
        gray = channels == 1
        flags = (getattr(cv2, f"IMREAD_REDUCED_{'GRAYSCALE' if gray else 'COLOR'}_{k}") if k > 1
                 else cv2.IMREAD_GRAYSCALE if gray else cv2.IMREAD_COLOR)
        image = cv2.imdecode(np.frombuffer(value, np.uint8), flags | cv2.IMREAD_IGNORE_ORIENTATION)
        if image is not None:
            return image[..., None] if gray else cv2.cvtColor(image, cv2.COLOR_BGR2RGB)
    from PIL import Image, UnidentifiedImageError  # the tfds source's dependency only

    try:  # naming the likely formats skips PIL's probing of every plugin: ~30% faster on CIFAR's small PNGs
        im = Image.open(io.BytesIO(value), formats=("PNG", "JPEG"))
    except UnidentifiedImageError:
        im = Image.open(io.BytesIO(value))
    with im:
        mode = "L" if channels == 1 else "RGB"
        if k > 1:  # libjpeg's DCT scaling, before loading
            im.draft(mode, (math.ceil(im.size[0] / k), math.ceil(im.size[1] / k)))
        if im.mode != mode:
            im = im.convert(mode)
        # tobytes (which loads the image) + frombuffer: ~25% cheaper than np.asarray(im) on small images
        return np.frombuffer(im.tobytes(), np.uint8).reshape(im.height, im.width, len(mode))


def reduction(box: tuple[float, float, float, float], size: int) -> int:
    """The largest libjpeg scale-down k (8, 4 or 2; else 1) after which `box`'s crop to size x size only shrinks."""
    shorter = min(box[2] - box[0], box[3] - box[1])
    return next((k for k in (8, 4, 2) if shorter / k >= size), 1)


def decode_crop(value: bytes | np.ndarray, channels: int,
                box_of: Callable[[int, int], tuple[float, float, float, float]], size: int, flip: bool) -> np.ndarray:
    """The box `box_of(height, width)` resized to size x size, mirrored if `flip`. A JPEG is decoded at 1/k of its
    size where `reduction` allows; the box is drawn from the stored size (the header's): the same either way."""
    if isinstance(value, bytes | bytearray | memoryview) and bytes(value[:2]) == b"\xff\xd8":
        from PIL import Image

        with Image.open(io.BytesIO(value), formats=("JPEG",)) as im:  # reads the header only
            width, height = im.size
        box = box_of(height, width)
        image = decode(value, channels, reduction(box, size))
        sx, sy = image.shape[1] / width, image.shape[0] / height  # 1 unless reduced
        return resize_box(image, (box[0] * sx, box[1] * sy, box[2] * sx, box[3] * sy), size, flip)
    image = decode(value, channels)
    return resize_box(image, box_of(image.shape[0], image.shape[1]), size, flip)


def resize_box(image: np.ndarray, box: tuple[float, float, float, float], size: int, flip: bool) -> np.ndarray:
    """The `box` of `image` resized (bilinear, antialiased) to size x size, mirrored if `flip`."""
    from PIL import Image

    im = Image.fromarray(image[..., 0] if image.shape[-1] == 1 else image)
    im = im.resize((size, size), Image.Resampling.BILINEAR, box=box)
    if flip:
        im = im.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    return np.asarray(im).reshape(size, size, -1)


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
        x = pad_crop_flip(batch["x"], batch["crop"], batch["flip"]) if "crop" in batch else batch["x"]
        std = jnp.asarray(self.std, jnp.float32)
        rows["x"] = x.astype(jnp.float32) * (1 / (255 * std)) - jnp.asarray(self.mean, jnp.float32) / std
        return rows
