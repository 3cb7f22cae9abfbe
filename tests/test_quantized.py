"""`jdp.sync.QuantizedAllReduce` (`allreduce_dtype=int8|int4`): block-quantized gradients through an all-to-all
and an all-gather. The round trip stays within half a block's scale; the mean it hands the update is the exact
mean within two such errors; the compiled program sends int8 (int4 packed in uint8) and its bytes match the hand
count; a killed run resumes bitwise, and so does its error feedback."""

from __future__ import annotations

import re
import signal

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import jdp
from jdp.errors import FitError
from jdp.mesh import DATA_AXIS, make_mesh
from jdp.sync import QuantizedAllReduce
from jdp.sync.base import Local
from jdp.sync.quantized import LARGEST, dequantize, quantize
from tests.helpers import train_losses
from tests.test_checkpoint import RUN, train
from tests.test_fit import Regressor, mse, regression_data


@pytest.mark.parametrize("bits", [8, 4])
def test_the_round_trip_stays_within_half_a_scale(bits):
    """Per block: |x - dequantize(quantize(x))| <= scale / 2, scale = max|x| / 127 (7 for int4). An all-zero block
    comes back as zeros and a block holding one huge value stays finite. Breaks if int4's packing mixes nibbles or
    the scale is not per block."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(6, 64)).astype(np.float32) * np.array([1e-3, 1, 10, 1e4, 0, 1], np.float32)[:, None]
    x[5, 7] = 3e38  # one huge value beside normal ones
    q, scale = quantize(jnp.asarray(x), bits)
    assert q.dtype == (jnp.int8 if bits == 8 else jnp.uint8) and q.shape == (6, 64 if bits == 8 else 32)
    back = np.asarray(dequantize(q, scale, bits))
    assert np.all(np.isfinite(back)) and np.all(np.isfinite(np.asarray(scale)))
    bound = np.abs(x).max(axis=1, keepdims=True) / LARGEST[bits] / 2
    assert np.all(np.abs(back - x) <= bound * (1 + 1e-6))
    assert np.array_equal(back[4], np.zeros(64))  # all zeros: scale 0, no division by it
    assert back[5, 7] == pytest.approx(3e38, rel=1e-6)
    ints = np.tile(np.arange(-LARGEST[bits], LARGEST[bits] + 1), 4)[:32].astype(np.float32)
    assert np.array_equal(np.asarray(dequantize(*quantize(jnp.asarray(ints[None]), bits), bits))[0],
                          ints * np.abs(ints).max() / LARGEST[bits])


@pytest.mark.parametrize("bits", [8, 4])
def test_the_mean_is_the_exact_mean_within_two_quantizations(bits):
    """8 devices, each with its own gradient of 3 leaves (1,000 values: 4 chunks of 256-blocks after padding):
    every device gets the same mean, within one quantization of each device's part plus one of the mean. Breaks
    if the all-to-all hands a device another chunk than its own, or the mean is not divided by N."""
    rng = np.random.default_rng(1)
    shapes = {"a": (10, 50), "b": (300,), "c": (2, 100)}
    grads = {k: rng.normal(size=(8, *s)).astype(np.float32) * (1 + 9 * (k == "b")) for k, s in shapes.items()}
    strategy = QuantizedAllReduce(bits=bits, block=256)

    def per_device(g):
        local = Local(grads=g, sums={"loss": jnp.float32(1)}, weight=jnp.float32(1), model_state={}, counts={},
                      rows=1, small_sq=None)
        return strategy.reduce(local, None, DATA_AXIS).grads

    reduced = jax.jit(jax.shard_map(lambda g: jax.tree.map(lambda x: x[None], per_device(
        jax.tree.map(lambda x: x[0], g))), mesh=make_mesh(8), in_specs=(P(DATA_AXIS),), out_specs=P(DATA_AXIS),
        check_vma=False))(grads)
    for k in shapes:
        got, exact = np.asarray(reduced[k]), grads[k].mean(axis=0)
        assert np.all(got == got[:1])  # the same on every device
        bound = 2 * np.abs(np.concatenate([v.reshape(8, -1) for v in grads.values()], 1)).max() / LARGEST[bits] / 2
        assert np.abs(got[0] - exact).max() <= bound
        assert np.abs(got[0] - exact).max() > 0  # it did quantize


def _fit(**options):
    options = {"steps": 6, "global_batch_size": 32, "optimizer": optax.sgd(0.1), "log_every": 1,
               "num_devices": 8, **options}
    return jdp.fit(lambda: Regressor(nnx.Rngs(0)), mse, regression_data(), **options)


@pytest.mark.parametrize("bits, integer", [(8, "s8"), (4, "u8")])
def test_the_compiled_program_sends_integers_and_the_hand_count(bits, integer, capsys):
    """The regression model's 129 parameters on 8 devices pad to 8 chunks of one 256-block: the all-to-all sends
    2,048 values and 8 scales a device, the all-gather 256 values and 1 scale, at bits/8 bytes a value and 4 a
    scale; the weighted sums of the loss and abs_err and the weight total go in one float32 all-reduce."""
    from jdp import hlo
    from jdp.trainer import FitOptions, prepare

    engine = prepare(lambda: Regressor(nnx.Rngs(0)), mse, regression_data(), optimizer=optax.sgd(0.1),
                     global_batch_size=32, options=FitOptions(num_devices=8, allreduce_dtype=f"int{bits}"))
    state = engine.parallel.to_devices(engine.init_state())
    batch = engine.parallel.shard_batch(engine.source.train_batch(0))
    text = engine.parallel.lower_train(state, batch).compile().as_text()
    assert re.search(rf"{integer}\[[\d,]*\][^\n]* all-to-all\(", text) and re.search(
        rf"{integer}\[[\d,]*\][^\n]* all-gather", text)
    values = 8 * 256
    expected = values * bits / 8 + 8 * 4 + values / 8 * bits / 8 + 4 + 3 * 4
    assert hlo.collectives(text, 8).total == expected


def test_error_feedback_trains_and_resumes_bitwise(tmp_path):
    strategy = QuantizedAllReduce(bits=4, error_feedback=True)
    straight = _fit(sync=strategy)
    assert straight.losses[-1] < straight.losses[0]
    _fit(sync=strategy, steps=3, workdir=tmp_path, checkpoint_every=3)
    resumed = _fit(sync=strategy, workdir=tmp_path, checkpoint_every=3)
    assert resumed.losses == straight.losses[3:]
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(resumed.params),
                                                    jax.tree.leaves(straight.params), strict=True))


@pytest.mark.slow
def test_a_killed_int8_run_resumes_bitwise(tmp_path):
    args = [*RUN, "--config.parallel.allreduce_dtype=int8"]
    assert train(tmp_path / "straight", *args).returncode == 0
    assert train(tmp_path / "run", *args, env={"JDP_KILL_AT": "step:7"}).returncode == -signal.SIGKILL
    out = train(tmp_path / "run")
    assert out.returncode == 0, out.stderr
    assert train_losses(tmp_path / "run") == train_losses(tmp_path / "straight")


@pytest.mark.parametrize("options, message", [
    (dict(allreduce_dtype="int8", backend="jit"), "allreduce_dtype=int8 quantizes each device's gradient before its "
                                                  "collectives; use backend='shard_map'"),
    (dict(sync=QuantizedAllReduce(), backend="jit"), r"QuantizedAllReduce\(bits=8, block=256, error_feedback=False\) "
                                                     "quantizes"),
    (dict(allreduce_dtype="int4", shard_optimizer=True), "shard_optimizer=True reduce-scatters the gradient in fp32 "
                                                         "or bf16, not int4; use allreduce_dtype='fp32'"),
])
def test_where_it_cannot_run_it_is_refused_in_one_line(options, message):
    with pytest.raises(FitError, match=message):
        jdp.FitOptions(**options)


@pytest.mark.parametrize("make", [lambda: QuantizedAllReduce(bits=3), lambda: QuantizedAllReduce(block=7),
                                  lambda: jdp.sync.DiLoCo(every=4, bits=4, block=3),
                                  lambda: jdp.sync.ZeRO3(weight_bits=4, block=0)])
def test_a_quantizer_it_cannot_run_is_refused_at_construction(make):
    """An odd block cannot pack int4 two to a byte, and a block of 0 divides by zero at trace time."""
    with pytest.raises(ValueError, match="choose 8 or 4|even block size"):
        make()


@pytest.mark.parametrize("bits, sent", [
    (dict(weight_bits=8), r"s8\[[\d,]*\][^\n]* all-gather"),
    (dict(grad_bits=8), r"s8\[[\d,]*\][^\n]* all-to-all\("),
    (dict(weight_bits=8, grad_bits=4), r"u8\[[\d,]*\][^\n]* all-to-all\("),
], ids=["qwZ", "qgZ", "both"])
def test_zero3_with_quantized_weights_or_gradients_trains_near_float32(bits, sent):
    """`ZeRO3(weight_bits=8)` (ZeRO++'s qwZ) all-gathers int8 blocks with their scales, `grad_bits` (qgZ)
    reduce-scatters the gradient as integers through an all-to-all, each device summing its part in float32, and
    each device updates float32 slices: the run stays near plain ZeRO-3's without equalling it. Breaks if the
    gradient went through the rounding (it would be 0: nothing would train), a device summed another's part, or
    the gathered blocks were put back out of order."""
    from jdp.sync import ZeRO3
    from jdp.trainer import FitOptions, prepare

    plain = _fit(sync=ZeRO3())
    quantized = _fit(sync=ZeRO3(**bits))
    np.testing.assert_allclose(quantized.losses, plain.losses, rtol=0.02)
    assert quantized.losses != plain.losses
    engine = prepare(lambda: Regressor(nnx.Rngs(0)), mse, regression_data(), optimizer=optax.sgd(0.1),
                     global_batch_size=32, options=FitOptions(num_devices=8, sync=ZeRO3(**bits)))
    state = engine.parallel.to_devices(engine.init_state())
    text = engine.parallel.lower_train(state, engine.parallel.shard_batch(engine.source.train_batch(0))).compile(
        ).as_text()
    assert re.search(sent, text)
    with pytest.raises(FitError, match="quantizes what it gathers and reduce-scatters"):
        jdp.FitOptions(sync=ZeRO3(**bits), backend="jit")


KILLED = {  # each new strategy through the CLI, as a config file sets it (an object and its settings by path)
    "diloco_int8": {"parallel.sync_every": 4, "parallel.outer_optimizer": "nesterov",
                    "parallel.allreduce_dtype": "int8"},
    "streaming_diloco": {"parallel.sync": "jdp.sync.streaming:StreamingDiLoCo",
                         "parallel.sync_kwargs": {"every": 4, "fragments": 2}},
    "zero3_int8": {"parallel.sync": "jdp.sync.zero3:ZeRO3", "parallel.sync_kwargs": {"weight_bits": 8,
                                                                                  "grad_bits": 8}},
    "diloco_across_nodes_int4": {"parallel.sync": "jdp.sync.diloco:DiLoCo",
                                 "parallel.sync_kwargs": {"every": 4, "group_size": 2, "bits": 4}},
    "streaming_diloco_overlapped": {"parallel.sync": "jdp.sync.streaming:StreamingDiLoCo",
                                    "parallel.sync_kwargs": {"every": 4, "fragments": 2, "overlap": 1,
                                                             "local_weight": 0.5}},
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(KILLED))
def test_a_killed_run_of_each_new_strategy_resumes_bitwise(name, tmp_path):
    """SIGKILL after step 7 (checkpoints every 4): the rerun resumes from step 4 and ends as the uninterrupted run,
    train losses bit for bit."""
    config = tmp_path / "config.py"
    config.write_text("from jdp.configs import mnist1d_mlp\n\n\ndef get_config():\n    c = mnist1d_mlp.get_config()\n"
                      + "".join(f"    c.{k} = {v!r}\n" for k, v in KILLED[name].items()) + "    return c\n")
    args = ["--config", str(config), *RUN[2:], "--config.train.eval_every=4"]
    assert train(tmp_path / "straight", *args).returncode == 0
    assert train(tmp_path / "run", *args, env={"JDP_KILL_AT": "step:7"}).returncode == -signal.SIGKILL
    out = train(tmp_path / "run")
    assert out.returncode == 0, out.stderr
    assert "checkpoints/4" in out.stdout
    assert train_losses(tmp_path / "run") == train_losses(tmp_path / "straight")
