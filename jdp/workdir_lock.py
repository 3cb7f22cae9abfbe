"""One run per workdir: an exclusive `fcntl.flock` on WORKDIR/jdp.lock, which holds the holder's host:pid. Process 0
takes it and tells the others the outcome, so every process of a second run stops (WorkdirLocked, exit 2).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import jax

from jdp import distributed as distributed_lib
from jdp import storage
from jdp.errors import FitError, warn

LOCK_NAME = "jdp.lock"
_UNSUPPORTED = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS)


class WorkdirLocked(FitError):
    """Another run holds the workdir, or it cannot hold one (exit 2)."""


@contextlib.contextmanager
def held(workdir: str | Path, timeout_s: float = 120.0) -> Iterator[None]:
    """The workdir's lock for the duration of the block, on every process of the run."""
    workdir = Path(workdir).absolute()
    fd, problem = None, ""
    if jax.process_index() == 0:
        try:
            workdir.mkdir(parents=True, exist_ok=True)
            fd, problem = _acquire(workdir / LOCK_NAME)
        except OSError as e:  # a place no run can be kept (/proc); a full disk is reported as one (exit 6)
            if storage.disk_failure(e):
                raise
            problem = f"workdir {workdir} cannot hold a run ({e.filename}: {e.strerror}); pass another workdir"
    problem = distributed_lib.broadcast("workdir lock", problem, timeout_s)
    if problem:
        raise WorkdirLocked(problem)
    try:
        yield
    finally:
        if fd is not None:
            os.close(fd)  # releases the lock; the file stays (unlinking it would race with a new run opening it)


def _acquire(path: Path) -> tuple[int | None, str]:
    """(descriptor holding the lock, "") or (None, why the run must stop)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        os.close(fd)
        if isinstance(e, BlockingIOError):
            return None, (f"{path.parent} is in use by another run: {path} is locked by {_holder(path)}; wait for "
                          "that run to end or stop it, or use another workdir")
        if e.errno not in _UNSUPPORTED:
            raise
        warn(f"the filesystem refuses locks on {path} ({os.strerror(e.errno)}); going on without protection "
             "against a second run on this workdir")
        return None, ""
    os.ftruncate(fd, 0)
    os.write(fd, f"{socket.gethostname()}:{os.getpid()}\n".encode())
    return fd, ""


def _holder(path: Path) -> str:
    """host:pid written by the holder right after locking (looked at again briefly while empty)."""
    for _ in range(10):
        with contextlib.suppress(OSError):
            text = path.read_text().strip()
            if text:
                return f"process {text} (host:pid)"
        time.sleep(0.05)
    return "a process that has not written its host:pid"
