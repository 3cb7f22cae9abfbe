"""PyTorch twins of jdp's models (`jdp.models`' settings and ResNet table): the same layers in the same order.
Module names mirror jdp's paths (`blocks.0.conv1` is `blocks/0/conv1`) for `jdp.compare.weights`; the dense layer
after a conv stack, which flattens (C, H, W) in torch but (H, W, C) in Flax, carries `jdp_flatten_from`.
"""

from __future__ import annotations

import functools
import math
from collections import OrderedDict
from collections.abc import Callable, Sequence
from itertools import pairwise

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.modules._functions import SyncBatchNorm as _SyncBatchNormFn

from jdp.models import ARCHS, image_shape, settings

MODEL_NAMES = ("mlp", "cnn1d", "cnn2d", *ARCHS, "gpt")


class BatchNorm(nn.BatchNorm2d):
    """jdp's BatchNorm, buffers one to one with jdp's `mean` / `var`: running statistics follow Flax (`new = m * old
    + (1 - m) * batch`, the *biased* variance). `sync=True` (`model.bn_sync`): the global batch's statistics (on CPU,
    which nn.SyncBatchNorm refuses, as Flax's `lax.pmean`); else this rank's (then `average_bn_buffers`)."""

    def __init__(self, num_features: int, flax_momentum: float = 0.9, eps: float = 1e-5, sync: bool = False):
        super().__init__(num_features, eps=eps, momentum=1.0 - flax_momentum)
        self.flax_momentum = flax_momentum
        self.sync = sync

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, False, 0.0, self.eps)
        dims = [0, *range(2, x.ndim)]
        world = dist.get_world_size() if self.sync and dist.is_available() and dist.is_initialized() else 1
        shape = (1, -1) + (1,) * (x.ndim - 2)
        if world > 1:
            import torch.distributed.nn.functional as dist_fn

            mean, mean2 = dist_fn.all_reduce(torch.stack([x.mean(dims), (x * x).mean(dims)])) / world
            var = (mean2 - mean * mean).clamp_min(0.0)
            if x.is_cuda:
                y = _SyncBatchNormFn.apply(x, self.weight, self.bias, None, None, self.eps, 0.0, dist.group.WORLD,
                                           world)
            else:  # Flax's order of operations: (x - mean) * (rsqrt(var + eps) * scale) + bias.
                y = ((x - mean.view(shape)) * (torch.rsqrt(var + self.eps) * self.weight).view(shape)
                     + self.bias.view(shape))
        else:
            y = F.batch_norm(x, None, None, self.weight, self.bias, True, 0.0, self.eps)
            with torch.no_grad():
                var, mean = torch.var_mean(x, dims, correction=0)
        with torch.no_grad():
            m = self.flax_momentum
            self.running_mean.copy_(m * self.running_mean + (1 - m) * mean)
            self.running_var.copy_(m * self.running_var + (1 - m) * var)
        return y


def average_bn_buffers(buffers: list[torch.Tensor], world: int) -> None:
    """Average running statistics across ranks (one all-reduce), as jdp's step averages its model state."""
    if not buffers or world == 1:
        return
    flat = torch.cat([b.reshape(-1) for b in buffers])
    dist.all_reduce(flat)
    flat /= world
    for b, averaged in zip(buffers, flat.split([b.numel() for b in buffers]), strict=True):
        b.copy_(averaged.view_as(b))


def _dense(layers: nn.ModuleList, x: torch.Tensor) -> torch.Tensor:
    *hidden, head = layers
    for layer in hidden:
        x = F.relu(layer(x))
    return head(x)


