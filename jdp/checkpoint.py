"""Orbax checkpoints in WORKDIR/checkpoints: the full train state plus the data position and a digest of every leaf.

Saves are asynchronous (the devices wait only for the device-to-host copy) and atomic (orbax writes to a
temporary directory and renames it when complete), so a kill at any moment leaves the previous checkpoints
usable. The digests (`jdp.digest`) are computed on orbax's save thread, before the rename, and checked on
restore. Restore falls back past damaged checkpoints with a warning and moves them to WORKDIR/rejected, so that
the step is saved anew; a checkpoint whose shapes no longer fit the model is a config change, not damage.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from jdp import digest
from jdp import distributed as distributed_lib
from jdp.errors import one_line
from jdp.faults import kill_if_requested, signal_if_requested
from jdp.storage import QuietDiskFailures

# Orbax logs every save at INFO through absl, and a failed write once per thread with a traceback; jdp reports
# saves, and a full disk (jdp.storage), itself.
logging.getLogger("absl").setLevel(logging.WARNING)
logging.getLogger("absl").addFilter(QuietDiskFailures())


# What a checkpoint holds: 2 = TrainState with the model's RNG state (format 1, before it, had none).
# The leaf digests came later, within format 2: a checkpoint without them restores unchecked.
FORMAT = 2
REJECTED = "rejected"  # WORKDIR/rejected: checkpoints that failed their integrity check


class CheckpointError(RuntimeError):
    """No usable checkpoint where one was expected; the message names the directory and the cause."""


class _DataHandler(ocp.handlers.JsonCheckpointHandler):
    """orbax's JSON item, whose value may be a function: it is called on the save thread (the digests). orbax has
    no public hook for a value computed there, and hashing before `save` would stall the training thread for the
    whole state's bytes, so this overrides its `_save_fn`."""

    async def _save_fn(self, x: Any, directory: Any) -> None:
        await super()._save_fn(x() if callable(x) else x, directory)


@ocp.args.register_with_handler(_DataHandler, for_save=True)
@dataclasses.dataclass
class _DataSave(ocp.args.CheckpointArgs):
    item: Any  # a JSON-able dict, or a function returning one


@ocp.args.register_with_handler(_DataHandler, for_restore=True)
@dataclasses.dataclass
class _DataRestore(ocp.args.CheckpointArgs):
    item: Any = None


def _as_dict_path(path: str) -> str:
    """A digest's path in the TrainState (`.params['w']`) as the path in the dict orbax restores (`['params']['w']`)."""
    field, bracket, rest = path[1:].partition("[")
    return f"['{field}']{bracket}{rest}"


def _int_keys(tree: Any) -> Any:
    """orbax names the entries of a list node (`nnx.List`, `nnx.Sequential` layers) "0", "1", ...: back to ints, as
    the model's pure dicts have them (empty dicts kept)."""
    if not isinstance(tree, dict):
        return tree
    return {int(k) if isinstance(k, str) and k.isdigit() else k: _int_keys(v) for k, v in tree.items()}


def read_arrays(directory: Path, step: int | None = None) -> tuple[int, dict[str, Any]]:
    """The latest (or `step`'s) checkpoint in `directory` as the dict of numpy arrays it holds (the optimizer state
    too, without the optimizer that made it), whatever devices saved it, read without opening the directory for
    writing; the model's parts (params, model_state, rng_state) are checked against their digests."""
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
        try:
            tree = reader.item_metadata(step)["state"].tree
            as_numpy = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
            restored = reader.restore(step, args=ocp.args.Composite(
                state=ocp.args.PyTreeRestore(restore_args=as_numpy), data=_DataRestore()))
        except Exception as e:  # noqa: BLE001 - unreadable: say which and why
            raise CheckpointError(f"checkpoint {directory / str(step)} is unusable: {one_line(e)}") from None
    finally:
        reader.close()
    _check_format(directory, step, restored["data"])
    arrays = _int_keys(jax.tree.map(np.asarray, dict(restored["state"])))
    digests = restored["data"].get("digests")
    if digests is not None:
        model_part = {k: arrays[k] for k in ("params", "model_state", "rng_state")}
        problem = digest.mismatch({_as_dict_path(path): v for path, v in digests.items()}, model_part)
        if problem:
            raise CheckpointError(f"checkpoint {directory / str(step)} is unusable: {problem}")
    return step, arrays


def _check_format(directory: Path, step: int, data: dict) -> None:
    if data.get("format", 1) != FORMAT:
        raise CheckpointError(
            f"checkpoint {directory / str(step)} has format {data.get('format', 1)}, this jdp reads "
            f"format {FORMAT} (the model's RNG state was added); resume it with the jdp that wrote it, "
            "or start afresh in a new workdir")


