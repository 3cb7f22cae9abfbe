"""The tracker loggers (`jdp.loggers`): MLflow on a local store and W&B offline, read back through their own
clients and record format; a resume (in-process and after a real SIGKILL) continues the same tracked run with each
step once; a silent tracker stalls nothing; 2 processes open one run; a failing tracker costs one warning; a missing
package or an unknown name is one line."""

from __future__ import annotations

import json
import os
import re
import shlex
import socket
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jdp
from jdp import loggers
from jdp.cli import config as config_lib
from jdp.cli import launch
from jdp.cli.train import main
from jdp.errors import UsageError
from jdp.loggers import MLflow, WandB
from jdp.loggers.wandb_logger import items, read_records
from tests.helpers import records, small_config
from tests.test_golden import MLP  # 6 -> 16 -> 1

if os.environ.get("CI"):  # in CI a missing `wandb` or `mlflow` extra fails these tests, never skips them
    import mlflow  # noqa: F401
    import wandb  # noqa: F401
    needs_trackers = pytest.mark.usefixtures()
else:
    installed = loggers.base.installed("wandb") and loggers.base.installed("mlflow")
    needs_trackers = pytest.mark.skipif(not installed, reason='pip install -e ".[wandb,mlflow]"')

ROOT = Path(__file__).resolve().parents[1]
# The CLI runs: a small MLP, a checkpoint every 4 steps, a train line every step, an eval every 6.
CLI_ARGS = ["--config", "configs/mnist1d_mlp.py", "--config.model.kwargs.hidden_sizes=(32,)",
            "--config.train.steps=12", "--config.train.log_every=1", "--config.train.eval_every=6",
            "--config.checkpoint.every_steps=4", "--config.compile_cache_dir=", "--config.metrics.loggers=wandb,mlflow",
            "--config.metrics.mlflow_experiment=tests"]


@pytest.fixture(autouse=True)
def offline(tmp_path, monkeypatch):
    """W&B offline, silent and writing only under the test's directory (its settings, cache and staging too); the
    caller's tracker settings out of the way."""
    for name in ("WANDB_DIR", "WANDB_PROJECT", "WANDB_BASE_URL", "WANDB_API_KEY", "MLFLOW_TRACKING_URI",
                 "MLFLOW_EXPERIMENT_NAME", "JDP_KILL_AT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_ERROR_REPORTING", "false")
    for name in ("CONFIG", "CACHE", "DATA"):
        monkeypatch.setenv(f"WANDB_{name}_DIR", str(tmp_path / f"wandb-{name.lower()}"))
    yield
    os.environ.pop("WANDB_SERVICE", None)  # set by W&B for this process's service: not for later tests' children


# --- W&B's offline run files, read through wandb's own record definitions ---------------------------------------

def wandb_run(run_dir: Path) -> dict:
    """One offline run directory: its run id, config, history rows (user keys only) and summary."""
    # offline-run-<time>-<id>, with -1, -2, ... when a directory of that second and id exists already
    run = {"id": None, "dir_id": run_dir.name.split("-")[3], "config": {}, "history": [], "summary": {}}
    files = list(run_dir.glob("run-*.wandb"))  # none when a SIGKILL came before W&B wrote its first block
    assert len(files) <= 1, files
    for record in (r for path in files for r in read_records(path)):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run["id"] = record.run.run_id
            run["config"].update(items(record.run.config.update))
        elif kind == "config":
            run["config"].update(items(record.config.update))
        elif kind == "history":
            run["history"].append(items(record.history.item))
        elif kind == "summary":
            run["summary"].update(items(record.summary.update))
    return run


def wandb_runs(workdir: Path) -> list[dict]:
    return [wandb_run(d) for d in sorted((workdir / "wandb").glob("offline-run-*"))]


