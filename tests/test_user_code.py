"""A model and a loss of the user's own, named by import path in a config beside them: trained by the CLI from
another directory, evaluated, exported, resumed, and refused in one line by the PyTorch comparison."""

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from jdp.cli import config as config_lib
from jdp.errors import UsageError
from tests.helpers import records

NETS = '''
from flax import nnx


class Wide(nnx.Module):
    """Any signature: jdp passes model.kwargs, rngs, and input_shape / num_classes because they are named."""

    def __init__(self, hidden, *, input_shape, num_classes, rngs):
        self.hidden = nnx.Linear(input_shape[0] * input_shape[1], hidden, rngs=rngs)
        self.norm = nnx.BatchNorm(hidden, rngs=rngs)
        self.out = nnx.Linear(hidden, num_classes, rngs=rngs)

    def __call__(self, x):
        return self.out(nnx.relu(self.norm(self.hidden(x.reshape(x.shape[0], -1)))))
'''

LOSSES = '''
import jax.numpy as jnp
import optax


def smoothed(model, batch):
    logits = model(batch["x"]).astype(jnp.float32)
    labels = optax.smooth_labels(jax_one_hot(batch["y"], logits.shape[-1]), 0.1)
    return {"loss": optax.softmax_cross_entropy(logits, labels),
            "accuracy": (logits.argmax(-1) == batch["y"]).astype(jnp.float32)}


def jax_one_hot(y, n):
    return (y[:, None] == jnp.arange(n)).astype(jnp.float32)
'''

CONFIG = '''
from jdp.configs import base


def get_config():
    c = base.get_config()
    c.model.name = "nets:Wide"
    c.model.kwargs.hidden = 32
    c.task.loss = "losses:smoothed"
    c.data.name = "digits"
    c.train.update(steps=6, global_batch_size=32, log_every=1, eval_every=6)
    c.checkpoint.every_steps = 3
    return c
'''


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    folder = tmp_path_factory.mktemp("my_project")
    for name, text in (("nets.py", NETS), ("losses.py", LOSSES), ("my_config.py", CONFIG)):
        (folder / name).write_text(textwrap.dedent(text))
    return folder


def jdp_command(module, *args, cwd):
    return subprocess.run([sys.executable, "-m", module, *map(str, args)], cwd=cwd, capture_output=True, text=True,
                          timeout=180, env={**os.environ, "JAX_NUM_CPU_DEVICES": "2"})


@pytest.mark.slow
def test_a_user_model_and_loss_by_import_path_train_evaluate_export_and_resume(project, tmp_path):
    workdir = tmp_path / "run"
    out = jdp_command("jdp.train", "--config", project / "my_config.py", "--workdir", workdir, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert records(workdir, "eval")[-1]["accuracy"] > 0.3  # 6 steps of 32 digits: well above chance

    out = jdp_command("jdp.train", "--workdir", workdir, "--eval_only", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert len(records(workdir, "eval")) == 2

    out = jdp_command("jdp.export", "--workdir", workdir, "--out", tmp_path / "wide.npz", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    with np.load(tmp_path / "wide.npz") as exported:
        assert {"params/hidden/kernel", "model_state/norm/mean", "step"} <= set(exported)

    out = jdp_command("jdp.train", "--workdir", workdir, "--config.train.steps=9", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "resumed from" in out.stdout and [r["step"] for r in records(workdir, "train")] == list(range(1, 10))

    out = jdp_command("jdp.train", "--config", project / "my_config.py", "--workdir", tmp_path / "again",
                      f"--config.init_from={tmp_path / 'wide.npz'}", "--config.train.steps=1", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "initialised from" in out.stdout


@pytest.mark.slow
def test_an_unknown_import_path_is_one_line(project, tmp_path):
    out = jdp_command("jdp.train", "--config", project / "my_config.py", "--config.model.name=nets:Narrow",
                      cwd=tmp_path)
    assert out.returncode == 2 and out.stderr.strip().splitlines() == [
        "jdp: warning: --config.model.name=nets:Narrow replaces the config file's nets:Wide, so the file's "
        "model.kwargs for it (hidden) are dropped; give the new model's as --config.model.kwargs.KEY=VALUE",
        "jdp: config error: model.name='nets:Narrow': nets has no 'Narrow'"]


def test_the_pytorch_comparison_refuses_a_model_it_has_no_twin_for(project):
    pytest.importorskip("torch")
    from jdp.compare import parity

    cfg = config_lib.load_config_file(project / "my_config.py")
    with pytest.raises(ValueError, match="model.name='nets:Wide': the PyTorch twin has no such model"):
        parity.check_supported(cfg, workers=2)


@pytest.mark.parametrize("source, error", [("raise RuntimeError('no GPU here')", "RuntimeError: no GPU here"),
                                           ("def broken(:\n", "SyntaxError: ")])
def test_a_users_module_that_fails_as_it_imports_is_one_line(source, error, tmp_path, monkeypatch):
    """A model's or a strategy's module whose import raises anything but ImportError (its own error, a typo) was a
    traceback from the CLI; now one line naming the module and its error."""
    from jdp.registry import import_object
    from jdp.sync.flags import from_config

    (tmp_path / "failing.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(UsageError, match=rf"^model.name='failing:Net': importing 'failing' fails \({error}"):
        import_object("failing:Net", "model.name")
    with pytest.raises(ValueError, match=rf"^'failing:Sync' cannot be imported \({error}"):
        from_config("failing:Sync", {})