class Checkpointer:
    def __init__(self, directory: Path, *, keep: int, every_steps: int) -> None:
        self.directory = directory.absolute()
        self.every_steps = every_steps
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=True,
                                                 create=True))

    def steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

    def save(self, step: int, state: Any, data_position: dict[str, int]) -> None:
        """Starts an asynchronous save; returns once the arrays are copied off the devices."""
        if step in self._manager.all_steps():
            return
        data = {**data_position, "format": FORMAT}
        # Process 0 writes the JSON item: it fetches the state to the host here (on CPU a view, which JAX keeps alive:
        # it does not donate a buffer that has a view) and hashes it on the save thread.
        host = jax.tree.map(np.asarray, state) if jax.process_index() == 0 else None

        def with_digests() -> dict:
            return {**data, "digests": digest.of_tree(host)} if host is not None else data

        self._manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                         data=_DataSave(with_digests)), force=True)
        kill_if_requested("save", step)

    def wait(self) -> None:
        self._manager.wait_until_finished()

    def restore_latest(self, abstract_state: Any, warn, *, reject_damaged: bool = True, timeout_s: float = 120.0
                       ) -> tuple[int, Any, dict[str, int]] | None:
        """The newest checkpoint that restores into `abstract_state` (shapes, dtypes, shardings) and matches its
        digests, falling back past damaged ones; None when there is no checkpoint at all. With `reject_damaged`,
        damaged checkpoints newer than the one restored are moved to WORKDIR/rejected (every process of the run
        must call this together)."""
        signal_if_requested("restore")
        problems, damaged = [], []
        for step in reversed(self.steps()):
            state, data, problem = self._restore(step, abstract_state)
            if problem is None:
                self._reject(damaged, warn, timeout_s)
                return step, state, {k: v for k, v in data.items() if k not in ("format", "digests")}
            problem = f"checkpoint {self.directory / str(step)} is unusable: {problem}"
            problems.append(problem)
            warn(f"warning: {problem}; trying the previous one")
            if reject_damaged and (data is None or data.get("digests") is not None):  # known to be damage
                damaged.append(step)
        if problems:
            raise CheckpointError(f"no usable checkpoint in {self.directory}: {problems[0]}; restore the files, "
                                  "or move the directory away to start afresh")
        return None

    def _restore(self, step: int, abstract_state: Any) -> tuple[Any, dict | None, str | None]:
        """(state, data item, None), or what is wrong with checkpoint `step`: (None, data item or None if it is
        unreadable, the problem). Raises CheckpointError for a checkpoint that is intact but does not fit."""
        try:
            data = self._manager.restore(step, args=ocp.args.Composite(data=_DataRestore()))["data"]
        except Exception as e:  # noqa: BLE001 - unreadable: damage
            return None, None, one_line(e)
        _check_format(self.directory, step, data)
        digests = data.get("digests")  # absent from checkpoints written before digests: restored unchecked
        if digests is not None:
            self._check_layout(step, digests, abstract_state)
        try:
            state = self._manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract_state)))["state"]
        except Exception as e:  # noqa: BLE001 - any failure means this checkpoint is unusable
            return None, data, one_line(e)
        problem = digest.mismatch(digests, jax.tree.map(np.asarray, state)) if digests is not None else None
        return (None if problem else state), data, problem

    def _check_layout(self, step: int, digests: dict, abstract_state: Any) -> None:
        """Leaves, dtypes and shapes that differ from the model's are a config change (exit 2), not damage."""
        difference = digest.layout_difference(digests, abstract_state)
        if difference:
            raise CheckpointError(
                f"checkpoint {self.directory / str(step)} does not fit this model ({difference}); the model or "
                "optimizer settings changed: resume with the settings that wrote it, or use a new --workdir")

    def _reject(self, steps: list[int], warn, timeout_s: float) -> None:
        """Moves damaged checkpoints aside (process 0, once every process has read them), so that those steps are
        saved anew."""
        if not steps:
            return
        distributed_lib.barrier("damaged checkpoints read", timeout_s)
        if jax.process_index() == 0:
            rejected = self.directory.parent / REJECTED
            rejected.mkdir(exist_ok=True)
            for step in steps:
                target = rejected / str(step)
                n = 1
                while target.exists():
                    target, n = rejected / f"{step}.{n}", n + 1
                (self.directory / str(step)).rename(target)
                warn(f"warning: moved the damaged checkpoint {self.directory / str(step)} to {target}")
        distributed_lib.barrier("damaged checkpoints moved", timeout_s)
        self._manager.reload()

    def close(self) -> None:
        self._manager.close()
