"""Checkpoints, exact resume and failure handling."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from jdp import params_file
from jdp.cli import export
from jdp.cli.optim import learning_rate
from jdp.cli.train import main, run
from jdp.data.batching import Batcher
from jdp.parallel import DataParallel
from tests.helpers import records, small_config, train_losses

# A short MLP run with a checkpoint every 4 steps, as a user would type it.
RUN = ["--config", "configs/mnist1d_mlp.py", "--config.model.kwargs.hidden_sizes=(32,)", "--config.train.steps=12",
       "--config.train.log_every=1", "--config.train.eval_every=6", "--config.checkpoint.every_steps=4"]
ENV = {**os.environ, "JAX_NUM_CPU_DEVICES": "2"}
ROOT = Path(__file__).resolve().parents[1]


def train(workdir, *args, env=None, timeout=120):
    return subprocess.run([sys.executable, "-m", "jdp.train", "--workdir", str(workdir), *args],
                          capture_output=True, text=True, timeout=timeout, env={**ENV, **(env or {})})


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run's workdir."""
    workdir = tmp_path_factory.mktemp("uninterrupted")
    out = train(workdir, *RUN)
    assert out.returncode == 0, out.stderr
    return workdir


@pytest.fixture(scope="module")
def uninterrupted(reference):
    return train_losses(reference)


@pytest.mark.parametrize("kill_at", ["step:7", "save:8"])
@pytest.mark.slow
def test_a_killed_run_resumes_bitwise(kill_at, uninterrupted, tmp_path):
    """SIGKILL right after step 7, or in the middle of writing checkpoint 8: the rerun (with only
    --workdir, so WORKDIR/config.json is used) resumes from the last complete checkpoint."""
    out = train(tmp_path, *RUN, env={"JDP_KILL_AT": kill_at})
    assert out.returncode == -signal.SIGKILL
    out = train(tmp_path)
    assert out.returncode == 0, out.stderr
    assert "resumed from" in out.stdout and "checkpoints/4" in out.stdout
    assert train_losses(tmp_path) == uninterrupted  # bitwise, and no duplicate steps


@pytest.mark.slow
def test_a_real_kill_at_an_arbitrary_moment(tmp_path):
    args = [*RUN, "--config.train.steps=400", "--config.checkpoint.every_steps=50", "--config.train.eval_every=400"]
    reference = tmp_path / "reference"
    assert train(reference, *args).returncode == 0
    proc = subprocess.Popen([sys.executable, "-m", "jdp.train", "--workdir", str(tmp_path / "run"), *args],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=ENV)
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "run" / "checkpoints" / "50").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.13)
        proc.kill()
    finally:
        proc.wait(timeout=30)
    assert (tmp_path / "run" / "checkpoints" / "50").exists()  # the kill came after the first checkpoint
    out = train(tmp_path / "run")
    assert out.returncode == 0, out.stderr
    assert train_losses(tmp_path / "run") == train_losses(reference)


