"""What a workdir holds, in-process: the lock that keeps a second run out, whole-file rewrites a reader never sees
half done, metrics.jsonl with damaged lines, the settings a resume refuses, and leaf digests. Then, under the CLI in
a child bounded in time: each writer meeting a full disk (a small tmpfs), a `checkpoints` that is a file, the
workdir deleted mid-run, a stdout whose reader goes away."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import jax
import numpy as np
import pytest

from jdp import digest, workdir_lock
from jdp import guard as guard_lib
from jdp import metrics as metrics_lib
from jdp import record as record_lib
from jdp.cli import config as config_lib
from jdp.configs import base
from jdp.metrics import MetricsWriter, read_metrics


def test_eval_only_waits_for_no_run_it_takes_the_lock_as_training_does(tmp_path, capsys):
    """--eval_only took no lock: beside a live run it appended its eval line into that run's metrics.jsonl, out
    of step order."""
    from jdp.cli.train import main

    fd = os.open(tmp_path / workdir_lock.LOCK_NAME, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a run training there
        assert main(["--workdir", str(tmp_path), "--eval_only"]) == 2
    finally:
        os.close(fd)
    assert f"jdp: error: {tmp_path} is in use by another run" in capsys.readouterr().err


def test_a_locked_workdir_is_refused_naming_the_holder(tmp_path):
    lock = tmp_path / workdir_lock.LOCK_NAME
    fd = os.open(lock, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # another run holds it
        os.write(fd, b"otherhost:4242\n")
        with pytest.raises(workdir_lock.WorkdirLocked) as refused:
            with workdir_lock.held(tmp_path):
                pass
        assert str(refused.value) == (f"{tmp_path} is in use by another run: {lock} is locked by process "
                                      "otherhost:4242 (host:pid); wait for that run to end or stop it, or use "
                                      "another workdir")
    finally:
        os.close(fd)
    # Released (its holder ended): the lock is taken, and names this process.
    with workdir_lock.held(tmp_path):
        assert lock.read_text().strip().endswith(f":{os.getpid()}")
        with pytest.raises(BlockingIOError):  # really held: nobody else gets it
            other = os.open(lock, os.O_RDWR)
            try:
                fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
            finally:
                os.close(other)


def test_a_filesystem_without_locks_warns_and_goes_on(tmp_path, monkeypatch, capsys):
    def refuse(fd, operation):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(fcntl, "flock", refuse)
    with workdir_lock.held(tmp_path):
        pass
    assert (f"jdp: warning: the filesystem refuses locks on {tmp_path / workdir_lock.LOCK_NAME} (No locks "
            "available); going on without protection") in capsys.readouterr().err


def test_config_json_is_never_seen_half_written(tmp_path):
    """A reader (another process checking the resume) polls config.json while it is rewritten: with a plain
    truncate-and-write it reads an empty or partial file thousands of times in this loop."""
    path, cfg = tmp_path / "config.json", base.get_config()
    config_lib.save_config(cfg, path)
    failures, done = [], threading.Event()

    def read_all_the_time():
        while not done.is_set():
            try:
                json.loads(path.read_text())
            except ValueError as e:
                failures.append(e)

    reader = threading.Thread(target=read_all_the_time)
    reader.start()
    try:
        for _ in range(300):
            config_lib.save_config(cfg, path)
    finally:
        done.set()
        reader.join()
    assert failures == []
    assert [p.name for p in tmp_path.iterdir()] == ["config.json"]  # no temporary file left


def test_metrics_lines_that_do_not_parse(tmp_path, capsys):
    """A torn last line (a full disk, a kill) is dropped; a bad line elsewhere is kept, and named."""
    lines = [json.dumps({"step": 1, "split": "train", "loss": 1.0}), "{garbage",
             json.dumps({"step": 2, "split": "train", "loss": 0.5}), json.dumps({"step": 2, "split": "eval"}),
             json.dumps({"split": "summary", "eval_loss": 0.5})]
    path = tmp_path / "metrics.jsonl"
    path.write_text("\n".join(lines) + '\n{"step": 3, "spl')
    assert [r.get("step") for r in read_metrics(tmp_path)] == [1, 2, 2, None]
    err = capsys.readouterr().err
    assert f"jdp: warning: line 2 of {path} is not JSON; keeping it as it is" in err
    assert f"jdp: warning: the last line (6) of {path} is cut short; dropping it" in err

    writer = MetricsWriter(tmp_path, total_steps=2, start_step=2)  # a finished run's rerun: the summary stays
    writer.close()
    assert path.read_text() == "\n".join(lines) + "\n"
    assert writer.eval_steps == {2} and writer.summary_written
    assert not (tmp_path / "tensorboard").exists()  # nothing was written, so no event file either
    with path.open("a") as f:  # an --eval_only line after the summary: the summary was still taken as missing
        f.write(json.dumps({"step": 2, "split": "eval", "loss": 0.5}) + "\n")
    writer = MetricsWriter(tmp_path, total_steps=2, start_step=2)
    writer.close()
    assert writer.summary_written
    path.write_text("\n".join(lines) + "\n")

    writer = MetricsWriter(tmp_path, total_steps=5, start_step=1)  # resumed from step 1
    writer.close()
    assert path.read_text() == "\n".join(lines[:2]) + "\n"
    assert writer.eval_steps == set() and not writer.summary_written


def test_tensorboard_is_imported_at_start_up_and_opened_at_the_first_line(tmp_path, monkeypatch):
    """Importing tensorboardX (~0.35 s) at the first train line fell inside the throughput clock: the GPT's
    60-step speed runs measured 93 examples/s over their last 10 steps instead of 120."""
    events = []

    class Writer:
        def __init__(self, logdir, **options):
            events.append("opened")

        def add_scalar(self, *args):
            events.append("scalar")

        def close(self):
            pass

    monkeypatch.setattr(metrics_lib, "_tensorboard_class", lambda: events.append("imported") or Writer)
    writer = MetricsWriter(tmp_path, total_steps=2)
    assert events == ["imported"]
    writer.train(1, {"loss": 1.0, "examples_per_sec": None})
    writer.close()
    assert events == ["imported", "opened", "scalar"]


# A run writing 100 train lines, killed (-9) once its buffered events reached the disk up to about step 60: the file
# ends in a record cut short, as a kill leaves it.
KILLED_WRITER = """
import os, signal, sys, time
from pathlib import Path
from jdp.metrics import MetricsWriter
writer = MetricsWriter(Path(sys.argv[1]), total_steps=100)
for step in range(1, 101):
    writer.train(step, {"loss": 1.0, "accuracy": 0.5, "lr": 0.1, "examples_per_sec": 10.0, "skipped_steps": 0})
