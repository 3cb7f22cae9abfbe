"""Deterministic crash points for the crash-safety tests, set through the environment. `JDP_KILL_AT=save:STEP`
sends SIGKILL to this process in the middle of writing checkpoint STEP (its asynchronous write has started,
not finished); `JDP_KILL_AT=step:STEP` right after step STEP, once earlier checkpoint writes are complete
(`jdp.callbacks.KillAfterStep`). Unset, nothing happens."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable


def kill_if_requested(point: str, step: int, before: Callable[[], None] = lambda: None) -> None:
    if os.environ.get("JDP_KILL_AT") == f"{point}:{step}":
        before()
        os.kill(os.getpid(), signal.SIGKILL)


def requested_step() -> int | None:
    """STEP of `JDP_KILL_AT=step:STEP`, else None."""
    point, _, step = os.environ.get("JDP_KILL_AT", "").partition(":")
    return int(step) if point == "step" else None
