"""`python -m jdp.launch --nprocs N [--cpu_devices D] -- python -m jdp.train ARGS`: N local processes, like
`torchrun --standalone`, with torchrun's variables, the coordinator on loopback and each output line prefixed with
the rank (docs/cluster.md, "On one machine"). SIGINT and SIGTERM go to every child. When a child fails, the others
get SIGTERM, then SIGKILL after --grace_s, and the launch exits with the code of the child that failed by itself
(128+N for a signal N); a command that cannot run exits 127 (not found) or 126 (not executable).

--max_restarts N restarts the group after a failure with code 1, 5, 134 or a signal, up to N times (JDP_RESTART=k),
resuming from the workdir's last checkpoint; 2, 3, 4, 6 and 75 end the launch (docs/cluster.md, "Restarts").
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import IO

from jdp.environment import MAX_CPU_DEVICES
from jdp.files import committed_steps, write_atomic
from jdp.metrics import console_may_close
from jdp.preemption import EXIT_PREEMPTED, LAUNCH_FAILURE_FILE

# Variables of other conventions that would take precedence over the launcher's in jdp.distributed.
_CLEARED = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "JAX_LOCAL_DEVICE_IDS",
            "JAX_COORDINATOR_BIND_ADDRESS")
# Exit codes that report another process's failure: jdp.train's 5 (EXIT_DISTRIBUTED: a peer or the coordinator
# is gone) and SIGABRT (JAX's heartbeat, or gloo when a peer's connection breaks mid-collective).
PEER_FAILED = (5, 128 + signal.SIGABRT)
EXIT_CANNOT_EXECUTE, EXIT_NOT_FOUND = 126, 127  # the command after --, as a shell reports it


def free_port() -> int:
    """A TCP port on the loopback interface that nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env(base: dict[str, str], *, rank: int, nprocs: int, port: int, cpu_devices: int, restart: int = 0,
              failure_file: str = "") -> dict[str, str]:
    env = {k: v for k, v in base.items() if k not in _CLEARED}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(nprocs),
               LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(nprocs), PYTHONUNBUFFERED="1",
               JAX_COORDINATOR_BIND_ADDRESS=f"127.0.0.1:{port}", JDP_RESTART=str(restart),
               **{LAUNCH_FAILURE_FILE: failure_file})  # "" (none) where an outer launcher's file was
    if cpu_devices:
        env["JAX_NUM_CPU_DEVICES"] = str(cpu_devices)
        env.setdefault("JAX_PLATFORMS", "cpu")
    return env


def _die_with_parent() -> None:
    """In the child, before exec: SIGKILL when the launcher dies, even by SIGKILL (Linux)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG


def exit_code(returncode: int) -> int:
    """Popen's returncode as a shell would report it: -N (killed by signal N) -> 128+N."""
    return 128 - returncode if returncode < 0 else returncode


def restartable(code: int) -> bool:
    """Whether --max_restarts restarts the group after a child's exit `code` (as exit_code reports it)."""
    return code in (1, 5) or 128 < code <= 128 + 64  # an unexpected error, a peer or start-up failure, a signal


def workdir_of(command: list[str]) -> Path | None:
    """The `--workdir DIR` (or `--workdir=DIR`) of a jdp.train command line, the last one as argparse takes it."""
    found = None
    for i, arg in enumerate(command):
        if arg == "--workdir" and i + 1 < len(command):
            found = command[i + 1]
        elif arg.startswith("--workdir="):
            found = arg.partition("=")[2]
    return Path(found) if found else None


def resumed_from(workdir: Path | None) -> str:
    """Where a restarted group resumes, for the restart's line: the workdir's last committed checkpoint."""
    if workdir is None:
        return "its workdir's last checkpoint (pass --workdir to jdp.launch to see its step here)"
    with contextlib.suppress(OSError):
        if steps := committed_steps(workdir):
            return f"step {max(steps)} (the last committed checkpoint in {workdir})"
    return f"the start (no committed checkpoint in {workdir})"


def first_failure(returncodes: list[int | None], expected: tuple[int | None, ...]) -> tuple[int, int] | None:
    """(rank, returncode) to report, or None: the lowest rank that failed by itself, else the lowest."""
    failed = [(rank, code) for rank, code in enumerate(returncodes) if code not in expected]
    return min(failed, key=lambda failure: exit_code(failure[1]) in PEER_FAILED, default=None)


