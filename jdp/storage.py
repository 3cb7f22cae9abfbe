"""The workdir's filesystem: checked writable before a run starts; a failed write (a full disk), or a read failing
for a reason other than its bytes (retried first), is one line naming the path (`DiskError`, exit 6)."""

from __future__ import annotations

import errno
import logging
import math
import os
import re
import shutil
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from jdp.errors import DiskError, UsageError

T = TypeVar("T")

# errno values that mean the storage, not the program, failed.
DISK_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EROFS, errno.EFBIG}
# orbax reports a failed tensorstore write as a ValueError whose text carries the errno: [os_error_code='28']
_OS_ERROR_CODE = re.compile(r"os_error_code='(\d+)'")
_WRITTEN_PATH = re.compile(r'(?:Failed writing|local file): "([^"]+)"')

# errno values of a read that say nothing about the bytes read: not damage, so retried (`read_retrying`), not rejected.
READ_ERRNOS = {errno.EACCES, errno.EPERM, errno.ESTALE, errno.EIO, errno.EAGAIN, errno.EINTR, errno.EBUSY,
               errno.ETIMEDOUT, errno.ENOTCONN, errno.EHOSTDOWN, errno.ECONNRESET, errno.ECONNREFUSED,
               errno.ENETDOWN, errno.ENETUNREACH, errno.EHOSTUNREACH, errno.EMFILE, errno.ENFILE, errno.ENOMEM}
# tensorstore's status codes for those errors, where its text names no errno.
_READ_STATUSES = {"PERMISSION_DENIED": errno.EACCES, "UNAVAILABLE": errno.EAGAIN, "DEADLINE_EXCEEDED": errno.ETIMEDOUT}
_STATUS = re.compile(r"^([A-Z_]+): ")
# `Failed to open: "PATH": Permission denied [os_error_code='13'] [tensorstore_spec=...`, or without the errno
_FAILED_PATH = re.compile(r'"([^"]+)": [^"\[]*\[(?:os_error_code|tensorstore_spec)=')
# A brief failure passes within seconds; a lasting one costs no more before exit 6.
READ_RETRY_DELAYS_S = (0.5, 1.0, 2.0)


def check_writable(workdir: str | Path, flag: str = "--workdir") -> None:
    """Refuse, in one line, a workdir that is a file, lies under a file, or cannot be written; writes nothing."""
    workdir = existing = Path(workdir)
    try:
        while not existing.exists():
            # exists() is False for a link that leads nowhere; mkdir would then fail with FileExistsError.
            if existing.is_symlink():
                raise UsageError(f"workdir {workdir} {_broken_link(existing, workdir)}; pass another {flag} or fix "
                                 "the link")
            existing = existing.parent
    except OSError as e:  # a name past the filesystem's limit (ENAMETOOLONG)
        raise UsageError(f"workdir {workdir} cannot be used ({e.strerror}); pass another {flag}") from None
    if not existing.is_dir():
        where = "is a file, not a directory" if existing == workdir else f"lies under {existing}, which is a file"
        raise UsageError(f"workdir {workdir} {where}; pass another {flag}")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UsageError(f"workdir {workdir} cannot be written ({existing} is read-only to this user); pass "
                         f"another {flag} or make it writable")
    # orbax would write into a file where a directory belongs, and wait forever for its failed save.
    for names, why_not in ((RUN_DIRECTORIES, not_a_directory), (RUN_FILES, not_a_file)):
        for name in names:
            if problem := why_not(workdir / name):
                raise UsageError(f"{workdir / name} {problem}: the run keeps its {name} there; move it away (or "
                                 f"pass another {flag}) and rerun")


def check_output_file(path: Path, example: str) -> None:
    """Refuse, in one line, an output file that cannot be written (`example`: a file name to suggest)."""
    if path.is_dir():
        raise UsageError(f"cannot write {path}: it is a folder; give a file path such as {path / example}")
    if not path.parent.is_dir():
        raise UsageError(f"cannot write {path}: {path.parent} is not an existing folder; make it, or give another "
                         "path")
    if not os.access(path.parent, os.W_OK | os.X_OK):
        raise UsageError(f"cannot write {path}: its folder is read-only; give another path")


# The directories a run makes in its workdir (`trackers`: the tracker loggers' state), and the files it writes.
RUN_DIRECTORIES = ("checkpoints", "tensorboard", "trackers")
RUN_FILES = ("jdp.lock", "run.json", "metrics.jsonl", "config.json", "config_history.jsonl")


def not_a_directory(path: Path) -> str | None:
    """Why `path`, where a directory is made or expected, cannot be one, or None."""
    if path.is_dir():
        return None
    if path.is_symlink():
        return _broken_link(path, path)
    return "is a file" if path.exists() else None


