"""Orbax checkpoints in WORKDIR/checkpoints: the train state, the data position, leaf digests (`jdp.digest`) and the
run's settings' fingerprint (`jdp.guard`); restore falls back past damaged checkpoints (docs/checkpoints.md).
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
from jdp.faults import inject
from jdp.workdir_lock import LOCK_NAME

# jdp reports saves and a full disk itself: orbax's INFO lines and per-thread tracebacks are dropped.
logging.getLogger("absl").setLevel(logging.WARNING)
_UNREADABLE_METADATA = ("Metadata file does not exist", "Failed to read Metadata file",
                        "Failed to json parse Metadata file")


def _quiet_orbax(record: logging.LogRecord) -> bool:
    """Drops orbax's lines that only alarm (its step metadata, which jdp does not read; the wait for a previous save,
    reported as the checkpoint stall), and its warnings once the workdir is gone (jdp says so once)."""
    if record.levelno >= logging.WARNING and (_VANISHED or any(c.vanished() for c in list(_OPEN))):
        return False
    message = str(record.msg)
    if message.startswith(("Provided metadata contains unknown key", "Waiting for previous save to complete",
                           "Attempted to create temporary directory")):  # a save a kill cut short: orbax redoes it
        return False
    return not (message.startswith(_UNREADABLE_METADATA) and isinstance(record.args, tuple) and record.args
                and Path(str(record.args[0])).name == "_CHECKPOINT_METADATA")


_OPEN: weakref.WeakSet[Checkpointer] = weakref.WeakSet()  # the Checkpointers not closed yet
_VANISHED: list[Path] = []  # what `Checkpointer.vanished` found gone: quiets what orbax logs after the close too
for _logger in ("absl", "asyncio"):
    logging.getLogger(_logger).addFilter(storage.quiet_disk_failures)
    logging.getLogger(_logger).addFilter(_quiet_orbax)


def _quiet_abandoned_reads(unraisable: Any, previous: Callable[[Any], None] = sys.unraisablehook) -> None:
    """sys.unraisablehook that drops what orbax leaves behind when it gives up at a failed leaf and closes its event
    loop (tensorstore callbacks finding the loop closed, coroutines closed mid-read); jdp reports the failure once."""
    error = unraisable.exc_value
    late = (isinstance(error, RuntimeError) and str(error) == "Event loop is closed"
            and any(f.name == "call_soon_threadsafe" for f in traceback.extract_tb(unraisable.exc_traceback)))
    closed = inspect.iscoroutine(unraisable.object) and isinstance(error.__cause__ or error.__context__, GeneratorExit)
    if not (late or closed):
        previous(unraisable)


sys.unraisablehook = _quiet_abandoned_reads


# 2 = TrainState with the model's RNG state. Within format 2, digests and then the data item's checksum were added.
FORMAT = 2
_UNSEALED_KEYS = {"step", "epoch", "format", "digests"}
_NOT_POSITION = ("format", "digests", "fingerprint", "checksum")  # what a data item holds beside the data position
REJECTED = "rejected"  # WORKDIR/rejected: checkpoints that failed their integrity check


class CheckpointError(FitError):
    """No usable checkpoint where one was expected, or one that does not fit the model (exit 2)."""


class _DataHandler(ocp.handlers.JsonCheckpointHandler):
    """orbax's JSON item, whose value may be a function called on the save thread (the digests, so that hashing does
    not stall training); orbax has no public hook for this."""

    async def _save_fn(self, x: Any, directory: Any) -> None:
        await super()._save_fn(x() if callable(x) else x, directory)


@ocp.args.register_with_handler(_DataHandler, for_save=True, for_restore=True)
@dataclasses.dataclass
class _Data(ocp.args.CheckpointArgs):
    item: Any = None  # to save: a JSON-able dict, or a function returning one


def _int_keys(tree: Any) -> Any:
    """orbax's "0", "1", ... keys of a list node back to ints, as the model's pure dicts have them."""
    if not isinstance(tree, dict):
        return tree
    return {int(k) if isinstance(k, str) and k.isdigit() else k: _int_keys(v) for k, v in tree.items()}


def read_arrays(directory: Path, step: int | None = None) -> tuple[int, dict[str, Any]]:
    """The latest (or `step`'s) checkpoint in `directory` as numpy arrays, read-only."""
    directory = directory.absolute()
    with ocp.CheckpointManager(directory, item_handlers={"state": ocp.PyTreeCheckpointHandler(),
                                                         "data": _DataHandler()},
                               options=ocp.CheckpointManagerOptions(create=False)) as reader:
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
    problem = problem or _data_problem(directory, step, restored["data"])
    if problem is None:
        arrays = _int_keys(jax.tree.map(np.asarray, dict(restored["state"])))
        if (digests := restored["data"].get("digests")) is not None:
            model_part = {k: arrays[k] for k in ("params", "model_state", "rng_state")}
            problem = (digest.layout_disagreement(digests, digest.stored_layout(tree))
                       or digest.mismatch(digests, model_part))
        problem = problem or _step_problem(step, int(arrays["step"]))
    if problem is not None:
        raise CheckpointError(f"checkpoint {directory / str(step)} is unusable: {problem}")
    return step, arrays


def _data_problem(directory: Path, step: int, data: Any) -> str | None:
    """What shows checkpoint `step`'s data item damaged, or None; CheckpointError for another format."""
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
    """The line for a checkpoint holding another step than its directory's name, or None."""
    if held == step:
        return None
    return (f"it holds step {held}, not step {step} as its directory's name says: a checkpoint copied or renamed "
            "from another step")


def _read(read: Callable[[], Any], where: Path) -> tuple[Any, str | None]:
    """(read(), None), or (None, the line) for a failure to read that is damage."""
    try:
        return storage.read_retrying(read, where), None
    except DiskError:
        raise
    except Exception as e:  # noqa: BLE001 - any other failure to read means the checkpoint is damaged
        # orbax wraps an array's failed read in a bare Exception; tensorstore's error inside names the file.
        while type(e) is Exception and e.__cause__ is not None:
            e = e.__cause__
        return None, one_line(e)


def _as_saved(abstract_state: Any, per_device: Any, digests: dict) -> tuple[Any, set[str]]:
    """`abstract_state` with each per-device leaf saved on another device count at its saved shape, and their paths."""
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
        self._manager = ocp.CheckpointManager(self.directory, options=ocp.CheckpointManagerOptions(max_to_keep=keep))
        # The lock file goes first when `rm -r` meets files that orbax is still writing.
        watched = (self.directory.parent, self.directory, self.directory.parent / LOCK_NAME)
        self._identity = {path: _identity(path) for path in watched}
        _OPEN.add(self)
        _VANISHED.clear()  # a new run: what an earlier one's orbax threads log is no longer quieted

    def steps(self) -> list[int]:
        """The committed steps, ascending (orbax also lists a multi-process save still under its temporary name)."""
        return sorted(step for step in self._manager.all_steps() if (self.directory / str(step)).is_dir())

    def vanished(self) -> Path | None:
        """The workdir, checkpoints dir or lock file if deleted or moved since the start (orbax remakes it), or None."""
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
        digests = digest.pending(state, host=jax.process_index() == 0)

        def with_digests() -> dict:
            leaves = digests()
            return digest.sealed({**data, "digests": leaves} if leaves is not None else data)

        self._manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                         data=_Data(with_digests)), force=True)
        inject("save", step)

    def wait(self) -> None:
        self._manager.wait_until_finished()

    def restore_latest(self, abstract_state: Any, warn: Callable[[str], None] | None = None, *,
                       reject_damaged: bool = True, per_device: Any = None,
                       check: Callable[[int, dict], None] | None = None) -> tuple[int, Any, dict[str, int]] | None:
        """(step, state, data position) of the newest intact checkpoint, restored into `abstract_state`; None when
        there is none at all (none intact: CheckpointError). Every process calls this together.
        `reject_damaged`: move damaged ones newer than it to WORKDIR/rejected. `warn`: takes each warning line.
        `per_device` (bools like the state): leaves saved one row per device, None when saved on another device
        count. `check(step, data item)` runs on each intact data item before its arrays are read."""
        warn = warn or (errors.warn if jax.process_index() == 0 else lambda line: None)
        inject("restore")
        # Entries named as a step that are not a directory: orbax skips them, then fails to save those steps.
        found = {int(p.name): storage.not_a_directory(p) for p in self.directory.glob("*") if p.name.isdigit()}
        not_checkpoints = sorted(step for step, problem in found.items() if problem)
        for step in not_checkpoints:
            warn(f"checkpoint {self.directory / str(step)} is unusable: {found[step].removeprefix('is ')} stands "
                 f"where its directory belongs; {'moving it aside' if reject_damaged else 'skipping it'}")
        self._reject(not_checkpoints if reject_damaged else [], warn)
        problems = {}  # {step: the line} of the damaged (one that no longer fits the model raised CheckpointError)
        for step in reversed(self.steps()):
            state, data, problem = self._restore(step, abstract_state, per_device, check)
            if problem is None:
                self._reject(list(problems) if reject_damaged else [], warn)
                return step, state, {k: v for k, v in data.items() if k not in _NOT_POSITION}
            problems[step] = f"checkpoint {self.directory / str(step)} is unusable: {problem}"
            warn(f"{problems[step]}; trying the previous one")
        if problems:
            raise CheckpointError(f"no usable checkpoint in {self.directory}: {next(iter(problems.values()))}; "
                                  "restore the files, or move the directory away to start afresh")
        return None

    def _restore(self, step: int, abstract_state: Any, per_device: Any,
                 check: Callable[[int, dict], None] | None) -> tuple[Any, dict | None, str | None]:
        """(state, data item, None), or (None, data item or None, what is wrong with checkpoint `step`)."""
        where = self.directory / str(step)
        data, problem = _read(lambda: self._manager.restore(step, args=ocp.args.Composite(
            data=_Data()))["data"], where)
        problem = problem or _data_problem(self.directory, step, data)
        if problem is None and check is not None:
            check(step, data)
        if problem is None:
            metadata, problem = _read(lambda: ocp.StandardCheckpointHandler().metadata(where / "state"), where)
        digests = None if problem else data.get("digests")
        if digests is not None:
            problem = digest.layout_disagreement(digests, digest.stored_layout(metadata))
        if problem is not None:
            return None, data, problem
        # Where no digests say what was saved, orbax's metadata does: a config change is told from damage.
        layout = digests if digests is not None else digest.stored_layout(metadata, abstract_state)
        resized = set()
        if per_device is not None:
            abstract_state, resized = _as_saved(abstract_state, per_device, layout)
        # Leaves, dtypes and shapes that differ from the model's are a config change (exit 2), not damage.
        if difference := digest.layout_difference(layout, abstract_state):
            raise CheckpointError(
                f"checkpoint {where} does not fit this model ({difference}); the model or "
                "optimizer settings changed: resume with the settings that wrote it, or use a new workdir")
        # A field of the state that is empty here and missing on disk (an older TrainState.sync) stays empty.
        missing = {k: v for k, v in abstract_state._asdict().items() if k not in metadata.keys() and v == {}}
        target = {k: v for k, v in abstract_state._asdict().items() if k not in missing}
        state, problem = _read(lambda: type(abstract_state)(**self._manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(target)))["state"], **missing), where)
        if problem is None:
            held = state.step.addressable_data(0) if hasattr(state.step, "addressable_data") else state.step
            problem = ((digest.mismatch(digests, state) if digests is not None else None)
                       or _step_problem(step, int(np.asarray(held))))
        if resized and not problem:
            state = jax.tree_util.tree_map_with_path(lambda path, x: None if jax.tree_util.keystr(path) in resized
                                                     else x, state)
        return (None if problem else state), data, problem

    def _reject(self, steps: list[int], warn, timeout_s: float = 120.0) -> None:
        """Moves damaged checkpoints aside (process 0, after every process read them), so those steps are saved anew."""
        if not steps:
            return
        distributed_lib.barrier("damaged checkpoints read", timeout_s)
        rejected = self.directory.parent / REJECTED
        if jax.process_index() == 0:
            for step in steps:
                checkpoint, target, n = self.directory / str(step), rejected / str(step), 1
                while os.path.lexists(target):  # a link moved aside before counts, even one that leads nowhere
                    target, n = rejected / f"{step}.{n}", n + 1
                try:
                    rejected.mkdir(exist_ok=True)
                    checkpoint.rename(target)
                except OSError as e:
                    raise DiskError(f"cannot move the damaged checkpoint {checkpoint} to {target} ({one_line(e)}); "
                                    "move it away and rerun") from None
                warn(f"moved the damaged checkpoint {checkpoint} to {target}")
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