deadline = time.monotonic() + 30
while sum(p.stat().st_size for p in Path(sys.argv[1], "tensorboard").iterdir()) < 16384 and time.monotonic() < deadline:
    time.sleep(0.01)
os.kill(os.getpid(), signal.SIGKILL)
"""


def _scalars(workdir: Path) -> dict[str, list[tuple[int, float]]]:
    """(step, value) of each scalar tag, as TensorBoard's own reader loads WORKDIR/tensorboard."""
    if os.environ.get("CI"):  # in CI a missing `tensorboard` (the test extra) fails this test, never skips it
        from tensorboard.backend.event_processing import event_accumulator
    else:
        event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    events = event_accumulator.EventAccumulator(str(workdir / "tensorboard"))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_tensorboard_holds_each_step_once_after_a_kill_and_resume(tmp_path):
    """The killed run's events past its last checkpoint (step 40) are purged from the event files on resume, as
    its lines are from metrics.jsonl: each step shows once, with the resumed run's value."""
    out = subprocess.run([sys.executable, "-c", KILLED_WRITER, str(tmp_path)], capture_output=True, text=True,
                         timeout=60, cwd=Path(__file__).resolve().parents[1])
    assert out.returncode == -signal.SIGKILL, out.stderr
    assert max(step for step, _ in _scalars(tmp_path)["train/loss"]) > 40  # the replayed steps reached the disk
    writer = MetricsWriter(tmp_path, total_steps=100, start_step=40)
    for step in range(41, 101):
        writer.train(step, {"loss": 2.0, "accuracy": 0.5, "lr": 0.1, "examples_per_sec": 10.0, "skipped_steps": 0})
    writer.summary(examples_per_sec=10.0)
    writer.close()
    scalars = _scalars(tmp_path)
    for tag in ("train/loss", "train/accuracy", "train/lr", "train/skipped_steps"):
        assert [step for step, _ in scalars[tag]] == list(range(1, 101)), tag
    assert scalars["train/loss"] == [(step, 1.0 if step <= 40 else 2.0) for step in range(1, 101)]
    assert scalars["summary/examples_per_sec"] == [(100, 10.0)]  # at the step it closes
    assert [r["step"] for r in read_metrics(tmp_path) if r["split"] == "train"] == list(range(1, 101))


