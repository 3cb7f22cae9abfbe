"""The workdir's filesystem: checked writable before a run starts, and a full disk or an I/O error while
writing reported as one line naming the path and the free space (`DiskError`, exit 6)."""

from __future__ import annotations

import errno
import logging
import os
import re
import shutil
from pathlib import Path

from jdp.errors import DiskError, UsageError

# errno values that mean the storage, not the program, failed.
DISK_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EROFS, errno.EFBIG}
# orbax reports a failed tensorstore write as a ValueError whose text carries the errno, e.g.
# `... Failed writing: "PATH": Failed to write 733997 bytes to file 12: No space left on device [os_error_code='28']`
_OS_ERROR_CODE = re.compile(r"os_error_code='(\d+)'")
_WRITTEN_PATH = re.compile(r'(?:Failed writing|local file): "([^"]+)"')


def check_writable(workdir: str | Path, flag: str = "--workdir") -> None:
    """Refuse, in one line, a workdir that is a file, lies under a file, or cannot be written; writes nothing."""
    workdir = Path(workdir)
    if workdir.exists() and not workdir.is_dir():
        raise UsageError(f"workdir {workdir} is a file, not a directory; pass another {flag}")
    existing = workdir
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise UsageError(f"workdir {workdir} lies under {existing}, which is a file; pass another {flag}")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UsageError(f"workdir {workdir} cannot be written ({existing} is read-only to this user); pass "
                         f"another {flag} or make it writable")


def disk_failure(error: BaseException) -> tuple[int, str | None] | None:
    """(errno, path) if `error`, or an error it was raised from, is a storage failure (see DISK_ERRNOS)."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno in DISK_ERRNOS:
            return error.errno, error.filename
        code = _OS_ERROR_CODE.search(str(error))
        if code and int(code[1]) in DISK_ERRNOS:
            path = _WRITTEN_PATH.search(str(error))
            return int(code[1]), path[1] if path else None
        error = error.__cause__ or error.__context__
    return None


def describe(failure: tuple[int, str | None], fallback: Path) -> str:
    """`no space left on device writing PATH (12.0 KiB free there)`; `fallback` names the place without a path."""
    code, path = failure
    where = Path(path) if path else fallback
    return f"{os.strerror(code).lower()} writing {where} ({_free(where)} free there)"


def disk_error(failure: tuple[int, str | None], workdir: Path, last_checkpoint: int | None) -> DiskError:
    """The one-line error for `failure` (from `disk_failure`) while a run wrote `workdir`."""
    kept = (f"the last checkpoint, step {last_checkpoint}, is intact: free space and rerun to resume"
            if last_checkpoint is not None else "no checkpoint was written yet: free space and rerun")
    return DiskError(f"{describe(failure, workdir)}; {kept}")


def _free(path: Path) -> str:
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        size, unit = float(shutil.disk_usage(path).free), "bytes"
    except OSError:
        return "unknown space"
    for larger in ("KiB", "MiB", "GiB", "TiB"):
        if size < 1024:
            break
        size, unit = size / 1024, larger
    return f"{size:.0f} bytes" if unit == "bytes" else f"{size:.1f} {unit}"


class QuietDiskFailures(logging.Filter):
    """orbax's background threads log each failed write with a traceback; jdp reports a storage failure
    once, itself, so those records are dropped (any other record passes)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR:
            return True
        if record.exc_info and record.exc_info[1] is not None and disk_failure(record.exc_info[1]):
            return False
        return disk_failure(Exception(record.getMessage())) is None
