"""Hybrid sharding (`jdp.sync.HybridShard`, `shard_group=k`): ZeRO inside groups of k devices, data parallelism
across the groups, on a groups x `data` mesh. 2 x 4 devices train as one device does; the compiled step sends
across the groups the hand count, 4 P / k bytes of gradient and the few bytes beside it; 2 processes x 2 devices
(a group a process) train as 1 x 4; a run stopped by `JDP_KILL_AT` resumes bitwise, and restores on one device;
the object and the flag are the same run, bit for bit; what it cannot run is refused in one line."""

from __future__ import annotations

import functools
import shutil
import sys

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from jdp import sync
from jdp.cli import config as config_lib
from jdp.configs import base
from jdp.errors import FitError
from jdp.mesh import DATA_AXIS, GROUPS_AXIS
from jdp.sync.base import padded, shard_axis
from jdp.trainer import FitOptions, prepare
from tests.helpers import max_abs_diff, records, train_losses
from tests.test_fit import CASES, Regressor, _fit, mse, regression_data
from tests.test_zero3 import OPTIMIZERS, _assert_same, reference

HYBRID = sync.HybridShard(group_size=4)


def _same_bits(a, b) -> bool:
    return a.losses == b.losses and all(np.array_equal(x, y) for x, y in zip(
        jax.tree.leaves(a.params), jax.tree.leaves(b.params), strict=True))


@pytest.mark.parametrize("stage, optimizer", [(3, "sgd"), (3, "adamw"), (1, "adamw")])
def test_2_groups_of_4_devices_train_as_one_device(stage, optimizer):
    """SGD shows a wrong gradient scale (the slice's mean taken over k, not over the G x k devices), AdamW a slice
    updated by the wrong device; `check_replicas_every=1` compares the replicated leaves after every step."""
    model_cls, loss, data = CASES["regression"]
    result = _fit(model_cls, loss, data, num_devices=8, optimizer=OPTIMIZERS[optimizer](),
                  sync=sync.HybridShard(group_size=4, stage=stage), check_replicas_every=1, eval_data=data)
    expected = reference("regression", optimizer)
    _assert_same(result, expected)
    assert result.eval_metrics == pytest.approx(expected.eval_metrics, rel=1e-5)


def test_batchnorm_accumulation_and_dropout_span_every_device_as_on_the_flat_mesh():
    """Synced BatchNorm averages over both axes, with two micro-batches a step each gathering and reduce-scattering
    in the group (2 x 4 == 1 device), and the device index folded into dropout's keys is the 1-D mesh's (2 x 4 ==
    plain data parallelism on the same 8 devices)."""
    model_cls, loss, data = CASES["batchnorm"]
    accumulated = dict(grad_accum_steps=2, global_batch_size=64)
    _assert_same(_fit(model_cls, loss, data, num_devices=8, sync=HYBRID, **accumulated),
                 _fit(model_cls, loss, data, backend="jit", num_devices=1, **accumulated))
    dropout = functools.partial(Regressor, dropout=0.3)
    result = _fit(dropout, mse, regression_data(), num_devices=8, sync=HYBRID)
    expected = _fit(dropout, mse, regression_data(), num_devices=8)
    np.testing.assert_allclose(result.losses, expected.losses, rtol=1e-5)
    assert max_abs_diff(result.params, expected.params) < 1e-5


def _compiled_bytes(strategy):
    engine = prepare(lambda: Regressor(nnx.Rngs(0)), mse, regression_data(), optimizer=optax.sgd(0.1),
                     global_batch_size=32, options=FitOptions(num_devices=8, sync=strategy))
    parallel = engine.parallel
    state = parallel.to_devices(engine.init_state())
    parallel.compile_train(state, parallel.shard_batch(engine.source.train_batch(0)))
    return engine, parallel


