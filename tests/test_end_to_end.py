"""The shipped MNIST-1D configs, run as a user would, reach the MNIST-1D paper's accuracies."""

import subprocess
import sys

import pytest

from jdp.metrics import read_metrics

pytestmark = pytest.mark.slow  # full CLI trainings: outside the fast tier

# The MNIST-1D paper (Greydanus, 2020) reports 94% test accuracy for its CNN and 68% for its MLP.
PAPER_ACCURACY = {"mnist1d_cnn": 0.94, "mnist1d_mlp": 0.68}
POINTS_BELOW_PAPER = {"mnist1d_cnn": 0.03, "mnist1d_mlp": 0.0}


@pytest.mark.timeout(400)
def test_the_mlp_config_reaches_the_paper_accuracy(tmp_path):
    """(The CNN config is the default: tests/test_readme.py runs it as the README's quick start.)"""
    out = subprocess.run([sys.executable, "-m", "jdp.train", "--config", "configs/mnist1d_mlp.py",
                          "--workdir", str(tmp_path)], capture_output=True, text=True, timeout=360)
    assert out.returncode == 0, out.stderr[-2000:]
    check_finished_run(tmp_path, "mnist1d_mlp")


def check_finished_run(workdir, name: str) -> None:
    """Config `name`'s run in `workdir` reached the paper's accuracy and wrote every metric and file."""
    lines = read_metrics(workdir)
    summary = lines[-1]
    assert summary["split"] == "summary" and summary["examples_per_sec"] > 0 and summary["compile_time_s"] > 0
    assert summary["eval_accuracy"] >= PAPER_ACCURACY[name] - POINTS_BELOW_PAPER[name], summary
    train = [r for r in lines if r["split"] == "train"]
    assert {"step", "loss", "accuracy", "lr", "examples_per_sec", "wall_time"} <= set(train[0])
    assert [r["step"] for r in train] == sorted({r["step"] for r in train})  # one line per logged step
    assert any(p.name.startswith("events") for p in (workdir / "tensorboard").iterdir())