def wandb_finished(workdir: Path, timeout_s: float = 30) -> None:
    """Until the newest offline run's file ends with its exit record. W&B's `finish` (wandb 0.31, offline) can return
    before its service has written the run file, which a read right after `fit` then finds holding its header alone;
    at a process's exit W&B waits for its service."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        newest = sorted((workdir / "wandb").glob("offline-run-*"))[-1:]
        files = list(newest[0].glob("run-*.wandb")) if newest else []
        if files and any(r.WhichOneof("record_type") == "exit" for r in read_records(files[0])):
            return
        time.sleep(0.1)
    raise AssertionError(f"W&B wrote no finished run file in {workdir / 'wandb'} within {timeout_s:g} s")


def wandb_points(runs: list[dict], key: str) -> list[tuple[int, float]]:
    """(step, value) of `key` over the history of every run directory, in order."""
    return [(row["_step"], row[key]) for run in runs for row in run["history"] if key in row]


# --- MLflow --------------------------------------------------------------------------------------------------------

def mlflow_client(store: Path):
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    from mlflow.tracking import MlflowClient

    return MlflowClient(store.as_uri())


def mlflow_runs(store: Path, experiment: str) -> list:
    client = mlflow_client(store)
    found = client.get_experiment_by_name(experiment)
    return client.search_runs([found.experiment_id]) if found else []


def mlflow_points(store: Path, run_id: str, key: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in mlflow_client(store).get_metric_history(run_id, key))


def jsonl_points(workdir: Path, split: str, key: str) -> list[tuple[int, float]]:
    return [(r["step"], r[key]) for r in records(workdir, split)]


# --- A small fit -----------------------------------------------------------------------------------------------------

def squared_error(model, batch):
    return {"loss": (model(batch["x"]) - batch["y"]) ** 2}


def make_net() -> MLP:
    return MLP(nnx.Rngs(0))


DATA = {"x": (x := np.random.default_rng(0).standard_normal((256, 6)).astype(np.float32)), "y": x.sum(1)}


def fit(workdir: Path, callbacks: list, steps: int = 12, **options) -> jdp.FitResult:
    return jdp.fit(make_net, squared_error, DATA, optimizer=optax.sgd(0.05), steps=steps, global_batch_size=32,
                   workdir=workdir, eval_data=DATA, log_every=1, eval_every=6, checkpoint_every=4,
                   callbacks=callbacks, **options)


# --- Tests -------------------------------------------------------------------------------------------------------

@needs_trackers
def test_mlflow_holds_the_record_and_the_lines_of_metrics_jsonl(tmp_path):
    store, workdir = tmp_path / "mlruns", tmp_path / "run"
    fit(workdir, [MLflow(tracking_uri=store.as_uri(), experiment="tests")])
    (run,) = mlflow_runs(store, "tests")
    assert run.info.status == "FINISHED" and run.info.run_name == "run"
    assert json.loads((workdir / "trackers" / "mlflow.json").read_text())["run_id"] == run.info.run_id
    params, record = run.data.params, json.loads((workdir / "run.json").read_text())
    assert params["fit.options.log_every"] == "1" and params["fit.steps"] == "12"
    assert params["versions.jax"] == record["versions"]["jax"] and json.loads(params["devices"]) == record["devices"]
    assert params["fit.model.class"] == record["fit"]["model"]["class"]
    # The train lines at their steps, equal in value; eval lines as eval_<key>; the summary at the last step.
    assert mlflow_points(store, run.info.run_id, "loss") == jsonl_points(workdir, "train", "loss")
    assert [s for s, _ in jsonl_points(workdir, "train", "loss")] == list(range(1, 13))
    assert mlflow_points(store, run.info.run_id, "eval_loss") == jsonl_points(workdir, "eval", "loss")
    summary = records(workdir, "summary")[-1]
    assert mlflow_points(store, run.info.run_id, "summary/examples_per_sec") == [(12, summary["examples_per_sec"])]
    assert mlflow_points(store, run.info.run_id, "summary/eval_loss") == [(12, summary["eval_loss"])]


@needs_trackers
def test_wandb_offline_run_holds_the_config_and_the_lines_of_metrics_jsonl(tmp_path):
    workdir = tmp_path / "run"
    fit(workdir, [WandB(project="tests", mode="offline")])
    wandb_finished(workdir)
    (run,) = wandb_runs(workdir)  # the run's files live in the workdir (no dir given, no WANDB_DIR)
    assert run["id"] == json.loads((workdir / "trackers" / "wandb.json").read_text())["run_id"]
    record = json.loads((workdir / "run.json").read_text())
    assert run["config"]["fit"]["options"]["log_every"] == 1 and run["config"]["fit"]["steps"] == 12
    assert run["config"]["versions"] == record["versions"] and run["config"]["devices"] == record["devices"]
    assert wandb_points([run], "loss") == jsonl_points(workdir, "train", "loss")
    assert wandb_points([run], "eval_loss") == jsonl_points(workdir, "eval", "loss")
    summary = records(workdir, "summary")[-1]
    assert run["summary"]["examples_per_sec"] == summary["examples_per_sec"]
    assert run["summary"]["eval_loss"] == summary["eval_loss"]


@needs_trackers
def test_a_resumed_fit_continues_the_same_runs_with_each_step_once(tmp_path, monkeypatch):
    """Stopped by an exception after step 7 (checkpoint 4): the rerun replays steps 5-7 and eval 6, which MLflow
    already has, and logs what W&B lost from metrics.jsonl; each step goes in once. The changed record goes to
    MLflow under a new name."""
    store, workdir = tmp_path / "mlruns", tmp_path / "run"
    first = [MLflow(tracking_uri=store.as_uri(), experiment="tests"), WandB(project="tests", mode="offline")]
    monkeypatch.setenv("JDP_KILL_AT", "raise:7")
    with pytest.raises(RuntimeError, match="raise:7"):
        fit(workdir, first)
    for logger in first:  # what the process's exit does
        logger.close()
    monkeypatch.delenv("JDP_KILL_AT")
    (run,) = mlflow_runs(store, "tests")
    assert run.info.status == "KILLED"
    assert [s for s, _ in mlflow_points(store, run.info.run_id, "loss")] == list(range(1, 8))  # past checkpoint 4
    # What a SIGKILL can leave: a step marked as sent that MLflow never got, and a W&B run file never written.
    state = workdir / "trackers" / "mlflow.json"
    state.write_text(json.dumps({**json.loads(state.read_text()), "train": 9}))
    (lost,) = (workdir / "wandb").glob("offline-run-*/run-*.wandb")
    lost.unlink()

    fit(workdir, [MLflow(tracking_uri=store.as_uri(), experiment="tests"), WandB(project="tests", mode="offline")],
        description="resumed")
    (run,) = mlflow_runs(store, "tests")
    assert run.info.status == "FINISHED"
    for key, split in (("loss", "train"), ("eval_loss", "eval")):
        expected = jsonl_points(workdir, split, key.removeprefix("eval_"))
        assert mlflow_points(store, run.info.run_id, key) == expected
    assert run.data.params["fit.options.description"] == ""
    assert run.data.params["resume_4.fit.options.description"] == "resumed"
    wandb_finished(workdir)
    runs = wandb_runs(workdir)
    assert [r["dir_id"] for r in runs] == [runs[1]["id"]] * 2  # offline: a second directory, the same run id
    assert wandb_points(runs, "loss") == jsonl_points(workdir, "train", "loss")
    assert wandb_points(runs, "eval_loss") == jsonl_points(workdir, "eval", "loss")


@needs_trackers
def test_a_resumed_run_whose_eval_loss_was_not_finite_logs_each_eval_once(tmp_path, monkeypatch):
    """MLflow's last eval step was read from eval_loss alone, which a non-finite loss never reaches: the rerun
    logged every earlier eval line again."""
    store, workdir = tmp_path / "mlruns", tmp_path / "run"
    eval_data = {"x": DATA["x"][:32], "y": np.where(np.arange(32) == 3, np.inf, DATA["y"][:32]).astype(np.float32)}

    def run(logger):
        jdp.fit(make_net, lambda m, b: {**squared_error(m, b), "ok": jnp.ones(len(b["x"]))}, DATA,
                optimizer=optax.sgd(0.05), steps=12, global_batch_size=32, workdir=workdir, eval_data=eval_data,
                log_every=1, eval_every=6, checkpoint_every=4, callbacks=[logger])

    monkeypatch.setenv("JDP_KILL_AT", "raise:7")
    first = MLflow(tracking_uri=store.as_uri(), experiment="tests")
    with pytest.raises(RuntimeError, match="raise:7"):
        run(first)
    first.close()  # what the process's exit does
    monkeypatch.delenv("JDP_KILL_AT")
    run(MLflow(tracking_uri=store.as_uri(), experiment="tests"))
    (tracked,) = mlflow_runs(store, "tests")
    assert [step for step, _ in mlflow_points(store, tracked.info.run_id, "eval_ok")] == [6, 12]


@needs_trackers
def test_two_segments_resumed_from_the_same_checkpoint_both_reach_mlflow(tmp_path, monkeypatch):
    """Killed at step 5, then again at 7, before checkpoint 8: the third segment resumes from step 4 as the second
    did. Its changed record went under resume_4 again, which MLflow refuses (params do not change), and that
    failure left the segment logging nothing: steps 8-12 and the summary missing, the run left RUNNING."""
    store, workdir = tmp_path / "mlruns", tmp_path / "run"
    for kill_at, description in ((5, ""), (7, "resumed"), (None, "resumed again")):
        logger = MLflow(tracking_uri=store.as_uri(), experiment="tests")
        if kill_at is None:
            monkeypatch.delenv("JDP_KILL_AT")
            fit(workdir, [logger], description=description)
            break
        monkeypatch.setenv("JDP_KILL_AT", f"raise:{kill_at}")
        with pytest.raises(RuntimeError, match=f"raise:{kill_at}"):
            fit(workdir, [logger], description=description)
        logger.close()  # what the process's exit does
    (run,) = mlflow_runs(store, "tests")
    assert run.info.status == "FINISHED"
    assert mlflow_points(store, run.info.run_id, "loss") == jsonl_points(workdir, "train", "loss")
    assert [run.data.params[f"{prefix}fit.options.description"] for prefix in ("", "resume_4.", "resume_4_2.")] == [
        "", "resumed", "resumed again"]


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """A training subprocess's: 2 CPU devices, and its own W&B service (WANDB_SERVICE would attach it to the one
    this process started for the in-process tests)."""
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_NUM_CPU_DEVICES", "XLA_FLAGS", "WANDB_SERVICE")}
    return {**env, "JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": "2", **extra}


# Slow enough steps (~0.1 s on 2 cores) that the trackers, which open a few seconds after the start, log past a
# checkpoint while the run still trains.
# Long enough that the trackers (whose imports take seconds in their threads) log past a checkpoint before the end.
# A train line every LOG_EVERY steps: on a loaded machine, trackers logging every step fell further behind the run
# than a checkpoint interval, and the run ended before they were past its last checkpoint (the kill's premise).
LOG_EVERY = 5
SLOW_ARGS = ["--config.model.kwargs.hidden_sizes=(1024,1024)", "--config.train.global_batch_size=512",
             "--config.train.steps=120", "--config.train.eval_every=20", "--config.checkpoint.every_steps=20",
             f"--config.train.log_every={LOG_EVERY}"]


def _logged(workdir: Path, name: str) -> int:
    try:
        return json.loads((workdir / "trackers" / f"{name}.json").read_text()).get("train", 0)
    except (OSError, ValueError):
        return 0


def _checkpoints(workdir: Path) -> list[int]:
    return sorted(int(p.name) for p in (workdir / "checkpoints").glob("*") if p.name.isdigit()
                  and (p / "commit_success.txt").exists())


@pytest.mark.slow
@needs_trackers
def test_a_killed_run_resumes_into_the_same_tracked_runs(tmp_path):
    """`metrics.loggers=wandb,mlflow` from the command line, SIGKILLed once both trackers logged past its last
    checkpoint, then the same command: one MLflow run and one W&B run id hold each step once, as metrics.jsonl."""
    store, workdir = tmp_path / "mlruns", tmp_path / "run"
    cmd = [sys.executable, "-m", "jdp.train", *CLI_ARGS, *SLOW_ARGS,
           f"--config.metrics.mlflow_tracking_uri={store.as_uri()}", "--workdir", str(workdir)]
    with open(tmp_path / "killed.log", "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(tmp_path), stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 150
        while proc.poll() is None and time.monotonic() < deadline:
            done = _checkpoints(workdir)
            # A tracker records a step before it sends it: two lines past the checkpoint, the first one is sent.
            if done and min(_logged(workdir, "mlflow"), _logged(workdir, "wandb")) >= done[-1] + 2 * LOG_EVERY:
                proc.kill()
                break
            time.sleep(0.02)
    finally:
        proc.kill()
        proc.wait(timeout=30)
    assert proc.returncode == -9, (tmp_path / "killed.log").read_text()[-3000:]
    resume_from = _checkpoints(workdir)[-1]
    (run,) = mlflow_runs(store, "tests")
    assert max(s for s, _ in mlflow_points(store, run.info.run_id, "loss")) > resume_from  # the premise

    out = subprocess.run(cmd, cwd=ROOT, env=_env(tmp_path), capture_output=True, text=True, timeout=150)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"checkpoints/{resume_from}" in out.stdout
    (run,) = mlflow_runs(store, "tests")
    assert run.info.status == "FINISHED"
    assert mlflow_points(store, run.info.run_id, "loss") == jsonl_points(workdir, "train", "loss")
    assert mlflow_points(store, run.info.run_id, "eval_loss") == jsonl_points(workdir, "eval", "loss")
    assert json.loads(run.data.params["config.train.steps"]) == 120  # the CLI's config beside the record
    # W&B buffers (its run file is written every 15 s): what the SIGKILL cost it, the rerun logs from metrics.jsonl.
    runs = wandb_runs(workdir)
    run_id = json.loads((workdir / "trackers" / "wandb.json").read_text())["run_id"]
    assert [r["dir_id"] for r in runs] == [run_id, run_id] and runs[1]["id"] == run_id, out.stderr[-3000:]
    assert wandb_points(runs, "loss") == jsonl_points(workdir, "train", "loss")
    assert wandb_points(runs, "eval_loss") == jsonl_points(workdir, "eval", "loss")
    assert runs[1]["config"]["config"]["metrics"]["loggers"] == "wandb,mlflow"


@pytest.mark.slow
@needs_trackers
def test_only_process_0_opens_a_tracked_run(tmp_path):
    store, workdir = tmp_path / "mlruns", tmp_path / "run"
    out = subprocess.run([sys.executable, "-m", "jdp.launch", "--nprocs", "2", "--cpu_devices", "2", "--",
                          sys.executable, "-m", "jdp.train", *CLI_ARGS, "--config.train.eval_every=12",
                          f"--config.metrics.mlflow_tracking_uri={store.as_uri()}", "--workdir", str(workdir)],
                         cwd=ROOT, env=_env(tmp_path), capture_output=True, text=True, timeout=200)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    (run,) = mlflow_runs(store, "tests")
    assert mlflow_points(store, run.info.run_id, "loss") == jsonl_points(workdir, "train", "loss")
    (wandb_dir,) = (workdir / "wandb").glob("offline-run-*")
    assert wandb_points([wandb_run(wandb_dir)], "loss") == jsonl_points(workdir, "train", "loss")


class SilentServer:
    """A loopback server that accepts connections and never answers."""

    def __init__(self) -> None:
        self.socket = socket.create_server(("127.0.0.1", launch.free_port()))
        self.port = self.socket.getsockname()[1]
        self.connections: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                self.connections.append(self.socket.accept()[0])
            except OSError:
                return

    def close(self) -> None:
        self.socket.close()
        for connection in self.connections:
            connection.close()


SILENT_SCRIPT = """
import json, sys, time
import jax
jax.config.update("jax_num_cpu_devices", 8)
sys.path.insert(0, {tests!r})
import jdp
import wandb
from test_loggers import fit
from jdp.loggers import MLflow, WandB