class Launcher:
    def __init__(self, command: list[str], nprocs: int, *, cpu_devices: int = 0, port: int = 0,
                 grace_s: float = 5.0, max_restarts: int = 0, workdir: Path | None = None) -> None:
        self.command, self.nprocs, self.grace_s = command, nprocs, grace_s
        self.cpu_devices, self._given_port = cpu_devices, port
        self.max_restarts, self.workdir = max_restarts, workdir or workdir_of(command)
        self.children: list[subprocess.Popen] = []
        self._write_lock = threading.Lock()
        self._signals: list[int] = []
        self.attempt = 0  # restarts so far: JDP_RESTART of the children
        self._dir: str | None = None  # the launcher's own files (the failure file)

    def say(self, line: str) -> None:
        with self._write_lock:
            print(f"[launch] {line}", file=sys.stderr, flush=True)

    def _pump(self, rank: int, stream: IO[bytes], sink: IO[str]) -> None:
        for raw in iter(stream.readline, b""):
            line = raw.decode(errors="replace").rstrip("\n")
            with self._write_lock:
                print(f"[{rank}] {line}", file=sink, flush=True)
        stream.close()

    def _failure_file(self) -> str:
        return os.path.join(self._dir, f"failure-{self.attempt}")

    def start(self) -> int | None:
        """Starts every child, or says why the command cannot run, returning 127 (not found) or 126 (not executable)."""
        # `failure`: (rank, exit code) of the failure that stops the group; `_kill_at`: when a second signal's SIGKILL
        self.children, self._pumps, self._kill_at, self.failure = [], [], None, None
        self.port = self._given_port or free_port()  # each group a fresh one: the last group's may linger
        for rank in range(self.nprocs):
            env = child_env(dict(os.environ), rank=rank, nprocs=self.nprocs, port=self.port,
                            cpu_devices=self.cpu_devices, restart=self.attempt, failure_file=self._failure_file())
            try:
                # A session of its own: a terminal's Ctrl-C reaches the child once, through the launcher.
                self.children.append(subprocess.Popen(self.command, env=env, stdout=subprocess.PIPE,
                                                      stderr=subprocess.PIPE, start_new_session=True,
                                                      preexec_fn=_die_with_parent))
            except OSError as e:  # the program is missing or not executable: the same for every rank
                self.stop_all()
                missing = isinstance(e, FileNotFoundError)
                self.say(f"cannot run {self.command[0]}: {e.strerror or e} (errno {e.errno}); " + (
                    "give its path, or a program on PATH" if missing else
                    "make it executable, or run it through its interpreter (-- python script.py)"))
                return EXIT_NOT_FOUND if missing else EXIT_CANNOT_EXECUTE
        for rank, child in enumerate(self.children):
            for stream, sink in ((child.stdout, sys.stdout), (child.stderr, sys.stderr)):
                self._pumps.append(threading.Thread(target=self._pump, args=(rank, stream, sink), daemon=True))
                self._pumps[-1].start()
        pids = ", ".join(f"rank {rank} pid {child.pid}" for rank, child in enumerate(self.children))
        again = f" (restart {self.attempt} of {self.max_restarts})" if self.attempt else ""
        self.say(f"{self.nprocs} processes{again}, coordinator 127.0.0.1:{self.port} (loopback only): {pids}")
        if self._signals:  # a signal to the launcher while it was starting them: theirs too
            self._signal_all(self._signals[-1])

    def _signal_all(self, signum: int) -> None:
        for child in self.children:
            if child.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(child.pid, signum)  # the child's whole group: also what a wrapper script started

    def _on_signal(self, signum: int, _frame: object) -> None:
        self._signals.append(signum)
        self._signal_all(signum)
        if len(self._signals) == 2:  # a child blocked in a collective cannot act on a signal: force it
            self.say(f"second signal: children still running after {self.grace_s:g} s get SIGKILL")
            self._kill_at = time.monotonic() + self.grace_s

    def stop_all(self) -> None:
        """SIGTERM to every child still running, SIGKILL to those left after the grace period."""
        self._signal_all(signal.SIGTERM)
        deadline = time.monotonic() + self.grace_s
        while time.monotonic() < deadline and any(c.poll() is None for c in self.children):
            time.sleep(0.05)
        self._signal_all(signal.SIGKILL)
        for child in self.children:
            child.wait()

    def wait(self) -> int:
        """Until every child has exited; stops the rest as soon as one fails. Returns the exit code."""
        try:
            while True:
                codes = [child.poll() for child in self.children]
                # After a forwarded SIGINT/SIGTERM, exit code 75 (checkpointed) is the expected way out.
                expected = (None, 0, EXIT_PREEMPTED) if self._signals else (None, 0)
                failed = first_failure(codes, expected)
                if failed is not None:
                    rank, code = self.failure = failed[0], exit_code(failed[1])
                    self.say(f"rank {rank} exited with code {code}; stopping the others")
                    # Before the others get their SIGTERM: a jdp child then exits 5 (a peer failed), not 75.
                    with contextlib.suppress(OSError):
                        write_atomic(Path(self._failure_file()), f"rank {rank} exited with code {code}\n")
                    self.stop_all()
                    self.say("exit codes: " + ", ".join(f"rank {r} {exit_code(c.returncode)}"
                                                        for r, c in enumerate(self.children)))
                    return code
                if all(code is not None for code in codes):
                    return next((exit_code(code) for code in codes if code), 0)
                if self._kill_at is not None and time.monotonic() > self._kill_at:
                    self._signal_all(signal.SIGKILL)
                time.sleep(0.05)
        finally:
            self.stop_all()  # any child left running, e.g. after a KeyboardInterrupt in the launcher
            deadline = time.monotonic() + 2.0  # let the output threads pass on what the children wrote last
            for pump in self._pumps:
                pump.join(timeout=max(0.0, deadline - time.monotonic()))

    def restart(self) -> bool:
        """After the group ended: whether to start it again (--max_restarts), saying why in one line."""
        if self.failure is None or self._signals or not self.max_restarts:
            return False  # done, preempted through the launcher, or no restarts asked for
        rank, code = self.failure
        if code == EXIT_PREEMPTED:
            self.say(f"rank {rank} was preempted (exit code {code}): passing it on, not restarting")
            return False
        if not restartable(code):
            self.say(f"rank {rank}'s exit code {code} is not one a restart cures (1, 5, 134 or a signal); not "
                     f"restarting, exiting with code {code}")
            return False
        if self.attempt >= self.max_restarts:
            self.say(f"rank {rank} exited with code {code} and --max_restarts {self.max_restarts} is spent; exiting "
                     f"with code {code}")
            return False
        self.attempt += 1
        self.say(f"restart {self.attempt} of {self.max_restarts}: rank {rank} exited with code {code}; starting the "
                 f"{self.nprocs} processes again, resuming from {resumed_from(self.workdir)}")
        return True

    def run(self) -> int:
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            with tempfile.TemporaryDirectory(prefix="jdp-launch-", ignore_cleanup_errors=True) as self._dir:
                while True:
                    code = self.start() or self.wait()
                    if not self.restart():
                        return code
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jdp.launch", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nprocs", type=int, required=True, help="number of local processes")
    parser.add_argument("--cpu_devices", type=int, default=0, help="simulated CPU devices per process (0 = leave "
                                                                   "JAX alone)")
    parser.add_argument("--port", type=int, default=0, help="coordinator port (default: a free one)")
    parser.add_argument("--grace_s", type=float, default=5.0,
                        help="after a failure, seconds between SIGTERM and SIGKILL for the others")
    parser.add_argument("--max_restarts", type=int, default=0,
                        help="when a process fails (exit 1, 5, 134 or a signal), stop the others and start the "
                             "group again, resuming from the last checkpoint, up to this many times (torchrun's "
                             "--max-restarts)")
    parser.add_argument("--workdir", type=Path, help="the run's workdir, whose last checkpoint each restart's line "
                                                     "names (default: the command's --workdir)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command each process runs")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command; e.g. python -m jdp.launch --nprocs 2 -- python -m jdp.train")
    if args.nprocs < 1 or not 0 <= args.cpu_devices <= MAX_CPU_DEVICES:
        parser.error(f"--nprocs must be at least 1 and --cpu_devices in 0..{MAX_CPU_DEVICES}")
    if args.max_restarts < 0:
        parser.error(f"--max_restarts {args.max_restarts} must not be negative")
    if not 0 <= args.port <= 65535 or not 0 <= args.grace_s < math.inf:  # a port each child failed on at its start
        parser.error(f"--port {args.port} must be in 0..65535 (0: a free one) and --grace_s {args.grace_s} a "
                     "non-negative number of seconds")
    with console_may_close():  # a pump that died at a closed pipe (| head) would leave its child blocked for ever
        return Launcher(command, args.nprocs, cpu_devices=args.cpu_devices, port=args.port, grace_s=args.grace_s,
                        max_restarts=args.max_restarts, workdir=args.workdir).run()

