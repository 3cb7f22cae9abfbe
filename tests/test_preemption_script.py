"""A plain script that calls `jdp.fit` and gets SIGTERM exits 75 in one line, as `python -m jdp.train` does, and its
rerun resumes bitwise."""

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import jdp
from jdp import preemption
from jdp.files import committed_steps

ROOT = Path(__file__).resolve().parents[1]

# Trains a tiny MLP into argv[1] and saves the final parameters to argv[2]; SIGTERMs itself after step
# $SIGTERM_AT_STEP. The env (JAX_COMPILATION_CACHE_DIR from conftest) shares the compilation cache.
SCRIPT = textwrap.dedent("""
    import os, signal, sys

    import jax

    jax.config.update("jax_num_cpu_devices", 2)

    import numpy as np
    import optax
    from flax import nnx

    import jdp


    class MLP(nnx.Module):
        def __init__(self, rngs):
            self.hidden, self.out = nnx.Linear(6, 16, rngs=rngs), nnx.Linear(16, 1, rngs=rngs)

        def __call__(self, x):
            return self.out(nnx.relu(self.hidden(x)))[:, 0]


    def mse(model, batch):
        return {"loss": (model(batch["x"]) - batch["y"]) ** 2}


    class SigtermAt:
        every = 1

        def __init__(self, step):
            self.step = step

        def on_step(self, step, metrics, state):
            if step == self.step:
                for _ in range(int(os.environ.get("SIGTERMS", "1"))):
                    os.kill(os.getpid(), signal.SIGTERM)

        def on_end(self, result):
            pass


    x = np.random.default_rng(0).normal(size=(256, 6)).astype(np.float32)
    data = {"x": x, "y": np.sin(x).sum(1).astype(np.float32)}
    kill_at = int(os.environ.get("SIGTERM_AT_STEP", "0"))
    result = jdp.fit(MLP(nnx.Rngs(0)), mse, data, optimizer=optax.sgd(0.05), steps=24, global_batch_size=32,
                     num_devices=2, workdir=sys.argv[1], checkpoint_every=4, log_every=100,
                     callbacks=[SigtermAt(kill_at)] if kill_at else [])
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # fit put the handlers back
    leaves = jax.tree_util.tree_flatten_with_path(result.params)[0]
    np.savez(sys.argv[2], **{jax.tree_util.keystr(path): np.asarray(leaf) for path, leaf in leaves})
""")


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "train_script.py"
    path.write_text(SCRIPT)

    def run(workdir, env=None):
        proc = subprocess.Popen([sys.executable, str(path), str(workdir), str(workdir) + ".npz"], cwd=ROOT,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env={**os.environ, **(env or {})})
        try:
            out, err = proc.communicate(timeout=180)
        finally:
            proc.kill()
        return proc.returncode, out, err

    return run


def preempted_lines(err):
    return [line for line in err.splitlines() if line.startswith("jdp: preempted")]


def params(workdir):
    with np.load(str(workdir) + ".npz") as f:
        return {k: f[k] for k in f.files}


@pytest.mark.slow
def test_a_sigterm_in_the_steps_exits_75_in_one_line_and_the_rerun_resumes_bitwise(script, tmp_path):
    code, out, err = script(tmp_path / "run", env={"SIGTERM_AT_STEP": "5"})
    assert code == 75, err
    assert "Traceback" not in err, err
    assert preempted_lines(err) == [f"jdp: preempted: SIGTERM at step 6: checkpoint written to "
                                    f"{tmp_path / 'run' / 'checkpoints' / '6'}; rerun the same command to resume"]
    code, out, err = script(tmp_path / "run")
    assert code == 0, err
    assert f"resumed from {tmp_path / 'run' / 'checkpoints' / '6'}" in out
    code, _, err = script(tmp_path / "uninterrupted")
    assert code == 0, err
    resumed, uninterrupted = params(tmp_path / "run"), params(tmp_path / "uninterrupted")
    assert resumed.keys() == uninterrupted.keys() and len(resumed) == 4
    assert all(np.array_equal(resumed[k], uninterrupted[k]) for k in resumed)


def test_a_second_sigterm_in_the_steps_exits_143_at_once_without_a_checkpoint(script, tmp_path):
    code, _, err = script(tmp_path / "run", env={"SIGTERM_AT_STEP": "5", "SIGTERMS": "2"})
    assert code == 128 + signal.SIGTERM, err
    assert err.splitlines()[-1] == "jdp: second SIGTERM: exiting now, without a checkpoint"
    assert set(committed_steps(tmp_path / "run")) <= {4}  # step 4's save, async, may have been cut short
    code, out, err = script(tmp_path / "run")  # and the rerun resumes from what was committed
    assert code == 0, err


@pytest.mark.slow
def test_a_sigterm_during_the_restore_exits_75_in_one_line(script, tmp_path):
    """Outside the steps nothing is lost: the script exits at once, as the CLI does."""
    code, _, err = script(tmp_path / "run", env={"JDP_KILL_AT": "restore:0"})
    assert code == 75, err
    assert "Traceback" not in err, err
    assert preempted_lines(err) == [
        "jdp: preempted: SIGTERM outside the training steps; exiting with code 75 (no step was lost: a rerun "
        "resumes from the last checkpoint, or starts over without one)"]