class MLP(nn.Module):
    """jdp.models.MLP: Linear layers with ReLU between them on the flattened input."""

    def __init__(self, in_features: int, hidden_sizes: Sequence[int], num_classes: int):
        super().__init__()
        sizes = [in_features, *hidden_sizes, num_classes]
        self.layers = nn.ModuleList([nn.Linear(a, b) for a, b in pairwise(sizes)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _dense(self.layers, x.flatten(1))


class CNN1D(nn.Module):
    """jdp.models.CNN1D: Conv1d (padding 1) + ReLU per layer, flatten, one Linear."""

    def __init__(self, in_length: int, in_channels: int, channels: Sequence[int], kernel_sizes: Sequence[int],
                 strides: Sequence[int], num_classes: int):
        super().__init__()
        self.convs = nn.ModuleList([
            nn.Conv1d(c_in, c_out, k, s, padding=1)
            for c_in, c_out, k, s in zip([in_channels, *channels[:-1]], channels, kernel_sizes, strides, strict=True)])
        length = in_length
        for k, s in zip(kernel_sizes, strides, strict=True):
            length = (length + 2 - k) // s + 1
        self.head = nn.Linear(length * channels[-1], num_classes)
        self.head.jdp_flatten_from = (channels[-1], length)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for conv in self.convs:
            x = F.relu(conv(x))
        return self.head(x.flatten(1))


class CNN2D(nn.Module):
    """jdp.models.CNN2D: 3x3 VALID convs + ReLU, one 2x2 max-pool, flatten, Linear + ReLU layers, head."""

    def __init__(self, in_shape: tuple[int, int, int], channels: Sequence[int], dense_sizes: Sequence[int],
                 num_classes: int):
        super().__init__()
        h, w, c = in_shape
        self.convs = nn.ModuleList([nn.Conv2d(c_in, c_out, 3) for c_in, c_out in
                                    zip([c, *channels[:-1]], channels, strict=True)])
        h, w = (h - 2 * len(channels)) // 2, (w - 2 * len(channels)) // 2
        sizes = [h * w * channels[-1], *dense_sizes, num_classes]
        self.dense = nn.ModuleList([nn.Linear(a, b) for a, b in pairwise(sizes)])
        self.dense[0].jdp_flatten_from = (channels[-1], h, w)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for conv in self.convs:
            x = F.relu(conv(x))
        return _dense(self.dense, F.max_pool2d(x, 2).flatten(1))  # floor, like jdp's crop of odd sizes


def _conv(c_in: int, c_out: int, k: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(c_in, c_out, k, stride, padding=k // 2, bias=False)  # symmetric k // 2, as jdp


class Block(nn.Module):
    """jdp.models.resnet.Block, basic or bottleneck: `conv1` / `bn1`, ... (its table of convs) and `shortcut`."""

    def __init__(self, c_in: int, filters: int, stride: int, bn: Callable[[int], BatchNorm], bottleneck: bool):
        super().__init__()
        convs = ([(filters, 1, 1), (filters, 3, stride), (4 * filters, 1, 1)] if bottleneck
                 else [(filters, 3, stride), (filters, 3, 1)])
        self.c_out, self.depth = c_in, len(convs)
        for i, (c_out, k, s) in enumerate(convs, 1):
            self.add_module(f"conv{i}", _conv(self.c_out, c_out, k, s))
            self.add_module(f"bn{i}", bn(c_out))
            self.c_out = c_out
        self.shortcut = (nn.Identity() if stride == 1 and c_in == self.c_out  # else a 1x1 projection and BatchNorm
                         else nn.Sequential(OrderedDict(proj=_conv(c_in, self.c_out, 1, stride), bn=bn(self.c_out))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x
        for i in range(1, self.depth + 1):
            y = self.get_submodule(f"bn{i}")(self.get_submodule(f"conv{i}")(y))
            y = F.relu(y) if i < self.depth else y
        return F.relu(y + self.shortcut(x))


def max_pool_same(x: torch.Tensor) -> torch.Tensor:
    """Flax `max_pool(x, (3, 3), (2, 2), padding="SAME")`: -inf padding, one row after each axis and one before an odd
    one (torch's MaxPool2d(3, 2, padding=1) pads one before an even one too: its windows start a row earlier)."""
    pads = [p for size in reversed(x.shape[2:]) for p in (size % 2, 1)]  # F.pad lists the last axis first
    return F.max_pool2d(F.pad(x, pads, value=float("-inf")), 3, 2)


class ResNet(nn.Module):
    """jdp.models.ResNet (v1.5). Stems: 'cifar' = conv3x3 + BN + ReLU; 'imagenet' = conv7x7/2 + BN + ReLU
    + max-pool 3x3/2 SAME. Head: global average pool, Linear."""

    def __init__(self, stage_sizes: Sequence[int], block: str, width: int, stem: str, in_channels: int,
                 num_classes: int, *, bn_momentum: float = 0.9, sync_bn: bool = False):
        super().__init__()
        bn = functools.partial(BatchNorm, flax_momentum=bn_momentum, sync=sync_bn)
        self.imagenet_stem = stem == "imagenet"
        k, stride = (7, 2) if self.imagenet_stem else (3, 1)
        self.stem_conv = _conv(in_channels, width, k, stride)
        self.stem_bn = bn(width)
        blocks = []
        for i, n in enumerate(stage_sizes):
            for j in range(n):
                c = blocks[-1].c_out if blocks else width
                blocks.append(Block(c, width * 2**i, 2 if i > 0 and j == 0 else 1, bn, block == "bottleneck"))
        self.blocks = nn.ModuleList(blocks)
        self.head = nn.Linear(blocks[-1].c_out, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.stem_bn(self.stem_conv(x)))
        if self.imagenet_stem:
            x = max_pool_same(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean((2, 3)))


class CausalSelfAttention(nn.Module):
    """jdp.models.gpt.CausalSelfAttention: q, k, v are the three thirds of `qkv`'s output, heads inside each."""

    def __init__(self, embed_dim: int, num_heads: int, dropout: float, bias: bool):
        super().__init__()
        self.num_heads, self.dropout = num_heads, dropout
        self.qkv = nn.Linear(embed_dim, 3 * embed_dim, bias=bias)
        self.proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (z.view(b, t, self.num_heads, d // self.num_heads).transpose(1, 2)
                   for z in self.qkv(x).split(d, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        return self.resid_dropout(self.proj(y.transpose(1, 2).reshape(b, t, d)))


class GPTBlock(nn.Module):
    def __init__(self, embed_dim: int, num_heads: int, dropout: float, bias: bool):
        super().__init__()
        self.ln1 = nn.LayerNorm(embed_dim, eps=1e-5, bias=bias)
        self.attn = CausalSelfAttention(embed_dim, num_heads, dropout, bias)
        self.ln2 = nn.LayerNorm(embed_dim, eps=1e-5, bias=bias)
        self.mlp = nn.Sequential(OrderedDict(fc=nn.Linear(embed_dim, 4 * embed_dim, bias=bias), gelu=nn.GELU(),
                                             proj=nn.Linear(4 * embed_dim, embed_dim, bias=bias),
                                             dropout=nn.Dropout(dropout)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """jdp.models.gpt.GPT (nanoGPT's model): the head is the token embedding, transposed (tied)."""

    def __init__(self, vocab_size: int, block_size: int, num_layers: int, num_heads: int, embed_dim: int,
                 dropout: float, bias: bool):
        super().__init__()
        self.wte = nn.Embedding(vocab_size, embed_dim)
        self.wpe = nn.Embedding(block_size, embed_dim)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList([GPTBlock(embed_dim, num_heads, dropout, bias) for _ in range(num_layers)])
        self.ln_f = nn.LayerNorm(embed_dim, eps=1e-5, bias=bias)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.drop(self.wte(tokens) + self.wpe(positions))
        for block in self.blocks:
            x = block(x)
        return self.ln_f(x) @ self.wte.weight.T


def build_twin(model_cfg, input_shape: Sequence[int], num_classes: int, *, sync_bn: bool = False) -> nn.Module:
    """The twin of the model a config's `model` section names (one of MODEL_NAMES: `parity.check_supported`);
    `sync_bn`: BatchNorm over the global batch."""
    name = model_cfg.name
    s = settings(name, model_cfg.kwargs.to_dict())
    if name == "mlp":
        return MLP(math.prod(input_shape), s["hidden_sizes"], num_classes)
    if name == "cnn1d":
        length, *c = input_shape
        return CNN1D(length, c[0] if c else 1, s["channels"], s["kernel_sizes"], s["strides"], num_classes)
    if name == "cnn2d":
        return CNN2D(image_shape(input_shape), s["channels"], s["dense_sizes"], num_classes)
    if name == "gpt":
        return GPT(num_classes, input_shape[0], s["num_layers"], s["num_heads"], s["embed_dim"], s["dropout"],
                   s["bias"])
    h, _, c = image_shape(input_shape)
    block, standard_stages = ARCHS[name]
    stem = s["stem"] if s["stem"] != "auto" else ("cifar" if h <= 64 else "imagenet")
    return ResNet(tuple(s["stage_sizes"]) or standard_stages, block, s["width"], stem, c, num_classes,
                  bn_momentum=s["bn_momentum"], sync_bn=sync_bn)


def prepare_input(model: nn.Module, x: np.ndarray) -> torch.Tensor:
    """jdp's channels-last batch -> the twin's layout: (N, L[, C]) -> (N, C, L); (N, H, W[, C]) -> (N, C, H, W);
    the MLP takes it as is (it flattens in the same order as jdp)."""
    t = torch.from_numpy(np.ascontiguousarray(x))
    if isinstance(model, (CNN1D, CNN2D, ResNet)):  # no channel axis (N, L) or (N, H, W): one channel
        return t[:, None] if t.ndim == (2 if isinstance(model, CNN1D) else 3) else t.movedim(-1, 1).contiguous()
    if isinstance(model, GPT):  # token ids
        return t.long()
    return t
