"""Small convolutional nets: the MNIST-1D ConvBase (1-D) and a classic MNIST-style 2-D net."""

from collections.abc import Sequence
from itertools import pairwise

import jax
from flax import nnx


def max_pool_2x2(x: jax.Array) -> jax.Array:
    """`nnx.max_pool(x, (2, 2), (2, 2))` as reshape + max, which differentiates much faster on XLA:CPU."""
    b, h, w, c = x.shape
    x = x[:, : h // 2 * 2, : w // 2 * 2]
    return x.reshape(b, h // 2, 2, w // 2, 2, c).max(axis=(2, 4))


class CNN1D(nnx.Module):
    """The MNIST-1D paper's ConvBase: Conv1d stack (padding 1, ReLU), flatten, one Dense; on (B, L, C) or (B, L)."""

    def __init__(
        self,
        in_length: int,
        in_channels: int,
        channels: Sequence[int],
        kernel_sizes: Sequence[int],
        strides: Sequence[int],
        num_classes: int,
        *,
        rngs: nnx.Rngs,
    ):
        convs, length = [], in_length
        for (c_in, c_out), k, s in zip(pairwise([in_channels, *channels]), kernel_sizes, strides, strict=True):
            # Explicit padding 1 gives the same output lengths as torch Conv1d(padding=1).
            convs.append(nnx.Conv(c_in, c_out, (k,), (s,), padding=((1, 1),), rngs=rngs))
            length = (length + 2 - k) // s + 1
        self.convs = nnx.List(convs)
        self.head = nnx.Linear(length * channels[-1], num_classes, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        if x.ndim == 2:
            x = x[..., None]
        for conv in self.convs:
            x = nnx.relu(conv(x))
        return self.head(x.reshape(x.shape[0], -1))


class CNN2D(nnx.Module):
    """3x3 VALID convs + ReLU, a 2x2 max-pool, flatten, Dense + ReLU layers, Dense head; on (B, H, W[, C])."""

    def __init__(
        self,
        in_shape: tuple[int, int, int],
        channels: Sequence[int],
        dense_sizes: Sequence[int],
        num_classes: int,
        *,
        rngs: nnx.Rngs,
    ):
        h, w, c = in_shape
        self.convs = nnx.List([nnx.Conv(a, b, (3, 3), padding="VALID", rngs=rngs) for a, b in pairwise([c, *channels])])
        h, w = (h - 2 * len(channels)) // 2, (w - 2 * len(channels)) // 2
        sizes = [h * w * channels[-1], *dense_sizes, num_classes]
        self.dense = nnx.List([nnx.Linear(a, b, rngs=rngs) for a, b in pairwise(sizes)])

    def __call__(self, x: jax.Array) -> jax.Array:
        if x.ndim == 3:
            x = x[..., None]
        for conv in self.convs:
            x = nnx.relu(conv(x))
        x = max_pool_2x2(x)
        x = x.reshape(x.shape[0], -1)
        *hidden, head = self.dense
        for layer in hidden:
            x = nnx.relu(layer(x))
        return head(x)
