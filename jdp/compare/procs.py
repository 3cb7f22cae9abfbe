"""Child processes with a time limit and their peak memory."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]  # for `configs`, which jdp's saved-config loader imports


@dataclasses.dataclass
class Finished:
    seconds: float
    peak_rss_mib: float  # ru_maxrss of the child itself (not of its own children)
    launch_time: float  # time.time() just before the start


class SideFailed(RuntimeError):
    pass


def child_env(drop: tuple[str, ...] = ()) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), *filter(None, [env.get("PYTHONPATH")])])
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def run(args: list[str], what: str, *, log: Path, timeout_s: float, env: dict[str, str] | None = None) -> Finished:
    """`python -m ...` in its own session with stdout+stderr to `log`, stopped at `timeout_s`. Peak memory from
    os.wait4, so it is this child's alone. ValueError when the child (`what`) refused its config in jdp's one line,
    else SideFailed when it failed."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as out:
        launch, t0 = time.time(), time.monotonic()
        proc = subprocess.Popen([sys.executable, *args], stdout=out, stderr=subprocess.STDOUT,
                                env=env or child_env(), start_new_session=True)
        while not (waited := os.wait4(proc.pid, os.WNOHANG))[0] and time.monotonic() < t0 + timeout_s:
            time.sleep(0.05)
    timed_out = not waited[0]
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # the child at the time limit, and its own children's leftovers
    _, status, usage = os.wait4(proc.pid, 0) if timed_out else waited
    proc.returncode = 124 if timed_out else os.waitstatus_to_exitcode(status)  # reaped: Popen need not wait
    seconds = time.monotonic() - t0
    if proc.returncode == 0:
        return Finished(seconds, usage.ru_maxrss / 1024, launch)
    lines = log.read_text(errors="replace").splitlines()
    if proc.returncode == 2 and lines and lines[-1].startswith("jdp: error: "):  # jdp_side's refusal
        raise ValueError(f"{what} refused the config: {lines[-1].removeprefix('jdp: error: ')}")
    why = f"ran past its time limit ({seconds:.0f} s)" if proc.returncode == 124 else f"exited {proc.returncode}"
    raise SideFailed(f"{what} {why}; log {log}:\n" + "\n".join(lines[-25:]))