class Clock(jdp.Callback):
    def __init__(self):
        self.lines = []
    def on_line(self, line):
        self.lines.append((line["split"], time.perf_counter()))

clock = Clock()
trackers = [MLflow(tracking_uri="http://127.0.0.1:{port}", close_timeout_s={bound}),
            WandB(project="tests", mode="online", close_timeout_s={bound},
                  settings=wandb.Settings(init_timeout={init_timeout}))]
fit({workdir!r}, [clock, *trackers], steps={steps})
returned = time.perf_counter()
train = [t for split, t in clock.lines if split == "train"]
print(json.dumps({{"gap": max(b - a for a, b in zip(train, train[1:])), "end": returned - clock.lines[-1][1],
                  "exit_from": time.time()}}), flush=True)
"""


@pytest.mark.slow
@needs_trackers
def test_a_tracker_that_never_answers_stalls_nothing(tmp_path):
    """MLflow's tracking server and W&B's both accept connections and stay silent. The train lines come without a
    stall (their clients wait 90-120 s for an answer), `fit` returns within `close_timeout_s` (2 s here) per
    logger of its last line, and the process exits once W&B's own exit hook gives up on its server (after its
    `init_timeout`, 90 s by default, 10 s here)."""
    server, bound, steps, init_timeout = SilentServer(), 2.0, 20, 10
    env = _env(tmp_path, WANDB_MODE="online", WANDB_BASE_URL=f"http://127.0.0.1:{server.port}",
               WANDB_API_KEY="x" * 40)
    env.update({k: str(tmp_path / k) for k in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR")})
    script = SILENT_SCRIPT.format(tests=str(ROOT / "tests"), workdir=str(tmp_path / "run"), steps=steps,
                                  port=server.port, bound=bound, init_timeout=init_timeout)
    try:
        out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                             timeout=240)
        exited = time.time()
    finally:
        server.close()
    assert out.returncode == 0, out.stderr[-3000:]
    assert len(server.connections) >= 2, "the trackers never connected"
    times = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"longest gap between train lines {times['gap']:.2f} s, fit returned {times['end']:.2f} s after its last "
          f"line, the process exited {exited - times['exit_from']:.1f} s after that")
    assert times["gap"] < 10  # far below the clients' own 90-120 s waits; room for a loaded 2-core machine
    assert times["end"] < 2 * bound + 5
    assert exited - times["exit_from"] < init_timeout + 10
    ends = [line for line in out.stderr.splitlines() if f"did not finish within {bound:g} s" in line]
    assert len(ends) == 2, out.stderr[-3000:]
    assert len(records(tmp_path / "run", "train")) == steps


@needs_trackers
def test_a_tracker_that_raises_costs_one_warning(tmp_path, monkeypatch, capfd):
    from mlflow.tracking import MlflowClient

    log_batch = MlflowClient.log_batch

    def failing(self, run_id, metrics=(), **kwargs):
        if any(m.step in (3, 4) for m in metrics):
            raise ConnectionError("the tracking server went away")
        return log_batch(self, run_id, metrics=metrics, **kwargs)

    monkeypatch.setattr(MlflowClient, "log_batch", failing)
    store, workdir = tmp_path / "mlruns", tmp_path / "run"
    result = fit(workdir, [MLflow(tracking_uri=store.as_uri(), experiment="tests")])
    assert result.step == 12
    warnings = [line for line in capfd.readouterr().err.splitlines() if "warning" in line]
    assert len(warnings) == 1 and "mlflow logger: ConnectionError: the tracking server went away" in warnings[0]
    (run,) = mlflow_runs(store, "tests")
    expected = [(s, v) for s, v in jsonl_points(workdir, "train", "loss") if s not in (3, 4)]
    assert mlflow_points(store, run.info.run_id, "loss") == expected  # training and logging went on


@needs_trackers
def test_a_dead_mlflow_server_is_one_warning_in_jdps_format(tmp_path, monkeypatch, capfd, caplog):
    """Nothing listens at the tracking URI: urllib3's `WARNING:urllib3.connectionpool:Retrying ...` (one per retry, in
    Python's logging format once absl has configured it) becomes the logger's one warning, in jdp's format."""
    import logging

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")  # MLflow's client gives up in a second, not minutes
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "0")
    caplog.set_level(logging.WARNING)
    port = launch.free_port()  # a closed port on loopback: every connection is refused
    result = fit(tmp_path / "run", [MLflow(tracking_uri=f"http://127.0.0.1:{port}", close_timeout_s=30)], steps=4)
    assert result.step == 4
    assert [r.getMessage() for r in caplog.records if r.name.startswith("urllib3")] == []
    warnings = [line for line in capfd.readouterr().err.splitlines() if "warning" in line.lower()]
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith("jdp: warning: mlflow logger: urllib3.connectionpool: Retrying (Retry(total=1")
    assert "Connection refused" in warnings[0] and warnings[0].endswith("(this warning is shown once)")


