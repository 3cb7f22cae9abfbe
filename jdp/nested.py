"""Nested dicts as one level of keys: `a.b.c` (configs, tracker params) or `a/b/c` (parameter files). No jax here."""

from collections.abc import Callable
from typing import Any


def flatten(tree: dict, prefix: str = "", sep: str = ".",
            into: Callable[[Any], Any] = lambda v: isinstance(v, dict)) -> dict:
    """{prefix + key + sep + subkey ...: leaf}, in the dicts' order, going into each value `into` accepts (dicts)."""
    flat = {}
    for k, v in tree.items():
        flat.update(flatten(v, f"{prefix}{k}{sep}", sep, into) if into(v) else {f"{prefix}{k}": v})
    return flat
