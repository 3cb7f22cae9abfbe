"""Orbax checkpoints in WORKDIR/checkpoints: the full train state, the data position, a digest of every leaf
(`jdp.digest`) and the fingerprint of the run's settings (`jdp.guard`). Saves are asynchronous and atomic; restore
checks each checkpoint and falls back past damaged ones. What is damage, a config change or an unreadable
checkpoint, and what each leads to: docs/checkpoints.md, "Checkpoints, resume and failures".
"""

from __future__ import annotations

import dataclasses
import errno
import inspect
import logging
import os
import sys
import traceback
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import NamedSharding, PartitionSpec

from jdp import digest, errors, storage
from jdp import distributed as distributed_lib
from jdp.errors import DiskError, FitError, one_line
from jdp.faults import kill_if_requested, signal_if_requested
from jdp.storage import QuietDiskFailures
from jdp.workdir_lock import LOCK_NAME

# Orbax logs every save at INFO through absl, and a failed write once per thread with a traceback; jdp reports
# saves, and a full disk (jdp.storage), itself.
logging.getLogger("absl").setLevel(logging.WARNING)
_UNREADABLE_METADATA = ("Metadata file does not exist", "Failed to read Metadata file",
                        "Failed to json parse Metadata file")


def _quiet_orbax_notes(record: logging.LogRecord) -> bool:
    """Drops orbax's absl lines that only alarm: its step metadata file (`STEP/_CHECKPOINT_METADATA`) missing,
    unreadable or holding unknown keys (jdp reads nothing from it: it names the handlers itself), and `Waiting for
    previous save to complete took ... seconds` (a loaded machine, close checkpoints: jdp reports that time as the
    summary's checkpoint stall, and a failed run's stderr must stay one line)."""
    message = str(record.msg)
    if message.startswith(("Provided metadata contains unknown key", "Waiting for previous save to complete",
                           "Attempted to create temporary directory")):  # a save a kill cut short: orbax redoes it
        return False
    return not (message.startswith(_UNREADABLE_METADATA) and isinstance(record.args, tuple) and record.args
                and Path(str(record.args[0])).name == "_CHECKPOINT_METADATA")


def _quiet_while_vanished(record: logging.LogRecord) -> bool:
    """Drops orbax's warnings and errors once the workdir or its checkpoints directory is gone (a traceback per failed
    write, naming no errno: `No ArrayMetadata found ...`; steps not found): jdp says so once (`vanished`)."""
    return record.levelno < logging.WARNING or not (_VANISHED or any(c.vanished() for c in list(_OPEN)))


_OPEN: weakref.WeakSet[Checkpointer] = weakref.WeakSet()  # the Checkpointers not closed yet
_VANISHED: list[Path] = []  # what `Checkpointer.vanished` found gone (until the next Checkpointer): what orbax
# logs late, once the Checkpointer is closed (a task's exception when it is collected), is quieted too
logging.getLogger("absl").addFilter(_quiet_orbax_notes)
# A failed write again from asyncio, once per write task still running when orbax gave up on the save ("Task
# exception was never retrieved", a traceback each, when the task is collected).
for _logger in ("absl", "asyncio"):
    logging.getLogger(_logger).addFilter(QuietDiskFailures())
    logging.getLogger(_logger).addFilter(_quiet_while_vanished)


class _QuietAbandonedReads:
    """sys.unraisablehook that drops what orbax leaves when it stops awaiting its reads and writes at the first failed
    leaf and closes its event loop: tensorstore callbacks that later find the loop closed (`Event loop is closed`),
    and coroutines closed mid-read that raise (orbax turns GeneratorExit into an Exception). jdp reports the failure
    once; anything else goes to the previous hook."""

    def __init__(self, previous: Callable[[Any], None]) -> None:
        self.previous = previous

    def __call__(self, unraisable: Any) -> None:
        error = unraisable.exc_value
        late = (isinstance(error, RuntimeError) and str(error) == "Event loop is closed"
                and any(f.name == "call_soon_threadsafe" for f in traceback.extract_tb(unraisable.exc_traceback)))
        closed = inspect.iscoroutine(unraisable.object) and isinstance(error.__cause__ or error.__context__,
                                                                        GeneratorExit)
        if not (late or closed):
            self.previous(unraisable)


