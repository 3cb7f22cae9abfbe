"""A digest of every leaf of a train state (path, dtype, shape and a BLAKE2b hash of its bytes), stored with each
checkpoint and compared with the restored arrays, so that bytes damaged on disk are found instead of trained on; and
a checksum of the JSON item that holds them, so that damage to the digests, the format or the data position is
found too."""

from __future__ import annotations

import hashlib
import json
import re
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


def _checksum(item: dict) -> str:
    """BLAKE2b of `item` without its checksum, as canonical JSON: the parsed values, not the file's bytes, so that
    any JSON writer's spacing or key order gives the same checksum."""
    text = json.dumps({k: v for k, v in item.items() if k != "checksum"}, sort_keys=True, separators=(",", ":"))
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def sealed(item: dict) -> dict:
    """`item` (JSON-able) with its checksum under "checksum"."""
    return {**item, "checksum": _checksum(item)}


def seal_broken(item: dict) -> bool:
    """Whether `item` carries a checksum that does not match it."""
    return "checksum" in item and item["checksum"] != _checksum(item)


_KEY = re.compile(r"""\.(\w+)|\[(-?\d+)\]|\['((?:[^'\\]|\\.)*)'\]|\["((?:[^"\\]|\\.)*)"\]""")


def _plain(path: str) -> str:
    """A leaf's path as its keys joined by "/", whatever tree spelled it: the TrainState's `.opt_state[0].mu['w']`
    and orbax's restored dict's `['opt_state'][0]['mu']['w']` are both `opt_state/0/mu/w`."""
    return "/".join(next(g for g in m.groups() if g is not None) for m in _KEY.finditer(path))


def stored_layout(metadata: Any) -> dict[str, list]:
    """{plain path: [dtype, shape]} of the arrays orbax's metadata of a saved tree describes."""
    leaves = jax.tree_util.tree_flatten_with_path(metadata)[0]
    return {_plain(jax.tree_util.keystr(path)): [np.dtype(leaf.dtype).name, list(leaf.shape)]
            for path, leaf in leaves if hasattr(leaf, "shape") and hasattr(leaf, "dtype")}


def layout_disagreement(digests: dict[str, list], stored: dict[str, list]) -> str | None:
    """The first leaf whose dtype or shape in `digests` differs from orbax's metadata of the arrays saved beside
    them (`stored_layout`), or that only one of them lists: both were written from one state, so it is damage."""
    listed = {_plain(path): value[:2] for path, value in digests.items()}
    for path in [*listed, *(p for p in stored if p not in listed)]:
        mine, theirs = listed.get(path), stored.get(path)
        if mine is None:
            return f"its arrays hold {path}, which its digests do not list"
        if theirs is None:
            return f"its digests list {path}, which its arrays do not hold"
        if mine != theirs:
            return f"its digests give {path} as {mine[0]}{tuple(mine[1])}, its arrays as {theirs[0]}{tuple(theirs[1])}"
    return None


def as_digest_layout(stored: dict[str, list], abstract: Any) -> dict[str, list]:
    """`stored_layout` keyed as digests are (the paths of `abstract`'s leaves, then any other stored path as it
    is), for a checkpoint saved without digests."""
    paths = {_plain(path): path for path, _ in _leaves(abstract)}
    return {paths.get(path, path): layout for path, layout in stored.items()}
