"""Run metadata for the run record (run.json, `jdp.record`): versions, devices, flags, git SHA and command line."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import subprocess
import sys
from pathlib import Path

import jax
from jax.sharding import Mesh


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _git_sha() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True,
                             text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def run_metadata(mesh: Mesh) -> dict:
    devices = list(mesh.devices.flat)
    return {
        "versions": {p: _version(p) for p in ("jdp", "jax", "jaxlib", "flax", "optax", "orbax-checkpoint")},
        "python": sys.version.split()[0],
        "host": platform.node(),
        "platform": devices[0].platform,
        "device_kind": devices[0].device_kind,
        "devices": [str(d) for d in devices],
        "process_count": jax.process_count(),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "jax_num_cpu_devices": jax.config.jax_num_cpu_devices,
        "git_sha": _git_sha(),
        "command": sys.argv,
    }
