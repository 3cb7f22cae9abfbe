"""The same computation whatever the backend, device count or failure: gradient accumulation with BatchNorm,
local SGD and ZeRO-1 at their edges, and counters and metrics that report what happened."""

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jdp
from jdp.cli.config import ConfigError
from jdp.cli.train import build, run
from jdp.data.batching import Batcher
from jdp.errors import NonFiniteLossError
from jdp.trainer import prepare
from tests.helpers import max_abs_diff, records, small_config
from tests.test_equivalence import assert_same_run


def _poison(monkeypatch, index, fill):
    """The train batch of step `index + 1` gets inputs `fill(x)`."""
    original = Batcher.train_batch

    def poisoned(self, step):
        rows = original(self, step)
        return {**rows, "x": fill(rows["x"])} if step == index else rows

    monkeypatch.setattr(Batcher, "train_batch", poisoned)


class BatchNormNet(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(6, 16, rngs=rngs)
        self.bn = nnx.BatchNorm(16, momentum=0.5, rngs=rngs)  # a fast average: running statistics move visibly
        self.out = nnx.Linear(16, 1, rngs=rngs)

    def __call__(self, x):
        return self.out(nnx.relu(self.bn(self.hidden(x))))[:, 0]


def _regression_data(n=256):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((n, 6)).astype(np.float32)
    return {"x": x, "y": (x @ rng.standard_normal(6) + 0.1 * rng.standard_normal(n)).astype(np.float32)}


def _mse(model, batch):
    return {"loss": (model(batch["x"]) - batch["y"]) ** 2}


def _fit_bn(backend, num_devices, bn_sync, k=4):
    return jdp.fit(lambda: BatchNormNet(nnx.Rngs(0)), _mse, _regression_data(), optimizer=optax.sgd(0.1), steps=4,
                   global_batch_size=128, num_devices=num_devices, backend=backend, bn_sync=bn_sync,
                   grad_accum_steps=k, log_every=1)


@pytest.mark.slow
def test_accumulation_with_synced_batchnorm_is_one_computation():
    """Micro-batch j is the same global rows on every backend and device count, so synced BatchNorm normalises
    the same rows: with micro-batches cut from each device's block as one slab (the old reshape), 8 devices and
    jit differ from 1."""
    reference = _fit_bn("jit", 1, bn_sync=True)
    for backend in ("shard_map", "pmap", "jit"):
        for n in (8, 2):
            assert_same_run(_fit_bn(backend, n, bn_sync=True), reference)


def test_accumulation_with_per_device_batchnorm_is_the_same_on_jit_and_shard_map():
    jit, shard_map = _fit_bn("jit", 8, bn_sync=False), _fit_bn("shard_map", 8, bn_sync=False)
    assert_same_run(jit, shard_map)  # running statistics included
    assert max_abs_diff(jit.model_state, _fit_bn("jit", 8, bn_sync=True).model_state) > 1e-3  # BN really per device


def _lowered(cfg):
    engine = build(cfg)
    state = engine.parallel.to_devices(engine.init_state())
    return engine.parallel.lower_train(state, engine.parallel.shard_batch(engine.source.train_batch(0)))


_BYTES = {"f32": 4, "s32": 4, "u32": 4, "bf16": 2, "f16": 2, "pred": 1}


def _all_reduced_bytes(text: str) -> int:
    """Bytes per device that the compiled program's all-reduces carry (their result shapes)."""
    total = 0
    for shapes in re.findall(r"= (.+?) all-reduce(?:-start)?\(", text):
        for dtype, dims in re.findall(r"\b(f32|s32|u32|bf16|f16|pred)\[([\d,]*)\]", shapes):
            total += _BYTES[dtype] * int(np.prod([int(d) for d in dims.split(",") if d]))
    return total


def test_jit_accumulation_does_one_devices_work_plus_one_all_reduce():
    """The micro-batch split keeps each device's rows on that device: no reshuffling collectives, and the
    FLOPs of one device's share of the batch (the old contiguous split cost 4x at k=4). The all-reduce
    carries one gradient: summing per-micro-batch gradients that XLA had each all-reduced (the program
    before the per-device lanes, 5x slower per step) sends k gradients' worth in the one combined op."""
    def stats(k):
        cfg = small_config("mlp", backend="jit", num_devices=8, train={"grad_accum_steps": k, "global_batch_size": 256})
        compiled = _lowered(cfg).compile()
        cost = compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, list) else cost
        text = compiled.as_text()
        collectives = {op: len(re.findall(rf"= [^\n]*? {op}(-start)?\(", text))
                       for op in ("all-reduce", "collective-permute", "all-gather", "all-to-all")}
        return cost["flops"], collectives, _all_reduced_bytes(text)

    flops_1, collectives_1, reduced_1 = stats(1)
    flops_4, collectives_4, reduced_4 = stats(4)
    assert flops_4 < 1.2 * flops_1
    assert collectives_4 == collectives_1 and collectives_1["collective-permute"] == collectives_1["all-to-all"] == 0
    assert collectives_1["all-reduce"] == 1
    params = sum(x.size for x in jax.tree.leaves(build(small_config("mlp")).init_state().params)) * 4
    assert params <= reduced_4 < 1.1 * reduced_1, (params, reduced_1, reduced_4)


