"""Model families and their registry: `model.name` (a built-in name or `package.module:Name`) called with
`model.kwargs`, `rngs=nnx.Rngs(seed)`, and `input_shape=` and `num_classes=` where its signature names them."""

import functools
import inspect
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
from flax import nnx

from jdp.models.cnn import CNN1D, CNN2D, max_pool_2x2
from jdp.models.gpt import GPT
from jdp.models.mlp import MLP
from jdp.models.resnet import ARCHS, ResNet, resnet18, resnet34, resnet50
from jdp.registry import Registry

__all__ = ["ARCHS", "CNN1D", "CNN2D", "GPT", "MLP", "MODELS", "ResNet", "build_model", "count_params",
           "image_shape", "max_pool_2x2", "resnet18", "resnet34", "resnet50", "settings"]

MODELS: Registry[Callable[..., nnx.Module]] = Registry("model.name")


def image_shape(input_shape: tuple[int, ...]) -> tuple[int, int, int]:
    """(H, W, C) of an image model's input shape (H, W) or (H, W, C)."""
    if len(input_shape) not in (2, 3):
        raise ValueError(f"image models need an input shape (H, W) or (H, W, C), got {input_shape}")
    h, w, *c = input_shape
    return h, w, c[0] if c else 1


def _sizes(key: str, value: Any, example: tuple[int, ...], *, allow_empty: bool = True) -> tuple[int, ...]:
    """`model.kwargs.<key>`: a tuple of positive ints, or a ValueError naming it and the fix."""
    sizes = tuple(value) if isinstance(value, (tuple, list)) else (value,)
    if not all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in sizes) or not (sizes or allow_empty):
        raise ValueError(f"model.kwargs.{key}={value!r} must be a tuple of positive ints; set e.g. "
                         f"--config.model.kwargs.{key}={str(example).replace(' ', '')}")
    return sizes


@MODELS.register("mlp")
def mlp(*, input_shape: tuple[int, ...], num_classes: int, hidden_sizes: Sequence[int] = (256, 256),
        rngs: nnx.Rngs) -> MLP:
    hidden_sizes = _sizes("hidden_sizes", hidden_sizes, (256, 256))
    return MLP(math.prod(input_shape), hidden_sizes, num_classes, rngs=rngs)


@MODELS.register("cnn1d")
def cnn1d(*, input_shape: tuple[int, ...], num_classes: int, channels: Sequence[int] = (25, 25, 25),
          kernel_sizes: Sequence[int] = (5, 3, 3), strides: Sequence[int] = (2, 2, 2), rngs: nnx.Rngs) -> CNN1D:
    if len(input_shape) not in (1, 2):
        raise ValueError(f"cnn1d needs an input shape (L,) or (L, C), got {input_shape}")
    channels = _sizes("channels", channels, (25, 25, 25), allow_empty=False)
    kernel_sizes, strides = _sizes("kernel_sizes", kernel_sizes, (5, 3, 3)), _sizes("strides", strides, (2, 2, 2))
    if not len(channels) == len(kernel_sizes) == len(strides):
        raise ValueError(f"model.kwargs channels {channels}, kernel_sizes {kernel_sizes} and strides {strides} need "
                         "one entry per conv layer each; give them the same length")
    length, *c = input_shape
    return CNN1D(length, c[0] if c else 1, channels, kernel_sizes, strides, num_classes, rngs=rngs)


@MODELS.register("cnn2d")
def cnn2d(*, input_shape: tuple[int, ...], num_classes: int, channels: Sequence[int] = (25, 25, 25),
          dense_sizes: Sequence[int] = (128,), rngs: nnx.Rngs) -> CNN2D:
    channels = _sizes("channels", channels, (25, 25, 25), allow_empty=False)
    dense_sizes = _sizes("dense_sizes", dense_sizes, (128,))
    return CNN2D(image_shape(input_shape), channels, dense_sizes, num_classes, rngs=rngs)


