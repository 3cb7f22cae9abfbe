"""The one place jdp reaches into JAX's private modules: the coordinator's key-value store of a `jax.distributed`
run, which JAX has no public form of (jax 0.10)."""

from __future__ import annotations

from typing import Any

import jax


def client() -> Any | None:
    """The distributed runtime client, or None in a single-process run."""
    if jax.process_count() == 1:
        return None
    from jax._src.distributed import global_state  # no public API for the key-value store

    return global_state.client
