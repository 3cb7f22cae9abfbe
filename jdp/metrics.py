"""What a run reports: metrics.jsonl and TensorBoard (process 0 only), a progress bar or plain
lines, and a steady-state throughput clock that leaves out compile, eval and checkpoint time."""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from tqdm import tqdm

from jdp.errors import warn
from jdp.files import write_atomic


class ThroughputClock:
    """Counts examples per second of training only: `paused()` around eval, checkpoints and checks."""

    def __init__(self) -> None:
        self.examples, self.seconds = 0, 0.0
        self._mark = (0, 0.0)  # (examples, seconds) at the previous `interval_rate`
        self._started: float | None = None

    def start(self) -> None:
        self._started = time.perf_counter()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Stopped for the block, then running again if it was."""
        running = self._started is not None
        if running:
            self.seconds += time.perf_counter() - self._started
            self._started = None
        try:
            yield
        finally:
            if running:
                self.start()

    def interval_rate(self) -> float | None:
        """Examples/sec since the previous call (the clock keeps running); None before any timed step."""
        with self.paused():
            examples, seconds = self.examples - self._mark[0], self.seconds - self._mark[1]
            self._mark = (self.examples, self.seconds)
        return examples / seconds if examples else None

    def rate(self) -> float:
        return self.examples / self.seconds if self.seconds else float("nan")


class MetricsWriter:
    """One JSON object per line to WORKDIR/metrics.jsonl (without a workdir, progress only), mirrored to TensorBoard;
    `resume` drops the lines past `start_step` an interrupted run wrote. A no-op on processes other than 0."""

    def __init__(self, workdir: Path | None, *, total_steps: int, start_step: int = 0, resume: bool = True,
                 enabled: bool = True) -> None:
        self.listeners: list = []  # functions of each line written (process 0)
        self.eval_steps: set[int] = set()  # steps with an eval line in the file (process 0)
        self.summary_written = False  # a summary follows the last train line (process 0)
        self.nonfinite_evals: list[int] = []  # steps of the eval lines whose loss was not finite (null; process 0)
        if not enabled:  # every method a no-op
            for name in ("train", "eval", "summary", "echo", "warn", "close"):
                setattr(self, name, lambda *_, **__: None)
            return
        self._start = time.time()
        self._step = start_step  # of the latest train or eval line: a summary's TensorBoard step
        self._workdir, self._file, self._tb = workdir, None, None
        # Imported now, at start-up (~0.35 s), not inside the throughput clock at the first train line.
        self._summary_writer = _tensorboard_class() if workdir is not None else None
        if workdir is not None:
            path = workdir / "metrics.jsonl"
            if path.exists():
                records = _truncate_after(path, start_step) if resume else read_metrics(workdir)
                evals = [r for r in records if r.get("split") == "eval"]
                self.eval_steps = {r["step"] for r in evals}
                self.nonfinite_evals = [r["step"] for r in evals if r.get("loss", 0) is None]
                # A summary after the last train line (an --eval_only line may follow it).
                trained = [r.get("split") for r in records if r.get("split") != "eval"]
                self.summary_written = bool(trained) and trained[-1] == "summary"
            self._file = open(path, "a", buffering=1)  # noqa: SIM115 - closed in close()
            if resume:
                _purge_events(workdir / "tensorboard", start_step)
        self._bar = (tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True)
                     if sys.stderr is not None and sys.stderr.isatty() else None)  # None: `2>&-`

    def _write(self, record: dict) -> None:
        record["wall_time"] = round(time.time() - self._start, 3)
        # A summary's TensorBoard step is the one it closes: one per segment of an extended run.
        self._step = record.get("step", self._step)
        # Strict JSON: a value that is not a finite number (a NaN loss, a rate not yet measured) is null.
        record = {k: v if not isinstance(v, float) or math.isfinite(v) else None for k, v in record.items()}
        if self._file is not None:
            self._file.write(json.dumps(record, allow_nan=False) + "\n")
        for listener in self.listeners:  # callbacks' `on_line`: the line as written (trackers log these)
            listener(dict(record))
        if self._tb is None and self._summary_writer is not None:  # on the first line; named to the nanosecond:
            # tensorboardX's name, to the second, would truncate the file of a segment resumed within it.
            self._tb = self._summary_writer(str(self._workdir / "tensorboard"),
                                            filename_suffix=f".{time.time_ns() % 10**9:09d}")
        if self._tb:
            for key, value in record.items():
                if key not in ("step", "split", "wall_time") and isinstance(value, (int, float)):
                    self._tb.add_scalar(f"{record['split']}/{key}", value, self._step)

    def train(self, step: int, metrics: dict[str, float]) -> None:
        """A train line: `metrics` holds `loss`, the loss function's other outputs and jdp's own fields."""
        self._write({"step": step, "split": "train", **metrics})
        rate = metrics["examples_per_sec"]
        text = f"loss {metrics['loss']:.4f}" + (f"  acc {metrics['accuracy']:.3f}" if "accuracy" in metrics else "")
        text += f"  {rate:,.0f} ex/s" if rate is not None else ""
        if self._bar is not None:
            self._bar.set_postfix_str(text, refresh=False)
            self._bar.update(step - self._bar.n)
        else:
            print(f"step {step}: {text}", flush=True)

    def eval(self, step: int, metrics: dict[str, float]) -> None:
        if not math.isfinite(metrics.get("loss", 0.0)) and step not in self.nonfinite_evals:
            self.nonfinite_evals.append(step)
        self._write({"step": step, "split": "eval", **metrics})
        self.echo(f"eval at step {step}: " + "  ".join(f"{k} {v:.4f}" for k, v in metrics.items()))

    def summary(self, **fields: float) -> None:
        """The summary line; `nonfinite_eval_steps` lists the evals whose loss was not finite, if any was."""
        flagged = {"nonfinite_eval_steps": sorted(self.nonfinite_evals)} if self.nonfinite_evals else {}
        self._write({"split": "summary", **fields, **flagged})

    def echo(self, line: str) -> None:
        (self._bar.write if self._bar is not None else print)(line)

    warn = staticmethod(warn)  # jdp.errors.warn

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        # Each closed once, the file even if closing the event file fails (a full disk).
        tb, file, self._tb, self._file, self._summary_writer = self._tb, self._file, None, None, None
        with file or contextlib.nullcontext():
            if tb:
                tb.close()


class _ClosableStream:
    """sys.stdout or sys.stderr that, from the first broken pipe (`| head`) or, in a run, full disk on, writes to
    /dev/null: the run goes on (its lines are in metrics.jsonl), where Python would raise at every print."""

    def __init__(self, stream: Any, name: str, quiet: bool) -> None:
        self._stream, self._name, self._quiet = stream, name, quiet

    def __getattr__(self, attribute: str) -> Any:
        return getattr(self._stream, attribute)

    def write(self, text: str) -> int:
        self._guarded(self._stream.write, text)
        return len(text)

    def flush(self) -> None:
        self._guarded(self._stream.flush)

    def _guarded(self, call: Callable[..., Any], *args: Any) -> None:
        try:
            call(*args)
        except OSError as e:
            closed = isinstance(e, BrokenPipeError)
            if not closed and (e.errno != errno.ENOSPC or self._quiet):  # a command's output lost is no success
                raise
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self._stream.fileno())  # the text still buffered goes there at the next flush
            os.close(devnull)
            if self._name == "stdout" and not self._quiet:
                why = "was closed by its reader (a pipe such as `| head`)" if closed else f"cannot be written ({e})"
                warn(f"stdout {why}; the run goes on, printing nothing more to it (metrics.jsonl holds its train "
                     "and eval lines)")


@contextlib.contextmanager
def console_may_close(quiet: bool = False) -> Iterator[None]:
    """A run whose stdout or stderr is closed goes on (`_ClosableStream`), with one warning unless `quiet` (a
    command whose output is all on the console: `jdp.sample | head -1` ends, a full disk exits 6 in one line)."""
    saved = sys.stdout, sys.stderr
    if not isinstance(sys.stdout, _ClosableStream):  # None (started with the stream closed, `>&-`): print skips it
        sys.stdout, sys.stderr = (None if stream is None else _ClosableStream(stream, name, quiet)
                                  for stream, name in zip(saved, ("stdout", "stderr"), strict=True))
    try:
        yield
        if sys.stdout is not None:
            sys.stdout.flush()  # here, not at the interpreter's exit, which would only print the error
    except OSError as e:
        if e.errno != errno.ENOSPC or not quiet:
            raise
        print(f"jdp: disk: the output cannot be written ({e.strerror}); free space, or send it elsewhere",
              file=saved[1])
        raise SystemExit(6) from None  # jdp's exit code for a full disk (docs/checkpoints.md)
    finally:
        sys.stdout, sys.stderr = saved


def read_metrics(run_dir: Path) -> list[dict]:
    """The records of RUN_DIR/metrics.jsonl, in order (lines that are not JSON are left out, with a warning)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found; pass run directories written by python -m jdp.train")
    return [record for _, record in _parse(path) if record is not None]