def _resnet(name: str, *, input_shape: tuple[int, ...], num_classes: int, width: int = 64,
            stage_sizes: Sequence[int] = (), stem: str = "auto", bn_momentum: float = 0.9, remat: str = "none",
            rngs: nnx.Rngs) -> ResNet:
    """`stage_sizes` () = the depth's standard stages; `stem` auto = cifar for images of <= 64 px (`ResNet`)."""
    h, _, c = image_shape(input_shape)
    if isinstance(width, bool) or not isinstance(width, int) or width <= 0:
        raise ValueError(f"model.kwargs.width={width!r} must be a positive int; set e.g. "
                         "--config.model.kwargs.width=64")
    stage_sizes = _sizes("stage_sizes", stage_sizes, (2, 2, 2, 2))
    if not 0 <= bn_momentum <= 1:
        raise ValueError(f"model.kwargs.bn_momentum={bn_momentum} must be in [0, 1]; e.g. 0.9")
    block, standard_stages = ARCHS[name]
    stem = stem if stem != "auto" else ("cifar" if h <= 64 else "imagenet")
    return ResNet(tuple(stage_sizes) or standard_stages, block, width, stem, c, num_classes,
                  bn_momentum=bn_momentum, remat=remat, rngs=rngs)


for _name in ARCHS:
    MODELS.register(_name)(functools.partial(_resnet, _name))


@MODELS.register("gpt")
def gpt(*, input_shape: tuple[int, ...], num_classes: int, num_layers: int = 6, num_heads: int = 6,
        embed_dim: int = 384, dropout: float = 0.0, bias: bool = True, dtype: Any = None, remat: str = "none",
        scan_layers: bool = False, rngs: nnx.Rngs) -> GPT:
    """A GPT over token windows of `input_shape` (block_size,) and a vocabulary of `num_classes` tokens (`GPT`)."""
    if len(input_shape) != 1:
        raise ValueError(f"gpt needs token windows of shape (block_size,), got {input_shape}; use a text source")
    return GPT(num_classes, input_shape[0], num_layers=num_layers, num_heads=num_heads, embed_dim=embed_dim,
               dropout=dropout, bias=bias, dtype=dtype, remat=remat, scan_layers=scan_layers, rngs=rngs)


def build_model(name: str, kwargs: dict[str, Any], input_shape: tuple[int, ...], num_classes: int, *,
                seed: int) -> nnx.Module:
    """Model `name` (registered, or an import path) built with `kwargs` for `input_shape` (no batch axis) and
    `num_classes` outputs."""
    factory = MODELS.get(name)
    signature = _signature(factory)
    parameters = signature.parameters if signature is not None else {}  # none to read: pass only what was asked for
    given = {key: value for key, value in (("input_shape", tuple(input_shape)), ("num_classes", num_classes))
             if key in parameters and key not in kwargs}
    call = {**kwargs, **given, "rngs": nnx.Rngs(seed)}
    # Checked before the call: a TypeError raised inside the constructor is the model's own failure.
    try:
        if signature is not None:
            signature.bind(*((None,) if isinstance(factory, type) else ()), **call)  # None stands for self
    except TypeError as e:
        raise ValueError(f"model.name={name!r} with model.kwargs {sorted(kwargs)}: {e}") from None
    return factory(**call)


def settings(name: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments model `name` is built with: its own defaults, overridden by `kwargs`."""
    signature = _signature(MODELS.get(name))
    parameters = signature.parameters.values() if signature is not None else ()
    return {p.name: p.default for p in parameters if p.default is not inspect.Parameter.empty} | dict(kwargs)


def _signature(factory: Callable[..., nnx.Module]) -> inspect.Signature | None:
    """A factory's signature (a class's __init__'s: NNX's metaclass hides the class's), or None (a C extension)."""
    try:
        return inspect.signature(factory.__init__ if isinstance(factory, type) else factory)
    except (TypeError, ValueError):
        return None


def count_params(params: Any) -> int:
    """Number of scalars in a parameter pytree (pure dict or nnx.State)."""
    return sum(x.size for x in jax.tree.leaves(params))
