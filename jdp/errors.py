"""The errors jdp reports as one line, and the exit code each maps to in `python -m jdp.train`; its warnings' line."""

import sys

from tqdm import tqdm


def warn(line: str) -> None:
    """`jdp: warning: LINE` on stderr, at once, above a progress bar rather than through it."""
    if sys.stderr is not None:  # None: started with stderr closed (`2>&-`)
        tqdm.write(f"jdp: warning: {line}", file=sys.stderr)
        sys.stderr.flush()


def one_line(error: BaseException, *, typed: bool = True) -> str:
    """`Type: first line of the message`, at most 400 characters (without `typed`: the line, else the type)."""
    line = next(iter(str(error).strip().splitlines()), "")
    return (f"{type(error).__name__}: {line}" if typed else line or type(error).__name__)[:400]


class UsageError(ValueError):
    """Bad input (arguments, config, data, workdir): one line naming what is wrong and the fix (exit 2)."""


class FitError(UsageError):
    """Bad input to `jdp.fit` or `jdp.restore`, found before anything compiles (or a resume that would change the
    run): one line naming it and the fix."""


class NonFiniteLossError(RuntimeError):
    """The loss or gradient was not finite and the run halted, its state from before saved (exit 3)."""


class ReplicaMismatchError(RuntimeError):
    """The replicas' parameters differ (exit 4)."""


class DiskError(RuntimeError):
    """Out of disk or an I/O error writing the workdir, the last checkpoint intact; or a checkpoint that cannot be
    read for a reason other than its content (a permission, a stale handle), left in place (exit 6)."""


class Preempted(RuntimeError):
    """SIGTERM or SIGINT: a checkpoint was written and the run stopped (exit 75)."""
