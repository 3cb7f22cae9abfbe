"""The gradient noise scale: its estimator fed through the real data-parallel step recovers a known tr(S) and
|G|^2, it costs no collective, and a run reports it with one sentence of batch-size advice."""

import re

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jdp
from jdp import noise_scale
from jdp.cli.train import build, run
from tests.helpers import records, small_config

DIM, NOISE = 8, 1.0
TEACHER = np.full(DIM, 0.5, np.float32)
# At w = 0 the per-example gradient of 0.5 (w.x - y)^2 is -y x, with x ~ N(0, I) and y = w*.x + N(0, NOISE^2):
# its mean is -w*, and its covariance (|w*|^2 + NOISE^2) I + w* w*^T (Isserlis).
TRUE_SQ = float(TEACHER @ TEACHER)
TRUE_TRACE = DIM * (TRUE_SQ + NOISE**2) + TRUE_SQ


class Linear(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.w = nnx.Param(jnp.zeros((DIM,)))

    def __call__(self, x):
        return x @ self.w


def half_squared_error(model, batch):
    return {"loss": 0.5 * (model(batch["x"]) - batch["y"]) ** 2}


class Collect:
    every = 1

    def __init__(self):
        self.estimates = []

    def on_step(self, step, metrics, state):
        self.estimates.append(noise_scale.estimate(metrics["noise_small_sq"], metrics["noise_big_sq"],
                                                   metrics["noise_small_batch"], metrics["weight"]))

    def on_end(self, result):
        pass


def _estimates(steps=100, **options):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((steps * 256, DIM)).astype(np.float32)
    data = {"x": x, "y": (x @ TEACHER + NOISE * rng.standard_normal(len(x))).astype(np.float32)}
    collect = Collect()
    # lr 0: every step estimates at w = 0, where the truth is known.
    result = jdp.fit(lambda: Linear(nnx.Rngs(0)), half_squared_error, data, optimizer=optax.sgd(0.0), steps=steps,
                     global_batch_size=256, log_noise_scale=True, callbacks=[collect], **options)
    return np.array(collect.estimates), result


@pytest.mark.parametrize("options", [dict(num_devices=8), dict(num_devices=1, grad_accum_steps=8)],
                         ids=["devices", "micro_batches"])
def test_the_estimator_recovers_a_known_trace_and_gradient_norm(options):
    """Small batches of 32 against the global 256: each device's slice, or on one device each micro-batch.
    A wrong small-batch size, a gradient scaled by the loss's row count instead of its weight, or a norm
    taken after the average would each miss by far more than the 100-step standard error checked here."""
    estimates, _ = _estimates(**options)
    trace, true_sq = estimates.mean(0)
    stderr = estimates.std(0) / np.sqrt(len(estimates))
    assert abs(trace - TRUE_TRACE) < 4 * stderr[0] and abs(trace - TRUE_TRACE) < 0.1 * TRUE_TRACE
    assert abs(true_sq - TRUE_SQ) < 4 * stderr[1] and abs(true_sq - TRUE_SQ) < 0.1 * TRUE_SQ


def test_a_run_reports_the_noise_scale_and_advice(tmp_path, capsys):
    cfg = small_config("mlp", num_devices=8, steps=6, train={"log_noise_scale": True, "log_every": 2})
    run(cfg, tmp_path)
    train, summary = records(tmp_path, "train"), records(tmp_path, "summary")[-1]
    assert all(r["grad_noise_scale"] is None or r["grad_noise_scale"] > 0 for r in train)
    assert "grad_noise_scale" in summary and "noise_small_sq" not in train[-1]
    assert re.search(r"batch size: global batch 32 against a gradient noise scale", capsys.readouterr().out)


def _all_reduces(cfg) -> list[str]:
    """The compiled step's all-reduces (XLA combines the step's one `pmean` of a pytree into one)."""
    engine = build(cfg)
    state = engine.parallel.to_devices(engine.init_state())
    compiled = engine.parallel.lower_train(state, engine.parallel.shard_batch(engine.source.train_batch(0))).compile()
    return re.findall(r"= \((.*)\) all-reduce(?:-start)?\(", compiled.as_text())


def test_the_noise_scale_rides_in_the_steps_one_collective():
    plain = _all_reduces(small_config("mlp", num_devices=8))
    noise = _all_reduces(small_config("mlp", num_devices=8, train={"log_noise_scale": True}))
    assert len(plain) == len(noise) == 1
    assert noise[0].count("f32[]") == plain[0].count("f32[]") + 1  # one more scalar in the same collective


@pytest.mark.parametrize("options, message", [
    (dict(backend="jit"), "which jit does not have"),
    (dict(sync_every=2, check_replicas_every=2), "which sync_every=2 does not hold on each device"),
    (dict(shard_optimizer=True), "which shard_optimizer=True does not hold"),
    (dict(num_devices=1), "grad_accum_steps > 1")])
def test_settings_without_small_batches_are_refused(options, message):
    with pytest.raises(jdp.FitError, match=message):
        _estimates(steps=2, **options)


def test_advice_follows_the_steps_examples_trade_off():
    assert "cut the steps by about 40%" in noise_scale.advice(250, 1000)
    assert "save only 8% of the steps" in noise_scale.advice(5000, 1000)
    assert "near the critical batch" in noise_scale.advice(1000, 1000)


@pytest.mark.slow
def test_the_critical_batch_sweep_runs_two_points(tmp_path):
    """The smoke version of benchmarks/critical_batch.py: two batch sizes reach the target, the Pareto fit and the
    noise scale at the target come out finite and positive, and the plot is written."""
    import json
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "benchmarks/critical_batch.py", "--batches", "16,128", "--lrs", "1",
                          "--max_steps", "600", "--target", "1.2", "--window", "256", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads((tmp_path / "critical_batch.json").read_text())
    assert [r["batch"] for r in result["best"]] == [16, 128]
    assert result["b_crit"] > 0 and result["b_simple"] > 0 and (tmp_path / "critical_batch.png").stat().st_size
