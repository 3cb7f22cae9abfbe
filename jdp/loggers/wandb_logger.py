"""`jdp.loggers.WandB`: metrics.jsonl's lines into a Weights & Biases run (`pip install "jdp[wandb]"`)."""

from __future__ import annotations

import json
import os
import secrets
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from jdp.errors import UsageError
from jdp.loggers.base import CLOSE_TIMEOUT_S, Tracker, numbers

HEADER = struct.pack("<4sHB", b":W&B", 0xBEE1, 0)  # a run file's: identity, magic, format version
BLOCK = 32768
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


class WandB(Tracker):
    """metrics.jsonl's lines into a W&B run, continued by a rerun (docs/trackers.md). `project`: None =
    `WANDB_PROJECT`, else W&B's default; `init_kwargs` go to `wandb.init` (`mode="offline"`, `entity`, `name`, `tags`,
    `dir`, ...). Its files go to `dir`, else `WANDB_DIR`, else the workdir; its name defaults to the workdir's."""

    name = package = "wandb"

    def __init__(self, project: str | None = None, *, close_timeout_s: float = CLOSE_TIMEOUT_S,
                 **init_kwargs: Any) -> None:
        super().__init__(close_timeout_s=close_timeout_s)
        if project is not None and not isinstance(project, str):  # W&B's own check, at the run's start, names neither
            raise UsageError(f"WandB(project={project!r}) must be a string, or None")
        if key := next((k for k in ("id", "resume", "project", "config", "reinit") if k in init_kwargs), None):
            raise UsageError(f"jdp.loggers.WandB sets wandb.init's {key!r} itself; leave it out")
        self.project, self.init_kwargs = project, init_kwargs

    def _open(self, run_id: str | None) -> str:
        import wandb

        kwargs = dict(self.init_kwargs)
        if self.workdir is not None:
            if "dir" not in kwargs and not os.environ.get("WANDB_DIR"):
                kwargs["dir"] = str(self.workdir)
            kwargs.setdefault("name", self.workdir.name)
        if run_id is None:  # W&B ids are lower-case letters and digits
            # Recorded before wandb.init (which writes its run directory at once): a rerun after a kill keeps this id.
            run_id = secrets.token_hex(4)
            self.state = {"run_id": run_id}
            self._save_state()
        # Its own run beside any the user has open.
        self.run = wandb.init(project=self.project, id=run_id, resume="allow",
                              config=self.params(), reinit="create_new", **kwargs)
        sync_file = str(self.run.settings.sync_file)  # each segment's run file, read by `_logged`
        self.state["files"] = [*(f for f in self.state.get("files", []) if f != sync_file), sync_file]
        return self.run.id

    def _logged(self) -> dict[str, int]:
        # The last steps with train and eval (`eval_<key>`) metrics in the run's files (`run-ID.wandb`), not the last
        # sent: W&B buffers, so a SIGKILL loses steps handed to it.
        if not (files := self.state.get("files")):
            return super()._logged()
        last = {"train": -1, "eval": -1}
        for record in (record for path in map(Path, files) if path.is_file() for record in read_records(path)):
            if record.WhichOneof("record_type") == "history":
                for split in {"eval" if k.startswith("eval_") else "train" for k in items(record.history.item)
                              if not k.startswith("_")}:
                    last[split] = max(last[split], record.history.step.num)
        return last

    def _log(self, split: str, step: int, line: dict[str, Any]) -> None:
        if split == "summary":
            self.run.log({}, commit=True)  # the last step's row first: its values would overwrite the summary's
            self.run.summary.update(numbers(line))
        else:
            self.run.log(numbers(line, "eval_" if split == "eval" else ""), step=step)

    def _close(self, ok: bool) -> None:
        self.run.finish(exit_code=0 if ok else 1)


def read_records(path: Path) -> Iterator[Any]:
    """The `wandb_internal_pb2.Record`s of a W&B run file: a header, then 32 KiB blocks of chunks, each with a 7-byte
    header (CRC, length, type: full, first, middle or last part of a record); one cut short by a kill ends it."""
    from google.protobuf.message import DecodeError
    from wandb.proto import wandb_internal_pb2

    data = Path(path).read_bytes()
    if data[:len(HEADER)] != HEADER:
        raise ValueError(f"{path} is not a W&B run file (or of another format version)")
    pos, parts = len(HEADER), b""
    while pos + 7 <= len(data):
        left = BLOCK - pos % BLOCK
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7]) if left >= 7 else (0, 0, 0)
        if kind == 0:  # a block's padding
            pos += left
            continue
        if pos + 7 + length > len(data):
            return
        parts += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (FULL, LAST):
            try:
                record = wandb_internal_pb2.Record.FromString(parts)
            except DecodeError:
                return
            parts = b""
            yield record


def items(updates: Any) -> dict[str, Any]:
    """A history row's, a config's or a summary's items as {key: value}."""
    return {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in updates}