if not isinstance(sys.unraisablehook, _QuietAbandonedReads):
    sys.unraisablehook = _QuietAbandonedReads(sys.unraisablehook)


# 2 = TrainState with the model's RNG state (format 1 had none). Within format 2 the digests (none: restored unchecked)
# and then the data item's checksum were added: a data item without one holds only _UNSEALED_KEYS unless damaged.
FORMAT = 2
_UNSEALED_KEYS = {"step", "epoch", "format", "digests"}
_NOT_POSITION = ("format", "digests", "fingerprint", "checksum")  # what a data item holds beside the data position
REJECTED = "rejected"  # WORKDIR/rejected: checkpoints that failed their integrity check


class CheckpointError(FitError):
    """No usable checkpoint where one was expected, or one that does not fit the model (exit 2); the message names
    the directory and the cause."""


class _DataHandler(ocp.handlers.JsonCheckpointHandler):
    """orbax's JSON item, whose value may be a function called on the save thread (the digests): hashing before `save`
    would stall training for the state's bytes, and orbax has no public hook for this, so `_save_fn` is overridden."""

    async def _save_fn(self, x: Any, directory: Any) -> None:
        await super()._save_fn(x() if callable(x) else x, directory)


@ocp.args.register_with_handler(_DataHandler, for_save=True, for_restore=True)
@dataclasses.dataclass
class _Data(ocp.args.CheckpointArgs):
    item: Any = None  # to save: a JSON-able dict, or a function returning one


def _int_keys(tree: Any) -> Any:
    """orbax names the entries of a list node (`nnx.List`, `nnx.Sequential` layers) "0", "1", ...: back to ints, as
    the model's pure dicts have them (empty dicts kept)."""
    if not isinstance(tree, dict):
        return tree
    return {int(k) if isinstance(k, str) and k.isdigit() else k: _int_keys(v) for k, v in tree.items()}


def read_arrays(directory: Path, step: int | None = None) -> tuple[int, dict[str, Any]]:
    """The latest (or `step`'s) checkpoint in `directory` as numpy arrays (the optimizer state too), whatever devices
    saved it, without opening it for writing; params, model_state and rng_state are checked against their digests."""
    directory = directory.absolute()
    # orbax's pytree handler takes a restore type per leaf: numpy, not the saving devices' shardings.
    reader = ocp.CheckpointManager(directory, item_handlers={"state": ocp.PyTreeCheckpointHandler(),
                                                             "data": _DataHandler()},
                                   options=ocp.CheckpointManagerOptions(create=False))
    try:
        steps = sorted(reader.all_steps())
        if not steps or (step is not None and step not in steps):
            raise CheckpointError(f"no checkpoint {'' if step is None else f'of step {step} '}in {directory}"
                                  + (f" (it holds steps {', '.join(map(str, steps))})" if steps else ""))
        step = steps[-1] if step is None else step
        tree, problem = _read(lambda: reader.item_metadata(step)["state"].tree, directory / str(step))
        if problem is None:
            as_numpy = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
            restored, problem = _read(lambda: reader.restore(step, args=ocp.args.Composite(
                state=ocp.args.PyTreeRestore(restore_args=as_numpy), data=_Data())), directory / str(step))
    finally:
        reader.close()
    problem = problem or _data_problem(directory, step, restored["data"])
    if problem is None:
        arrays = _int_keys(jax.tree.map(np.asarray, dict(restored["state"])))
        problem = _arrays_problem(restored["data"].get("digests"), digest.stored_layout(tree), arrays)
        problem = problem or _step_problem(step, int(arrays["step"]))
    if problem is not None:
        raise CheckpointError(f"checkpoint {directory / str(step)} is unusable: {problem}")
    return step, arrays


def _arrays_problem(digests: dict | None, stored: dict[str, list], arrays: dict[str, Any]) -> str | None:
    """What shows the arrays read by `read_arrays` damaged (their model parts checked against their digests)."""
    if digests is None:
        return None
    if problem := digest.layout_disagreement(digests, stored):
        return f"{problem} (damaged bytes)"
    model_part = {k: arrays[k] for k in ("params", "model_state", "rng_state")}
    return digest.mismatch(digests, model_part)