def _parse(path: Path) -> list[tuple[str, dict | None]]:
    """(line, record or None) for each non-empty line, with a warning for one that is no JSON record: the last line
    is dropped (a write cut short), another kept as None."""
    lines = path.read_text(errors="surrogateescape").splitlines()  # written back as read (`_truncate_after`)
    parsed = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            if not isinstance(record, dict):
                raise ValueError(f"{type(record).__name__}, not a record")
        except ValueError:
            if number == len(lines):
                warn(f"the last line ({number}) of {path} is cut short; dropping it")
                continue
            warn(f"line {number} of {path} is not JSON; keeping it as it is")
            record = None
        parsed.append((line, record))
    return parsed


def _truncate_after(path: Path, step: int) -> list[dict]:
    """Drops the train and eval lines past `step` and the summaries after them (atomically); the records kept."""
    text = path.read_text(errors="surrogateescape")
    kept, beyond = [], False
    for line, record in _parse(path):
        if record is not None and record.get("split") in ("train", "eval") and record.get("step", 0) > step:
            beyond = True
        elif record is None or not (beyond and record.get("split") == "summary"):
            kept.append((line, record))
    new_text = "".join(line + "\n" for line, _ in kept)
    if new_text != text:
        write_atomic(path, new_text.encode(errors="surrogateescape"))
    return [record for _, record in kept if record is not None]


