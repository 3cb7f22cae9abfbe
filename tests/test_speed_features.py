"""Gradient accumulation, mixed precision, compressed all-reduce, sharded optimizer state, local SGD,
profiling and the benchmark command: each must keep the numbers right."""

import contextlib
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jdp import memory
from jdp.cli.config import ConfigError
from jdp.cli.train import build, run
from jdp.perf import bench
from tests.helpers import max_abs_diff, records, small_config


def test_gradient_accumulation_equals_one_big_batch(tmp_path):
    """No BatchNorm: k micro-batches averaged must equal one step on the whole batch."""
    for backend in ("shard_map", "jit"):
        whole = run(small_config("mlp", backend=backend, num_devices=8), tmp_path / f"{backend}-1")
        accumulated = run(small_config("mlp", backend=backend, num_devices=8, train={"grad_accum_steps": 4}),
                          tmp_path / f"{backend}-4")
        np.testing.assert_allclose(accumulated.losses, whole.losses, rtol=1e-5)
        assert max_abs_diff(accumulated.params, whole.params) < 1e-5


def test_gradient_accumulation_must_split_the_batch():
    with pytest.raises(ConfigError, match="does not split into 3 micro-batches on each of 8 devices"):
        build(small_config("mlp", num_devices=8, train={"grad_accum_steps": 3}))


@pytest.mark.parametrize("optimizer", ["momentum", "adamw"])
def test_sharded_optimizer_matches_plain_data_parallelism(optimizer, tmp_path):
    # 33 and 7 units: leaves that 8 devices do not divide, so the padding is exercised.
    sections = {"model": {"kwargs": {"hidden_sizes": (33, 7)}},
                "optim": {"name": optimizer, "lr": 0.05, "grad_clip_norm": 0.5, "weight_decay": 0.1}}
    plain = run(small_config("mlp", num_devices=8, **sections), tmp_path / "plain")
    sharded = run(small_config("mlp", num_devices=8, parallel={"shard_optimizer": True}, **sections),
                  tmp_path / "sharded")
    np.testing.assert_allclose(sharded.losses, plain.losses, rtol=1e-5)
    assert max_abs_diff(sharded.params, plain.params) < 1e-6


def test_sharded_optimizer_memory_and_restore_on_other_device_counts(tmp_path):
    sections = {"optim": {"name": "adamw", "lr": 0.01}, "parallel": {"shard_optimizer": True}}
    b = build(small_config("mlp", num_devices=8, **sections))
    state = b.parallel.to_devices(b.init_state())
    per_device = memory.per_device_bytes(state.opt_state)
    whole = sum(x.nbytes for x in jax.tree.leaves(b.parallel.to_host(b.parallel.to_logical(state).opt_state)))
    assert per_device <= 1.1 * whole / 8

    run(small_config("mlp", num_devices=8, steps=4, **sections), tmp_path / "run")
    resumed = run(small_config("mlp", num_devices=4, steps=6, **sections), tmp_path / "run")
    reference = run(small_config("mlp", num_devices=8, steps=6, **sections), tmp_path / "reference")
    assert max_abs_diff(resumed.params, reference.params) < 1e-5


def test_bf16_compute_keeps_float32_masters_and_tracks_fp32(tmp_path):
    fp32 = run(small_config("cnn1d", num_devices=2), tmp_path / "fp32")
    bf16 = run(small_config("cnn1d", num_devices=2, precision="bf16"), tmp_path / "bf16")
    assert all(x.dtype == np.float32 for x in jax.tree.leaves(bf16.params))
    np.testing.assert_allclose(bf16.losses, fp32.losses, rtol=3e-2)
    assert bf16.losses != fp32.losses  # the forward really ran in bfloat16


def test_fp16_loss_scaling_skips_overflows_without_halting(tmp_path):
    # A loss scale of 2^40 overflows float16 gradients: each such step halves the scale and is skipped, and
    # does not count against train.max_skipped_fraction (0.1: 20 of 40 steps would halt the run).
    cfg = small_config("mlp", num_devices=2, steps=40, precision="fp16", loss_scale={"initial": 2.0**40},
                       train={"on_nonfinite": "skip"})
    result = run(cfg, tmp_path)
    train = records(tmp_path, "train")
    assert train[-1]["overflow_steps"] >= 20 and train[-1]["skipped_steps"] == 0
    assert len(result.losses) == 40 and np.isfinite(result.losses).all()  # an overflowed step's forward loss too
    assert train[-1]["loss_scale"] < 2.0**20
    assert train[-1]["loss"] < train[0]["loss"]  # it trains once the scale fits
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(result.params))


