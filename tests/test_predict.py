"""The scaling predictor (`python -m jdp.bench --predict`): its all-reduce times against hand computation, its
step and threshold arithmetic, the gradient bytes of a config's model, and the command on a shipped config."""

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from flax import nnx

from jdp import models
from jdp.cli.config import load_config_file
from jdp.perf import bench, measure, predict, scaling, validation
from jdp.perf.scaling import Link, Topology


def test_ring_allreduce_matches_hand_computation():
    link = Link(bandwidth=1e9, latency=1e-5, about="test")
    # 4 devices, 8 MB: 2*3/4 * 8e6 B / 1e9 B/s = 12 ms of transfer, plus 2*3 steps of 10 us.
    assert scaling.ring_allreduce_s(8e6, 4, link) == pytest.approx(0.012 + 6e-5, rel=1e-12)
    assert scaling.ring_allreduce_s(8e6, 1, link) == 0.0  # one device sends nothing


def test_hierarchical_allreduce_matches_hand_computation():
    topo = Topology(per_node=4, intra=Link(100e9, 2e-6, "in"), inter=Link(10e9, 1e-5, "out"))
    # 16 devices on 4 nodes of 4, 400 MB. Reduce-scatter in the node: 3/4 * 4e8 / 1e11 = 3 ms + 3 * 2 us.
    # Ring across 4 nodes: each GPU's quarter (1e8 B) over a quarter of the node's link (2.5e9 B/s):
    # 2*3/4 * 1e8 / 2.5e9 = 60 ms + 2*3 * 10 us. All-gather in the node: as the reduce-scatter.
    in_node = 0.003 + 3 * 2e-6
    across = 0.06 + 6 * 1e-5
    assert scaling.hierarchical_allreduce_s(4e8, 16, topo) == pytest.approx(2 * in_node + across, rel=1e-12)
    # Within one node it is the plain ring on the node's link.
    assert scaling.hierarchical_allreduce_s(4e8, 4, topo) == scaling.ring_allreduce_s(4e8, 4, topo.intra)
    with pytest.raises(ValueError, match="do not fill nodes of 4"):
        scaling.hierarchical_allreduce_s(4e8, 6, topo)


def test_step_time_efficiency_and_thresholds():
    topo = Topology(per_node=8, intra=Link(1e9, 0.0, "in"), inter=Link(1e9, 1e-6, "out"))
    nbytes, one_step, batch = 7e6, 0.016, 64
    rows = scaling.predict(nbytes, one_step, batch, [1, 8, 16], topo, scaling="strong")
    one, eight, sixteen = rows
    assert one["allreduce_s"] == 0.0 and one["efficiency"] == 1.0
    # 8 devices: compute 16 ms / 8 = 2 ms; all-reduce 2*7/8 * 7e6 / 1e9 = 12.25 ms, none of it hidden at overlap 0.
    assert eight["compute_s"] == pytest.approx(0.002)
    assert eight["allreduce_s"] == pytest.approx(0.01225)
    assert eight["step_s"] == pytest.approx(0.01425)
    assert eight["efficiency"] == pytest.approx(0.002 / 0.01425)
    # With the backward's 2/3 of the compute overlapping, only the rest is exposed.
    assert eight["step_s_overlap"] == pytest.approx(0.002 + 0.01225 - 2 / 3 * 0.002)
    # At the threshold per-device batch the compute equals the all-reduce; at the threshold bytes likewise.
    assert eight["threshold_batch"] * one_step / batch == pytest.approx(eight["allreduce_s"])
    crossing = scaling.hierarchical_allreduce_s(sixteen["threshold_bytes"], 16, topo)
    assert crossing == pytest.approx(sixteen["compute_s"])
    weak = scaling.predict(nbytes, one_step, batch, [8], topo, scaling="weak")[0]
    assert weak["per_device_batch"] == batch and weak["compute_s"] == one_step


def test_gradient_bytes_follow_the_model_and_the_allreduce_dtype():
    cfg = load_config_file("configs/digits_mlp.py")
    params, nbytes = predict.gradient_bytes(cfg, (64,), 10)
    built = models.build_model("mlp", cfg.model.kwargs.to_dict(), (64,), 10, seed=0)
    assert params == models.count_params(nnx.state(built, nnx.Param)) == 64 * 128 + 128 + 128 * 10 + 10
    assert nbytes == 4 * params
    cfg.parallel.allreduce_dtype = "bf16"
    assert predict.gradient_bytes(cfg, (64,), 10)[1] == 2 * params
    # Without a shape, the model is built from the config's own data (8x8 digits, 10 classes): the same model.
    cfg.parallel.allreduce_dtype = "fp32"
    assert predict.gradient_bytes(cfg) == (params, nbytes)


def test_validation_table_covers_every_published_case():
    rows = validation.validate()
    assert len(rows) == len(validation.CASES) >= 3
    for r in rows:  # hiding part of the all-reduce can only help; nothing beats linear scaling
        assert 0 < r["no_overlap"] <= r["overlap"] <= 1
    table = validation.to_markdown(rows)
    assert all(c.name in table for c in validation.CASES)


def test_bad_predict_input_is_one_line_and_exit_2(capsys):
    assert bench.main(["--predict", "--config", "configs/digits_mlp.py", "--step_ms", "1", "--devices", "1,12"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "jdp.bench --predict: 12 devices do not fill nodes of 8; use a multiple of --per_node"


@pytest.mark.slow
def test_readme_prediction_commands_run_as_printed():
    """The README's commands as a user runs them, on a shipped config: --step_ms, so nothing is measured or
    trained, and --input_shape, so the ImageNet data is not needed."""
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    section = readme[readme.index("## How big a batch, how many devices"):]
    block = section[section.index("```bash") + len("```bash"):section.index("```", section.index("```bash") + 7)]
    commands = [shlex.split(line) for line in block.strip().splitlines()]
    assert [c[:4] for c in commands] == [["python", "-m", "jdp.bench", "--predict"]] * 2
    outs = []
    for command in commands:
        out = subprocess.run([sys.executable, *command[1:]], capture_output=True, text=True, timeout=240,
                             env={**os.environ, "JAX_PLATFORMS": "cpu"})
        assert out.returncode == 0, out.stderr
        outs.append(out.stdout)
    predicted, validated = outs
    assert "25,557,032 parameters" in predicted and "gradient 102.23 MB per all-reduce" in predicted
    rows = [line.split("|") for line in predicted.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert [int(r[1]) for r in rows] == [1, 8, 64, 512]
    assert [r[7].strip() for r in rows[1:3]] == ["98.4%", "27.8%"]  # the figures the README quotes
    assert all(c.name in validated for c in validation.CASES)


def test_without_step_ms_the_step_is_measured_on_one_device():
    """`--predict` without `--step_ms` times jdp.bench's one-device step (it had called a removed function)."""
    cfg = load_config_file("configs/synthetic_mlp.py")
    cfg.model.kwargs.hidden_sizes = (16,)
    cfg.train.global_batch_size = 16
    assert 0 < measure.one_device_step_s(cfg, steps=2, repeats=2) < 5