def _purge_events(directory: Path, step: int) -> None:
    """`_truncate_after` for the TensorBoard event files (tensorboardX's `purge_step` only hides the replayed steps
    from TensorBoard's own loader)."""
    if not directory.is_dir():
        return
    try:
        from tensorboardX.proto.event_pb2 import Event  # the files' writer's own protobuf
    except ImportError:  # no tensorboardX: jdp wrote no event files
        return
    from jdp.data.tfrecord import UnreadableFileError, frames  # the files' framing is TFRecord's

    for path in sorted(directory.glob("events.out.tfevents.*")):
        data, kept = path.read_bytes(), []
        with contextlib.suppress(UnreadableFileError):  # a record cut short ends the file
            for offset, length in frames(str(path), lambda n, at, data=data: data[at:at + n], len(data)):
                if Event.FromString(data[offset:offset + length]).step <= step:
                    kept.append(data[offset - 12:offset + length + 4])  # its header, the Event, its CRC
        purged = b"".join(kept)
        if purged != data:
            write_atomic(path, purged)


FLUSH_S = 120.0  # how often the event file's buffered records are pushed to the disk (tensorboardX's default)


class _EventFile:
    """A TensorBoard event file written on the caller's thread: on SummaryWriter's own thread a failed write (a full
    disk) ends that thread, and the exit waits forever on its full queue. Here it raises, naming the file."""

    def __init__(self, logdir: str, filename_suffix: str = "") -> None:
        from tensorboardX.event_file_writer import EventsWriter
        from tensorboardX.proto.event_pb2 import Event
        from tensorboardX.summary import scalar

        self._event, self._scalar = Event, scalar
        self._logdir, self._flushed = logdir, time.monotonic()
        self._named(os.makedirs, logdir, exist_ok=True)
        self._events = self._named(EventsWriter, os.path.join(logdir, "events"), filename_suffix)

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        event = self._event(wall_time=time.time(), step=int(step), summary=self._scalar(tag, value))
        self._named(self._events.write_event, event)
        if time.monotonic() - self._flushed > FLUSH_S:
            self._named(self._events.flush)
            self._flushed = time.monotonic()

    def close(self) -> None:
        self._named(self._events.close)

    def _named(self, write: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """`write(*args, **kwargs)`, naming the event file in an OSError without a path (a buffered write's)."""
        try:
            return write(*args, **kwargs)
        except OSError as e:
            if e.filename is None:
                writer = getattr(self, "_events", None)
                e.filename = getattr(getattr(writer, "_py_recordio_writer", None), "path", self._logdir)
            raise


def _tensorboard_class() -> type | None:
    """`_EventFile`, or None without tensorboardX (optional). Torch is hidden from its import, which would take
    2-3 s only to accept torch tensors."""
    hide_torch = "torch" not in sys.modules
    if hide_torch:
        sys.modules["torch"] = None
    try:
        import tensorboardX.event_file_writer  # noqa: F401
        import tensorboardX.summary  # noqa: F401
    except ImportError:
        return None
    finally:
        if hide_torch:
            del sys.modules["torch"]
    return _EventFile
