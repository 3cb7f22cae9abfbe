"""What every tracker logger shares: process 0 only, metrics.jsonl's lines as written, the run id and logged steps in
WORKDIR/trackers/NAME.json, and a worker thread behind a bounded queue (docs/trackers.md)."""

from __future__ import annotations

import atexit
import contextlib
import importlib
import importlib.util
import json
import logging
import math
import queue
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax

from jdp import nested, preemption, storage
from jdp.callbacks import Callback
from jdp.errors import UsageError, one_line, warn
from jdp.files import write_atomic

CLOSE_TIMEOUT_S = 30.0  # the most a run's end (or its exit after an error or a signal) waits for a tracker
QUEUE_LINES = 10_000  # lines held for a tracker that lags; past that, lines are dropped (with the one warning)
SPLITS = ("train", "eval", "summary")
_END = object()
_IMPORTS = threading.Lock()


def installed(package: str) -> bool:
    """Whether `package` can be imported, without importing it (a tracker's import costs seconds)."""
    if package in sys.modules:  # find_spec raises for a module without a spec (a stub)
        return sys.modules[package] is not None
    return importlib.util.find_spec(package) is not None


def flatten(record: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested dicts as `a.b.c` keys; lists, and dicts keyed by more than plain names (the model's shapes), as JSON."""
    flat = nested.flatten(record, prefix, into=lambda value: isinstance(value, dict) and value and all(
        isinstance(k, str) and k.replace("_", "").replace("-", "").isalnum() for k in value))
    return {k: json.dumps(v, default=str) if isinstance(v, (dict, list, tuple)) else v for k, v in flat.items()}


def numbers(line: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """A metrics.jsonl line's finite numbers as tracker metrics, but `wall_time` (reset by each resume)."""
    return {f"{prefix}{k}": float(v) for k, v in line.items()
            if k not in ("step", "split", "wall_time") and isinstance(v, (int, float)) and not isinstance(v, bool)
            and math.isfinite(v)}


class Tracker(Callback):
    """A logger of metrics.jsonl's lines to an experiment tracker, as a `jdp.Callback`: the training thread queues
    them and returns; a worker thread sends them (subclasses' `_open`, `_log(split, step, line)` and `_close(ok)`)."""

    name = ""  # jdp.loggers.LOGGERS's name; the state file's and the extra's name
    package = ""  # what the tracker's client imports as

    def __init__(self, *, close_timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        preemption.install_excepthook()  # left uncaught in a script, a refusal here is one line and exit 2
        if not installed(self.package):
            raise UsageError(f"jdp.loggers.{type(self).__name__} needs the {self.package} package, which is not "
                             f"installed: pip install \"jdp[{self.name}]\"")
        if not isinstance(close_timeout_s, (int, float)) or not close_timeout_s >= 0:
            raise UsageError(f"close_timeout_s={close_timeout_s!r} must be a number of seconds, at least 0")
        self.close_timeout_s = close_timeout_s
        self._thread: threading.Thread | None = None

    def on_start(self, start: int, workdir: Path | None, record: dict[str, Any] | None) -> None:
        self.close()  # a logger passed to a second fit: the first one's run ends first
        if jax.process_index() != 0:
            return
        self.workdir, self.start, self.record = workdir, start, record
        self._state_file = workdir / "trackers" / f"{self.name}.json" if workdir is not None else None
        self.state: dict[str, Any] = {}  # the run id and the last step of each split sent
        if self._state_file is not None and self._state_file.is_file():
            try:
                state = json.loads(self._state_file.read_text())
                self.state = state if isinstance(state, dict) else {}
            except (OSError, ValueError) as e:
                warn(f"{self._state_file} cannot be read ({one_line(e)}); the {self.name} logger opens a new run")
        self._last_step = start
        jsonl = workdir / "metrics.jsonl" if workdir is not None else None
        self._jsonl_size = jsonl.stat().st_size if jsonl is not None and jsonl.is_file() else 0
        self._queue: queue.Queue = queue.Queue()
        self._warned = self._abandoned = False
        self._write_failure: Exception | None = None  # the worker's failed write to the workdir (it then stopped)
        # Started now: the client's import (seconds) overlaps the compilation. The run opens with the first line.
        self._thread = threading.Thread(target=self._work, name=f"jdp-{self.name}-logger", daemon=True)
        self._thread.start()
        atexit.register(self.close)

    def on_line(self, line: dict[str, Any]) -> None:
        if self._thread is None:
            return
        self._raise_write_failure()
        split = line.get("split")
        if split not in SPLITS:
            return
        step = line["step"] if split != "summary" else self._last_step  # a summary ends the steps before it
        self._last_step = max(self._last_step, step)
        if self._queue.qsize() >= QUEUE_LINES:
            self._warn(f"{QUEUE_LINES} lines are waiting for the tracker; dropping the line of step {step}")
            return
        self._queue.put((split, step, line))

    def on_end(self, result: Any) -> None:
        self.close(ok=True)

    def close(self, ok: bool = False) -> None:
        """Ends the tracked run (finished if `ok`, else killed), past `close_timeout_s` without it (a warning)."""
        thread, self._thread = self._thread, None
        if thread is None:
            return
        atexit.unregister(self.close)
        self._queue.put((_END, ok, None))
        thread.join(self.close_timeout_s)
        if ok:
            self._raise_write_failure()
        if thread.is_alive():
            self._abandoned = True  # silent from now on: the tracker may answer long after
            warn(f"the {self.name} tracker did not finish within {self.close_timeout_s:g} s of the run's end "
                 f"(close_timeout_s); going on without it, with {max(0, self._queue.qsize() - 1)} more line(s) waiting")

    def _raise_write_failure(self) -> None:
        """A write to the workdir that failed on the worker (a full disk) stops the run: raised here, once."""
        failure, self._write_failure = self._write_failure, None
        if failure is not None:
            raise failure

    def _work(self) -> None:
        self._opened = self._failed = False
        logged: dict[str, int] | None = None
        try:
            with _client_logs(self):
                # One client's import at a time: wandb and mlflow share packages, and two threads importing them at
                # once can see each other's half-initialised modules. A failed one fails again in `_open`, which warns.
                with _IMPORTS, contextlib.suppress(Exception):
                    importlib.import_module(self.package)
                while True:
                    split, step, line = self._queue.get()
                    if split is _END:  # `step` holds whether the run ended well
                        if self._opened:
                            self._guard(self._close, step)
                        return
                    if logged is None:
                        logged = self._guard(self._logged)
                        logged = Tracker._logged(self) if logged is None else logged
                        for earlier in self._missing(logged):
                            self._send(*earlier)
                    # Steps an earlier segment logged past its last checkpoint (then killed) go in once.
                    if step > logged.get(split, -1):
                        self._send(split, step, line)
        except Exception as e:  # noqa: BLE001 - a write to the workdir failed (_save_state, `_guard`)
            self._write_failure = e  # the training thread raises it; the worker stops, and the lines are dropped

    def _send(self, split: str, step: int, line: dict[str, Any]) -> None:
        if self._failed:
            return
        if not self._opened:
            run_id = self._guard(self._open, self.state.get("run_id"))
            if run_id is None:
                self._failed = True  # no run to log to: the lines are dropped, after the one warning
                return
            self._opened = True
            # After the client's own exit hooks (W&B's): at exit jdp's close runs before their teardown, and an
            # uncaught jdp error stays one line (W&B's excepthook printed its traceback first).
            atexit.unregister(self.close)
            atexit.register(self.close)
            preemption.install_excepthook()
            if run_id != self.state.get("run_id"):  # a new tracked run: nothing of it logged yet
                self.state = {"run_id": run_id}
        # Recorded (with the run id) before it is sent: a kill in between loses this point rather than logging it twice.
        self.state[split] = step
        self._save_state()
        self._guard(self._log, split, step, line)

    def _missing(self, logged: dict[str, int]) -> Iterator[tuple[str, int, dict[str, Any]]]:
        """metrics.jsonl's train and eval lines up to the start step that the tracked run lacks (lost to a SIGKILL)."""
        if not self._jsonl_size:  # no workdir, or no lines before this start
            return
        with open(self.workdir / "metrics.jsonl", "rb") as f:
            text = f.read(self._jsonl_size).decode(errors="replace")
        for row in text.splitlines():
            try:
                line = json.loads(row)
            except ValueError:
                continue
            split, step = line.get("split"), line.get("step")
            if split in ("train", "eval") and isinstance(step, int) and logged.get(split, -1) < step <= self.start:
                yield split, step, line

    def _guard(self, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except Exception as e:  # noqa: BLE001 - a tracker's failure must not stop the training
            failure = storage.disk_failure(e) if self.workdir is not None else None
            if failure and failure[1] and Path(failure[1]).absolute().is_relative_to(self.workdir.absolute()):
                raise  # the client's failed write into the workdir (a full disk) stops the run
            self._warn(f"{one_line(e)}; training goes on, the tracker may miss lines")
            return None

    def _warn(self, message: str) -> None:
        if not self._warned and not self._abandoned:
            self._warned = True
            warn(f"{self.name} logger: {message} (this warning is shown once)")

    def _save_state(self) -> None:
        if self._state_file is not None and not self._abandoned:
            self._state_file.parent.mkdir(exist_ok=True)
            write_atomic(self._state_file, json.dumps(self.state, indent=1) + "\n")

    def params(self) -> dict[str, Any]:
        """What the tracked run records as its settings: the run record (run.json's) and the CLI's config, if any."""
        params = dict(self.record or {})
        if self.workdir is not None:
            with contextlib.suppress(OSError, ValueError):  # no config.json: a run of the API
                params["config"] = json.loads((self.workdir / "config.json").read_text())
        return params

    def _logged(self) -> dict[str, int]:
        """The last step of each split the tracked run holds; by default (or when the tracker fails) the last sent."""
        return {split: self.state[split] for split in SPLITS if isinstance(self.state.get(split), int)}

    def _open(self, run_id: str | None) -> str:
        """Opens the tracked run `run_id` (None: a new one) and records its settings; returns its id."""
        raise NotImplementedError


@contextlib.contextmanager
def _client_logs(tracker: Tracker) -> Iterator[None]:
    """What this (the worker) thread's client libraries log at WARNING or above (urllib3's `Retrying ...`, once per
    retry) becomes the tracker's one warning."""
    thread = threading.get_ident()

    def keep(record: logging.LogRecord) -> bool:
        if record.thread != thread or record.levelno < logging.WARNING:
            return True
        with contextlib.suppress(Exception):  # a record that does not format: dropped all the same
            tracker._warn(f"{record.name}: {record.getMessage()[:300]}; training goes on, the tracker may miss lines")
        return False

    loggers = [logging.getLogger(name) for name in ("urllib3.connectionpool", "urllib3.util.retry", "urllib3.response")]
    for logger in loggers:
        logger.addFilter(keep)
    try:
        yield
    finally:
        for logger in loggers:
            logger.removeFilter(keep)
