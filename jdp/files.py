"""Whole-file rewrites that a crash or a concurrent reader never sees half done (a temporary file beside the target,
fsynced and renamed over it), and where generated datasets are kept between runs (`cache_dir()`)."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path


def write_atomic(path: Path, content: str | bytes) -> None:
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb" if isinstance(content, bytes) else "w") as f:
            f.write(content)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        if e.filename is None:  # a buffered write's error names no file (a full disk): name it
            e.filename = str(tmp)
        raise
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
    with contextlib.suppress(OSError):  # the rename made durable, where the filesystem allows opening a directory
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def cache_dir() -> Path:
    """Where generated datasets are kept between runs: $JDP_CACHE_DIR, else ~/.cache/jdp."""
    return Path(os.environ.get("JDP_CACHE_DIR") or Path.home() / ".cache" / "jdp")


def write_atomically(path: Path, data: bytes) -> None:
    """`write_atomic` into a folder made if needed; a failure only means the next process makes the data again."""
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, data)


def committed_steps(workdir: Path) -> list[int]:
    """The steps of WORKDIR/checkpoints that orbax committed, ascending."""
    return sorted(int(p.name) for p in (Path(workdir) / "checkpoints").glob("*") if p.name.isdigit() and p.is_dir())
