"""Digests of a train state's leaves, checked on restore, and the checksum of the JSON item that holds them. A split
leaf's digest is integer word sums computed where its parts live: the same on any device count."""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jdp.mesh import to_numpy

WORDS = "words:"


def _leaves(tree: Any) -> list[tuple[str, Any]]:
    return [(jax.tree_util.keystr(path), leaf) for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]]


def of_leaf(x: np.ndarray) -> list:
    data = np.ascontiguousarray(x).reshape(-1).view(np.uint8)
    return [x.dtype.name, list(x.shape), hashlib.blake2b(data, digest_size=16).hexdigest()]


def _words(x: Any, xp: Any) -> Any:
    """A leaf's bytes as uint32 words (two per 8-byte element); `xp` is numpy or jax.numpy."""
    x = x.astype(xp.uint8) if x.dtype == xp.bool_ else x  # bitcast takes no booleans
    size = x.dtype.itemsize
    if xp is np:
        return np.ascontiguousarray(x).view(f"uint{min(size, 4) * 8}").astype(np.uint32)
    if size >= 4:  # an 8-byte element becomes a trailing axis of two words
        return jax.lax.bitcast_convert_type(x, jnp.uint32)
    return jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{size * 8}")).astype(jnp.uint32)


def sums_on_device(x: jax.Array) -> jax.Array:
    """[sum of words, sum of words x (row-major position + 1)], wrapping, where `x`'s parts are (positions from iotas
    in `x`'s own shape: nothing is reshaped across devices)."""
    words = _words(x, jnp)
    position = jnp.zeros(words.shape, jnp.uint32)
    stride = 1
    for axis in reversed(range(words.ndim)):
        position = position + jax.lax.broadcasted_iota(jnp.uint32, words.shape, axis) * jnp.uint32(stride % 2**32)
        stride *= words.shape[axis]
    return jnp.stack([words.sum(dtype=jnp.uint32), (words * (position + 1)).sum(dtype=jnp.uint32)])


_word_sums = jax.jit(lambda leaves: jnp.stack([sums_on_device(x) for x in leaves]).reshape(-1, 2))


def _sums_on_host(x: np.ndarray) -> np.ndarray:
    """`sums_on_device` of a numpy array, on the host."""
    words = _words(np.asarray(x), np).reshape(-1)
    position = np.arange(1, words.size + 1, dtype=np.uint64).astype(np.uint32)
    return np.array([words.sum(dtype=np.uint32), (words * position).sum(dtype=np.uint32)], np.uint32)


def _of_words(x: Any, sums: np.ndarray) -> list:
    return [np.dtype(x.dtype).name, list(x.shape), WORDS + "".join(f"{int(v):08x}" for v in sums)]


def pending(tree: Any, host: bool = True) -> Callable[[], dict[str, list] | None]:
    """Starts a train state's digests (split leaves' word sums, on their devices: every process calls this together),
    returning what completes them on a save thread (hashes of the rest); `host` False: that returns None."""
    leaves = _leaves(tree)
    split = {path: x for path, x in leaves if isinstance(x, jax.Array) and not x.sharding.is_fully_replicated}
    sums = _word_sums(list(split.values())) if split else None
    if not host:
        return lambda: None
    # On CPU the host arrays are views, which JAX keeps alive: it does not donate a buffer that has a view.
    whole = {path: to_numpy(x) for path, x in leaves if path not in split}

    def complete() -> dict[str, list]:
        words = dict(zip(split, np.asarray(sums) if split else [], strict=True))
        return {path: _of_words(x, words[path]) if path in words else of_leaf(whole[path]) for path, x in leaves}
    return complete


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
    """A line naming the first leaf of `tree` whose digest differs from `digests`, or None; a collective."""
    leaves, digests = _leaves(tree), {_plain(path): value for path, value in digests.items()}
    counted = [(path, x) for path, x in leaves if str(digests.get(_plain(path), [None] * 3)[2]).startswith(WORDS)]
    on_devices = {path: x for path, x in counted if isinstance(x, jax.Array)}
    words = dict(zip(on_devices, np.asarray(_word_sums(list(on_devices.values()))) if on_devices else [], strict=True))
    words |= {path: _sums_on_host(x) for path, x in counted if not isinstance(x, jax.Array)}
    for path, leaf in leaves:
        got = _of_words(leaf, words[path]) if path in words else of_leaf(to_numpy(leaf))
        if got != digests.get(_plain(path)):
            return f"the digest of {path} does not match the one saved with it (damaged bytes)"
    return None


def sealed(item: dict) -> dict:
    """`item` with "checksum": BLAKE2b of the rest as canonical JSON (any writer's spacing and key order alike)."""
    text = json.dumps({k: v for k, v in item.items() if k != "checksum"}, sort_keys=True, separators=(",", ":"))
    return {**item, "checksum": hashlib.blake2b(text.encode(), digest_size=16).hexdigest()}


def seal_broken(item: dict) -> bool:
    """Whether `item` carries a checksum that does not match it (sealing it anew changes it)."""
    return "checksum" in item and sealed(item) != item


_KEY = re.compile(r"""\.(\w+)|\[(-?\d+)\]|\['((?:[^'\\]|\\.)*)'\]|\["((?:[^"\\]|\\.)*)"\]""")


def _plain(path: str) -> str:
    """A leaf's path as its keys joined by "/": `.opt_state[0].mu['w']` and `['opt_state'][0]['mu']['w']` alike."""
    return "/".join(next(g for g in m.groups() if g is not None) for m in _KEY.finditer(path))


def stored_layout(metadata: Any, abstract: Any = None) -> dict[str, list]:
    """{path: [dtype, shape]} of the arrays orbax's metadata describes; a path as `abstract` has it, else plain."""
    paths = {_plain(path): path for path, _ in _leaves(abstract)}
    return {paths.get(_plain(path), _plain(path)): [np.dtype(leaf.dtype).name, list(leaf.shape)]
            for path, leaf in _leaves(metadata) if hasattr(leaf, "shape") and hasattr(leaf, "dtype")}


def layout_disagreement(digests: dict[str, list], stored: dict[str, list]) -> str | None:
    """The first leaf whose dtype or shape in `digests` differs from `stored_layout` of the arrays saved beside them,
    or that only one lists: both were written from one state, so it is damage."""
    listed = {_plain(path): value[:2] for path, value in digests.items()}
    for path in [*listed, *(p for p in stored if p not in listed)]:
        mine, theirs = listed.get(path), stored.get(path)
        if mine is None:
            return f"its arrays hold {path}, which its digests do not list (damaged bytes)"
        if theirs is None:
            return f"its digests list {path}, which its arrays do not hold (damaged bytes)"
        if mine != theirs:
            return (f"its digests give {path} as {mine[0]}{tuple(mine[1])}, its arrays as {theirs[0]}"
                    f"{tuple(theirs[1])} (damaged bytes)")
    return None