@pytest.mark.slow
def test_a_crash_campaign_of_three_kills():
    """benchmarks/crash_campaign.py, small: one run killed three times at seeded moments (seed 1: twice during a save,
    once from outside), then rerun and compared bitwise with an uninterrupted run."""
    out = subprocess.run([sys.executable, "benchmarks/crash_campaign.py", "--kills", "3", "--kills_per_run", "3",
                          "--seed", "1", "--steps", "12"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env=ENV)
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    assert out.stdout.splitlines()[-1] == "survived 3 / tried 3"


@pytest.mark.slow
def test_sigterm_checkpoints_and_exits_75(tmp_path):
    args = [*RUN, "--config.train.steps=100000", "--config.checkpoint.every_steps=0"]
    proc = subprocess.Popen([sys.executable, "-m", "jdp.train", "--workdir", str(tmp_path), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "metrics.jsonl").exists() or len(train_losses(tmp_path)) < 20:
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 75, err
    assert "preempted: SIGTERM at step" in err and "checkpoint written to" in err
    step = int(err.split("SIGTERM at step ")[1].split(":")[0])
    assert (tmp_path / "checkpoints" / str(step)).is_dir()
    out = train(tmp_path, f"--config.train.steps={step + 2}")
    assert out.returncode == 0, out.stderr
    assert f"resumed from {tmp_path / 'checkpoints' / str(step)}" in out.stdout
    assert "warning: train.steps changed from 100000" in out.stdout
    assert [s for s, _ in train_losses(tmp_path)][-3:] == [step, step + 1, step + 2]


def evals(workdir):
    return [(r["step"], r["loss"], r["accuracy"]) for r in records(workdir, "eval")]


def _change_a_stored_value(checkpoint):
    """Rewrites one value of the stored first kernel through tensorstore (the store orbax writes): the checkpoint
    stays readable and consistent, with a wrong value, as flipped bits in its data file can leave it."""
    import tensorstore as ts

    kernel = ts.open({"driver": "zarr", "kvstore": {"driver": "ocdbt", "base": f"file://{checkpoint / 'state'}",
                                                    "path": "params.layers.0.kernel/"}}).result()
    kernel[3, 5].write(kernel[3, 5].read().result() + 1).result()


@pytest.mark.slow
def test_a_damaged_checkpoint_is_moved_aside_and_saved_anew(reference, tmp_path):
    assert train(tmp_path, *RUN).returncode == 0
    damaged = tmp_path / "checkpoints" / "12"
    _change_a_stored_value(damaged)  # the final checkpoint: without digests it restores without complaint
    out = train(tmp_path)  # the same run again
    assert out.returncode == 0, out.stderr
    assert (f"warning: checkpoint {damaged} is unusable: the digest of .params['layers'][0]['kernel'] does not match "
            "the one saved with it (damaged bytes); trying the previous one") in out.stdout
    assert f"warning: moved the damaged checkpoint {damaged} to {tmp_path / 'rejected' / '12'}" in out.stdout
    assert "resumed from" in out.stdout and "checkpoints/8" in out.stdout
    assert train_losses(tmp_path) == train_losses(reference)  # steps 9-12 trained again, bitwise
    assert evals(tmp_path) == evals(reference)
    out = train(tmp_path)  # step 12 was saved anew: nothing to do, nothing unusable
    assert out.returncode == 0 and "nothing to do" in out.stdout and "unusable" not in out.stdout, out.stdout

    for step in ("4", "8", "12"):
        for path in (tmp_path / "checkpoints" / step).rglob("*"):
            if path.is_file():
                path.unlink()
    out = train(tmp_path, "--config.train.steps=20")
    assert out.returncode == 2
    assert f"no usable checkpoint in {tmp_path / 'checkpoints'}" in out.stderr and "Traceback" not in out.stderr
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["12", "4", "8"]  # none usable: none moved


@pytest.mark.slow
def test_a_kill_before_an_eval_loses_no_result(reference, tmp_path):
    """Killed after checkpoint 12 was written, before its (final) eval: the rerun writes that eval and the summary,
    and nothing else; a further rerun writes nothing; a run resumed at such a step redoes its eval."""
    finished, extended = tmp_path / "finished", tmp_path / "extended"
    assert train(finished, *RUN, env={"JDP_KILL_AT": "step:12"}).returncode == -signal.SIGKILL
    shutil.copytree(finished, extended)
    holder = (finished / "jdp.lock").read_text()  # the killed process's lock file: it does not block the rerun
    out = train(finished)
    assert out.returncode == 0 and "nothing to do" in out.stdout, out.stderr
    assert (finished / "jdp.lock").read_text() != holder
    assert evals(finished) == evals(reference)
    assert [r["split"] for r in records(finished, "summary")] == ["summary"]
    written = {p: p.read_bytes() for p in finished.rglob("*") if p.is_file() and p.name != "jdp.lock"}
    out = train(finished)  # rerunning the finished run: nothing to do, nothing written, the summary kept
    assert out.returncode == 0 and "nothing to do" in out.stdout, out.stderr
    assert {p: p.read_bytes() for p in finished.rglob("*") if p.is_file() and p.name != "jdp.lock"} == written

    out = train(extended, "--config.train.steps=16")
    assert out.returncode == 0, out.stderr
    assert evals(extended)[:2] == evals(reference)
    lines = [(r["split"], r.get("step")) for r in records(extended, "train") + records(extended, "eval")]
    assert lines.count(("eval", 12)) == 1 and ("eval", 16) in lines
    history = [json.loads(line) for line in (extended / "config_history.jsonl").read_text().splitlines()]
    assert [(h["latest_checkpoint_step"], h["config"]["train"]["steps"]) for h in history] == [(0, 12), (12, 16)]


@pytest.mark.slow
def test_sigterm_during_start_up_or_restore_exits_75(tmp_path):
    """Safe to requeue: nothing was trained since the last checkpoint."""
    out = train(tmp_path, *RUN, env={"JDP_KILL_AT": "restore:0"})  # SIGTERM while restoring
    assert out.returncode == 75, out.stderr
    assert out.stderr.strip().splitlines()[-1] == (
        "jdp: preempted: SIGTERM outside the training steps; exiting with code 75 (no step was lost: a rerun "
        "resumes from the last checkpoint, or starts over without one)")
    proc = subprocess.Popen([sys.executable, "-m", "jdp.train", "--workdir", str(tmp_path), *RUN],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    time.sleep(1.0)  # still importing JAX (about 3 s here)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 75 and "Traceback" not in err, err


@pytest.mark.slow
def test_a_changed_model_is_refused_with_the_differing_keys(tmp_path):
    assert train(tmp_path, *RUN).returncode == 0
    out = train(tmp_path, *RUN, "--config.model.kwargs.hidden_sizes=(64,)", "--config.optim.lr=0.5")
    assert out.returncode == 2
    assert "model.kwargs.hidden_sizes: (32,) -> (64,)" in out.stderr and "optim.lr: 0.01 -> 0.5" in out.stderr
    assert "allow_config_change=True" in out.stderr
    # Allowed on purpose, the shapes no longer fit: a config change, not damage, so nothing is moved aside.
    out = train(tmp_path, *RUN, "--config.model.kwargs.hidden_sizes=(64,)",
                "--config.checkpoint.allow_config_change=True")
    assert out.returncode == 2
    assert (f"checkpoint {tmp_path / 'checkpoints' / '12'} does not fit this model (.params['layers'][0]['bias'] is "
            "float32(32,) there, float32(64,) in the model)") in out.stderr
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["12", "4", "8"]
    assert not (tmp_path / "rejected").exists()


@pytest.mark.slow
def test_elastic_restore_from_8_devices_to_4_and_1(tmp_path):
    cfg = small_config("resnet", steps=4, num_devices=8)
    reference = run(small_config("resnet", steps=8, num_devices=8), tmp_path / "reference")
    run(cfg, tmp_path / "run")
    for num_devices, steps in ((4, 6), (1, 8)):
        cfg = small_config("resnet", steps=steps, num_devices=num_devices)
        result = run(cfg, tmp_path / "run")
    got = [loss for _, loss in train_losses(tmp_path / "run")]
    np.testing.assert_allclose(got, reference.losses, rtol=1e-4)
    for a, b in zip(jax.tree.leaves(result.params), jax.tree.leaves(reference.params), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_the_replica_guard_stops_a_run_whose_copies_differ(monkeypatch, tmp_path, capsys):
    original = DataParallel.train_step
    calls = []

    def corrupt_device_5_at_step_3(self, state, batch):
        state, metrics = original(self, state, batch)
        calls.append(1)
        if len(calls) == 3:
            bias = state.params["layers"][0]["bias"]
            shards = [s.data for s in bias.addressable_shards]
            shards[5] = shards[5] + 1.0
            bias = jax.make_array_from_single_device_arrays(bias.shape, bias.sharding, shards)
            state = state._replace(params={**state.params, "layers": {**state.params["layers"],
                                                                      0: {**state.params["layers"][0], "bias": bias}}})
        return state, metrics

    monkeypatch.setattr(DataParallel, "train_step", corrupt_device_5_at_step_3)
    code = main(["--config", "configs/mnist1d_mlp.py", "--workdir", str(tmp_path), "--config.train.steps=10",
                 "--config.parallel.check_replicas_every=2", "--config.train.eval_every=10"])
    assert code == 4
    err = capsys.readouterr().err
    assert "replicas differ at step 4: first differing parameter ['params']['layers'][0]['bias']" in err


def _nan_at_index(monkeypatch, index):
    original = Batcher.train_batch

    def poisoned(self, step):
        rows = original(self, step)
        return {**rows, "x": np.full_like(rows["x"], np.nan)} if step == index else rows

    monkeypatch.setattr(Batcher, "train_batch", poisoned)


def test_nonfinite_halt_saves_the_state_before_the_bad_step(monkeypatch, tmp_path, capsys):
    args = ["--config", "configs/mnist1d_mlp.py", "--config.train.steps=10", "--config.train.eval_every=10",
            "--config.checkpoint.every_steps=0", "--config.optim.schedule=constant"]
    clean = tmp_path / "clean"
    assert main([*args, "--workdir", str(clean), "--config.train.steps=5"]) == 0
    _nan_at_index(monkeypatch, 5)  # the batch of step 6
    assert main([*args, "--workdir", str(tmp_path / "bad")]) == 3
    assert "non-finite inputs (batch key 'x'), hence the loss (nan) at step 6" in capsys.readouterr().err
    assert sorted(p.name for p in (tmp_path / "bad" / "checkpoints").iterdir()) == ["5"]
    monkeypatch.undo()
    for workdir in (clean, tmp_path / "bad"):
        assert export.main(["--workdir", str(workdir), "--out", str(workdir / "p.npz")]) == 0
    with np.load(clean / "p.npz") as a, np.load(tmp_path / "bad" / "p.npz") as b:
        assert a.files == b.files and all(np.array_equal(a[k], b[k]) for k in a.files)
    # Rerun once the bad batch is gone: the halted run resumes from step 5 and finishes.
    assert main([*args, "--workdir", str(tmp_path / "bad")]) == 0


def test_nonfinite_skip_drops_the_update_and_counts_it(monkeypatch, tmp_path):
    _nan_at_index(monkeypatch, 3)
    skip = {"train": {"on_nonfinite": "skip"}, "checkpoint": {"every_steps": 2},
            "optim": {"name": "sgd", "lr": 0.2, "schedule": "linear"}}
    first = small_config("mlp", steps=6, **skip)
    run(first, tmp_path)
    result = run(small_config("mlp", steps=8, **skip), tmp_path)  # resumed: the count carries over
    train_lines = records(tmp_path, "train")
    assert [r["step"] for r in train_lines] == [1, 2, 3, 5, 6, 7, 8]  # step 4's NaN loss is not logged
    assert train_lines[-1]["skipped_steps"] == 1
    # The logged lr is the one the update used: the schedule stands still over the skipped step.
    schedule = learning_rate(first.optim, first.train.global_batch_size, 6)
    np.testing.assert_allclose([r["lr"] for r in train_lines[:5]], [schedule(n) for n in range(5)], rtol=1e-6)
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(result.params))


@pytest.mark.slow
def test_export_eval_only_and_init_from_work_whatever_device_count_the_run_used(tmp_path):
    """A run on 4 devices, exported and evaluated in processes that have 1 device, started from on 2."""
    first = run(small_config("mlp", steps=2, num_devices=4), tmp_path / "a")
    one_device = {"env": {"JAX_NUM_CPU_DEVICES": "1"}}
    out = subprocess.run([sys.executable, "-m", "jdp.export", "--workdir", str(tmp_path / "a"), "--out",
                          str(tmp_path / "p.npz")], capture_output=True, text=True, timeout=120,
                         env={**os.environ, **one_device["env"]})
    assert out.returncode == 0, out.stderr
    out = train(tmp_path / "a", "--eval_only", **one_device)
    assert out.returncode == 0, out.stderr
    assert records(tmp_path / "a", "eval")[-1]["loss"] == pytest.approx(first.eval_loss, rel=1e-5)
    with np.load(tmp_path / "p.npz") as stored:
        exported = params_file.flatten(first.params, "params")
        assert all(np.array_equal(stored[k], v) for k, v in exported.items())
    second = small_config("mlp", steps=1, num_devices=2, init_from=str(tmp_path / "p.npz"))
    second.optim.lr = 1e-12
    assert run(second, tmp_path / "b").eval_loss == pytest.approx(first.eval_loss, rel=1e-5)


@pytest.mark.slow
def test_export_round_trips_into_a_new_run(tmp_path, capsys):
    first = run(small_config("resnet", steps=3), tmp_path / "a")
    assert export.main(["--workdir", str(tmp_path / "a"), "--out", str(tmp_path / "p.npz")]) == 0
    with np.load(tmp_path / "p.npz") as stored:
        assert "params/stem_conv/kernel" in stored.files and "model_state/stem_bn/mean" in stored.files
        assert int(stored["step"]) == 3
    exported = params_file.flatten(first.params, "params") | params_file.flatten(first.model_state, "model_state")
    params, model_state = params_file.load_into(tmp_path / "p.npz", first.params, first.model_state)
    loaded = params_file.flatten(params, "params") | params_file.flatten(model_state, "model_state")
    assert all(np.array_equal(exported[k], loaded[k]) for k in exported)

    # A new run from the file evaluates like the run it came from, before its first update.
    assert main(["--workdir", str(tmp_path / "a"), "--eval_only"]) == 0
    evals = records(tmp_path / "a", "eval")
    assert evals[-1]["step"] == 3 and evals[-1]["loss"] == pytest.approx(first.eval_loss, rel=1e-6)
    second = small_config("resnet", steps=1, init_from=str(tmp_path / "p.npz"))
    second.optim.lr = 1e-12
    second.model.kwargs.bn_momentum = 1.0  # keep the loaded running statistics through the one step
    result = run(second, tmp_path / "b")
    assert result.eval_loss == pytest.approx(first.eval_loss, rel=1e-5)
