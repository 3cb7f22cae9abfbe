"""W&B's run files (`run-ID.wandb`), read with wandb's own record definitions: W&B's client buffers, so after a
SIGKILL its files, not what was handed to it, say which steps a resumed segment still has to log."""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

HEADER = struct.pack("<4sHB", b":W&B", 0xBEE1, 0)  # the file's: identity, magic, format version
BLOCK = 32768
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


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


def logged_steps(paths: list[Path]) -> dict[str, int]:
    """The last step with train metrics and the last with eval metrics (`eval_<key>`) in the run files `paths`."""
    last = {"train": -1, "eval": -1}
    for record in (record for path in paths if Path(path).is_file() for record in read_records(path)):
        if record.WhichOneof("record_type") == "history":
            for split in {"eval" if k.startswith("eval_") else "train" for k in items(record.history.item)
                          if not k.startswith("_")}:
                last[split] = max(last[split], record.history.step.num)
    return last
