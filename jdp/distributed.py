"""Multi-process start-up (docs/cluster.md): this process's place in the job, and `jax.distributed.initialize` with
time limits that end in one clear line instead of a hang or an abort.
"""

from __future__ import annotations

import argparse
import ipaddress
import itertools
import json
import math
import os
import re
import socket
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax

from jdp import kvstore
from jdp.errors import UsageError, one_line
from jdp.nested import flatten
from jdp.preemption import exit_now

# jax aborts about 4 s after its own initialization_timeout: jdp's watchdog speaks first.
JAX_TIMEOUT_MARGIN_S = 10
_SLURM_VARIABLES = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID")
# Words in the errors that a collective or the coordination service raises when a peer has gone.
_PEER_FAILURE_MARKERS = ("gloo", "nccl", "connection closed", "connection reset", "peer", "unavailable",
                         "coordination service", "heartbeat", "barrier", "deadline_exceeded")


class DistributedUsageError(UsageError):
    """Missing or inconsistent start-up settings: a usage error (exit 2), found before anything waits."""


class DistributedFailure(RuntimeError):
    """The processes could not start together, or a peer failed (exit 5)."""


@dataclass(frozen=True)
class Job:
    """This process's place in a multi-process job."""
    coordinator: str | None  # HOST:PORT; None when JAX derives it from SLURM
    num_processes: int
    process_id: int
    local_device_ids: tuple[int, ...] | None
    origin: str  # where the settings came from, for messages
    auto_detect: bool  # let JAX's SLURM detection fill in what jdp left unset

    def describe(self) -> str:
        where = self.coordinator or slurm_coordinator(os.environ) or "the address JAX derives from SLURM"
        return (f"coordinator {where}, expected {self.num_processes} processes, this is process {self.process_id}; "
                f"settings from {self.origin}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The start-up flags; each overrides the corresponding variable of every convention."""
    parser.add_argument("--coordinator", metavar="HOST:PORT",
                        help="address of process 0's coordinator (overrides JAX_COORDINATOR_ADDRESS, "
                             "MASTER_ADDR/MASTER_PORT, SLURM)")
    parser.add_argument("--num_processes", type=int, metavar="N",
                        help="number of processes (overrides JAX_NUM_PROCESSES, WORLD_SIZE, SLURM_NTASKS)")
    parser.add_argument("--process_id", type=int, metavar="I",
                        help="this process's id, 0..N-1 (overrides JAX_PROCESS_ID, RANK, SLURM_PROCID)")


def flags_from_argv(argv: list[str]) -> dict[str, object]:
    """The start-up flags of a jdp.train command line, ignoring every other argument."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    add_arguments(parser)
    return vars(parser.parse_known_args(argv)[0])


def _integer(name: str, raw: object, minimum: int) -> int:
    try:
        value = int(str(raw).strip())
    except ValueError:
        raise DistributedUsageError(f"{name}={raw!r} is not an integer") from None
    if value < minimum:
        raise DistributedUsageError(f"{name}={value} must be at least {minimum}")
    return value


def _address(name: str, raw: str) -> str:
    host, sep, port = raw.strip().rpartition(":")
    if not sep or not host:
        raise DistributedUsageError(f"{name}={raw!r} is not HOST:PORT")
    _port(f"the port in {name}", port)
    return f"{host}:{port.strip()}"


def check_bind_address(raw: str) -> str:
    """`distributed.bind_address` as HOST:PORT, checked in every run (a single process never listens)."""
    return _address("distributed.bind_address", raw)


def _port(name: str, raw: str) -> None:
    if not (raw.strip().isdecimal() and 1 <= int(raw) <= 65535):
        raise DistributedUsageError(f"{name}={raw!r} is not a port number; use an integer in 1-65535")


def _first(*candidates: tuple[str, object | None]) -> tuple[str, object] | None:
    return next(((name, value) for name, value in candidates if value is not None), None)


def resolve(env: Mapping[str, str] | None = None, *, coordinator: str | None = None,
            num_processes: int | None = None, process_id: int | None = None) -> Job | None:
    """This process's Job from the flags and `env` (default os.environ), or None for a single process."""
    env = os.environ if env is None else env
    get = {k: (v if v.strip() else None) for k, v in env.items()}.get
    slurm = all(get(k) is not None for k in _SLURM_VARIABLES)
    master_addr, master_port = get("MASTER_ADDR"), get("MASTER_PORT")

    coord = _first(("--coordinator", coordinator), ("JAX_COORDINATOR_ADDRESS", get("JAX_COORDINATOR_ADDRESS")))
    if coord is None and master_addr and master_port:  # a bad port is named before a half pair below
        _port("MASTER_PORT", master_port)
        coord = ("MASTER_ADDR/MASTER_PORT", f"{master_addr}:{master_port}")
    num = _first(("--num_processes", num_processes), ("JAX_NUM_PROCESSES", get("JAX_NUM_PROCESSES")),
                 ("WORLD_SIZE", get("WORLD_SIZE")))
    pid = _first(("--process_id", process_id), ("JAX_PROCESS_ID", get("JAX_PROCESS_ID")), ("RANK", get("RANK")))

    # Half of one of torchrun's pairs, with no flag or JAX variable for the other half, is a broken launch script.
    pairs = (("MASTER_ADDR", "MASTER_PORT", coord or master_port, "--coordinator HOST:PORT"),
             ("MASTER_PORT", "MASTER_ADDR", coord or master_addr, "--coordinator HOST:PORT"),
             ("RANK", "WORLD_SIZE", num, "--num_processes N"), ("WORLD_SIZE", "RANK", pid, "--process_id I"))
    for present, missing, setting, field in pairs:
        if get(present) is not None and setting is None:
            raise DistributedUsageError(f"{present}={get(present)} is set but {missing} is missing; set {missing} "
                                        f"too, or pass {field}")
    if slurm:
        num = num or ("SLURM_NTASKS", get("SLURM_NTASKS"))
        pid = pid or ("SLURM_PROCID", get("SLURM_PROCID"))
    if coord is None and num is None and pid is None:
        return None

    set_names = [name for name, _ in filter(None, (coord, num, pid))]
    given = f"{' and '.join(set_names)} {'is' if len(set_names) == 1 else 'are'}"
    if num is None:
        raise DistributedUsageError(f"{given} set but the number of processes is missing; set one of "
                                     "--num_processes / JAX_NUM_PROCESSES / WORLD_SIZE")
    count = _integer(num[0], num[1], 1)
    if pid is None and count > 1:
        raise DistributedUsageError(f"{given} set but this process's id is missing; set one of "
                                    "--process_id / JAX_PROCESS_ID / RANK")
    if pid is not None and (rank := _integer(pid[0], pid[1], 0)) >= count:
        raise DistributedUsageError(f"{pid[0]}={rank} is not below {num[0]}={count}: process ids run from 0 to "
                                    f"{count - 1}")
    if count == 1:
        return None
    if coord is None and not slurm:
        raise DistributedUsageError(f"{given} set but the coordinator address is missing; set MASTER_ADDR and "
                                    "MASTER_PORT, or JAX_COORDINATOR_ADDRESS, or pass --coordinator HOST:PORT")
    local_ids = None
    if pid[0] == "RANK" and get("LOCAL_RANK") is not None and get("JAX_LOCAL_DEVICE_IDS") is None:
        local_ids = (_integer("LOCAL_RANK", get("LOCAL_RANK"), 0),)
    auto = coord is None or any(name.startswith("SLURM") for name in set_names)
    origin = ", ".join(set_names + (["SLURM (coordinator)"] if coord is None else []))
    return Job(_address(*coord) if coord else None, count, rank, local_ids, origin, auto)


def slurm_coordinator(env: Mapping[str, str]) -> str | None:
    """HOST:PORT of a SLURM job step's coordinator by JAX's rule (SlurmCluster, jax 0.10); None outside SLURM."""
    if not all(env.get(k) for k in _SLURM_VARIABLES):
        return None
    match = re.match(r"([^,\[]+)(?:\[([^,\-\]]+))?", env["SLURM_STEP_NODELIST"].strip())
    first = match[1] + (match[2] or "") if match else None
    port = env.get("JAX_COORDINATOR_PORT") or (
        str(int(env["SLURM_JOB_ID"]) % 2**12 + 65535 - 2**12 + 1) if env["SLURM_JOB_ID"].strip().isdigit() else None)
    return f"{first}:{port}" if first and port else None


@dataclass(frozen=True)
class Listen:
    """Where process 0's coordinator listens, and why (for the start-up line)."""
    address: str  # HOST:PORT as gRPC takes it ([v6]:PORT)
    reason: str


def listen_address(job: Job, bind_address: str = "", env: Mapping[str, str] | None = None) -> Listen:
    """Where process 0's coordinator listens (docs/cluster.md, "What the coordinator exposes")."""
    env = os.environ if env is None else env
    for name, value in (("distributed.bind_address", bind_address), ("JAX_COORDINATOR_BIND_ADDRESS",
                                                                     env.get("JAX_COORDINATOR_BIND_ADDRESS", ""))):
        if value.strip():
            address = _address(name, value)
            every = address.rpartition(":")[0] in ("0.0.0.0", "::", "[::]")
            return Listen(address, f"every interface, as {name} asks" if every else f"from {name}")
    coordinator = job.coordinator or slurm_coordinator(env)
    if coordinator is None:
        raise DistributedUsageError("the coordinator's address cannot be worked out from SLURM_STEP_NODELIST and "
                                    "SLURM_JOB_ID; pass --coordinator HOST:PORT")
    host, _, port = coordinator.rpartition(":")
    name = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    source = job.origin.split(",")[0] if job.coordinator else "SLURM_STEP_NODELIST"
    try:
        ip, resolved = ipaddress.ip_address(name), False
    except ValueError:
        ip, resolved = _resolve(name, source), True
    listen = f"[{ip}]:{port}" if ip.version == 6 else f"{ip}:{port}"
    if not resolved:
        return Listen(listen, f"the host of the coordinator address, from {source}")
    if not ip.is_loopback:
        return Listen(listen, f"{name}, as this host resolves it")
    if (hosts := _hosts(env) or 1) > 1:
        raise DistributedUsageError(
            f"the coordinator's host {name} resolves to {ip} on process 0's host, a loopback address, but the job "
            f"spans {hosts} hosts, which cannot reach it; set the coordinator address (MASTER_ADDR, --coordinator) "
            f"to an IP address the other hosts reach, or --config.distributed.bind_address=IP:{port}")
    return Listen(listen, f"{name}, as this host resolves it: a loopback address, so only processes on this host "
                          f"can join; if others must, set distributed.bind_address=IP:{port} to an address they reach")


def _resolve(name: str, source: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """The address a coordinator named `name` listens on: the first non-loopback one it resolves to, else the first."""
    try:
        found = [ipaddress.ip_address(info[4][0].split("%")[0])
                 for info in socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)]
    except (OSError, ValueError) as e:
        raise DistributedUsageError(f"the coordinator's host {name} (from {source}) does not resolve "
                                    f"on process 0's host ({one_line(e, typed=False)}); give a name or an IP address "
                                    "every host resolves") from None
    return next((ip for ip in found if not ip.is_loopback), found[0])


def _hosts(env: Mapping[str, str]) -> int | None:
    """How many hosts the job spans, where its variables say (torchrun's, SLURM's); None when they do not."""
    def number(key: str) -> int | None:
        value = env.get(key, "").strip()
        return int(value) if value.isdigit() and int(value) > 0 else None

    world, local = number("WORLD_SIZE"), number("LOCAL_WORLD_SIZE")
    return -(-world // local) if world and local else number("SLURM_STEP_NUM_NODES") or number("SLURM_NNODES")


def initialize(job: Job, *, init_timeout_s: float, heartbeat_timeout_s: float, bind_address: str = "") -> None:
    """`jax.distributed.initialize` for `job`, before JAX touches a device. Not all joined within `init_timeout_s`:
    one line and exit 5 (JAX would abort later, misleadingly). `heartbeat_timeout_s` also bounds the shutdown."""
    for name, value in (("distributed.init_timeout_s", init_timeout_s),
                        ("distributed.heartbeat_timeout_s", heartbeat_timeout_s)):
        if not value > 0:
            raise DistributedUsageError(f"{name}={value} must be positive")
    if bind_address:
        check_bind_address(bind_address)
    # The SLURM address by JAX's rule, given to JAX too: the address bound and the one connected to are one.
    coordinator = job.coordinator or slurm_coordinator(os.environ)
    listen = listen_address(job, bind_address) if job.process_id == 0 else None
    bound = f"; process 0's coordinator listens on {listen.address}" if listen else ""
    if listen is not None:
        print(f"jdp: distributed: process 0's coordinator listens on {listen.address} ({listen.reason})", flush=True)
    message = (f"jdp: distributed: not all {job.num_processes} processes joined within {init_timeout_s:g} s "
               f"({job.describe()}{bound}); start every process with the same coordinator and process count, check "
               "that the coordinator is reachable from every host, or raise distributed.init_timeout_s")
    watchdog = threading.Timer(init_timeout_s, exit_now, args=(message, 5), kwargs={"flush_stdout": True})
    watchdog.daemon = True
    watchdog.start()
    # JAX's preemption notifier would take SIGTERM from jdp's handler; jdp agrees on its own stop step.
    jax.config.update("jax_enable_preemption_service", False)
    try:
        jax.distributed.initialize(
            coordinator_address=coordinator, num_processes=job.num_processes, process_id=job.process_id,
            local_device_ids=list(job.local_device_ids) if job.local_device_ids else None,
            cluster_detection_method=None if job.auto_detect else "deactivate",
            initialization_timeout=math.ceil(init_timeout_s) + JAX_TIMEOUT_MARGIN_S,
            heartbeat_timeout_seconds=math.ceil(heartbeat_timeout_s),
            shutdown_timeout_seconds=math.ceil(heartbeat_timeout_s),
            coordinator_bind_address=listen.address if listen else None)
    except Exception as e:  # noqa: BLE001 - e.g. the coordinator's port is taken, or its address is not this host's
        fix = ("; if that address is not one of this host's, or its port is taken, set "
               "distributed.bind_address=HOST:PORT" if listen else "")
        raise DistributedFailure(f"could not start ({job.describe()}{bound}): {one_line(e, typed=False)}"
                                 f"{fix}") from None
    finally:
        watchdog.cancel()
    if job.process_id == 0:
        print(f"jdp: distributed: all {job.num_processes} processes joined ({job.describe()})", flush=True)


def check_same_run(cfg_dict: dict, workdir: Path, timeout_s: float) -> None:
    """Refuses (exit 2) on all processes a config (but compile_cache_dir), workdir, device count unlike process 0's."""
    client, me = kvstore.client(), jax.process_index()
    if client is None:
        return
    settings = {"config": {k: v for k, v in cfg_dict.items() if k != "compile_cache_dir"},
                "workdir": str(Path(workdir).absolute()), "local_devices": jax.local_device_count()}
    mine = json.dumps(settings, sort_keys=True, default=str)
    client.key_value_set(f"jdp/run/{me}", mine)
    for other in range(1, jax.process_count()) if me == 0 else [0]:
        theirs = _within(timeout_s, f"process {other} did not report its settings", client.blocking_key_value_get,
                         f"jdp/run/{other}")
        index, pair = (other, (mine, theirs)) if me == 0 else (me, (theirs, mine))
        differing = [f"{k}: {a!r} on process 0, {b!r} on process {index}"
                     for k, a, b in differences(*map(json.loads, pair))]
        if differing:
            raise DistributedUsageError(f"process {index} was started with other settings than process 0 "
                                        f"({'; '.join(differing[:5])}); start every process with the same "
                                        "config, overrides and --workdir, on as many devices")


def differences(a: dict, b: dict) -> list[tuple[str, object, object]]:
    """(dotted key, value in a, value in b) for each leaf of two nested dicts that differs (None if absent)."""
    flat_a, flat_b = flatten(a), flatten(b)
    return [(k, flat_a.get(k), flat_b.get(k)) for k in sorted(set(flat_a) | set(flat_b))
            if flat_a.get(k) != flat_b.get(k)]


_sequence = itertools.count()  # every process makes the same calls in the same order: the same key names


def broadcast(name: str, value: str, timeout_s: float) -> str:
    """Process 0's `value` on every process (through the coordinator's key-value store); alone, `value`."""
    client = kvstore.client()
    if client is None:
        return value
    key = f"jdp/broadcast/{name}/{next(_sequence)}"
    if jax.process_index() == 0:
        client.key_value_set(key, value)
        return value
    return _within(timeout_s, f"process 0 did not report {name}", client.blocking_key_value_get, key)


def barrier(name: str, timeout_s: float) -> None:
    """Every process waits here until all have arrived; alone, nothing happens."""
    client = kvstore.client()
    if client is not None:
        _within(timeout_s, f"not every process reached {name}", client.wait_at_barrier,
                f"jdp/barrier/{name}/{next(_sequence)}")


def _within(timeout_s: float, failure: str, wait: Callable[[str, int], Any], key: str) -> Any:
    """`wait(key, timeout_ms)`; an error (a peer went away) is the DistributedFailure `failure within timeout_s`."""
    try:
        return wait(key, int(timeout_s * 1000))
    except Exception as e:  # noqa: BLE001 - the peer went away between joining and here
        raise DistributedFailure(f"{failure} within {timeout_s:g} s: {one_line(e, typed=False)}") from None


class StopAgreement:
    """The step at which every process stops after a SIGTERM or SIGINT reached any of them (alone: at once). The
    first to see one proposes `step + LOOKAHEAD_STEPS`; processes run at most two steps apart, so all learn it."""

    LOOKAHEAD_STEPS = 4
    KEY = "jdp/stop_at_step/"  # a directory: looking it up never raises

    def __init__(self) -> None:
        self._client = kvstore.client()
        self.stop_at: int | None = None

    def should_stop(self, step: int, requested: bool) -> bool:
        """Call once per step on every process; `requested`: this process has seen a signal."""
        if self._client is None:
            return requested
        if requested and self.stop_at is None:  # once known, the agreed step holds: nothing to propose
            try:
                self._client.key_value_set(self.KEY + "step", str(step + self.LOOKAHEAD_STEPS))
            except Exception as e:  # noqa: BLE001 - ALREADY_EXISTS: another process proposed first, its step holds
                if "already" not in str(e).lower():
                    raise
        if self.stop_at is None:
            proposals = self._client.key_value_dir_get(self.KEY)  # [] until a process has seen a signal
            if not proposals:
                return False
            self.stop_at = int(proposals[0][1])
            if step > self.stop_at:
                raise DistributedFailure(f"the processes agreed to stop at step {self.stop_at}, but process "
                                         f"{jax.process_index()} is already at step {step}")
        return step == self.stop_at


def is_peer_failure(error: BaseException) -> bool:
    """True for an error of a multi-process run that says a peer or the coordinator has gone."""
    text = str(error).lower()
    return jax.process_count() > 1 and any(marker in text for marker in _PEER_FAILURE_MARKERS)