def test_bf16_all_reduce_changes_little_but_something(tmp_path):
    fp32 = run(small_config("mlp", num_devices=8), tmp_path / "fp32")
    compressed = run(small_config("mlp", num_devices=8, parallel={"allreduce_dtype": "bf16"}), tmp_path / "bf16")
    np.testing.assert_allclose(compressed.losses, fp32.losses, rtol=1e-2)
    assert max_abs_diff(compressed.params, fp32.params) > 0


def test_local_sgd_syncs_every_h_steps(tmp_path):
    sections = {"parallel": {"sync_every": 4, "check_replicas_every": 4},
                "checkpoint": {"every_steps": 4}, "train": {"eval_every": 8}}
    cfg = small_config("mlp", num_devices=8, steps=8, **sections)
    b = build(cfg)
    state = b.parallel.to_devices(b.init_state())
    for i in range(3):
        state, _ = b.parallel.train_step(state, b.parallel.shard_batch(b.source.train_batch(i)))
    assert b.parallel.first_differing_leaf(state.params) is not None  # between syncs: replicas differ
    state, _ = b.parallel.train_step(state, b.parallel.shard_batch(b.source.train_batch(3)))
    assert b.parallel.first_differing_leaf(state.params) is None  # step 4: averaged

    local = run(cfg, tmp_path / "local")  # the replica guard at steps 4 and 8 passes
    every_step = run(small_config("mlp", num_devices=8, steps=8), tmp_path / "every")
    assert local.losses[:1] == every_step.losses[:1] and local.losses != every_step.losses


def test_local_sgd_checks_happen_at_sync_points():
    sections = {"parallel": {"sync_every": 4, "check_replicas_every": 4}, "checkpoint": {"every_steps": 4}}
    with pytest.raises(ConfigError, match=r"train.eval_every=6 is not a multiple of the sync period 4 "
                                          r"\(parallel.sync_every=4\)"):
        build(small_config("mlp", num_devices=8, steps=8, train={"eval_every": 6}, **sections))


def test_profile_writes_a_trace(tmp_path):
    run(small_config("mlp", num_devices=2, steps=4, profile={"steps": "2:3"}), tmp_path)
    assert list((tmp_path / "profile").rglob("*.xplane.pb"))


@pytest.mark.slow
def test_bench_reports_time_memory_and_scaling(tmp_path, capsys, monkeypatch):
    """Each variant is compiled once however many repeats (1 device with its collective, 2 devices with and
    without, the single-device jit baseline: 4 programs, not 4 per repeat), the program's bf16 products and
    MFU against the given peak are reported."""
    from jdp.parallel import DataParallel

    lowered = []
    lower_train = DataParallel.lower_train
    monkeypatch.setattr(DataParallel, "lower_train", lambda self, *a: lowered.append(1) or lower_train(self, *a))
    # cpu_devices=8: the test session's count, which a worker that has not touched a device yet would lower to 2.
    assert bench.main(["--config", "configs/mnist1d_mlp.py", "--devices", "1,2", "--steps", "3", "--repeats", "2",
                       "--out", str(tmp_path), "--config.model.kwargs.hidden_sizes=(64,)", "--config.precision=bf16",
                       "--peak_tflops", "0.5", "--config.parallel.cpu_devices=8"]) == 0
    assert len(lowered) == 4
    rows = json.loads((tmp_path / "bench.json").read_text())["rows"]
    assert [r["devices"] for r in rows] == [1, 2]
    for r in rows:
        assert r["examples_per_sec"] > 0 and r["params_bytes"] > 0 and r["vs_single_device_jit"] > 0
        assert r["compute_s"] > 0 and r["allreduce_s"] is not None and "temp_bytes" in r
        assert r["matmul_dtypes"] == {"bf16": 5} and r["mfu"] == pytest.approx(r["flops"] / r["step_s"] / 0.5e12)
    assert rows[0]["efficiency"] == pytest.approx(1.0) and rows[0]["allreduce_s"] == 0.0
    assert "| devices | examples/s |" in (tmp_path / "bench.md").read_text()
    assert "has 5 dots/convolutions: 5 bf16" in capsys.readouterr().out