def _data_problem(directory: Path, step: int, data: Any) -> str | None:
    """What shows checkpoint `step`'s data item (data position, format, digests) damaged, or None. Raises
    CheckpointError for an intact one of another format."""
    if not isinstance(data, dict):
        return "its data item is not a JSON object (damaged bytes)"
    if digest.seal_broken(data):
        return "its data item (data/metadata) does not match its checksum (damaged bytes)"
    if "checksum" not in data:
        unknown = sorted(set(data) - _UNSEALED_KEYS)
        if unknown:
            return f"its data item holds the key {unknown[0]!r}, which no jdp wrote (damaged bytes)"
        if not isinstance(data.get("digests", {}), dict):
            return "its data item's digests are not a JSON object (damaged bytes)"
        if "format" in data and data["format"] != FORMAT:
            return f"its data item says format {data['format']!r} without a checksum: no jdp wrote that (damaged bytes)"
    if data.get("format", 1) != FORMAT:
        raise CheckpointError(
            f"checkpoint {directory / str(step)} has format {data.get('format', 1)}, this jdp reads "
            f"format {FORMAT} (the model's RNG state was added); resume it with the jdp that wrote it, "
            "or start afresh in a new workdir")
    return _step_problem(step, data.get("step", step))


def _step_problem(step: int, held: Any) -> str | None:
    """The line for a checkpoint holding another step (data position or state's step) than its directory's name."""
    if held == step:
        return None
    return (f"it holds step {held}, not step {step} as its directory's name says: a checkpoint copied or renamed "
            "from another step")


def _read(read: Callable[[], Any], where: Path) -> tuple[Any, str | None]:
    """(read(), None), or (None, the line) for a failure to read that is damage. One that is not about the bytes
    read (a permission, a stale handle) is retried, then raised as DiskError: the checkpoint is left in place."""
    try:
        return storage.read_retrying(read, where), None
    except DiskError:
        raise
    except Exception as e:  # noqa: BLE001 - any other failure to read means the checkpoint is damaged
        # orbax wraps an array's failed read in a bare Exception ending in a method's repr (`See full TensorStore
        # details: <bound method ...>`); tensorstore's error inside names the file and the fault.
        while type(e) is Exception and e.__cause__ is not None:
            e = e.__cause__
        return None, one_line(e)


def _as_saved(abstract_state: Any, per_device: Any, digests: dict) -> tuple[Any, set[str]]:
    """`abstract_state` with each per-device leaf that was saved on another device count at its saved shape
    (replicated, which any count can hold), and the paths of those leaves."""
    resized = set()

    def saved(path: Any, leaf: Any, is_per_device: bool) -> Any:
        name = jax.tree_util.keystr(path)
        shape = digests.get(name, [None, list(leaf.shape)])[1]
        if not is_per_device or list(leaf.shape) == shape:
            return leaf
        resized.add(name)
        return jax.ShapeDtypeStruct(tuple(shape), leaf.dtype,
                                    sharding=NamedSharding(leaf.sharding.mesh, PartitionSpec()))

    return jax.tree_util.tree_map_with_path(saved, abstract_state, per_device), resized


