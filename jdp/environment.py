"""The variables JAX and XLA read at start-up, checked before JAX is imported (no JAX here), so that a bad value is
one line, not JAX's import-time traceback or XLA's C++ abort (hence XLA_FLAGS is tried in a child process).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Mapping
from typing import Any

from jdp.errors import UsageError

# The most simulated CPU devices: XLA sets each up at start, where no signal stops it (1024 take 3 s and 280 MB).
MAX_CPU_DEVICES = 1024

# The flags jdp itself adds to XLA_FLAGS, always with values XLA reads: they need no probe.
_JDP_FLAGS = re.compile(r"--(xla_gpu_enable_latency_hiding_scheduler=(true|false)|"
                        r"xla_gpu_all_reduce_combine_threshold_bytes=\d+|xla_cpu_multi_thread_eigen=false)")
# Building compile options makes XLA parse XLA_FLAGS without starting any backend.
_PROBE = "import jaxlib._jax as xla; xla.CompileOptions()"
PROBE_TIMEOUT_S = 60.0
_UNKNOWN = re.compile(r"Unknown flags? in XLA_FLAGS: (.+)")
_BAD_VALUE = re.compile(r"Couldn't interpret value (.*) for flag (\S+?)\.")
_NOT_A_FLAG = re.compile(r'Could not open file "(.*)" to read flags')
_FATAL = re.compile(r"^[FE]\d{4} [\d:.]+ +\d+ \S+\] (.+)$", re.MULTILINE)  # an XLA log line's message
_accepted: set[str] = set()  # XLA_FLAGS values a probe of this process found readable


class BadEnvironment(UsageError):
    """A variable that JAX or XLA reads at start-up holds a value they refuse (exit 2): one line naming it."""


def check_environment(env: Mapping[str, str] | None = None) -> None:
    """JAX_NUM_CPU_DEVICES and XLA_FLAGS of `env` (default os.environ), before JAX is imported."""
    env = os.environ if env is None else env
    raw = env.get("JAX_NUM_CPU_DEVICES")  # unset, JAX's -1 (= unset), or 1 to MAX_CPU_DEVICES
    try:
        count = -1 if raw is None else int(raw.strip())
    except ValueError:
        count = None
    if count is None or not (count == -1 or 1 <= count <= MAX_CPU_DEVICES):
        what = (f"is more than the {MAX_CPU_DEVICES} CPU devices jdp simulates" if count and count > MAX_CPU_DEVICES
                else "is not a device count")
        raise BadEnvironment(f"JAX_NUM_CPU_DEVICES={raw!r} {what}; set it to an integer from 1 to "
                             f"{MAX_CPU_DEVICES}, or unset it")
    # XLA_FLAGS tried in a child process; a probe failing for another reason (a timeout) lets the run go on.
    value = env.get("XLA_FLAGS", "")
    if value in _accepted or all(_JDP_FLAGS.fullmatch(flag) for flag in value.split()):  # unset or blank too
        return
    try:
        probe = subprocess.run([sys.executable, "-c", _PROBE], env=dict(env), capture_output=True, text=True,
                               timeout=PROBE_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return
    if probe.returncode == 0:
        _accepted.add(value)
    elif (problem := _problem(probe.stderr)) is not None:
        raise BadEnvironment(f"XLA_FLAGS={value!r}: {problem}")


def _problem(stderr: str) -> str | None:
    """What XLA's log says is wrong with XLA_FLAGS and the fix, or None if the probe failed for another reason."""
    if match := _UNKNOWN.search(stderr):
        flags = match[1].strip()
        return f"XLA does not know {flags} and would abort; remove {'them' if ' ' in flags else 'it'} from XLA_FLAGS"
    if match := _BAD_VALUE.search(stderr):
        return f"XLA cannot read {match[1]!r} as the value of --{match[2]}; fix or remove it in XLA_FLAGS"
    if match := _NOT_A_FLAG.search(stderr):
        return (f"{match[1]!r} does not start with --, so XLA takes it for a file of flags, which it cannot open; "
                "give flags as --name=value")
    fatal = [line for line in _FATAL.findall(stderr) if "XLA_FLAGS" in line or "flag" in line.lower()]
    return f"XLA refuses it ({fatal[0].strip()}); fix or remove it" if fatal else None


def add_xla_flags(flags: dict[str, str]) -> None:
    """Adds each flag=value to XLA_FLAGS unless it sets that flag already, before JAX starts its backends."""
    current = os.environ.get("XLA_FLAGS", "")
    present = {flag.split("=", 1)[0] for flag in current.split()}
    os.environ["XLA_FLAGS"] = " ".join([current, *(f"{k}={v}" for k, v in flags.items() if k not in present)]).strip()


def apply_communication_flags(parallel: Any) -> None:
    """The parallel section's XLA flags for GPUs (a combine threshold of 0 keeps XLA's default)."""
    threshold = parallel.allreduce_combine_threshold_bytes
    add_xla_flags({**({"--xla_gpu_all_reduce_combine_threshold_bytes": str(threshold)} if threshold else {}),
                   "--xla_gpu_enable_latency_hiding_scheduler": str(parallel.latency_hiding_scheduler).lower()})
