"""SIGTERM/SIGINT: the first asks the run to checkpoint and stop after the current step; a second
one exits at once."""

from __future__ import annotations

import os
import signal
import sys
import threading
from types import FrameType


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
