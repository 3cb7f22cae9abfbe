from collections.abc import Sequence
from itertools import pairwise

import jax
from flax import nnx


class MLP(nnx.Module):
    """Dense layers with ReLU between them; any input is flattened to (B, -1) first."""

    def __init__(self, in_features: int, hidden_sizes: Sequence[int], num_classes: int, *, rngs: nnx.Rngs):
        sizes = [in_features, *hidden_sizes, num_classes]
        self.layers = nnx.List([nnx.Linear(a, b, rngs=rngs) for a, b in pairwise(sizes)])

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x.reshape(x.shape[0], -1)
        *hidden, head = self.layers
        for layer in hidden:
            x = nnx.relu(layer(x))
        return head(x)