@pytest.mark.parametrize("stage", [3, 1])
def test_the_bytes_across_groups_are_one_kth_of_the_gradient_plus_the_sums(stage):
    """Per device and step, across the groups: each device's slice of the gradient, 4 P / k bytes (P counted with
    each leaf zero-padded to a multiple of k on its split axis: the regression model's 129 parameters are 132), the
    loss's and abs_err's weighted sums and the weight total riding in the same all-reduce (12 bytes), and the
    non-finite guard's int32 pmin over every device (4). In the group: the all-gathers of the slices (4 P / k), the
    reduce-scatters of the whole padded gradient (4 P) and the all-reduce of the sums (12)."""
    engine, parallel = _compiled_bytes(sync.HybridShard(group_size=4, stage=stage))
    k = 4
    assert parallel.mesh.shape == {GROUPS_AXIS: 2, DATA_AXIS: k}
    leaves = jax.tree.leaves(engine.abstract_state.params)
    padded_size = sum(padded(np.zeros(x.shape), k, shard_axis(x.shape, k)).size for x in leaves)
    assert (sum(x.size for x in leaves), padded_size) == (129, 132)
    sums, guard = 3 * 4, 4
    assert parallel.comm_cross_group_bytes_per_step == 4 * padded_size / k + sums + guard
    assert parallel.comm_bytes_per_step - parallel.comm_cross_group_bytes_per_step == (
        4 * padded_size / k + 4 * padded_size + sums)
    # Plain data parallelism all-reduces the whole gradient and the sums across every device.
    _, plain = _compiled_bytes(sync.AllReduce())
    assert plain.comm_bytes_per_step == 4 * 129 + sums and plain.comm_cross_group_bytes_per_step is None


def test_the_train_lines_and_summary_carry_the_cross_group_bytes(tmp_path):
    _fit(Regressor, mse, regression_data(), num_devices=8, sync=HYBRID, steps=2, workdir=tmp_path)
    (summary,) = records(tmp_path, "summary")
    train = records(tmp_path, "train")
    assert summary["comm_cross_group_bytes_per_step"] == train[-1]["comm_cross_group_bytes_per_step"] == 148
    assert summary["comm_bytes_per_step"] == 820


def test_a_run_stopped_by_jdp_kill_at_resumes_bitwise_and_restores_on_one_device(tmp_path, monkeypatch):
    """Stopped by an exception after step 3 (`JDP_KILL_AT=raise:3`, checkpoint 2 committed), resumed: the run that
    never stopped, bit for bit. The checkpoint holds the logical (whole-shaped) state, so it restores on one
    device under plain data parallelism, to float tolerance."""
    options = dict(optimizer=optax.adam(0.02), num_devices=8, sync=HYBRID, steps=6, checkpoint_every=2)
    straight = _fit(Regressor, mse, regression_data(), **options)
    monkeypatch.setenv("JDP_KILL_AT", "raise:3")
    with pytest.raises(RuntimeError, match="JDP_KILL_AT=raise:3"):
        _fit(Regressor, mse, regression_data(), workdir=tmp_path / "run", **options)
    monkeypatch.delenv("JDP_KILL_AT")
    shutil.copytree(tmp_path / "run", tmp_path / "one")
    resumed = _fit(Regressor, mse, regression_data(), workdir=tmp_path / "run", **options)
    assert resumed.losses == straight.losses[2:]
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(resumed.params),
                                                    jax.tree.leaves(straight.params), strict=True))
    on_one = _fit(Regressor, mse, regression_data(), **{**options, "num_devices": 1, "sync": "allreduce"},
                  workdir=tmp_path / "one")
    np.testing.assert_allclose(on_one.losses, straight.losses[2:], rtol=1e-5, atol=1e-6)
    assert max_abs_diff(on_one.params, straight.params) < 1e-5