@pytest.mark.slow  # two W&B start-ups: ~9 s
@needs_trackers
def test_a_kill_during_wandbs_start_up_leaves_its_id_for_the_rerun(tmp_path, monkeypatch):
    """W&B's start-up takes seconds; a kill then left an empty `offline-run-...-<id>` directory and no id in
    trackers/wandb.json, so the rerun opened another id (two runs for `wandb sync`). The id is written first."""
    import wandb

    workdir, calls, real_init = tmp_path / "run", [], wandb.init
    state = workdir / "trackers" / "wandb.json"

    def killed(**kwargs):  # what a kill inside wandb.init leaves: its run directory, empty, and no run
        calls.append((kwargs["id"], json.loads(state.read_text()) if state.exists() else None))
        (workdir / "wandb" / f"offline-run-20000101_000000-{kwargs['id']}").mkdir(parents=True)
        raise RuntimeError("killed in wandb.init")

    monkeypatch.setattr(wandb, "init", killed)
    monkeypatch.setenv("JDP_KILL_AT", "raise:7")
    first = WandB(project="tests", mode="offline")
    with pytest.raises(RuntimeError, match="raise:7"):
        fit(workdir, [first])
    first.close()  # what the process's exit does: the lines sent, so wandb.init was called
    monkeypatch.setattr(wandb, "init", real_init)
    monkeypatch.delenv("JDP_KILL_AT")
    fit(workdir, [WandB(project="tests", mode="offline")])
    wandb_finished(workdir)
    empty, run = wandb_runs(workdir)
    assert calls == [(run["id"], {"run_id": run["id"]})]  # the id was on disk before W&B started
    assert empty["dir_id"] == run["dir_id"] == run["id"] and empty["history"] == []  # one run id for `wandb sync`
    assert wandb_points([run], "loss") == jsonl_points(workdir, "train", "loss")  # every step, from metrics.jsonl