def test_bench_baseline_is_the_plain_step_whatever_the_runs_strategy(tmp_path):
    """The single-device jit baseline is the mean all-reduce without the noise scale. Breaks if it copies the
    run's strategy: int8 (and the noise scale) refuse jit, so the bench stopped with advice about the run's
    backend, which is already shard_map."""
    assert bench.main(["--config", "configs/mnist1d_mlp.py", "--devices", "2", "--steps", "1", "--repeats", "1",
                       "--out", str(tmp_path), "--config.model.kwargs.hidden_sizes=(16,)",
                       "--config.parallel.allreduce_dtype=int8", "--config.train.log_noise_scale=True",
                       "--config.parallel.cpu_devices=8"]) == 0
    assert json.loads((tmp_path / "bench.json").read_text())["rows"][0]["vs_single_device_jit"] > 0


def test_bench_runs_where_the_eval_batch_fits_the_runs_devices_but_not_one(tmp_path):
    """1,021 eval examples: an eval batch of 1,022 fits 2 devices (one padded row), not 1. Breaks if the
    bench's one-device variants (the baseline) keep the run's eval batch: they are refused, though no eval runs."""
    assert bench.main(["--config", "configs/mnist1d_mlp.py", "--devices", "2", "--steps", "1", "--repeats", "1",
                       "--out", str(tmp_path), "--config.model.kwargs.hidden_sizes=(16,)",
                       "--config.data.name=synthetic", "--config.data.num_classes=10",
                       "--config.data.num_eval_examples=1021", "--config.train.eval_batch_size=1022",
                       "--config.parallel.cpu_devices=8"]) == 0


BENCH_REFUSALS = {  # each was a traceback (exit 1), a silent nonsense figure, or a refusal after the whole run
    "no timed step": (["--steps", "0"], "argument --steps: '0' is not a positive integer"),
    "no repeat": (["--repeats", "0"], "argument --repeats: '0' is not a positive integer"),
    "zero devices": (["--devices", "1,0"], "argument --devices: '1,0' is not a comma-separated list of positive "
                                           "integers, e.g. 1,2,4"),
    "an empty count": (["--devices", "1,,2"], "argument --devices: '1,,2' is not a comma-separated list"),
    "more devices than exist": (["--devices", "16"], "16 devices asked for (num_devices / parallel.num_devices) but "
                                                     "only 8 exist"),
    "a negative peak": (["--peak_tflops", "-5"], "argument --peak_tflops: '-5' is not a non-negative finite number"),
    "no memory": (["--fits", "--devices", "8", "--memory_gb", "-1"],
                  "argument --memory_gb: '-1' is not a positive finite number"),
    "an out that is a file": (["--out", "FILE"], "--out FILE is a file; pass a folder for the results"),
    "a nan step time": (["--predict", "--step_ms", "nan"], "argument --step_ms: 'nan' is not a non-negative finite"),
}


@pytest.mark.parametrize("case", BENCH_REFUSALS, ids=list(BENCH_REFUSALS))
def test_bad_bench_arguments_are_one_line_before_anything_is_measured(case, tmp_path, capsys):
    args, refusal = BENCH_REFUSALS[case]
    (tmp_path / "file").write_text("")
    args = [str(tmp_path / "file") if a == "FILE" else a for a in args]
    assert len(jax.devices()) == 8  # started: the bench cannot simulate more
    out = [] if "--out" in args else ["--out", str(tmp_path / "out")]
    assert bench.main([*args, *out, "--config", "configs/mnist1d_mlp.py", "--no-baseline"]) == 2
    err = capsys.readouterr().err
    assert refusal.replace("FILE", str(tmp_path / "file")) in err and err.count("\n") == 1, err