def test_the_settings_a_resume_may_not_change_are_named_by_their_keys():
    """The config's settings that change the data order or the numerics go to jdp.fit's resume guard
    (`trainer.run(settings=)`), which names each one that differs; paths, caches and periods are not among them."""
    saved = base.get_config()
    changed = base.get_config()
    changed.seed, changed.train.global_batch_size, changed.precision = 1, 64, "bf16"
    changed.data.normalize, changed.train.grad_accum_steps, changed.data.train_split = False, 2, "train[:90%]"
    guarded = config_lib.guarded_settings
    assert record_lib.listed_changes(guarded(saved), guarded(changed), steps_changed=False) == [
        "data.normalize: True -> False", "data.train_split: 'train' -> 'train[:90%]'", "precision: 'fp32' -> 'bf16'",
        "seed: 0 -> 1", "train.global_batch_size: 128 -> 64", "train.grad_accum_steps: 1 -> 2"]
    assert str(guard_lib.refusal(Path("/w"), ["seed: 0 -> 1"])) == (
        "/w holds a run with other settings that change the numerics or the data order (seed: 0 -> 1); use a new "
        "workdir, or pass allow_config_change=True (--config.checkpoint.allow_config_change=True)")
    # Paths, caches, periods and the way out of a refusal change nothing the run computes.
    moved = base.get_config()
    moved.data.data_dir, moved.data.cache_decoded_mb, moved.compile_cache_dir = "/elsewhere", 0, ""
    moved.train.log_every, moved.checkpoint.every_steps, moved.checkpoint.allow_config_change = 7, 5, True
    assert guarded(moved) == guarded(saved)


def test_digests_name_the_damaged_leaf_and_a_changed_layout():
    state = {"params": {"w": np.arange(6, dtype=np.float32).reshape(2, 3)}, "step": np.int32(4)}
    saved = digest.pending(state)()
    assert saved["['step']"][:2] == ["int32", []]
    assert digest.mismatch(saved, state) is None
    flipped = {**state, "params": {"w": state["params"]["w"].copy()}}
    flipped["params"]["w"].reshape(-1).view(np.uint8)[5] ^= 1
    assert digest.mismatch(saved, flipped) == ("the digest of ['params']['w'] does not match the one saved with it "
                                               "(damaged bytes)")
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype), state)
    assert digest.layout_difference(saved, abstract) is None
    wider = {**abstract, "params": {"w": jax.ShapeDtypeStruct((2, 4), np.float32)}}
    assert digest.layout_difference(saved, wider) == ("['params']['w'] is float32(2, 3) there, float32(2, 4) in the "
                                                      "model")


# -- the storage under a running CLI: a writer that meets a full disk, a workdir deleted or in the way ----------
# Each run is a child, bounded in time and killed at the bound: what failed here used to hang for good.

ROOT = Path(__file__).resolve().parents[1]
TINY = [sys.executable, "-m", "jdp.train", "--config", "digits_mlp", "--config.model.kwargs.hidden_sizes=(16,)",
        "--config.train.log_every=1", "--config.train.eval_every=0", "--config.parallel.num_devices=2",
        "--config.train.global_batch_size=32", "--config.compile_cache_dir="]
HANG_S = 60  # the most a child may take: the hangs these tests guard against lasted 5 minutes and more


def _child_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("JDP_KILL_AT", "XLA_FLAGS", "MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME")}
    return {**env, "JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": "2", "PYTHONUNBUFFERED": "1"}


