"""Orbax checkpoints in WORKDIR/checkpoints: the full train state plus the data position.

Saves are asynchronous (the devices wait only for the device-to-host copy) and atomic (orbax
writes to a temporary directory and renames it when complete), so a kill at any moment leaves
the previous checkpoints usable. Restore falls back past damaged checkpoints with a warning.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import orbax.checkpoint as ocp

from jdp.faults import kill_if_requested
from jdp.storage import QuietDiskFailures

# Orbax logs every save at INFO through absl, and a failed write once per thread with a traceback; jdp reports
# saves, and a full disk (jdp.storage), itself.
logging.getLogger("absl").setLevel(logging.WARNING)
logging.getLogger("absl").addFilter(QuietDiskFailures())


# What a checkpoint holds: 2 = TrainState with the model's RNG state (format 1, before it, had none).
FORMAT = 2


class CheckpointError(RuntimeError):
    """No usable checkpoint where one was expected; the message names the directory and the cause."""


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
        self._manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                         data=ocp.args.JsonSave(data)), force=True)
        kill_if_requested("save", step)

    def wait(self) -> None:
        self._manager.wait_until_finished()

    def restore_latest(self, abstract_state: Any, warn) -> tuple[int, Any, dict[str, int]] | None:
        """The newest checkpoint that restores into `abstract_state` (shapes, dtypes, shardings),
        falling back past damaged ones; None when there is no checkpoint at all."""
        steps = self.steps()
        problems = []
        for step in reversed(steps):
            try:
                data = self._manager.restore(step, args=ocp.args.Composite(data=ocp.args.JsonRestore()))["data"]
                if data.get("format", 1) != FORMAT:
                    raise CheckpointError(
                        f"checkpoint {self.directory / str(step)} has format {data.get('format', 1)}, this jdp reads "
                        f"format {FORMAT} (the model's RNG state was added); resume it with the jdp that wrote it, "
                        "or start afresh in a new workdir")
                restored = self._manager.restore(step, args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(abstract_state)))
            except CheckpointError:
                raise
            except Exception as e:  # noqa: BLE001 - any failure means this checkpoint is unusable
                problem = f"checkpoint {self.directory / str(step)} is unusable: {_first_line(e)}"
                problems.append(problem)
                warn(f"warning: {problem}; trying the previous one")
                continue
            return step, restored["state"], {k: v for k, v in data.items() if k != "format"}
        if problems:
            raise CheckpointError(f"no usable checkpoint in {self.directory}: {problems[0]}; restore the files, "
                                  "or move the directory away to start afresh")
        return None

    def close(self) -> None:
        self._manager.close()


def _first_line(error: Exception) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"[:400]