class Checkpointer:
    def __init__(self, directory: Path, *, keep: int, every_steps: int, fingerprint: dict | None = None) -> None:
        """`fingerprint`: what every checkpoint saved carries of the run's settings (`jdp.guard`), in its data item."""
        self.directory = directory.absolute()
        self.every_steps = every_steps
        self.fingerprint = fingerprint
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=True,
                                                 create=True))
        # What a deletion or a move of the workdir (whole or in part) changes; the lock file, held by the run, goes
        # first when `rm -r` meets files that orbax is still writing.
        watched = (self.directory.parent, self.directory, self.directory.parent / LOCK_NAME)
        self._identity = {path: _identity(path) for path in watched}
        _OPEN.add(self)
        _VANISHED.clear()  # a new run: what an earlier one's orbax threads log is no longer quieted

    def steps(self) -> list[int]:
        """The committed steps, ascending: in a multi-process run orbax also lists a save still under its temporary
        name, which no restore can read."""
        return sorted(step for step in self._manager.all_steps() if (self.directory / str(step)).is_dir())

    def vanished(self) -> Path | None:
        """The workdir, its checkpoints directory or its lock file, if deleted or moved since the run began (another
        one, or none, under that name now: orbax would make a new directory and go on saving there), else None."""
        gone = next((path for path, then in self._identity.items() if then is not None and _identity(path) != then),
                    None)
        if gone is not None and not _VANISHED:
            _VANISHED.append(gone)
        return gone

    def save(self, step: int, state: Any, data_position: dict[str, int]) -> None:
        """Starts an asynchronous save; returns once the arrays are copied off the devices."""
        if step in self._manager.all_steps():
            return
        if (gone := self.vanished()) is not None:
            raise FileNotFoundError(errno.ENOENT, "deleted or moved during the run", str(gone))
        data = {**data_position, "format": FORMAT, **({"fingerprint": self.fingerprint} if self.fingerprint else {})}
        # Process 0 writes the JSON item; its digests are completed on the save thread.
        digests = digest.pending(state, host=jax.process_index() == 0)

        def with_digests() -> dict:
            leaves = digests()
            return digest.sealed({**data, "digests": leaves} if leaves is not None else data)

        self._manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                         data=_Data(with_digests)), force=True)
        kill_if_requested("save", step)

    def wait(self) -> None:
        self._manager.wait_until_finished()

    def restore_latest(self, abstract_state: Any, warn: Callable[[str], None] | None = None, *,
                       reject_damaged: bool = True, timeout_s: float = 120.0, per_device: Any = None,
                       check: Callable[[int, dict], None] | None = None) -> tuple[int, Any, dict[str, int]] | None:
        """(step, state, data position) of the newest intact checkpoint, restored into `abstract_state`; None when
        there is no checkpoint at all (none intact: CheckpointError). Every process calls this together.
        `reject_damaged`: move damaged ones newer than it to WORKDIR/rejected. `warn`: takes each warning line
        (default: stderr, process 0). `per_device` (bools like the state): leaves saved one row per device, None
        when saved on another device count (started afresh).
        `check(step, data item)` runs on each intact data item before its arrays are read; what it raises (the
        guard's refusal) stops the restore. An unreadable, not damaged, checkpoint: DiskError, nothing moved."""
        warn = warn or _warn
        signal_if_requested("restore")
        if not_checkpoints := self._not_directories():  # orbax skips them, then fails to save those steps
            for step, problem in not_checkpoints.items():
                warn(f"checkpoint {self.directory / str(step)} is unusable: {problem.removeprefix('is ')} stands "
                     f"where its directory belongs; {'moving it aside' if reject_damaged else 'skipping it'}")
            if reject_damaged:
                self._reject(list(not_checkpoints), warn, timeout_s)
        problems, damaged = [], []
        for step in reversed(self.steps()):
            state, data, problem = self._restore(step, abstract_state, per_device, check)
            if problem is None:
                self._reject(damaged, warn, timeout_s)
                return step, state, {k: v for k, v in data.items() if k not in _NOT_POSITION}
            problem = f"checkpoint {self.directory / str(step)} is unusable: {problem}"
            problems.append(problem)
            warn(f"{problem}; trying the previous one")
            if reject_damaged:  # a checkpoint that no longer fits the model raised CheckpointError: this is damage
                damaged.append(step)
        if problems:
            raise CheckpointError(f"no usable checkpoint in {self.directory}: {problems[0]}; restore the files, "
                                  "or move the directory away to start afresh")
        return None

    def _not_directories(self) -> dict[int, str]:
        """{step: what it is} of the entries named as a step that are not a directory: a file, a symbolic link
        loop, a link to nothing."""
        try:
            entries = [path for path in self.directory.iterdir() if path.name.isdigit()]
        except OSError:
            return {}
        found = {int(path.name): storage.not_a_directory(path) for path in entries}
        return {step: problem for step, problem in sorted(found.items()) if problem}

    def _restore(self, step: int, abstract_state: Any, per_device: Any,
                 check: Callable[[int, dict], None] | None) -> tuple[Any, dict | None, str | None]:
        """(state, data item, None), or what is wrong with checkpoint `step`: (None, data item or None if it is
        unreadable, the problem). Raises CheckpointError for a checkpoint that is intact but does not fit."""
        where = self.directory / str(step)
        data, problem = _read(lambda: self._manager.restore(step, args=ocp.args.Composite(
            data=_Data()))["data"], where)
        problem = problem or _data_problem(self.directory, step, data)
        if problem is None and check is not None:
            check(step, data)
        if problem is None:
            metadata, problem = _read(lambda: ocp.StandardCheckpointHandler().metadata(where / "state"), where)
        if problem is not None:
            return None, data, problem
        state, problem = self._restore_arrays(step, data.get("digests"), metadata, abstract_state, per_device)
        return state, data, problem

    def _restore_arrays(self, step: int, digests: dict | None, metadata: Any, abstract_state: Any,
                        per_device: Any) -> tuple[Any, str | None]:
        """(state, None), or (None, what is wrong with checkpoint `step`'s arrays); `digests` None for a
        checkpoint from before them, `metadata` orbax's of its saved tree."""
        stored = digest.stored_layout(metadata)
        if digests is not None and (problem := digest.layout_disagreement(digests, stored)):
            return None, f"{problem} (damaged bytes)"
        # Where no digests say what was saved, orbax's metadata does: a config change is told from damage.
        layout = digests if digests is not None else digest.as_digest_layout(stored, abstract_state)
        resized = set()
        if per_device is not None:
            abstract_state, resized = _as_saved(abstract_state, per_device, layout)
        # Leaves, dtypes and shapes that differ from the model's are a config change (exit 2), not damage.
        if difference := digest.layout_difference(layout, abstract_state):
            raise CheckpointError(
                f"checkpoint {self.directory / str(step)} does not fit this model ({difference}); the model or "
                "optimizer settings changed: resume with the settings that wrote it, or use a new workdir")
        state, problem = _read(lambda: self._restore_state(step, abstract_state, metadata.keys()),
                               self.directory / str(step))
        if problem is not None:
            return None, problem
        problem = digest.mismatch(digests, state) if digests is not None else None
        held = state.step.addressable_data(0) if hasattr(state.step, "addressable_data") else state.step
        problem = problem or _step_problem(step, int(np.asarray(held)))
        if resized and not problem:
            state = jax.tree_util.tree_map_with_path(lambda path, x: None if jax.tree_util.keystr(path) in resized
                                                     else x, state)
        return (None if problem else state), problem

    def _restore_state(self, step: int, abstract_state: Any, on_disk: Any) -> Any:
        """Checkpoint `step`'s state; `on_disk` the fields its saved tree has."""
        # A checkpoint from before a field of the state that holds nothing here (TrainState.sync under most sync
        # strategies) restores without it, the empty field as it is.
        missing = {k: v for k, v in abstract_state._asdict().items() if k not in on_disk and v == {}}
        target = {k: v for k, v in abstract_state._asdict().items() if k not in missing}
        restored = self._manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(target)))["state"]
        return type(abstract_state)(**restored, **missing)

    def _reject(self, steps: list[int], warn, timeout_s: float) -> None:
        """Moves damaged checkpoints aside (process 0, after every process read them), so those steps are saved anew."""
        if not steps:
            return
        distributed_lib.barrier("damaged checkpoints read", timeout_s)
        if jax.process_index() == 0:
            for step in steps:
                target = _move_aside(self.directory / str(step), self.directory.parent / REJECTED)
                warn(f"moved the damaged checkpoint {self.directory / str(step)} to {target}")
        distributed_lib.barrier("damaged checkpoints moved", timeout_s)
        self._manager.reload()

    def close(self) -> None:
        self._manager.close()
        _OPEN.discard(self)


def _identity(path: Path) -> tuple[int, int] | None:
    """(device, inode) of `path`, or None where there is nothing."""
    try:
        found = os.stat(path)
    except OSError:
        return None
    return found.st_dev, found.st_ino


def _warn(line: str) -> None:
    if jax.process_index() == 0:
        errors.warn(line)


def _move_aside(checkpoint: Path, rejected: Path) -> Path:
    """Renames `checkpoint` into `rejected` (as STEP, or STEP.N where that is taken); returns its new path."""
    target, n = rejected / checkpoint.name, 1
    while os.path.lexists(target):  # a symbolic link moved aside before counts, even one that leads nowhere
        target, n = rejected / f"{checkpoint.name}.{n}", n + 1
    try:
        rejected.mkdir(exist_ok=True)
        checkpoint.rename(target)
    except OSError as e:
        raise DiskError(f"cannot move the damaged checkpoint {checkpoint} to {target} ({one_line(e)}); move it "
                        "away and rerun") from None
    return target
