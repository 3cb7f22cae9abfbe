"""SIGTERM/SIGINT: in training the first checkpoints and stops after the current step, a second exits at once;
outside training either exits 75 at once (docs/checkpoints.md)."""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType, TracebackType
from typing import Self

from jdp.errors import Preempted, UsageError

EXIT_PREEMPTED = 75  # safe to requeue: the rerun resumes from the last checkpoint, or starts over without one
EXIT_USAGE = 2  # a refusal or bad input: the same again fails the same way
EXIT_PEER_FAILED = 5  # jdp.cli.train's EXIT_DISTRIBUTED: another process (or the coordinator) failed
# Set by jdp.launch for its children: the file it writes, before its SIGTERM, when it stops them because one failed.
LAUNCH_FAILURE_FILE = "JDP_LAUNCH_FAILURE_FILE"


def exit_now(message: str, code: int, flush_stdout: bool = False, leave: bool = False) -> None:
    """`message` on stderr and exit `code` at once, from any thread. `flush_stdout` where no signal handler runs it
    (inside one, the main thread may hold stdout's lock, or a stalled reader may block the flush). `leave`: first
    `jdp.kvstore.leaving`, where a multi-process run imported it (a signal handler imports nothing)."""
    if flush_stdout:
        sys.stdout.flush()
    print(message, file=sys.stderr, flush=True)
    if leave and (kvstore := sys.modules.get("jdp.kvstore")) is not None:
        kvstore.leaving()
    os._exit(code)


def _exit_if_peer_failed(flush_stdout: bool = False) -> None:
    """A SIGTERM from jdp.launch after another process failed is no preemption: one line and exit 5 (no requeue).
    `flush_stdout` from the watching thread only (see `exit_now`)."""
    if not (path := os.environ.get(LAUNCH_FAILURE_FILE)):  # unset, or "" for a child with no file
        return
    try:
        failure = Path(path).read_text().strip() or "another process failed"
    except OSError:
        return
    exit_now(f"jdp: distributed: process {os.environ.get('RANK', '?')} stopped because another process failed "
             f"(jdp.launch: {failure}); exiting with code {EXIT_PEER_FAILED}, not {EXIT_PREEMPTED}: this is no "
             "preemption (a rerun resumes from the last checkpoint)", EXIT_PEER_FAILED, flush_stdout)


def _watch_for_peer_failure() -> None:
    """Under jdp.launch: its SIGTERM after a peer failed also ends a process blocked in a collective, whose main
    thread would not run the handler; the signal's byte on the wakeup fd wakes this thread at once."""
    if not os.environ.get(LAUNCH_FAILURE_FILE) or threading.current_thread() is not threading.main_thread():
        return
    read, write = os.pipe()
    os.set_blocking(write, False)
    if (owner := signal.set_wakeup_fd(write, warn_on_full_buffer=False)) != -1:  # an event loop's: give it back
        signal.set_wakeup_fd(owner)
        os.close(read)
        os.close(write)
        return

    def watch() -> None:
        while os.read(read, 1):
            _exit_if_peer_failed(flush_stdout=True)

    threading.Thread(target=watch, name="jdp-peer-failure", daemon=True).start()


def _exit_at_once(signum: int, frame: FrameType | None) -> None:
    _exit_if_peer_failed()
    exit_now(f"jdp: preempted: {signal.Signals(signum).name} outside the training steps; exiting with code "
             f"{EXIT_PREEMPTED} (no step was lost: a rerun resumes from the last checkpoint, or starts over without "
             "one)", EXIT_PREEMPTED, leave=True)


def exit_on_signal() -> None:
    """From now on (until a `PreemptionRequest` takes over), SIGTERM or SIGINT exits 75 at once."""
    for s in ExitOnSignal.SIGNALS:
        signal.signal(s, _exit_at_once)
    _watch_for_peer_failure()


class ExitOnSignal:
    """Context manager: SIGTERM or SIGINT exits 75 inside, the previous handlers restored after (main thread only)."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)
    _previous: dict[int, object] = {}
    _handle = staticmethod(_exit_at_once)

    def __enter__(self) -> Self:
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
        return self

    def __exit__(self, *exc: object) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)


class PreemptionRequest(ExitOnSignal):
    """Context manager that records the first SIGTERM or SIGINT instead of dying on it."""

    def __init__(self) -> None:
        self.signal_name: str | None = None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        _exit_if_peer_failed()
        name = signal.Signals(signum).name
        if self.signal_name is not None:
            exit_now(f"jdp: second {name}: exiting now, without a checkpoint", 128 + signum)
        self.signal_name = name
        print(f"jdp: {name} received: finishing the current step and writing a checkpoint "
              "(send it again to exit at once)", file=sys.stderr, flush=True)


def interactive() -> bool:
    """IPython, Jupyter, `python -i` or the REPL: an uncaught error must not end the session."""
    ipython = sys.modules.get("IPython")
    return (hasattr(sys, "ps1") or bool(sys.flags.interactive)
            or (ipython is not None and getattr(ipython, "get_ipython", lambda: None)() is not None))


class _PreemptedExits:
    """`sys.excepthook`: an uncaught `Preempted` or `jdp.UsageError` is one line and exit 75 or 2, as in the CLI."""

    def __init__(self, previous: Callable[[type[BaseException], BaseException, TracebackType | None], object]) -> None:
        self.previous = previous

    def __call__(self, kind: type[BaseException], error: BaseException, tb: TracebackType | None) -> None:
        if not issubclass(kind, (Preempted, UsageError)) or interactive():
            self.previous(kind, error, tb)
            return
        preempted = issubclass(kind, Preempted)
        print(f"jdp: {'preempted' if preempted else 'error'}: {error}", file=sys.stderr)
        # The interpreter's status for an uncaught exception is 1: exit here, after what a normal exit runs first.
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(EXIT_PREEMPTED if preempted else EXIT_USAGE)


def install_excepthook() -> None:
    """`_PreemptedExits` as `sys.excepthook`, once: a script leaving jdp's errors uncaught ends as the CLI does."""
    if not isinstance(sys.excepthook, _PreemptedExits):
        sys.excepthook = _PreemptedExits(sys.excepthook)


@contextlib.contextmanager
def during_fit() -> Iterator[None]:
    """`jdp.fit`'s whole call. In a script a signal outside the training steps exits 75 at once, as in the CLI
    (raising there is unsafe: `except Exception` blocks would take it for a failure). Interactive, the handlers stay."""
    install_excepthook()
    with contextlib.nullcontext() if interactive() else ExitOnSignal():
        yield