def not_a_file(path: Path) -> str | None:
    """Why `path`, where a file is written, cannot be one, or None."""
    if path.is_dir():
        return "is a directory"
    return _broken_link(path, path) if _loops(path) else None


def _loops(link: Path) -> bool:
    try:
        os.stat(link)
    except OSError as e:
        return e.errno == errno.ELOOP
    return False


def _broken_link(link: Path, workdir: Path) -> str:
    """Why the symbolic link `link` (the workdir or a folder above it) cannot be a directory."""
    where = "is" if link == workdir else f"lies under {link}, which is"
    if _loops(link):
        return f"{where} a symbolic link loop (it leads back to itself)"
    return f"{where} a symbolic link to {os.readlink(link)}, which does not exist"


def disk_failure(error: BaseException) -> tuple[int, str | None] | None:
    """(errno, path) if `error`, or an error it was raised from, is a storage failure (see DISK_ERRNOS)."""
    return _failure(error, DISK_ERRNOS, _WRITTEN_PATH)


def read_failure(error: BaseException) -> tuple[int, str | None] | None:
    """(errno, path) if `error`, or an error it was raised from, is a read failure of READ_ERRNOS."""
    return _failure(error, READ_ERRNOS, _FAILED_PATH)


def _failure(error: BaseException, errnos: set[int], path_pattern: re.Pattern) -> tuple[int, str | None] | None:
    """(errno, path) of the first error in `error`'s chain (an OSError, or tensorstore's text) with one of `errnos`."""
    for cause in _chain(error, unreported=True):
        if isinstance(cause, OSError) and cause.errno in errnos:
            return cause.errno, cause.filename
        text = str(cause)
        code, status = _OS_ERROR_CODE.search(text), _STATUS.match(text)
        found = int(code[1]) if code else _READ_STATUSES.get(status[1]) if status else None
        if found in errnos:
            path = path_pattern.search(text)
            return found, path[1] if path else None
    return None


_QUOTED_PATH = re.compile(r'"(/[^"]+)"')
_ABSOLUTE_PATH = re.compile(r"(/[^\s\"',\[\]]+)")
_ORBAX_TMP = ".orbax-checkpoint-tmp"  # orbax's temporary directory of a save in progress


def lost_directory(error: BaseException, workdir: Path | None = None) -> tuple[Path, str | None] | None:
    """(what is gone, the path written or None) for an ENOENT write in `error`'s chain: with `workdir` (absolute), it or
    its highest missing directory; without (orbax's threads' logs), a path in a missing or orbax's temporary one."""
    for cause in _chain(error, unreported=True):
        if (path := _enoent_path(cause)) is None:
            continue
        if workdir is not None and not workdir.is_dir():
            return workdir, path or None
        gone = Path(path).absolute()
        if workdir is not None and path and gone.is_relative_to(workdir) and not gone.exists():
            while gone.parent != workdir and not gone.parent.exists():  # the highest missing directory below it
                gone = gone.parent
            return gone, path
        # orbax names some files of its temporary directory relative to it ('commit_success.txt')
        if workdir is None and path and (_ORBAX_TMP in path or not Path(path).is_absolute()
                                         or not Path(path).parent.exists()):
            return Path(path), path
    return None


def lost_workdir(error: BaseException, workdir: Path, vanished: Callable[[], Path | None],
                 settle_s: float = 2.0) -> tuple[Path, str | None] | None:
    """What of `workdir` is gone if `error` came of its deletion or move; asked again for up to `settle_s` after an
    ENOENT or an error inside orbax (`rm -r` may not have reached the directories yet)."""
    settles = any(_enoent_path(e) is not None or any("/orbax/" in frame.filename for frame in
                                                     traceback.extract_tb(e.__traceback__)) for e in _chain(error))
    deadline = time.monotonic() + (settle_s if settles else 0.0)
    while True:
        gone = vanished()
        lost = (gone, None) if gone is not None else lost_directory(error, workdir)
        if lost is not None or time.monotonic() >= deadline:
            return lost
        time.sleep(0.1)


def _chain(error: BaseException | None, unreported: bool = False) -> list[BaseException]:
    """`error` and those it was raised from; `unreported`: up to a DiskError (already reported)."""
    chain: list[BaseException] = []
    while error is not None and all(error is not e for e in chain):
        if unreported and isinstance(error, DiskError):
            break
        chain.append(error)
        error = error.__cause__ or error.__context__
    return chain


