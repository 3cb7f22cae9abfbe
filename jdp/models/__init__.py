"""Model families, and the one place that maps the `model` config section to a model."""

import math
from typing import Any

import jax
import ml_collections
from flax import nnx

from jdp.models.cnn import CNN1D, CNN2D, max_pool_2x2
from jdp.models.mlp import MLP
from jdp.models.resnet import ARCHS, ResNet, resnet18, resnet34, resnet50

__all__ = [
    "CNN1D",
    "CNN2D",
    "MLP",
    "MODEL_NAMES",
    "ResNet",
    "build_model",
    "count_params",
    "max_pool_2x2",
    "resnet18",
    "resnet34",
    "resnet50",
]

MODEL_NAMES = ("mlp", "cnn1d", "cnn2d", "resnet18", "resnet34", "resnet50")


def _image_shape(input_shape: tuple[int, ...]) -> tuple[int, int, int]:
    if len(input_shape) not in (2, 3):
        raise ValueError(f"image models need an input shape (H, W) or (H, W, C), got {input_shape}")
    h, w, *c = input_shape
    return h, w, c[0] if c else 1


def build_model(
    cfg: ml_collections.ConfigDict,
    input_shape: tuple[int, ...],
    num_classes: int,
    *,
    seed: int,
) -> nnx.Module:
    """Build `cfg.name` for inputs of `input_shape` (no batch axis)."""
    rngs = nnx.Rngs(seed)
    if cfg.name == "mlp":
        return MLP(math.prod(input_shape), cfg.hidden_sizes, num_classes, rngs=rngs)
    if cfg.name == "cnn1d":
        if len(input_shape) not in (1, 2):
            raise ValueError(f"cnn1d needs an input shape (L,) or (L, C), got {input_shape}")
        length, *c = input_shape
        return CNN1D(
            length, c[0] if c else 1, cfg.channels, cfg.kernel_sizes, cfg.strides, num_classes, rngs=rngs
        )
    if cfg.name == "cnn2d":
        return CNN2D(_image_shape(input_shape), cfg.channels, cfg.dense_sizes, num_classes, rngs=rngs)
    if cfg.name in ARCHS:
        h, _, c = _image_shape(input_shape)
        block, standard_stages = ARCHS[cfg.name]
        stem = cfg.stem if cfg.stem != "auto" else ("cifar" if h <= 64 else "imagenet")
        return ResNet(
            tuple(cfg.stage_sizes) or standard_stages,
            block,
            cfg.width,
            stem,
            c,
            num_classes,
            bn_momentum=cfg.bn_momentum,
            rngs=rngs,
        )
    raise ValueError(f"unknown model name {cfg.name!r}; choose one of {MODEL_NAMES}")


def count_params(params: Any) -> int:
    """Number of scalars in a parameter pytree (pure dict or nnx.State)."""
    return sum(x.size for x in jax.tree.leaves(params))
