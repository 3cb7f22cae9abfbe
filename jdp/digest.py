"""A digest of every leaf of a train state (path, dtype, shape and a BLAKE2b hash of its bytes), stored with each
checkpoint and compared with the restored arrays, so that bytes damaged on disk are found instead of trained on."""

from __future__ import annotations

import hashlib
from typing import Any

import jax
import numpy as np


def _leaves(tree: Any) -> list[tuple[str, Any]]:
    return [(jax.tree_util.keystr(path), leaf) for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]]


def of_leaf(x: np.ndarray) -> list:
    data = np.ascontiguousarray(x).reshape(-1).view(np.uint8)
    return [x.dtype.name, list(x.shape), hashlib.blake2b(data, digest_size=16).hexdigest()]


def of_tree(tree: Any) -> dict[str, list]:
    """{leaf path: [dtype, shape, hash]} of a tree of host arrays."""
    return {path: of_leaf(np.asarray(leaf)) for path, leaf in _leaves(tree)}


def layout_difference(digests: dict[str, list], abstract: Any) -> str | None:
    """The first leaf whose path, dtype or shape in `digests` differs from `abstract` (ShapeDtypeStructs), or None."""
    expected = {path: [np.dtype(leaf.dtype).name, list(leaf.shape)] for path, leaf in _leaves(abstract)}
    for path in [*expected, *(p for p in digests if p not in expected)]:  # in the state's order
        stored, wanted = digests.get(path, [None, None])[:2], expected.get(path)
        if wanted is None:
            return f"it holds {path}, which the model has not"
        if stored[0] is None:
            return f"the model has {path}, which it does not hold"
        if stored != wanted:
            return f"{path} is {stored[0]}{tuple(stored[1])} there, {wanted[0]}{tuple(wanted[1])} in the model"
    return None


def mismatch(digests: dict[str, list], tree: Any) -> str | None:
    """A line naming the first leaf of `tree` (host arrays) whose digest differs from `digests`, or None."""
    for path, leaf in _leaves(tree):
        if of_leaf(np.asarray(leaf)) != digests.get(path):
            return f"the digest of {path} does not match the one saved with it (damaged bytes)"
    return None
