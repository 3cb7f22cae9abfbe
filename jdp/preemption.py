"""SIGTERM/SIGINT: during training the first asks the run to checkpoint and stop after the current step, and a
second one exits at once; before training (imports, start-up, restore) and after it, either exits 75 at once.
`jdp.fit` in a script ends the same way (`during_fit`); in an interactive session `Preempted` is an error like
any other, and the handlers outside the steps are left alone."""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from types import FrameType, TracebackType

from jdp.errors import Preempted

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


def interactive() -> bool:
    """IPython, Jupyter, `python -i` or the REPL: an uncaught error must not end the session."""
    ipython = sys.modules.get("IPython")
    return (hasattr(sys, "ps1") or bool(sys.flags.interactive)
            or (ipython is not None and getattr(ipython, "get_ipython", lambda: None)() is not None))


class _PreemptedExits:
    """`sys.excepthook`: in a script, an uncaught `Preempted` is one line and exit 75, as in `python -m jdp.train`;
    anything else goes to the previous hook. IPython and Jupyter show a cell's errors without this hook."""

    def __init__(self, previous: Callable[[type[BaseException], BaseException, TracebackType | None], object]) -> None:
        self.previous = previous

    def __call__(self, kind: type[BaseException], error: BaseException, tb: TracebackType | None) -> None:
        if not issubclass(kind, Preempted) or interactive():
            self.previous(kind, error, tb)
            return
        print(f"jdp: preempted: {error}", file=sys.stderr)
        # The interpreter fixes the status of an uncaught exception at 1: end the process here, after what a normal
        # exit runs first (atexit: loggers, trackers, JAX's distributed shutdown).
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(EXIT_PREEMPTED)


@contextlib.contextmanager
def during_fit() -> Iterator[None]:
    """`jdp.fit`'s whole call. In a script, a signal outside the training steps exits 75 at once, as in the CLI (raising
    there is unsafe: `except Exception` blocks, such as the restore's, would take the error for a damaged checkpoint,
    and one process of several would wait for the others in a barrier); in the steps it checkpoints and raises
    `Preempted`, which, uncaught, exits 75 in one line. Interactive, the handlers stay (SIGINT raises
    KeyboardInterrupt) and `Preempted` is shown as any error: the session lives."""
    if not isinstance(sys.excepthook, _PreemptedExits):  # installed once: later fits find it
        sys.excepthook = _PreemptedExits(sys.excepthook)
    with contextlib.nullcontext() if interactive() else ExitOnSignal():
        yield