def test_halt_counts_no_skipped_step_and_the_rerun_reports_none(monkeypatch, tmp_path):
    """halt freezes the state from before the bad step; the step already dispatched after it must not count
    it again, and the resumed run, which retries that step, has dropped nothing."""
    cfg = small_config("mlp", steps=6, checkpoint={"every_steps": 0})
    _poison(monkeypatch, 3, lambda x: np.full_like(x, np.nan))
    with pytest.raises(NonFiniteLossError, match="non-finite inputs .* at step 4"):
        run(cfg, tmp_path)
    monkeypatch.undo()
    result = run(cfg, tmp_path)
    train = records(tmp_path, "train")
    assert [r["skipped_steps"] for r in train] == [0] * 6
    # Each segment's first line has no timed step behind it: its rate is null, not 0.
    assert [r["examples_per_sec"] is None for r in train] == [True, False, False, True, False, False]
    assert result.step == 6


def test_local_sgd_halt_keeps_the_last_sync_point_checkpoint(monkeypatch, tmp_path):
    """Between syncs the replicas differ: a halt there saves nothing, and the rerun from the last sync point
    equals a run that never failed."""
    local = {"parallel": {"sync_every": 4, "check_replicas_every": 4}, "checkpoint": {"every_steps": 4},
             "train": {"eval_every": 8}}
    cfg = small_config("mlp", num_devices=8, steps=8, **local)
    _poison(monkeypatch, 6, lambda x: np.full_like(x, np.nan))  # step 7
    with pytest.raises(NonFiniteLossError, match="local SGD saves only at sync points"):
        run(cfg, tmp_path / "halted")
    assert sorted(p.name for p in (tmp_path / "halted" / "checkpoints").iterdir()) == ["4"]
    monkeypatch.undo()
    resumed = run(cfg, tmp_path / "halted")
    uninterrupted = run(cfg, tmp_path / "clean")
    assert max_abs_diff(resumed.params, uninterrupted.params) == 0


def test_fp16_overflows_leave_the_window_and_metrics_are_strict_json(tmp_path):
    cfg = small_config("mlp", num_devices=2, steps=12, precision="fp16", loss_scale={"initial": 2.0**24},
                       train={"log_grad_norm": True, "log_every": 1})
    run(cfg, tmp_path)

    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")

    lines = [json.loads(line, parse_constant=refuse) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in lines if r["split"] == "train"]
    assert train and all(r["grad_norm"] is not None and np.isfinite(r["grad_norm"]) for r in train)
    assert train[-1]["overflow_steps"] > 0 and len(train) == 12 - train[-1]["overflow_steps"]


def test_fp16_forward_overflow_halts_and_says_why(monkeypatch, tmp_path):
    """Loss scaling rescues gradients, not activations: a forward pass past float16's range halts."""
    _poison(monkeypatch, 1, lambda x: x * 1e6)
    with pytest.raises(NonFiniteLossError, match="the forward pass overflowed float16; precision=bf16"):
        run(small_config("mlp", num_devices=2, steps=4, precision="fp16"), tmp_path)


@pytest.mark.slow
def test_bf16_all_reduce_applies_to_the_sharded_optimizer(tmp_path):
    sections = {"parallel": {"shard_optimizer": True}, "optim": {"name": "adamw", "lr": 0.01}}
    fp32 = run(small_config("mlp", num_devices=8, **sections), tmp_path / "fp32")
    compressed_cfg = small_config("mlp", num_devices=8, parallel={"shard_optimizer": True, "allreduce_dtype": "bf16"},
                                  optim=sections["optim"])
    compressed = run(compressed_cfg, tmp_path / "bf16")
    assert 0 < max_abs_diff(compressed.params, fp32.params) < 1e-2
    # The program jdp asks for (XLA:CPU widens bf16 collectives in its own passes).
    scatters = re.findall(r"= (\w+)\[\d+\]\{0\} reduce-scatter\(", _lowered(compressed_cfg).as_text(dialect="hlo"))
    assert scatters and set(scatters) == {"bf16"}