def test_bench_compile_only_puts_the_three_shardings_side_by_side(tmp_path, capsys, monkeypatch):
    """Nothing is put on the devices or run (no train step is called); each sharding's per-device parameters plus
    optimizer state shrink as the issue of ZeRO says: ZeRO-1 keeps whole parameters and 1/N of AdamW's state,
    ZeRO-3 at most 1.1/N of plain's."""
    from jdp.parallel import DataParallel

    monkeypatch.setattr(DataParallel, "train_step", lambda *a: pytest.fail("--compile_only ran a step"))
    assert bench.main(["--config", "configs/mnist1d_mlp.py", "--devices", "8", "--compile_only", "--out",
                       str(tmp_path), "--config.model.kwargs.hidden_sizes=(256,255)"]) == 0
    rows = {r["sharding"]: r for r in json.loads((tmp_path / "bench.json").read_text())["rows"]}
    persistent = {name: r["params_bytes"] + r["opt_state_bytes"] for name, r in rows.items()}
    assert rows["zero1"]["params_bytes"] == rows["plain"]["params_bytes"]
    assert rows["zero1"]["opt_state_bytes"] <= 1.1 / 8 * rows["plain"]["opt_state_bytes"]
    assert persistent["zero3"] <= 1.1 / 8 * persistent["plain"]
    assert all(r["compile_s"] > 0 and r["argument_bytes"] > 0 for r in rows.values())
    out = capsys.readouterr().out
    assert "| 8 | zero3 |" in out and "temp MB/dev (XLA:CPU's compiler)" in out


def test_bench_peak_follows_the_precision():
    h200 = [bench.peak_tflops_for("NVIDIA H200", p) for p in ("bf16", "fp32")]
    assert h200 == [989.5, 494.5]
    assert bench.peak_tflops_for("NVIDIA H100 PCIe", "bf16") == 756.5
    assert bench.peak_tflops_for("cpu", "bf16") == 0.0


def test_local_sgd_preemption_stops_at_a_sync_point(tmp_path, monkeypatch):
    """A signal between syncs: the run goes on to the next sync point, checkpoints there, exits 75."""
    import os
    import signal

    from jdp.cli.train import Preempted
    from jdp.parallel import DataParallel

    original, calls = DataParallel.train_step, []

    def signal_after_step_5(self, state, batch):
        calls.append(1)
        if len(calls) == 5:
            os.kill(os.getpid(), signal.SIGTERM)
        return original(self, state, batch)

    monkeypatch.setattr(DataParallel, "train_step", signal_after_step_5)
    sections = {"parallel": {"sync_every": 4, "check_replicas_every": 4}, "checkpoint": {"every_steps": 0},
                "train": {"eval_every": 16}}
    with pytest.raises(Preempted, match="at step 8"):
        run(small_config("mlp", num_devices=8, steps=16, **sections), tmp_path)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["8"]


def test_throughput_leaves_out_replica_checks_and_fetches_once_per_step(monkeypatch):
    """The clock is paused around every replica check (the first one compiles its checksum program, at the last
    step), and each step's metrics arrive as one array (one transfer), not one blocking transfer per metric."""
    import optax
    from flax import nnx

    import jdp
    from jdp.metrics import ThroughputClock
    from jdp.parallel import DataParallel

    events = []
    paused = ThroughputClock.paused

    @contextlib.contextmanager
    def spied(self):  # "pause" as the clock stops; "start" where it runs again after the block
        with paused(self):
            events.append("pause")
            yield
        if self._started is not None:
            events.append("start")

    monkeypatch.setattr(ThroughputClock, "paused", spied)
    check = DataParallel.first_differing_leaf
    monkeypatch.setattr(DataParallel, "first_differing_leaf", lambda self, t: events.append("check") or check(self, t))
    fetch = DataParallel.fetch
    transfers = []
    monkeypatch.setattr(DataParallel, "fetch", lambda self, out: transfers.append(out) or fetch(self, out))

    x = np.random.default_rng(0).standard_normal((64, 6)).astype(np.float32)
    jdp.fit(lambda: nnx.Linear(6, 1, rngs=nnx.Rngs(0)),
            lambda m, b: {"loss": (m(b["x"])[:, 0] - b["y"]) ** 2, "abs": jnp.abs(m(b["x"])[:, 0])},
            {"x": x, "y": x.sum(1)}, optimizer=optax.sgd(0.1), steps=5, global_batch_size=16, num_devices=2,
            check_replicas_every=2)
    checks = [i for i, e in enumerate(events) if e == "check"]
    assert len(checks) == 3  # steps 2, 4 and the last
    assert all(events[i - 1] == "pause" and events[i + 1] == "start" for i in checks)
    assert len(transfers) == 5 and all(isinstance(t, jax.Array) and t.size >= 4 for t in transfers)  # loss, abs,
    # weight and jdp's counters, together
