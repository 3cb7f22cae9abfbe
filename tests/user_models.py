"""Small Flax models written the way current Flax docs write them, for jdp's user-code tests."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx


def tiny_images(n: int = 256, seed: int = 0) -> dict[str, np.ndarray]:
    """8x8x1 noisy images; the label is the index of the brightest quadrant."""
    rng = np.random.default_rng(seed)
    x = rng.normal(0.0, 0.5, (n, 8, 8, 1)).astype(np.float32)
    hot = rng.integers(0, 4, n)
    for q in range(4):
        r, c = divmod(q, 2)
        x[hot == q, 4 * r : 4 * r + 4, 4 * c : 4 * c + 4] += 1.0
    quads = x.reshape(n, 2, 4, 2, 4).mean(axis=(2, 4)).reshape(n, 4)
    return {"x": x, "y": quads.argmax(axis=1).astype(np.int32)}


def _metrics(logits: jax.Array, y: jax.Array) -> dict[str, jax.Array]:
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, y)
    return {"loss": loss, "accuracy": (logits.argmax(-1) == y).astype(jnp.float32)}


class CallTimeDropoutCNN(nnx.Module):
    """CNN with BatchNorm and an rngs-less Dropout that takes its key at call time."""

    def __init__(
        self, in_channels: int = 1, features: int = 8, num_classes: int = 4, rate: float = 0.1, *, rngs: nnx.Rngs
    ):
        self.conv = nnx.Conv(in_channels, features, kernel_size=(3, 3), rngs=rngs)
        self.bn = nnx.BatchNorm(features, rngs=rngs)
        self.dropout = nnx.Dropout(rate)
        self.head = nnx.Linear(4 * features, num_classes, rngs=rngs)

    def __call__(self, x: jax.Array, *, rngs: nnx.Rngs | None = None) -> jax.Array:
        x = nnx.avg_pool(nnx.relu(self.bn(self.conv(x))), (4, 4), strides=(4, 4))
        x = self.dropout(x.reshape(x.shape[0], -1), rngs=rngs)
        return self.head(x)


def call_time_loss(model: CallTimeDropoutCNN, batch: dict, rngs: nnx.Rngs | None) -> dict[str, jax.Array]:
    """Per-example loss/accuracy, passing the dropout rngs at call time."""
    return _metrics(model(batch["x"], rngs=rngs), batch["y"])


class ScannedBlock(nnx.Module):
    """One residual layer of ScannedMLP: Linear, BatchNorm, stored-rngs Dropout."""

    def __init__(self, features: int, rate: float, *, rngs: nnx.Rngs):
        self.linear = nnx.Linear(features, features, rngs=rngs)
        self.bn = nnx.BatchNorm(features, rngs=rngs)
        self.dropout = nnx.Dropout(rate, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return x + self.dropout(nnx.relu(self.bn(self.linear(x))))


class ScannedMLP(nnx.Module):
    """MLP whose layers are created with vmap and run with scan (Flax scan-over-layers idiom)."""

    def __init__(
        self,
        in_features: int = 64,
        hidden: int = 16,
        num_layers: int = 3,
        num_classes: int = 4,
        rate: float = 0.1,
        *,
        rngs: nnx.Rngs,
    ):
        self.proj = nnx.Linear(in_features, hidden, rngs=rngs)

        @nnx.split_rngs(splits=num_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def create_block(rngs: nnx.Rngs) -> ScannedBlock:
            return ScannedBlock(hidden, rate, rngs=rngs)

        self.blocks = create_block(rngs)
        self.head = nnx.Linear(hidden, num_classes, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def forward(h: jax.Array, block: ScannedBlock) -> jax.Array:
            return block(h)

        h = forward(self.proj(x.reshape(x.shape[0], -1)), self.blocks)
        self.sow(nnx.Intermediate, "features", h)
        return self.head(h)


def scanned_loss(model: ScannedMLP, batch: dict) -> dict[str, jax.Array]:
    """Per-example loss/accuracy of ScannedMLP."""
    return _metrics(model(batch["x"]), batch["y"])


class LinenCNN(nn.Module):
    """Linen CNN with BatchNorm and Dropout, switched by ``train``."""

    features: int = 8
    num_classes: int = 4
    rate: float = 0.1
    axis_name: str | None = None

    @nn.compact
    def __call__(self, x: jax.Array, train: bool) -> jax.Array:
        x = nn.Conv(self.features, (3, 3))(x)
        x = nn.BatchNorm(use_running_average=not train, axis_name=self.axis_name)(x)
        x = nn.avg_pool(nn.relu(x), (4, 4), strides=(4, 4))
        x = nn.Dropout(self.rate, deterministic=not train)(x.reshape(x.shape[0], -1))
        return nn.Dense(self.num_classes)(x)


def make_linen_cnn(
    sample_shape: tuple[int, ...] = (8, 8, 1), seed: int = 0, dropout: float = 0.1, axis_name: str | None = None
) -> nnx.bridge.ToNNX:
    """LinenCNN bridged into NNX with ToNNX and lazily initialised."""
    model = nnx.bridge.ToNNX(LinenCNN(rate=dropout, axis_name=axis_name), rngs=nnx.Rngs(seed, dropout=seed + 1))
    nnx.bridge.lazy_init(model, jnp.zeros((1, *sample_shape), jnp.float32), train=False)
    return model


def linen_loss(model: nnx.bridge.ToNNX, batch: dict, *, train: bool = True) -> dict[str, jax.Array]:
    """Per-example loss/accuracy of a bridged LinenCNN; in training its batch_stats update in place."""
    if train:
        logits = model(batch["x"], train=True, mutable=["batch_stats"])
    else:
        logits = model(batch["x"], train=False)
    return _metrics(logits, batch["y"])


def make_call_time_cnn(seed: int = 0, rate: float = 0.1) -> CallTimeDropoutCNN:
    """An importable zero-argument factory (with JSON-able keywords) of CallTimeDropoutCNN."""
    return CallTimeDropoutCNN(rate=rate, rngs=nnx.Rngs(seed))


def make_scanned_mlp(seed: int = 0, rate: float = 0.1) -> ScannedMLP:
    return ScannedMLP(rate=rate, rngs=nnx.Rngs(params=seed, dropout=seed + 1))
