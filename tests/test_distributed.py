"""Multi-process runs on this machine (loopback, free ports, every subprocess time-limited and killed on
failure): 2 processes x 2 simulated CPU devices against 1 x 4, torchrun variables, the launcher, and the
failure modes: missing peer, killed peer, bad variables."""

from __future__ import annotations

import fcntl
import ipaddress
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from jdp import distributed
from jdp.cli import launch
from tests.helpers import MODELS, overrides, train_losses

pytestmark = pytest.mark.slow  # multi-process runs in subprocesses: outside the fast tier

ROOT = Path(__file__).resolve().parents[1]
TRAIN = [sys.executable, "-m", "jdp.train"]
TIMEOUT_S = 5  # init and heartbeat timeouts of the failure tests
ARGS = ["--config", "configs/mnist1d_mlp.py", "--config.model.kwargs.hidden_sizes=(32,)", "--config.optim.name=sgd",
        "--config.optim.lr=0.2", "--config.train.steps=5", "--config.train.log_every=1",
        "--config.parallel.backend=shard_map", "--config.compile_cache_dir=",
        "--config.distributed.init_timeout_s=20", "--config.distributed.heartbeat_timeout_s=10"]
# Anything from the outer environment that would make a child think it is part of some other job.
_JOB_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                  "JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "JAX_LOCAL_DEVICE_IDS",
                  "JAX_COORDINATOR_BIND_ADDRESS", "JAX_COORDINATOR_PORT", "JAX_NUM_CPU_DEVICES", "XLA_FLAGS",
                  "JDP_KILL_AT")


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _JOB_VARIABLES and not k.startswith("SLURM_")}
    env.update(JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1", **extra)
    return env


def run(cmd: list[str], *, timeout: float, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Runs `cmd` in the repo; on timeout it (and, for the launcher, its children) is killed."""
    return subprocess.run(cmd, cwd=ROOT, env=env or clean_env(), capture_output=True, text=True, timeout=timeout)


def start(cmd: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    with open(log, "w") as out:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def finish(procs: list[subprocess.Popen], timeout: float) -> list[int]:
    """Waits for every process until a common deadline; kills all of them if one is late."""
    deadline = time.monotonic() + timeout
    try:
        return [p.wait(timeout=max(0.1, deadline - time.monotonic())) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


def export(workdir: Path, devices: int = 4) -> dict[str, np.ndarray]:
    out = workdir.parent / f"{workdir.name}.npz"
    result = run([sys.executable, "-m", "jdp.export", "--workdir", str(workdir), "--out", str(out)], timeout=90,
                 env=clean_env(JAX_NUM_CPU_DEVICES=str(devices)))
    assert result.returncode == 0, result.stderr
    with np.load(out) as arrays:
        return dict(arrays)


def assert_same_run(a: Path, b: Path) -> None:
    (steps_a, losses_a), (steps_b, losses_b) = zip(*train_losses(a), strict=True), zip(*train_losses(b), strict=True)
    assert steps_a == steps_b
    np.testing.assert_allclose(losses_b, losses_a, rtol=1e-5)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> Path:
    """The reference: 1 process x 4 devices."""
    workdir = tmp_path_factory.mktemp("one") / "run"
    result = run([*TRAIN, *ARGS, "--cpu_devices", "4", "--workdir", str(workdir)], timeout=120)
    assert result.returncode == 0, result.stderr
    return workdir


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """The same run as 2 processes x 2 devices, through the launcher."""
    workdir = tmp_path_factory.mktemp("two") / "run"
    result = run([sys.executable, "-m", "jdp.launch", "--nprocs", "2", "--cpu_devices", "2", "--",
                  *TRAIN, *ARGS, "--workdir", str(workdir)], timeout=150)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return workdir, result


def test_two_processes_match_one(one_process, two_processes):
    workdir, result = two_processes
    assert_same_run(one_process, workdir)
    # Metrics and progress come from process 0 only; every line carries its rank.
    assert "[0] step 5: loss" in result.stdout and "[1] step" not in result.stdout
    assert "[0] jdp: distributed: all 2 processes joined" in result.stdout
    assert all(line[:4] in ("[0] ", "[1] ") for line in result.stdout.splitlines())
    # A checkpoint written by 2 processes restores in 1 process with 4 devices.
    reference, restored = export(one_process), export(workdir)
    assert sorted(reference) == sorted(restored)
    for key in reference:
        np.testing.assert_allclose(restored[key], reference[key], rtol=1e-5, atol=1e-7, err_msg=key)


def test_sharded_parameters_in_two_processes_match_one(one_process, tmp_path):
    """ZeRO-3 over 2 processes x 2 devices trains as plain data parallelism in 1 x 4; each process writes its own
    slices of the checkpoint, whose digests of split leaves are summed on the devices across processes, and it
    exports whole arrays in one process."""
    workdir = tmp_path / "run"
    result = run([sys.executable, "-m", "jdp.launch", "--nprocs", "2", "--cpu_devices", "2", "--",
                  *TRAIN, *ARGS, "--config.parallel.shard_params=True", "--workdir", str(workdir)], timeout=150)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert_same_run(one_process, workdir)
    reference, restored = export(one_process), export(workdir)
    assert sorted(reference) == sorted(restored)
    for key in reference:
        np.testing.assert_allclose(restored[key], reference[key], rtol=1e-5, atol=1e-7, err_msg=key)


def test_tfds_two_processes_match_one(tmp_path):
    """The tfds source end to end: each process reads its rows of the PNG fixture, augments them on its
    devices, and 2 processes x 2 devices train exactly as 1 process x 4 devices."""
    pytest.importorskip("tensorflow_datasets")
    mlp_only = "--config.model.kwargs.hidden_sizes=(32,)"
    tfds_args = [*(a for a in ARGS if a != mlp_only), "--config.train.global_batch_size=16",
                 *overrides(MODELS["tiny_cifar"])]
    one = run([*TRAIN, *tfds_args, "--cpu_devices", "4", "--workdir", str(tmp_path / "one")], timeout=120)
    assert one.returncode == 0, one.stderr[-3000:]
    two = run([sys.executable, "-m", "jdp.launch", "--nprocs", "2", "--cpu_devices", "2", "--",
               *TRAIN, *tfds_args, "--workdir", str(tmp_path / "two")], timeout=150)
    assert two.returncode == 0, two.stdout[-3000:] + two.stderr[-3000:]
    assert_same_run(tmp_path / "one", tmp_path / "two")


def test_torchrun_variables_by_hand(one_process, tmp_path):
    port, workdir = launch.free_port(), tmp_path / "run"
    procs = [start([*TRAIN, *ARGS, "--cpu_devices", "2", "--workdir", str(workdir)],
                   clean_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2"),
                   tmp_path / f"rank{rank}.log") for rank in range(2)]
    codes = finish(procs, timeout=150)
    assert codes == [0, 0], (tmp_path / "rank0.log").read_text()[-3000:]
    assert_same_run(one_process, workdir)


def test_checkpoint_from_two_processes_resumes_in_one(one_process, two_processes, tmp_path):
    """Both 5-step runs, continued to 8 steps in a single process, continue alike."""
    more = [*ARGS, "--config.train.steps=8", "--cpu_devices", "2"]
    resumed = {}
    for name, source in (("one", one_process), ("two", two_processes[0])):
        shutil.copytree(source, tmp_path / name)
        result = run([*TRAIN, *more, "--workdir", str(tmp_path / name)], timeout=120)
        assert result.returncode == 0, result.stderr
        assert f"resumed from {tmp_path / name / 'checkpoints' / '5'}" in result.stdout
        resumed[name] = tmp_path / name
    assert [step for step, _ in train_losses(resumed["two"])] == list(range(1, 9))
    assert_same_run(resumed["one"], resumed["two"])


def test_missing_peer_gives_a_clear_error_in_time(tmp_path):
    port = launch.free_port()
    t0 = time.monotonic()
    result = run([*TRAIN, *ARGS, f"--config.distributed.init_timeout_s={TIMEOUT_S}", "--cpu_devices", "2",
                  "--workdir", str(tmp_path / "run")], timeout=60,
                 env=clean_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="2"))
    elapsed = time.monotonic() - t0
    assert result.returncode == 5, result.stderr[-2000:]
    assert TIMEOUT_S <= elapsed < TIMEOUT_S + 20  # start-up (imports) plus the timeout, never JAX's abort
    message = result.stderr.strip().splitlines()[-1]
    assert message.startswith(f"jdp: distributed: not all 2 processes joined within {TIMEOUT_S} s")
    assert f"coordinator 127.0.0.1:{port}" in message and "this is process 0" in message


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").exists() and Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


def test_killed_peer_stops_the_launcher(tmp_path):
    out = tmp_path / "launch.log"
    cmd = [sys.executable, "-m", "jdp.launch", "--nprocs", "2", "--cpu_devices", "2", "--grace_s", "2", "--",
           *TRAIN, *ARGS, "--config.train.steps=100000", "--config.train.log_every=10",
           "--config.train.eval_every=100000", f"--config.distributed.heartbeat_timeout_s={TIMEOUT_S}",
           "--workdir", str(tmp_path / "run")]
    launcher = start(cmd, clean_env(), out)
    try:
        deadline = time.monotonic() + 120
        while "[0] step 20:" not in out.read_text():
            assert launcher.poll() is None and time.monotonic() < deadline, out.read_text()[-3000:]
            time.sleep(0.2)
        pids = {int(rank): int(pid) for rank, pid in re.findall(r"rank (\d+) pid (\d+)", out.read_text())}
        port = int(re.search(r"coordinator 127\.0\.0\.1:(\d+)", out.read_text())[1])
        listening = listening_addresses(port)  # gRPC's IPv6 socket shows 127.0.0.1 as ::ffff:127.0.0.1
        assert listening and all(_loopback(address) for address in listening), listening  # not [::] nor 0.0.0.0
        t0 = time.monotonic()
        os.kill(pids[1], signal.SIGKILL)
        code = launcher.wait(timeout=30)
        detected_s = time.monotonic() - t0
    finally:
        finish([launcher], timeout=0.1)
    print(f"launcher exited {code} {detected_s:.1f} s after rank 1 was killed")
    assert code == 128 + signal.SIGKILL
    assert detected_s < 10
    assert not any(_alive(pid) for pid in pids.values())
    assert "[launch] rank 1 exited with code 137; stopping the others" in out.read_text()
    # Rank 0, blocked in a collective with the dead rank, exits 5 on the launcher's SIGTERM (or 134 where gloo
    # aborts first): its Python handler never ran, and it waited for the launcher's SIGKILL (137).
    assert re.search(r"\[launch\] exit codes: rank 0 (5|134), rank 1 137", out.read_text()), out.read_text()[-3000:]


def listening_addresses(port: int) -> list[str]:
    """The local addresses of the TCP sockets listening on `port` (IPv4 and IPv6), from /proc/net."""
    found = []
    for table, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        for row in Path(table).read_text().splitlines()[1:]:
            local, state = row.split()[1], row.split()[3]
            address, local_port = local.split(":")
            if state == "0A" and int(local_port, 16) == port:  # 0A: LISTEN
                raw = bytes.fromhex(address)  # 32-bit words in host (little-endian) order
                found.append(socket.inet_ntop(family, b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))))
    return found


def _loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    return (getattr(ip, "ipv4_mapped", None) or ip).is_loopback


BIND_SCRIPT = """
import sys
from jdp import distributed
distributed.initialize(distributed.resolve(), init_timeout_s=20, heartbeat_timeout_s=10)
print("joined", flush=True)
sys.stdin.read()  # until the test has read the listening sockets
"""


def test_the_coordinator_listens_only_where_the_processes_connect(tmp_path):
    """torchrun's variables with MASTER_ADDR=127.0.0.1 and no jdp.launch (which sets JAX_COORDINATOR_BIND_ADDRESS): the
    coordinator listens on loopback only, not on every interface (JAX's default, [::]), and process 0 says where."""
    port, logs = launch.free_port(), [tmp_path / f"rank{rank}.log" for rank in range(2)]
    procs = []
    for rank, log in enumerate(logs):
        with open(log, "w") as out:
            procs.append(subprocess.Popen(
                [sys.executable, "-c", BIND_SCRIPT], cwd=ROOT, stdin=subprocess.PIPE, stdout=out,
                stderr=subprocess.STDOUT, start_new_session=True,
                env=clean_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")))
    try:
        deadline = time.monotonic() + 60
        while not all("joined" in log.read_text() for log in logs):
            assert all(p.poll() is None for p in procs) and time.monotonic() < deadline, logs[0].read_text()[-2000:]
            time.sleep(0.1)
        listening = listening_addresses(port)
        for p in procs:
            p.stdin.close()
        assert finish(procs, timeout=30) == [0, 0]
    finally:
        finish(procs, timeout=0.1)
    assert listening and all(_loopback(address) for address in listening), listening
    assert (f"jdp: distributed: process 0's coordinator listens on 127.0.0.1:{port} (the host of the coordinator "
            "address, from MASTER_ADDR/MASTER_PORT)") in logs[0].read_text()


def _addresses(table: dict[str, list[str]]):
    """A getaddrinfo that knows the names of `table`, each with its addresses in order."""
    def getaddrinfo(name, port, *args, **kwargs):
        if name not in table:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return [(socket.AF_INET6 if ":" in address else socket.AF_INET, socket.SOCK_STREAM, 6, "", (address, 0))
                for address in table[name]]
    return getaddrinfo


def test_where_the_coordinator_listens(monkeypatch):
    """The rule: the address the processes were told to connect to; a hostname as process 0's host resolves it,
    its first address that is not loopback; a loopback one only if there is no other (refused when the variables say
    the job spans hosts); every interface only when asked for."""
    names = {"node001": ["127.0.1.1", "10.0.0.7"], "debian": ["127.0.1.1"], "localhost": ["127.0.0.1", "::1"]}
    monkeypatch.setattr(socket, "getaddrinfo", _addresses(names))

    def listen(coordinator, bind="", **env):
        job = distributed.resolve({"MASTER_ADDR": coordinator.rpartition(":")[0], "MASTER_PORT": "29500",
                                   "RANK": "0", "WORLD_SIZE": "2"}) if coordinator else distributed.resolve(env)
        return distributed.listen_address(job, bind, env)

    assert listen("127.0.0.1:29500").address == "127.0.0.1:29500"
    assert listen("10.1.2.3:29500").address == "10.1.2.3:29500"
    assert listen("[::1]:29500").address == "[::1]:29500"
    assert listen("node001:29500") == distributed.Listen("10.0.0.7:29500", "node001, as this host resolves it")
    assert listen("localhost:29500").address == "127.0.0.1:29500"
    alone = listen("debian:29500")
    assert alone.address == "127.0.1.1:29500" and "only processes on this host can join" in alone.reason
    with pytest.raises(distributed.DistributedUsageError, match="resolves to 127.0.1.1 on process 0's host, a loopback "
                       "address, but the job spans 2 hosts"):
        listen("debian:29500", WORLD_SIZE="16", LOCAL_WORLD_SIZE="8")
    with pytest.raises(distributed.DistributedUsageError, match="the coordinator's host nowhere .from MASTER_ADDR/"
                       "MASTER_PORT. does not resolve on process 0's host"):
        listen("nowhere:29500")
    assert listen("127.0.0.1:29500", "0.0.0.0:29500") == distributed.Listen(
        "0.0.0.0:29500", "every interface, as distributed.bind_address asks")
    assert listen("127.0.0.1:29500", JAX_COORDINATOR_BIND_ADDRESS="10.0.0.5:29500") == distributed.Listen(
        "10.0.0.5:29500", "from JAX_COORDINATOR_BIND_ADDRESS")
    slurm = {"SLURM_JOB_ID": "4242", "SLURM_STEP_NODELIST": "node[001-004],gpu7", "SLURM_NTASKS": "8",
             "SLURM_PROCID": "0", "SLURM_LOCALID": "0"}
    assert distributed.slurm_coordinator(slurm) == "node001:61586"  # JAX's port: 4242 % 4096 + 61440
    assert listen("", **slurm) == distributed.Listen("10.0.0.7:61586", "node001, as this host resolves it")
    with pytest.raises(distributed.DistributedUsageError, match="spans 4 hosts"):
        listen("", **{**slurm, "SLURM_STEP_NODELIST": "debian", "SLURM_STEP_NUM_NODES": "4"})


def test_an_exception_in_one_process_ends_the_launch(tmp_path):
    """Rank 1 raises after step 3: it prints one traceback and exits 1 at once (not after JAX's 300 s shutdown
    barrier), and the launcher stops rank 0, which waits for it in the next step's collective."""
    out = tmp_path / "launch.log"
    t0, raised = time.monotonic(), None
    launcher = start([sys.executable, "-m", "jdp.launch", "--nprocs", "2", "--cpu_devices", "2", "--grace_s", "2", "--",
                      *TRAIN, *ARGS, "--config.train.steps=100000", "--config.train.eval_every=100000",
                      "--workdir", str(tmp_path / "run")], clean_env(JDP_KILL_AT="raise:3@1"), out)
    try:
        while launcher.poll() is None and time.monotonic() - t0 < 60:
            if raised is None and "Traceback" in out.read_text():
                raised = time.monotonic()
            time.sleep(0.05)
        code = launcher.wait(timeout=0.1)
    finally:
        finish([launcher], timeout=0.1)
    ended, log = time.monotonic(), out.read_text()
    print(f"launch ended with {code} {ended - t0:.1f} s after its start, {ended - (raised or t0):.1f} s after the "
          "exception")
    # Without the fix rank 1 waits in JAX's shutdown barrier, then every rank aborts (134). The whole launch takes
    # ~13 s on 2 idle cores (start-up and compilation included); the time after the exception is what the fix sets.
    assert code == 1 and raised is not None and ended - raised < 10 and ended - t0 < 30, log[-3000:]
    assert "[launch] rank 1 exited with code 1; stopping the others" in log
    assert log.count("Traceback") == 1 and "[1] RuntimeError: JDP_KILL_AT=raise:3: a fault injected after step 3" in log
    pids = [int(pid) for pid in re.findall(r"rank \d+ pid (\d+)", log)]
    assert len(pids) == 2 and not any(_alive(pid) for pid in pids)


def test_the_launcher_reports_the_process_that_failed_not_the_ones_it_stopped():
    """Two children found failed in one poll: the cause is reported, not a peer that aborted (134) or exited 5
    because of it; otherwise the lowest rank. CI once saw rank 0's abort reported instead of rank 1's exit 1."""
    from jdp.cli.train import EXIT_DISTRIBUTED

    assert EXIT_DISTRIBUTED in launch.PEER_FAILED
    assert launch.first_failure([-signal.SIGABRT, 1], (None, 0)) == (1, 1)
    assert launch.first_failure([5, 1], (None, 0)) == (1, 1)
    assert launch.first_failure([1, 5], (None, 0)) == (0, 1)
    assert launch.first_failure([-signal.SIGABRT, None], (None, 0)) == (0, -signal.SIGABRT)
    assert launch.first_failure([-signal.SIGKILL, 1], (None, 0)) == (0, -signal.SIGKILL)
    assert launch.first_failure([0, None, 75], (None, 0, 75)) is None


def test_every_process_of_a_second_run_on_a_workdir_stops(tmp_path):
    """Another run holds the workdir's lock: both processes of this one exit 2 naming it, before anything compiles."""
    workdir, port = tmp_path / "run", launch.free_port()
    workdir.mkdir()
    lock = workdir / "jdp.lock"
    fd = os.open(lock, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.write(fd, b"otherhost:4242\n")
        procs = [start([*TRAIN, *ARGS, "--cpu_devices", "1", "--workdir", str(workdir)],
                       clean_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2"),
                       tmp_path / f"rank{rank}.log") for rank in range(2)]
        codes = finish(procs, timeout=60)
    finally:
        os.close(fd)
    assert codes == [2, 2], (tmp_path / "rank1.log").read_text()[-2000:]
    for rank in range(2):
        assert (f"jdp: error: {workdir} is in use by another run: {lock} is locked by process otherhost:4242 "
                "(host:pid)") in (tmp_path / f"rank{rank}.log").read_text()
    assert not (workdir / "checkpoints").exists() and not (workdir / "config.json").exists()


# Bad or inconsistent variables: found before anything waits, one line, exit 2.
BAD = [
    ({"RANK": "1"}, "RANK=1 is set but WORLD_SIZE is missing"),
    ({"WORLD_SIZE": "2"}, "WORLD_SIZE=2 is set but RANK is missing"),
    ({"RANK": "2", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1234"}, "RANK=2 is not below WORLD_SIZE=2"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "http"}, "MASTER_PORT='http' is not a port"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h"}, "MASTER_ADDR=h is set but MASTER_PORT is missing"),
    ({"RANK": "0", "MASTER_ADDR": "h", "MASTER_PORT": "http"}, "MASTER_PORT='http' is not a port"),  # named first
    ({"RANK": "0", "WORLD_SIZE": "2"}, "coordinator address is missing"),
    ({"RANK": "-1", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"}, "RANK=-1 must be at least 0"),
    ({"RANK": "0", "WORLD_SIZE": "two", "MASTER_ADDR": "h", "MASTER_PORT": "1"}, "WORLD_SIZE='two' is not an integer"),
    ({"JAX_COORDINATOR_ADDRESS": "h", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "0"},
     "JAX_COORDINATOR_ADDRESS='h' is not HOST:PORT"),
    ({"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_PROCESS_ID": "1"}, "the number of processes is missing"),
]


@pytest.mark.parametrize("env,message", BAD, ids=[m.split(" ")[0] for _, m in BAD])
def test_bad_variables(env, message):
    with pytest.raises(distributed.DistributedUsageError, match=message.replace("(", r"\(")):
        distributed.resolve(env)


def test_bad_variables_stop_the_command_at_once(tmp_path):
    t0 = time.monotonic()
    result = run([*TRAIN, *ARGS, "--workdir", str(tmp_path / "run")], timeout=60, env=clean_env(RANK="1"))
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "jdp: distributed: RANK=1 is set but WORLD_SIZE is missing; set WORLD_SIZE too, or pass --num_processes N"]
    assert time.monotonic() - t0 < 30 and not (tmp_path / "run").exists()


def test_resolve_precedence():
    torchrun = {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500", "RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1"}
    slurm = {"SLURM_JOB_ID": "7", "SLURM_STEP_NODELIST": "node[001-004]", "SLURM_NTASKS": "8", "SLURM_PROCID": "3",
             "SLURM_LOCALID": "1"}
    assert distributed.resolve({}) is None  # nothing set: one process, no initialize
    assert distributed.resolve({"RANK": "0", "WORLD_SIZE": "1"}) is None
    assert distributed.resolve({**slurm, "SLURM_NTASKS": "1", "SLURM_PROCID": "0"}) is None
    job = distributed.resolve(torchrun)
    assert (job.coordinator, job.num_processes, job.process_id, job.local_device_ids, job.auto_detect) == (
        "10.0.0.1:29500", 4, 1, (1,), False)
    jax_vars = {"JAX_COORDINATOR_ADDRESS": "c:1", "JAX_NUM_PROCESSES": "3", "JAX_PROCESS_ID": "2"}
    job = distributed.resolve({**torchrun, **jax_vars, **slurm})
    assert (job.coordinator, job.num_processes, job.process_id, job.local_device_ids) == ("c:1", 3, 2, None)
    job = distributed.resolve({**torchrun, **slurm}, coordinator="f:2", num_processes=2, process_id=0)
    assert (job.coordinator, job.num_processes, job.process_id, job.auto_detect) == ("f:2", 2, 0, False)
    job = distributed.resolve(slurm)  # JAX's own SLURM detection derives the coordinator
    assert (job.coordinator, job.num_processes, job.process_id, job.auto_detect) == (None, 8, 3, True)
    job = distributed.resolve(slurm, coordinator="head:1234")  # a flag overrides one setting of SLURM's
    assert (job.coordinator, job.num_processes, job.process_id, job.auto_detect) == ("head:1234", 8, 3, True)
    assert distributed.flags_from_argv(["--config.train.steps=3", "--process_id", "1", "--config", "x.py"]) == {
        "coordinator": None, "num_processes": None, "process_id": 1}


def test_launcher_environment_and_exit_codes():
    env = launch.child_env({"JAX_COORDINATOR_ADDRESS": "x:1", "HOME": "/h"}, rank=1, nprocs=2, port=1234,
                           cpu_devices=2)
    assert {k: env[k] for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK",
                                "JAX_NUM_CPU_DEVICES", "HOME")} == {
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1234", "RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1",
        "JAX_NUM_CPU_DEVICES": "2", "HOME": "/h"}
    assert env["JAX_COORDINATOR_BIND_ADDRESS"] == "127.0.0.1:1234"
    assert "JAX_COORDINATOR_ADDRESS" not in env
    assert [launch.exit_code(c) for c in (0, 5, -9, -15)] == [0, 5, 137, 143]


STOP_SCRIPT = """
import sys, time
from jdp import distributed
distributed.initialize(distributed.resolve(), init_timeout_s=20, heartbeat_timeout_s=10)
signal_at = {0: 3, 1: 10**6}[distributed.jax.process_index()]  # only process 0 sees a signal
agreement = distributed.StopAgreement()
for step in range(1, 50):
    if agreement.should_stop(step, step >= signal_at):
        print("stopped at step", step)
        break
    time.sleep(0.1)  # no collective keeps these two in step: leave them time
"""


def test_processes_agree_on_the_step_to_stop_at():
    result = run([sys.executable, "-m", "jdp.launch", "--nprocs", "2", "--", sys.executable, "-c", STOP_SCRIPT],
                 timeout=60)
    assert result.returncode == 0, result.stderr[-2000:]
    stop = 3 + distributed.StopAgreement.LOOKAHEAD_STEPS
    assert sorted(line for line in result.stdout.splitlines() if "stopped" in line) == [
        f"[0] stopped at step {stop}", f"[1] stopped at step {stop}"]


SLURM_SCRIPT = """
import jax
from jdp import distributed
jax.config.update("jax_num_cpu_devices", 2)
job = distributed.resolve()
distributed.initialize(job, init_timeout_s=20, heartbeat_timeout_s=10)
print(f"process {jax.process_index()} of {jax.process_count()}, {jax.device_count()} devices, auto {job.auto_detect}")
"""


def test_slurm_variables_use_jax_auto_detection(tmp_path):
    """What srun sets, on this machine: JAX derives the coordinator (localhost:JAX_COORDINATOR_PORT)."""
    port = launch.free_port()
    slurm = dict(SLURM_JOB_ID="4242", SLURM_STEP_NODELIST="localhost", SLURM_NTASKS="2",
                 JAX_COORDINATOR_PORT=str(port))
    procs = [start([sys.executable, "-c", SLURM_SCRIPT],
                   clean_env(**slurm, SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank)), tmp_path / f"{rank}.log")
             for rank in range(2)]
    assert finish(procs, timeout=60) == [0, 0], (tmp_path / "0.log").read_text()[-2000:]
    for rank in range(2):
        assert f"process {rank} of 2, 4 devices, auto True" in (tmp_path / f"{rank}.log").read_text()


@pytest.mark.parametrize("differing", ["steps", "devices"])
def test_processes_started_with_different_settings_stop(tmp_path, differing):
    """Another device count on one host (1 and 3 devices, 4 in all) was orbax's reshape error, exit 1."""
    port, workdir = launch.free_port(), tmp_path / "run"
    steps, devices = ((5, 6), (1, 1)) if differing == "steps" else ((4, 4), (1, 3))
    procs = [start([*TRAIN, *ARGS, f"--config.train.steps={steps[rank]}", "--workdir", str(workdir)],
                   clean_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                             JAX_NUM_CPU_DEVICES=str(devices[rank])), tmp_path / f"rank{rank}.log")
             for rank in range(2)]
    assert finish(procs, timeout=60) == [2, 2], (tmp_path / "rank0.log").read_text()[-2000:]
    said = ("config.train.steps: 5 on process 0, 6 on process 1" if differing == "steps" else
            "local_devices: 1 on process 0, 3 on process 1")
    for rank in range(2):
        assert (f"jdp: distributed: process 1 was started with other settings than process 0 ({said}); start every "
                "process with the same config, overrides and --workdir, on as many devices") in (
            tmp_path / f"rank{rank}.log").read_text()


SIGNAL_SCRIPT = """
import os, signal, sys, time
def stop(signum, frame):
    print("got", signal.Signals(signum).name, flush=True)
    sys.exit(75)
signal.signal(signal.SIGTERM, stop)
print("ready", os.environ["RANK"], flush=True)
time.sleep(60)
"""


def test_launcher_passes_sigterm_on(tmp_path):
    out = tmp_path / "launch.log"
    launcher = start([sys.executable, "-m", "jdp.launch", "--nprocs", "2", "--", sys.executable, "-c", SIGNAL_SCRIPT],
                     clean_env(), out)
    try:
        deadline = time.monotonic() + 30
        while not all(f"[{rank}] ready {rank}" in out.read_text() for rank in range(2)):
            assert launcher.poll() is None and time.monotonic() < deadline, out.read_text()
            time.sleep(0.1)
        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(timeout=20) == 75
    finally:
        finish([launcher], timeout=0.1)
    assert "[0] got SIGTERM" in out.read_text() and "[1] got SIGTERM" in out.read_text()


LOUD_SCRIPT = "import time; time.sleep(1); [print('x' * 1000) for _ in range(300)]"  # 4 pipe buffers' worth


def test_a_launch_whose_stdout_reader_goes_away_lets_its_children_finish(tmp_path):
    """`python -m jdp.launch ... | head -1`: the thread passing a child's stdout on died at the closed pipe with a
    BrokenPipeError traceback, and the child, its pipe no longer read, blocked for ever at its next 64 KB."""
    with open(tmp_path / "launch.err", "w") as err:  # the launcher keeps its own copy of the descriptor
        launcher = subprocess.Popen([sys.executable, "-m", "jdp.launch", "--nprocs", "2", "--", sys.executable, "-c",
                                     LOUD_SCRIPT], cwd=ROOT, env=clean_env(), stdout=subprocess.PIPE, stderr=err,
                                    start_new_session=True)
    launcher.stdout.close()  # before the children print
    assert finish([launcher], timeout=60) == [0]
    lines = (tmp_path / "launch.err").read_text().splitlines()
    assert [line for line in lines if not line.startswith("[launch] 2 processes")] == [
        "jdp: warning: stdout was closed by its reader (a pipe such as `| head`); the run goes on, printing nothing "
        "more to it (metrics.jsonl holds its train and eval lines)"]


def test_only_the_key_value_shim_reaches_into_jax_private_modules():
    from jdp import kvstore

    package = Path(distributed.__file__).parent
    offenders = [p.name for p in package.rglob("*.py") if "jax._src" in p.read_text() and p.name != "kvstore.py"]
    assert offenders == []
    assert kvstore.client() is None  # one process: no store (the multi-process tests above use it)


PEER_FAILS_SCRIPT = """
import os, sys, time
from pathlib import Path
from jdp import preemption
ready = Path(sys.argv[1])
if os.environ["RANK"] == "1":  # fails once rank 0 has its handlers: before a collective, as in a compile or an eval
    deadline = time.monotonic() + 20
    while not ready.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    sys.exit(1)
# Rank 0 as jdp.train is outside the steps (ExitOnSignal) or in them (PreemptionRequest, whose loop would checkpoint).
with preemption.ExitOnSignal() if sys.argv[2] == "start-up" else preemption.PreemptionRequest() as request:
    ready.write_text("ready")
    for _ in range(400):
        if getattr(request, "signal_name", None):
            print("jdp: preempted: checkpoint written", file=sys.stderr, flush=True)
            sys.exit(preemption.EXIT_PREEMPTED)
        time.sleep(0.05)
"""


@pytest.mark.parametrize("phase", ["start-up", "steps"])
def test_a_process_stopped_for_a_peer_failure_says_so_not_preempted(tmp_path, phase):
    """Rank 1 fails; the launcher's SIGTERM to rank 0 comes after it. Rank 0 says a peer failed and exits 5, in
    start-up and in the steps alike: 75 (preempted) would have a SLURM script requeue a crashed run."""
    from jdp.cli.train import EXIT_DISTRIBUTED
    from jdp.preemption import EXIT_PEER_FAILED

    assert EXIT_PEER_FAILED == EXIT_DISTRIBUTED
    t0 = time.monotonic()
    result = run([sys.executable, "-m", "jdp.launch", "--nprocs", "2", "--grace_s", "5", "--", sys.executable, "-c",
                  PEER_FAILS_SCRIPT, str(tmp_path / "ready"), phase], timeout=60)
    print(f"launch ended in {time.monotonic() - t0:.1f} s")
    assert result.returncode == 1, result.stderr[-2000:]
    assert "[launch] exit codes: rank 0 5, rank 1 1" in result.stderr, result.stderr[-2000:]
    assert ("[0] jdp: distributed: process 0 stopped because another process failed (jdp.launch: rank 1 exited "
            "with code 1); exiting with code 5, not 75") in result.stderr
    assert "preempted" not in result.stderr and "received" not in result.stderr


SIGNAL_AFTER_JOINING_SCRIPT = """
import hashlib, os, sys, time
from pathlib import Path
import jdp
from jdp import preemption
with preemption.ExitOnSignal():  # jdp.train's start-up: the data, the model, a restore, --eval_only
    jdp.initialize()
    Path(sys.argv[1] + os.environ["RANK"]).write_text("joined")
    deadline = time.monotonic() + 30
    while os.environ["RANK"] == "1" and time.monotonic() < deadline:  # busy in C: its handler runs up to 1 s late
        hashlib.pbkdf2_hmac("sha256", b"jdp", b"salt", 3_000_000)
    time.sleep(30)
"""


def test_a_sigterm_after_the_processes_joined_and_before_the_steps_exits_75(tmp_path):
    """JAX's preemption notifier, started by jax.distributed.initialize, took SIGTERM from jdp's handler: a
    preempted job loading its data trained on to the end (or was SIGKILLed at its time limit), never exiting 75.
    And process 0, exiting before a peer busy in C code ran its handler, ended the key-value store under it: JAX
    aborted the peer (134), and the launcher exited 134, not 75."""
    launcher = subprocess.Popen([sys.executable, "-m", "jdp.launch", "--nprocs", "2", "--grace_s", "10", "--",
                                 sys.executable, "-c", SIGNAL_AFTER_JOINING_SCRIPT, str(tmp_path / "joined")],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=clean_env())
    try:
        deadline = time.monotonic() + 60
        while not all((tmp_path / f"joined{rank}").exists() for rank in "01") and time.monotonic() < deadline:
            time.sleep(0.05)
        launcher.send_signal(signal.SIGTERM)
        _, err = launcher.communicate(timeout=30)
    finally:
        launcher.kill()
        launcher.wait()
    assert launcher.returncode == 75, err[-2000:]
    assert sorted(line[:3] for line in err.splitlines() if "jdp: preempted: SIGTERM outside the training" in line) == [
        "[0]", "[1]"], err[-2000:]


ONE_HOSTS_DATA = """
import os
import numpy as np

def make(data):  # rank 1's copy of the labels is bad: refused there alone, after the processes joined
    x = np.random.default_rng(0).normal(size=(320, 8)).astype(np.float32)
    y = (x.sum(1) > 0).astype(np.int32)
    if os.environ.get("RANK") == "1":
        y[5] = -1
    return {"x": x[:256], "y": y[:256]}, {"x": x[256:], "y": y[256:]}
"""


def test_a_refusal_on_one_process_after_joining_exits_2_there_and_is_not_restarted(tmp_path):
    """Exit 2 went through JAX's shutdown barrier, where the peer never came (it waited in a collective): both
    aborted with 134, which the launcher restarts."""
    (tmp_path / "one_hosts_data.py").write_text(ONE_HOSTS_DATA)
    result = run([sys.executable, "-m", "jdp.launch", "--nprocs", "2", "--cpu_devices", "1", "--max_restarts", "1",
                  "--", sys.executable, "-m", "jdp.train", "--config", "mnist1d_mlp",
                  "--config.data.name=one_hosts_data:make", "--config.data.shape=(8,)", "--config.train.steps=4",
                  "--config.train.global_batch_size=32", "--config.distributed.heartbeat_timeout_s=15",
                  "--workdir", str(tmp_path / "run")],
                 timeout=120, env=clean_env(PYTHONPATH=f"{tmp_path}:{Path(__file__).parent.parent}"))
    assert result.returncode == 2, result.stderr[-3000:]
    assert "[1] jdp: config error: labels must be >= 0, got -1" in result.stderr
    assert "[launch] exit codes: rank 0 5, rank 1 2" in result.stderr, result.stderr[-3000:]
    assert "restart 1 of 1" not in result.stderr


RESTART_SCRIPT = """
import os, sys, time
attempt, rank = int(os.environ["JDP_RESTART"]), os.environ["RANK"]
print("attempt", attempt, flush=True)
if attempt >= int(sys.argv[2]):  # this attempt runs clean
    sys.exit(0)
if rank == "1":
    os.abort() if sys.argv[1] == "134" else sys.exit(int(sys.argv[1]))
time.sleep(30)  # rank 0: until the launcher stops it
"""


@pytest.mark.parametrize(("code", "failing", "attempts", "final"), [
    (1, 2, 3, 0), (134, 1, 2, 0), (5, 5, 3, 5),  # restarted; the last: --max_restarts 2 spent, the last code
    (2, 5, 1, 2), (3, 5, 1, 3), (4, 5, 1, 4), (6, 5, 1, 6), (75, 5, 1, 75)])  # never restarted
def test_max_restarts_restarts_the_group_on_what_a_restart_cures(tmp_path, code, failing, attempts, final):
    """`--max_restarts 2`: rank 1 fails in the first `failing` attempts with `code`; every attempt gets its
    JDP_RESTART, each restart one line with the rank, the code and the step of the last committed checkpoint."""
    (tmp_path / "checkpoints" / "4").mkdir(parents=True)
    (tmp_path / "checkpoints" / "6.orbax-checkpoint-tmp-1").mkdir()  # not committed: not where it resumes
    result = run([sys.executable, "-m", "jdp.launch", "--nprocs", "2", "--grace_s", "5", "--max_restarts", "2",
                  "--", sys.executable, "-c", RESTART_SCRIPT, str(code), str(failing), "--workdir", str(tmp_path)],
                 timeout=60)
    assert result.returncode == final, result.stderr[-2000:]
    assert [line for line in result.stdout.splitlines() if line.startswith("[1] attempt")] == [
        f"[1] attempt {k}" for k in range(attempts)]
    restarts = [line for line in result.stderr.splitlines() if "[launch] restart" in line]
    assert restarts == [f"[launch] restart {k} of 2: rank 1 exited with code {code}; starting the 2 processes again, "
                        f"resuming from step 4 (the last committed checkpoint in {tmp_path})"
                        for k in range(1, attempts)]
    if attempts == 3 and final:
        assert f"rank 1 exited with code {code} and --max_restarts 2 is spent; exiting with code {code}" in (
            result.stderr)
    if attempts == 1:
        assert "not restarting" in result.stderr


def test_restart_helpers():
    assert [launch.restartable(c) for c in (1, 5, 134, 137, 143, 0, 2, 3, 4, 6, 75, 126, 127)] == [
        True] * 5 + [False] * 8
    assert launch.workdir_of(["python", "-m", "jdp.train", "--workdir", "a", "--workdir=b"]) == Path("b")
    assert launch.workdir_of(["python", "x.py"]) is None
    assert launch.child_env({}, rank=0, nprocs=2, port=1, cpu_devices=0, restart=3)["JDP_RESTART"] == "3"


def test_faults_fire_only_in_the_first_attempt(monkeypatch):
    from jdp import faults

    monkeypatch.setenv("JDP_KILL_AT", "raise:3")
    for attempt, expected in (("", 3), ("0", 3), ("1", None)):
        monkeypatch.setenv("JDP_RESTART", attempt)
        assert faults.requested_step() == expected


def test_a_restarted_run_ends_with_the_parameters_of_an_uninterrupted_one(two_processes, tmp_path):
    """Rank 1 SIGKILLed after step 3 (checkpoint 2 committed), `--max_restarts 1`: the launcher stops rank 0, starts
    both again, they resume from step 2 and end with the same parameters, bit for bit, as the uninterrupted run."""
    workdir, t0 = tmp_path / "run", time.monotonic()
    result = run([sys.executable, "-m", "jdp.launch", "--nprocs", "2", "--cpu_devices", "2", "--grace_s", "2",
                  "--max_restarts", "1", "--", *TRAIN, *ARGS, "--config.checkpoint.every_steps=2",
                  "--workdir", str(workdir)], timeout=200, env=clean_env(JDP_KILL_AT="step:3@1"))
    print(f"restarted run took {time.monotonic() - t0:.1f} s")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "[launch] rank 1 exited with code 137; stopping the others" in result.stderr
    (restart,) = [line for line in result.stderr.splitlines() if "[launch] restart" in line]
    assert restart.startswith("[launch] restart 1 of 1: rank 1 exited with code 137; starting the 2 processes "
                              "again, resuming from step 2"), restart
    assert f"[0] resumed from {workdir / 'checkpoints' / '2'}" in result.stdout
    import jax

    from jdp.checkpoint import read_arrays

    # The whole last checkpoint of each (parameters, optimizer and RNG state), read here, leaf by leaf.
    (step_a, reference), (step_b, restarted) = read_arrays(two_processes[0] / "checkpoints"), read_arrays(
        workdir / "checkpoints")
    assert step_a == step_b == 5
    leaves_a, leaves_b = jax.tree.leaves_with_path(reference), jax.tree.leaves_with_path(restarted)
    assert [path for path, _ in leaves_a] == [path for path, _ in leaves_b] and leaves_a
    for (path, a), (_, b) in zip(leaves_a, leaves_b, strict=True):
        assert np.asarray(a).dtype == np.asarray(b).dtype and np.array_equal(a, b), jax.tree_util.keystr(path)


@pytest.mark.parametrize("flag, value", [("--port", "99999"), ("--port", "-1"), ("--grace_s", "-1"),
                                         ("--grace_s", "nan")])
def test_a_launcher_port_or_grace_out_of_range_is_its_usage_error(flag, value, capsys):
    """--port 99999 was printed as the coordinator, and every child then failed on its MASTER_PORT."""
    with pytest.raises(SystemExit) as exited:
        launch.main(["--nprocs", "2", flag, value, "--", sys.executable, "-c", "pass"])
    assert exited.value.code == 2
    assert "must be in 0..65535 (0: a free one) and --grace_s" in capsys.readouterr().err


def test_a_negative_max_restarts_is_named_with_its_value(capsys):
    with pytest.raises(SystemExit) as exited:
        launch.main(["--nprocs", "2", "--max_restarts", "-1", "--", sys.executable, "-c", "pass"])
    assert exited.value.code == 2
    assert "--max_restarts -1 must not be negative" in capsys.readouterr().err