def test_a_missing_package_or_an_unknown_name_is_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed
    with pytest.raises(UsageError, match=re.escape('needs the wandb package, which is not installed: pip install '
                                                   '"jdp[wandb]"')):
        WandB(project="tests")
    cfg = small_config("mlp")
    cfg.metrics.loggers = "mlflow, wandb"
    with pytest.raises(config_lib.ConfigError, match=re.escape('the wandb logger needs the wandb package, which is '
                                                               'not installed: pip install "jdp[wandb]"')):
        config_lib.validate(cfg)
    for spec, message in (("tensorboard", "names an unknown logger 'tensorboard'; choose from wandb, mlflow"),
                          ("mlflow,mlflow", "names mlflow twice")):
        code = main(["--config", "configs/mnist1d_mlp.py", f"--config.metrics.loggers={spec}",
                     "--workdir", str(tmp_path / "run")])
        err = capsys.readouterr().err
        assert code == 2 and len(err.strip().splitlines()) == 1 and message in err, err


@needs_trackers
@pytest.mark.parametrize("made, refusal", [
    ("MLflow(tracking_uri='::::')", "MLflow(tracking_uri='::::') is neither a URI"),
    ("MLflow(tracking_uri=5)", "MLflow(tracking_uri=5) must be a string, or None"),  # was a raw TypeError
    ("WandB(close_timeout_s='x')", "close_timeout_s='x' must be a number of seconds, at least 0"),  # TypeError too
    ("WandB(project=3)", "WandB(project=3) must be a string, or None"),  # lost the run behind a pydantic warning
])
def test_a_tracker_refused_in_a_script_is_one_line_and_exit_2(made, refusal):
    """Before fit installed jdp's exception hook, an uncaught refusal was a traceback and exit 1."""
    out = subprocess.run([sys.executable, "-c", f"from jdp.loggers import MLflow, WandB; {made}"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and out.stderr.startswith(f"jdp: error: {refusal}"), out.stderr[-2000:]
    assert out.stderr.count("\n") == 1, out.stderr[-2000:]


@pytest.mark.slow
@needs_trackers
def test_the_docs_tracker_command_runs(tmp_path):
    """docs/trackers.md's command as printed, from a directory holding the configs folder: W&B offline in the
    workdir, MLflow in ./mlruns."""
    from tests.test_readme import doc_command

    (tmp_path / "configs").symlink_to(ROOT / "configs")
    command = doc_command("WANDB_MODE=offline python -m jdp.train")
    assignments = dict(arg.split("=", 1) for arg in command[:command.index("python")])
    args = command[command.index("python") + 1:]
    env = {**_env(tmp_path), **assignments, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, *args], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    workdir = tmp_path / command[command.index("--workdir") + 1]
    (run,) = mlflow_runs(tmp_path / "mlruns", "Default")
    assert mlflow_points(tmp_path / "mlruns", run.info.run_id, "loss") == jsonl_points(workdir, "train", "loss")
    (wandb_dir,) = (workdir / "wandb").glob("offline-run-*")
    assert wandb_points([wandb_run(wandb_dir)], "loss") == jsonl_points(workdir, "train", "loss")
    print(shlex.join(command))


def test_a_package_already_imported_without_a_spec_counts_as_installed(monkeypatch):
    """A stub module in sys.modules (a test double, a lazily made module) has no __spec__, where find_spec raises."""
    monkeypatch.setitem(sys.modules, "jdp_stub_tracker", types.ModuleType("jdp_stub_tracker"))
    monkeypatch.setitem(sys.modules, "jdp_blocked_tracker", None)
    assert loggers.base.installed("jdp_stub_tracker") and not loggers.base.installed("jdp_blocked_tracker")
