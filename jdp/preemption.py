"""SIGTERM/SIGINT: during training the first asks the run to checkpoint and stop after the current step, and a
second one exits at once; before training (imports, start-up, restore) and after it, either exits 75 at once."""

from __future__ import annotations

import os
import signal
import sys
import threading
from types import FrameType

EXIT_PREEMPTED = 75  # safe to requeue: the rerun resumes from the last checkpoint, or starts over without one


def _exit_at_once(signum: int, frame: FrameType | None) -> None:
    print(f"jdp: preempted: {signal.Signals(signum).name} outside the training steps; exiting with code "
          f"{EXIT_PREEMPTED} (no step was lost: a rerun resumes from the last checkpoint, or starts over without one)",
          file=sys.stderr, flush=True)
    os._exit(EXIT_PREEMPTED)


def exit_on_signal() -> None:
    """From now on (until a `PreemptionRequest` takes over), SIGTERM or SIGINT exits 75 at once."""
    for s in PreemptionRequest.SIGNALS:
        signal.signal(s, _exit_at_once)


class ExitOnSignal:
    """Context manager: `exit_on_signal` inside, the previous handlers restored after (main thread only)."""

    def __enter__(self) -> ExitOnSignal:
        self._previous = {}
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.getsignal(s) for s in PreemptionRequest.SIGNALS}
            exit_on_signal()
        return self

    def __exit__(self, *exc: object) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)


class PreemptionRequest:
    """Context manager that records the first SIGTERM or SIGINT instead of dying on it."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.signal_name: str | None = None
        self._previous: dict[int, object] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.signal_name is not None:
            print(f"jdp: second {name}: exiting now, without a checkpoint", file=sys.stderr, flush=True)
            os._exit(128 + signum)
        self.signal_name = name
        print(f"jdp: {name} received: finishing the current step and writing a checkpoint "
              "(send it again to exit at once)", file=sys.stderr, flush=True)

    def __enter__(self) -> PreemptionRequest:
        if threading.current_thread() is threading.main_thread():  # signals can only be caught there
            self._previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
        return self

    def __exit__(self, *exc: object) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