@pytest.mark.parametrize("session", ["script", "interactive"])
def test_the_hook_ends_a_script_on_preempted_and_leaves_everything_else(monkeypatch, session):
    seen, exits = [], []
    hook = preemption._PreemptedExits(lambda kind, error, tb: seen.append(kind))
    monkeypatch.setattr(preemption.os, "_exit", exits.append)
    monkeypatch.setattr(preemption.atexit, "_run_exitfuncs", lambda: None)
    if session == "interactive":
        monkeypatch.setattr(sys, "ps1", ">>> ", raising=False)
    hook(ValueError, ValueError("a bug"), None)
    hook(jdp.Preempted, jdp.Preempted("SIGTERM at step 2"), None)
    if session == "script":
        assert seen == [ValueError] and exits == [75]
    else:  # the session shows it and goes on
        assert seen == [ValueError, jdp.Preempted] and exits == []


@pytest.mark.parametrize("error", [jdp.FitError("a refused resume"), jdp.UsageError("a locked workdir")])
def test_the_hook_ends_a_script_on_a_fit_error_in_one_line_with_exit_2(monkeypatch, capsys, error):
    seen, exits = [], []
    hook = preemption._PreemptedExits(lambda kind, error, tb: seen.append(kind))
    monkeypatch.setattr(preemption.os, "_exit", exits.append)
    monkeypatch.setattr(preemption.atexit, "_run_exitfuncs", lambda: None)
    hook(type(error), error, None)
    assert seen == [] and exits == [2]
    assert capsys.readouterr().err == f"jdp: error: {error}\n"


# Trains 4 steps into argv[1]; a rerun with a 10x learning rate is caught (FitError stays an exception); then run.json
# is random bytes, and the rerun's refusal (by the checkpoint's fingerprint of its settings) is left uncaught.
REFUSED = textwrap.dedent("""
    import os, sys
    from pathlib import Path

    import jax

    jax.config.update("jax_num_cpu_devices", 1)

    import numpy as np
    import optax
    from flax import nnx

    import jdp

    x = np.random.default_rng(0).normal(size=(64, 4)).astype(np.float32)
    data = {"x": x, "y": x.sum(1)}
    mse = lambda model, batch: {"loss": (model(batch["x"])[:, 0] - batch["y"]) ** 2}
    run = lambda lr: jdp.fit(nnx.Linear(4, 1, rngs=nnx.Rngs(0)), mse, data, optimizer=optax.sgd(lr), steps=4,
                             global_batch_size=16, workdir=sys.argv[1], log_every=100)
    run(0.05)
    try:
        run(0.5)
    except jdp.FitError as e:
        print("caught:", e)
    Path(sys.argv[1], "run.json").write_bytes(os.urandom(64))
    run(0.5)
    print("not reached")
""")


def test_a_refusal_left_uncaught_in_a_script_is_one_line_and_exit_2(tmp_path):
    path = tmp_path / "refused.py"
    path.write_text(REFUSED)
    out = subprocess.run([sys.executable, str(path), str(tmp_path / "run")], cwd=ROOT, capture_output=True,
                         text=True, timeout=180)
    assert out.returncode == 2, out.stderr
    assert "caught: " in out.stdout and "learning rate" in out.stdout and "not reached" not in out.stdout
    assert "Traceback" not in out.stderr, out.stderr
    errors = [line for line in out.stderr.splitlines() if line.startswith("jdp: error")]
    assert len(errors) == 1 and (f"the settings differ from those checkpoint {tmp_path / 'run' / 'checkpoints' / '4'} "
                                 "was saved under") in errors[0], out.stderr


def test_fit_puts_the_signal_handlers_back(monkeypatch):
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)  # put back after the test
    before = {s: signal.getsignal(s) for s in preemption.PreemptionRequest.SIGNALS}
    with preemption.during_fit():
        assert signal.getsignal(signal.SIGTERM) is preemption._exit_at_once
    assert {s: signal.getsignal(s) for s in preemption.PreemptionRequest.SIGNALS} == before
    assert isinstance(sys.excepthook, preemption._PreemptedExits)
    monkeypatch.setattr(sys, "ps1", ">>> ", raising=False)
    with preemption.during_fit():  # interactive: the handlers stay (SIGINT raises KeyboardInterrupt)
        assert {s: signal.getsignal(s) for s in preemption.PreemptionRequest.SIGNALS} == before


def test_under_jdp_launch_an_event_loops_wakeup_fd_is_left_to_it(monkeypatch, tmp_path):
    """The peer-failure watch needs the signal wakeup fd; where an event loop holds it, the loop keeps it (it was
    cleared to -1, so the loop no longer woke on signals)."""
    monkeypatch.setenv(preemption.LAUNCH_FAILURE_FILE, str(tmp_path / "failure"))
    read, write = os.pipe()
    os.set_blocking(write, False)
    signal.set_wakeup_fd(write)
    try:
        preemption._watch_for_peer_failure()
        assert signal.set_wakeup_fd(-1) == write
    finally:
        signal.set_wakeup_fd(-1)
        os.close(read)
        os.close(write)