def _enoent_path(error: BaseException) -> str | None:
    """The path named by an ENOENT `error`, "" for one naming none; None for any other error."""
    text = str(error)
    if isinstance(error, OSError):
        if error.errno != errno.ENOENT and not (error.errno is None and isinstance(error, FileNotFoundError)):
            return None
        if isinstance(error.filename, str):
            return error.filename
        named = _ABSOLUTE_PATH.search(text)
        return named[1].rstrip(".") if named else ""
    if code := _OS_ERROR_CODE.search(text):
        if int(code[1]) != errno.ENOENT:
            return None
        named = _WRITTEN_PATH.search(text) or _QUOTED_PATH.search(text)
        return named[1] if named else ""
    if isinstance(error, ValueError) and "does not exist" in text and (named := _ABSOLUTE_PATH.search(text)):
        return named[1].rstrip(".")
    return None


def lost_error(lost: tuple[Path, str | None], workdir: Path) -> DiskError:
    """The one-line error for `lost` (`lost_directory`, `Checkpointer.vanished`)."""
    gone, path = lost
    written = f"no such file or directory writing {path}" if path and Path(path) != gone else ""
    if gone == workdir:
        return DiskError(f"{gone} was deleted or moved while the run wrote it{f' ({written})' if written else ''}; "
                         "move it back and rerun to resume, or rerun to start afresh")
    return DiskError(f"{workdir} was deleted in part while the run wrote it ({gone} is gone"
                     f"{f': {written}' if written else ''}); rerun to resume from the last checkpoint left, or to "
                     "start afresh if none is")


def read_retrying(read: Callable[[], T], what: Path) -> T:
    """`read()`, retried after each failure that `read_failure` names; a last one is a DiskError naming `what`."""
    for delay in (*READ_RETRY_DELAYS_S, None):
        try:
            return read()
        except Exception as e:
            failure = read_failure(e)
            if failure is None:
                raise
            if delay is None:
                code, path = failure
                raise DiskError(f"cannot read {what}: {os.strerror(code).lower()} ({errno.errorcode.get(code, code)})"
                                f"{f' on {path}' if path else ''}, {len(READ_RETRY_DELAYS_S) + 1} tries over "
                                f"{sum(READ_RETRY_DELAYS_S):g} s; it is left in place, since this error is not about "
                                "its content: make it readable and rerun") from None
        time.sleep(delay)


def describe(failure: tuple[int, str | None], fallback: Path) -> str:
    """`no space left on device writing PATH (12.0 KiB free there)`; `fallback` names the place without a path."""
    code, path = failure
    where = Path(path) if path else fallback
    return f"{os.strerror(code).lower()} writing {where} ({_free(where)} free there)"


def remedy(code: int) -> str:
    """What to do about a storage failure of errno `code` (DISK_ERRNOS) before rerunning."""
    return {errno.EROFS: "make the filesystem writable (it is mounted read-only)",
            errno.EIO: "check the storage (an I/O error: see dmesg)",
            errno.EFBIG: "raise the file size limit (ulimit -f) or use a filesystem that allows larger files",
            errno.EDQUOT: "free space within your quota"}.get(code, "free space")


def disk_error(failure: tuple[int, str | None], workdir: Path, last_checkpoint: int | None) -> DiskError:
    """The one-line error for `failure` (from `disk_failure`) while a run wrote `workdir`."""
    fix = remedy(failure[0])
    kept = (f"the last checkpoint, step {last_checkpoint}, is intact: {fix} and rerun to resume"
            if last_checkpoint is not None else f"no checkpoint was written yet: {fix} and rerun")
    return DiskError(f"{describe(failure, _fullest(workdir))}; {kept}")


def _fullest(workdir: Path) -> Path:
    """Where a failed write that named no path most likely was: the workdir or a run directory, the fullest."""
    def free(path: Path) -> float:
        try:
            return shutil.disk_usage(path).free if path.is_dir() else math.inf
        except OSError:
            return math.inf

    return min([workdir, *(workdir / name for name in RUN_DIRECTORIES)], key=free)  # the first of equals: workdir


def _free(path: Path) -> str:
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        size = float(shutil.disk_usage(path).free)
    except OSError:
        return "unknown space"
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} bytes" if unit == "bytes" else f"{size:.1f} {unit}"
        size /= 1024


def quiet_disk_failures(record: logging.LogRecord) -> bool:
    """A logging filter: drops the tracebacks orbax's threads and asyncio log for a storage failure (jdp reports it)."""
    if record.levelno < logging.ERROR:
        return True
    errors = [record.exc_info[1]] if record.exc_info and record.exc_info[1] is not None else []
    errors.append(Exception(record.getMessage()))
    return not any(disk_failure(e) or lost_directory(e) or read_failure(e) for e in errors)
