"""ResNet v1.5 (stride on the bottleneck's 3x3 conv). Its BatchNorms know nothing of devices: `jdp.fit` points
them at the `data` axis when BatchNorm is synced."""

import functools
from collections.abc import Callable, Sequence
from types import SimpleNamespace
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jdp.layers import check_remat, remat

# name -> (block, stage sizes)
ARCHS: dict[str, tuple[str, tuple[int, ...]]] = {
    "resnet18": ("basic", (2, 2, 2, 2)),
    "resnet34": ("basic", (3, 4, 6, 3)),
    "resnet50": ("bottleneck", (3, 4, 6, 3)),
}


class BatchNorm(nnx.BatchNorm):
    """`nnx.BatchNorm` whose output keeps its input's dtype: the statistics and normalisation in float32 (Flax
    promotes to the running statistics' dtype), the next convolution still in the compute dtype."""

    def __call__(self, x: jax.Array, **kwargs: Any) -> jax.Array:
        return super().__call__(x, **kwargs).astype(x.dtype)


def _conv(c_in: int, c_out: int, k: int, stride: int = 1, **kwargs: Any) -> nnx.Conv:
    # Symmetric padding k // 2, as in torchvision, rather than SAME (asymmetric for stride 2).
    return nnx.Conv(c_in, c_out, (k, k), (stride, stride), padding=((k // 2, k // 2),) * 2, use_bias=False, **kwargs)


class _Shortcut(nnx.Module):
    """Identity, or 1x1 conv + BN when the shape changes."""

    def __init__(self, c_in: int, c_out: int, stride: int, layers: SimpleNamespace):
        project = stride != 1 or c_in != c_out
        self.proj = layers.conv(c_in, c_out, 1, stride) if project else None
        self.bn = layers.bn(c_out) if project else None

    def __call__(self, x: jax.Array) -> jax.Array:
        return x if self.proj is None else self.bn(self.proj(x))


class Block(nnx.Module):
    """A basic (3x3, 3x3 convs) or bottleneck (1x1, 3x3 with the stride: v1.5, 1x1 to 4x the filters) residual block:
    `conv1` / `bn1`, ... with ReLU between them, added to the shortcut, then ReLU."""

    def __init__(self, c_in: int, filters: int, stride: int, layers: SimpleNamespace, bottleneck: bool):
        convs = ([(filters, 1, 1), (filters, 3, stride), (4 * filters, 1, 1)] if bottleneck
                 else [(filters, 3, stride), (filters, 3, 1)])
        self.depth, self.c_out = len(convs), c_in
        for i, (c_out, k, s) in enumerate(convs, 1):
            setattr(self, f"conv{i}", layers.conv(self.c_out, c_out, k, s))
            setattr(self, f"bn{i}", layers.bn(c_out))
            self.c_out = c_out
        self.shortcut = _Shortcut(c_in, self.c_out, stride, layers)

    def __call__(self, x: jax.Array) -> jax.Array:
        y = x
        for i in range(1, self.depth + 1):
            y = getattr(self, f"bn{i}")(getattr(self, f"conv{i}")(y))
            y = nnx.relu(y) if i < self.depth else y
        return nnx.relu(y + self.shortcut(x))


BLOCKS = ("basic", "bottleneck")
STEMS = ("cifar", "imagenet")


class ResNet(nnx.Module):
    """ResNet on (B, H, W[, C]) images; float32 logits. `dtype` None computes in the input's and parameters' dtype;
    `remat` ("none", "full", "dots") checkpoints each residual block (`jdp.layers.remat`). Stems: 'cifar' =
    conv3x3 + BN + ReLU; 'imagenet' = conv7x7/2 + BN + ReLU + maxpool 3x3/2 (SAME)."""

    def __init__(
        self,
        stage_sizes: Sequence[int],
        block: str,
        width: int,
        stem: str,
        in_channels: int,
        num_classes: int,
        *,
        bn_momentum: float = 0.9,
        dtype: Any = None,
        remat: str = "none",
        rngs: nnx.Rngs,
    ):
        if block not in BLOCKS:
            raise ValueError(f"unknown ResNet block {block!r}; choose from {BLOCKS}")
        if stem not in STEMS:
            raise ValueError(f"unknown ResNet stem {stem!r}; choose from {STEMS}")
        layers = SimpleNamespace(conv=functools.partial(_conv, dtype=dtype, rngs=rngs), bn=functools.partial(
            BatchNorm, momentum=bn_momentum, epsilon=1e-5, dtype=dtype, rngs=rngs))  # shared by every block
        self.remat = check_remat(remat)  # of each residual block: BatchNorm statistics still update once
        self.imagenet_stem = stem == "imagenet"
        k, stride = (7, 2) if self.imagenet_stem else (3, 1)
        self.stem_conv = layers.conv(in_channels, width, k, stride)
        self.stem_bn = layers.bn(width)
        blocks, c = [], width
        for i, n in enumerate(stage_sizes):
            for j in range(n):
                blocks.append(Block(c, width * 2**i, 2 if i > 0 and j == 0 else 1, layers, block == "bottleneck"))
                c = blocks[-1].c_out
        self.blocks = nnx.List(blocks)
        self.head = nnx.Linear(c, num_classes, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        if x.ndim == 3:
            x = x[..., None]
        x = nnx.relu(self.stem_bn(self.stem_conv(x)))
        if self.imagenet_stem:
            x = nnx.max_pool(x, (3, 3), (2, 2), padding="SAME")
        for block in self.blocks:
            x = remat(lambda block, x: block(x), self.remat)(block, x)
        return self.head(x.mean(axis=(1, 2))).astype(jnp.float32)


def _standard(name: str) -> Callable[..., ResNet]:
    def build(num_classes: int, **kwargs: Any) -> ResNet:
        block, stage_sizes = ARCHS[name]
        kwargs = {"width": 64, "stem": "imagenet", "in_channels": 3, **kwargs}
        return ResNet(stage_sizes, block, num_classes=num_classes, **kwargs)

    build.__name__ = build.__qualname__ = name
    build.__doc__ = (f"ResNet-{name[6:]}; keyword arguments as ResNet's (width 64, ImageNet stem, 3 input channels by "
                     "default).")
    return build


resnet18, resnet34, resnet50 = (_standard(name) for name in ARCHS)
