"""The one place jdp reaches into JAX's private modules: the coordinator's key-value store of a `jax.distributed`
run, which JAX has no public form of (jax 0.10)."""

from __future__ import annotations

import contextlib
import time
from typing import Any

import jax

LEFT_S = 1.0  # from a process's word that it leaves to its exit, at the most: os._exit right after


def client() -> Any | None:
    """The distributed runtime client, or None in a single-process run."""
    if jax.process_count() == 1:
        return None
    from jax._src.distributed import global_state  # no public API for the key-value store

    return global_state.client


def leaving(timeout_s: float = 10.0) -> None:
    """In a multi-process run, says this process is leaving (at once, by os._exit). Process 0, whose exit ends the
    key-value store, first waits up to `timeout_s` for the others to say so, then a moment more: JAX aborts (134) a
    process that outlives its coordinator. Alone, nothing happens."""
    if not jax.distributed.is_initialized():
        return
    store, me = client(), jax.process_index()
    deadline = time.monotonic() + timeout_s
    with contextlib.suppress(Exception):  # the store gone, or a peer that does not come: leave as it is
        if me != 0:
            store.key_value_set(f"jdp/leaving/{me}", "yes")
            return
        for other in range(1, jax.process_count()):
            store.blocking_key_value_get(f"jdp/leaving/{other}", max(1, int((deadline - time.monotonic()) * 1000)))
        time.sleep(LEFT_S)