def test_bf16_all_reduce_is_refused_under_local_sgd():
    with pytest.raises(ConfigError, match="local SGD .* averages parameters instead"):
        build(small_config("mlp", num_devices=8, steps=4, parallel={"sync_every": 2, "allreduce_dtype": "bf16",
                                                                      "check_replicas_every": 2}))
    with pytest.raises(jdp.FitError, match="local SGD .* averages parameters instead"):
        jdp.FitOptions(sync_every=2, allreduce_dtype="bf16")


def test_local_sgd_clips_each_replicas_own_gradient():
    """Between syncs there is no averaged gradient: each replica clips its own, so every replica's first
    SGD update has exactly the clip norm, and the replicas differ."""
    lr, clip = 0.2, 1e-3
    cfg = small_config("mlp", num_devices=8, steps=2, parallel={"sync_every": 2, "check_replicas_every": 2},
                       optim={"grad_clip_norm": clip})
    engine = build(cfg)
    before = engine.init_state()
    start = jax.tree.leaves(engine.parallel.to_host(before.params))  # before the step donates `before`
    state, _ = engine.parallel.train_step(engine.parallel.to_devices(before),
                                          engine.parallel.shard_batch(engine.source.train_batch(0)))
    replicas = [[np.asarray(leaf.addressable_shards[d].data) for leaf in jax.tree.leaves(state.params)]
                for d in range(8)]
    for replica in replicas:
        norm = np.sqrt(sum(np.sum((p - p0) ** 2) for p, p0 in zip(replica, start, strict=True)))
        np.testing.assert_allclose(norm, lr * clip, rtol=1e-4)
    assert max_abs_diff(replicas[0], replicas[1]) > 0


def test_eval_runs_in_float32_whatever_the_precision():
    engine = build(small_config("mlp", num_devices=2, precision="bf16"))
    state = engine.parallel.to_devices(engine.init_state())
    train_text = engine.parallel.lower_train(state, engine.parallel.shard_batch(engine.source.train_batch(0))).as_text()
    eval_rows = next(iter(engine.source.eval_batches()))
    eval_text = str(jax.make_jaxpr(engine.parallel.eval_step)(state, engine.parallel.shard_batch(eval_rows)))
    assert "bf16" in train_text and "bf16" not in eval_text


class ScaledNet(nnx.Module):
    """A linear model with a learned scalar temperature: a 0-d parameter leaf."""

    def __init__(self, rngs: nnx.Rngs):
        self.linear = nnx.Linear(6, 1, rngs=rngs)
        self.temperature = nnx.Param(jnp.array(1.5))

    def __call__(self, x):
        return self.linear(x)[:, 0] * self.temperature


def test_sharded_optimizer_updates_a_scalar_parameter_whole():
    """ZeRO-1 keeps a scalar leaf's optimizer state whole: every device updates it with the mean gradient,
    so the run equals plain data parallelism and the replicas agree (checked every step)."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((256, 6)).astype(np.float32)
    data = {"x": x, "y": (x @ rng.standard_normal(6) + 0.1 * rng.standard_normal(256)).astype(np.float32)}

    def mse(model, batch):
        return {"loss": (model(batch["x"]) - batch["y"]) ** 2}

    def fit(shard):
        return jdp.fit(lambda: ScaledNet(nnx.Rngs(0)), mse, data, optimizer=optax.adam(0.05), steps=6,
                       global_batch_size=64, num_devices=8, shard_optimizer=shard, check_replicas_every=1)

    plain, sharded = fit(False), fit(True)
    assert max_abs_diff(sharded.params, plain.params) < 1e-6
    assert abs(float(plain.params["temperature"]) - 1.5) > 1e-3  # the scalar trained

    # On the devices: the scalar's Adam moments keep their shape and agree on every device (cut into
    # slices, they became length-1 arrays that only device 0 updated with the real gradient).
    engine = prepare(lambda: ScaledNet(nnx.Rngs(0)), mse, data, optimizer=optax.adam(0.05), global_batch_size=64,
                     options=jdp.FitOptions(num_devices=8, shard_optimizer=True))
    state = engine.parallel.to_devices(engine.init_state())
    for step in range(2):
        state, _ = engine.parallel.train_step(state, engine.parallel.shard_batch(engine.source.train_batch(step)))
    moments = [leaf for path, leaf in jax.tree_util.tree_leaves_with_path(state.opt_state)
               if "temperature" in jax.tree_util.keystr(path)]
    assert len(moments) == 2
    for leaf in moments:
        copies = [np.asarray(shard.data) for shard in leaf.addressable_shards]
        assert leaf.shape == () and all(np.array_equal(c, copies[0]) for c in copies)
