"""The one place jdp reaches into JAX's private modules: the coordinator's key-value store of a
`jax.distributed` run, which JAX has no public form of (checked from jax 0.10 on). jdp uses it to compare
the processes' settings at start-up and to agree on a step to stop at."""

from __future__ import annotations

from typing import Any

import jax


def client() -> Any | None:
    """The distributed runtime client (`key_value_set`, `key_value_dir_get`, `blocking_key_value_get`), or
    None in a single-process run."""
    if jax.process_count() == 1:
        return None
    from jax._src.distributed import global_state  # no public API for the key-value store

    return global_state.client
