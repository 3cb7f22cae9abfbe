"""Deterministic faults for the crash-safety tests: `JDP_KILL_AT=POINT:STEP`, or `POINT:STEP@PROCESS` for one
process, with POINT `save`, `step`, `raise` or `restore` (docs/checkpoints.md); only where `JDP_RESTART` is 0 or unset.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable


def _requested(point: str) -> int | None:
    """STEP of `JDP_KILL_AT=POINT:STEP[@PROCESS]` when it names `point` (and this process), else None."""
    if os.environ.get("JDP_RESTART", "0").strip() not in ("", "0"):  # a restart by jdp.launch: it has fired
        return None
    name, _, rest = os.environ.get("JDP_KILL_AT", "").partition(":")
    step, _, process = rest.partition("@")
    if name != point or not step.lstrip("-").isdigit():
        return None
    if process:
        import jax  # only when a process is named: jdp.faults is imported before JAX starts

        if int(process) != jax.process_index():
            return None
    return int(step)


def inject(point: str, step: int | None = None, before: Callable[[], None] = lambda: None) -> None:
    """The fault `JDP_KILL_AT` asks for at `point` after `step` (`restore`: any): SIGKILL after `before()` (`save`,
    `step`), an exception (`raise`), or SIGTERM as a scheduler would send it (`restore`)."""
    requested = _requested(point)
    if requested is None or step not in (None, requested):
        return
    if point == "raise":
        raise RuntimeError(f"JDP_KILL_AT=raise:{step}: a fault injected after step {step}")
    before()
    os.kill(os.getpid(), signal.SIGTERM if point == "restore" else signal.SIGKILL)


def requested_step() -> int | None:
    """STEP of a `step` or `raise` fault for this process, else None: the step after which the loop acts."""
    return next((s for s in map(_requested, ("step", "raise")) if s is not None), None)