def _train(workdir: Path, *args: str) -> subprocess.CompletedProcess:
    """The CLI on `workdir`; fails the test (the child killed) when it runs past HANG_S."""
    try:
        return subprocess.run([*TINY, "--workdir", str(workdir), *args], cwd=ROOT, env=_child_env(),
                              capture_output=True, text=True, timeout=HANG_S)
    except subprocess.TimeoutExpired as e:  # subprocess.run has killed it
        pytest.fail(f"the run still ran after {HANG_S} s (a hang); its stderr ended with: "
                    f"{(e.stderr or b'')[-2000:]!r}")


def _one_line(out: subprocess.CompletedProcess, code: int, start: str) -> str:
    assert out.returncode == code, out.stderr[-3000:]
    assert out.stderr.count("\n") == 1 and out.stderr.startswith(start), out.stderr[-3000:]
    return out.stderr


@contextlib.contextmanager
def _small_disk(path: Path, size: str) -> Iterator[Path]:
    """A tmpfs of `size` mounted at `path` for the block (root only; in CI, which runs as root, a failure to
    mount fails the test), unmounted after, lazily if a killed child still holds it."""
    path.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True,
                             text=True, timeout=30)
    if mounted.returncode:
        if os.environ.get("CI"):
            pytest.fail(f"mount -t tmpfs failed: {mounted.stderr.strip()}")
        pytest.skip(f"needs root to mount a tmpfs ({mounted.stderr.strip()})")
    try:
        yield path
    finally:
        for _ in range(20):
            if subprocess.run(["umount", str(path)], capture_output=True, timeout=30).returncode == 0:
                break
            time.sleep(0.25)
        else:
            subprocess.run(["umount", "-l", str(path)], capture_output=True, timeout=30)


# The disk each writer meets full: a tmpfs of its own in the workdir, the rest on the test's disk. A page (4 KiB)
# holds the tracker's state file once (its rewrite needs a second) and less than TensorBoard's buffer (8 KiB, about
# 20 steps); 120 KiB, the first checkpoint of the tiny MLP, not the second.
WRITERS = {"tensorboard": "4k", "trackers": "4k", "checkpoints": "120k"}


@pytest.mark.parametrize("writer", WRITERS)
def test_a_full_disk_stops_each_writer_in_one_line_and_the_rerun_resumes(writer, tmp_path):
    """The issue's run: the disk filled, tensorboardX's writer thread died of ENOSPC with a traceback, and the run
    then waited on that thread's full queue for good (over 10 minutes). A tracker's worker thread died the same way,
    its state file unwritten, while the run went on. Each writer's ENOSPC is now the one-line disk error, exit 6;
    once the disk is larger, the rerun resumes from the last checkpoint and computes the same losses, bitwise."""
    # Without the fix: tensorboard hangs (killed at HANG_S), trackers exits 0 after a thread's traceback;
    # checkpoints (orbax's own errors reach the training thread) guards the same line for orbax's writes.
    workdir = tmp_path / "run"
    args = ["--config.train.steps=24", "--config.checkpoint.every_steps=8"]
    if writer == "trackers":
        if not os.environ.get("CI") and importlib.util.find_spec("mlflow") is None:  # in CI a missing extra fails
            pytest.skip('pip install -e ".[mlflow]"')
        args += ["--config.metrics.loggers=mlflow", f"--config.metrics.mlflow_tracking_uri={tmp_path / 'mlruns'}",
                 "--config.metrics.mlflow_experiment=tests"]
    with _small_disk(workdir / writer, WRITERS[writer]) as disk:
        _one_line(_train(workdir, *args), 6, f"jdp: disk: no space left on device writing {disk}")
        if writer != "tensorboard":  # the run: resumed here; after a save cut short: test_checkpoint.py
            return
        written = dict(_losses(workdir))
        subprocess.run(["mount", "-o", "remount,size=8m", str(disk)], check=True, timeout=30)
        out = _train(workdir, *args)
        assert out.returncode == 0 and "resumed from" in out.stdout, out.stderr[-3000:]
    resumed = dict(_losses(workdir))
    assert [step for step, _ in _losses(workdir)] == list(range(1, 25))  # each step once
    assert {s: resumed[s] for s in written} == written  # the steps both segments trained: the same bits


def _losses(workdir: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in read_metrics(workdir) if r["split"] == "train"]