@pytest.mark.parametrize("flags, strategy", [
    ({"shard_group": 4}, sync.HybridShard(group_size=4)),
    ({"shard_group": 2, "shard_optimizer": True}, sync.HybridShard(group_size=2, stage=1)),
])
def test_the_object_and_the_flag_are_the_same_run(flags, strategy):
    by_flag = _fit(Regressor, mse, regression_data(), num_devices=8, optimizer=optax.adamw(0.02), **flags)
    by_object = _fit(Regressor, mse, regression_data(), num_devices=8, optimizer=optax.adamw(0.02), sync=strategy)
    assert _same_bits(by_flag, by_object)


def test_the_config_key_chooses_it():
    cfg = config_lib.apply_overrides(base.get_config(), {"parallel.shard_group": "4"})
    strategy, what = config_lib.sync_strategy(config_lib.fit_values(cfg))
    assert (repr(strategy), what) == ("HybridShard(group_size=4, stage=3)", "parallel.shard_group=4")


@pytest.mark.parametrize("options, message", [
    (dict(backend="pmap"), r"HybridShard\(group_size=4, stage=3\) \(hybrid sharding\) runs on a two-axis mesh under "
                           "shard_map only \\(jit and pmap are refused\\); use backend='shard_map'"),
    (dict(backend="jit"), "shard_map only"),
    (dict(sync=sync.HybridShard(group_size=3)), r"a group of 3 devices does not divide the 8 devices"),
    (dict(sync=sync.HybridShard()), "groups one process's devices by default, and this run is one process"),
    (dict(sync=None, shard_group=4, sync_every=2), "cannot be combined with sync_every > 1"),
    (dict(sync=None, shard_group=4, allreduce_dtype="bf16"), "use allreduce_dtype='fp32'"),
    (dict(shard_group=2), r"is a strategy object, and shard_group=2 is a strategy setting"),
    (dict(log_noise_scale=True), "log_noise_scale needs each device's whole gradient"),
    (dict(optimizer=optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.1))),
     "runs the optimizer on slices of each parameter"),
])
def test_what_it_cannot_run_is_refused_in_one_line(options, message):
    options = {"sync": HYBRID, **options}
    if options["sync"] is None:
        del options["sync"]
    with pytest.raises(FitError, match=message) as caught:
        _fit(Regressor, mse, regression_data(), num_devices=8, **options)
    assert "\n" not in str(caught.value)


def test_bad_parameters_are_refused():
    with pytest.raises(ValueError, match="group_size=0 must be an int of at least 1"):
        sync.HybridShard(group_size=0)
    with pytest.raises(ValueError, match="stage=2 is not one of 1, 3"):
        sync.HybridShard(group_size=4, stage=2)


@pytest.mark.slow
def test_two_processes_of_two_devices_a_group_each_train_as_one_process_of_four(tmp_path):
    """`HybridShard()` with no group size: a group is one process's devices (2), the mesh 2 x 2 across the two
    processes; the run equals plain data parallelism on 1 process x 4 devices, and its summary reports what
    crossed between the processes."""
    from tests.test_distributed import ARGS, TRAIN, run

    one, two = tmp_path / "one", tmp_path / "two"
    reference_run = run([*TRAIN, *ARGS, "--cpu_devices", "4", "--workdir", str(one)], timeout=120)
    assert reference_run.returncode == 0, reference_run.stderr[-3000:]
    result = run([sys.executable, "-m", "jdp.launch", "--nprocs", "2", "--cpu_devices", "2", "--",
                  *TRAIN, *ARGS, "--config.parallel.sync=jdp.sync:HybridShard", "--workdir", str(two)], timeout=150)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "sync HybridShard(group_size=None, stage=3)" in result.stdout
    (steps_a, losses_a), (steps_b, losses_b) = (zip(*train_losses(w), strict=True) for w in (one, two))
    assert steps_a == steps_b
    np.testing.assert_allclose(losses_b, losses_a, rtol=1e-5)
    (summary,) = records(two, "summary")
    assert 0 < summary["comm_cross_group_bytes_per_step"] < summary["comm_bytes_per_step"]