def test_checkpoints_as_a_file_is_refused_at_start_up(tmp_path):
    """WORKDIR/checkpoints a regular file: the run started from step 0 without a word and hung at its first save
    (over 300 s), ending in an absl traceback."""
    (tmp_path / "checkpoints").write_text("")
    _one_line(_train(tmp_path), 2, f"jdp: error: {tmp_path / 'checkpoints'} is a file: the run keeps its checkpoints "
                                   "there; move it away (or pass another --workdir) and rerun")
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoints"]  # nothing written


def test_a_workdir_deleted_mid_run_is_the_one_line_disk_error(tmp_path):
    """The workdir removed while the run writes it (moved away, then deleted, so that the removal is at once):
    exit 1 with 5 tracebacks and 454 lines of stderr, or a run that went on into a directory orbax made anew."""
    workdir = tmp_path / "run"
    child = subprocess.Popen([*TINY, "--workdir", str(workdir), "--config.train.steps=100000",
                              "--config.checkpoint.every_steps=5"], cwd=ROOT, env=_child_env(),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    bound = threading.Timer(2 * HANG_S, child.kill)  # however it hangs: before its first lines, or after
    bound.start()
    try:
        for line in child.stdout:  # trained past its first checkpoints
            if line.startswith("step 12:"):
                break
        workdir.rename(tmp_path / "removed")
        shutil.rmtree(tmp_path / "removed", ignore_errors=True)  # a write still in flight may add a file there
        started = time.monotonic()
        stdout, stderr = child.communicate(timeout=HANG_S)
    finally:
        bound.cancel()
        child.kill()
        child.wait()
    assert time.monotonic() - started < HANG_S
    out = subprocess.CompletedProcess(child.args, child.returncode, stdout, stderr)
    _one_line(out, 6, f"jdp: disk: {workdir} was deleted or moved while the run wrote it")
    assert stderr.strip().endswith("move it back and rerun to resume, or rerun to start afresh")


CLOSED_STDOUT_WARNING = ("jdp: warning: stdout was closed by its reader (a pipe such as `| head`); the run goes on, "
                         "printing nothing more to it (metrics.jsonl holds its train and eval lines)")


@pytest.mark.parametrize("closed", ["by its reader", "at the start", "on a full disk", "with stderr at the start"])
def test_a_run_whose_stdout_is_closed_trains_to_the_end(closed, tmp_path):
    """`python -m jdp.train | head -1`: the pipe closes after the first line. The next print ended the run with a
    BrokenPipeError traceback, exit 1, losing the steps since the last checkpoint; now one warning, and the run
    finishes with its summary line and final checkpoint. Started with stdout closed (`>&-`), it prints nothing;
    with stderr closed too (`>&- 2>&-`), it was exit 1 at once (the progress bar asked a None stderr for a tty).
    `> log` on a full disk (/dev/full) was an OSError traceback at the first flush; now one warning too."""
    workdir, err = tmp_path / "run", tmp_path / "stderr"
    stdout = {"by its reader": subprocess.PIPE, "on a full disk": open("/dev/full", "w")}.get(closed)
    closes = {"at the start": (1,), "with stderr at the start": (1, 2)}.get(closed, ())
    with open(err, "w") as stderr:  # the child keeps its own copy of the descriptor
        child = subprocess.Popen([*TINY, "--workdir", str(workdir), "--config.train.steps=40"], cwd=ROOT,
                                 env=_child_env(), stdout=stdout, stderr=stderr,
                                 preexec_fn=lambda: [os.close(fd) for fd in closes])
    if closed == "on a full disk":
        stdout.close()
    try:
        if child.stdout is not None:
            child.stdout.readline()  # the start-up line, as `head -1` reads it
            child.stdout.close()
        child.wait(timeout=HANG_S)
    finally:
        child.kill()
        child.wait()
    assert child.returncode == 0, err.read_text()[-3000:]
    warned = {"by its reader": [CLOSED_STDOUT_WARNING], "on a full disk": [
        "jdp: warning: stdout cannot be written ([Errno 28] No space left on device); the run goes on, printing "
        "nothing more to it (metrics.jsonl holds its train and eval lines)"]}
    assert err.read_text().splitlines() == warned.get(closed, [])
    assert read_metrics(workdir)[-1]["split"] == "summary"
    assert max(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit()) == 40
