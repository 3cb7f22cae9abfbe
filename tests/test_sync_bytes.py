"""`comm_bytes_per_step` (`DataParallel.compile_train`, `jdp.hlo`): the operand bytes each device hands the
collectives of the compiled (partitioned) train step, against each strategy's count written out here by hand.

The model has no scalar parameter, so the program's rank-0 collective operands are the step's few sums (loss
outputs, weight, the guard's agreement, the gradient norm): counted apart from the same text, and added to the
strategy's count, which must then match exactly (beside ZeRO-1's padding of each leaf to a multiple of N). A
periodic sync's average runs in a conditional's branch, once per `sync_every` steps: its bytes are divided by the
period. The parser's own rules are held to small HLO texts in tests/test_hlo.py.
"""

from __future__ import annotations

import re

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import jdp
from jdp import hlo
from jdp.trainer import FitOptions, prepare
from tests.test_golden import MLP  # leaves of 16, 96, 1 and 16 elements: the 1 is padded under ZeRO-1

SCALAR = re.compile(r"\b(f32|s32|pred)\[\]")
COLLECTIVE_LINE = re.compile(r"=\s+(.+?)\s+(all-reduce|reduce-scatter|all-gather)(?:-start)?\(")


def mse(model, batch):
    err = model(batch["x"]) - batch["y"]
    return {"loss": err**2, "abs_err": abs(err)}


def _compiled(n: int, optimizer: optax.GradientTransformation, **options) -> tuple[float, str, str, object]:
    """After one step: `comm_bytes_per_step`, the compiled train step's text, the program as jdp asked for it
    (before XLA's passes) and the abstract train state."""
    x = np.random.default_rng(0).normal(size=(64, 6)).astype(np.float32)
    engine = prepare(lambda: MLP(nnx.Rngs(0)), mse, {"x": x, "y": x.sum(1)}, optimizer=optimizer,
                     global_batch_size=8 * n, options=FitOptions(num_devices=n, **options))
    parallel = engine.parallel
    state, batch = parallel.to_devices(engine.init_state()), parallel.shard_batch(engine.source.train_batch(0))
    state, _ = parallel.train_step(state, batch)
    parallel.compile_train(state, batch)
    sent = parallel.comm_bytes_per_step
    assert all(leaf.ndim > 0 for leaf in jax.tree.leaves(engine.abstract_state.params))  # scalars = the sums
    lowered = parallel.lower_train(state, batch)
    return sent, lowered.compile().as_text(), lowered.as_text(dialect="hlo"), engine.abstract_state


def _scalar_bytes(text: str) -> int:
    """The rank-0 operands of the program's collectives (all 4-byte or 1-byte sums)."""
    return sum({"pred": 1}.get(dtype, 4) for line in text.splitlines() if (m := COLLECTIVE_LINE.search(line))
               for dtype in SCALAR.findall(m.group(1)))


def _kinds(text: str) -> set[str]:
    return {m.group(2) for line in text.splitlines() if (m := COLLECTIVE_LINE.search(line))}


def _sizes(params) -> int:
    return sum(leaf.size for leaf in jax.tree.leaves(params))


@pytest.mark.parametrize("n", [2, 8])
@pytest.mark.parametrize("backend", ["shard_map", "pmap", "jit"])
def test_mean_all_reduce(backend, n):
    """Under jit the all-reduce exists only in the partitioned program. Breaks if the gradient's all-reduce is
    left out, or a collective is counted twice."""
    sent, text, _, state = _compiled(n, optax.sgd(0.1), backend=backend, log_grad_norm=True)
    scalars = _scalar_bytes(text)
    assert _kinds(text) == {"all-reduce"}
    assert 0 < scalars <= 8 * 4  # loss, abs_err, weight, the gradient norm's sum: a few scalars
    assert sent == _sizes(state.params) * 4 + scalars


def test_a_bfloat16_all_reduce_is_sent_in_float32_by_xla_cpu():
    """jdp asks for a bfloat16 all-reduce (the lowered program); XLA:CPU widens it to float32 before it is sent,
    so on CPU devices `allreduce_dtype=bf16` saves no bytes, and `comm_bytes_per_step` says so. Breaks (and
    docs/communication.md must change) if XLA:CPU comes to all-reduce bfloat16 as it is."""
    sent, text, asked, state = _compiled(4, optax.sgd(0.1), allreduce_dtype="bf16")
    assert hlo.sends_dtype(asked, "bf16") and not hlo.sends_dtype(text, "bf16")
    assert sent == _sizes(state.params) * 4 + _scalar_bytes(text)


@pytest.mark.parametrize("n", [2, 8])
def test_zero1_reduce_scatter_and_all_gather(n):
    """The reduce-scatter of each gradient padded to a multiple of N, then this device's slice of the
    parameters into the all-gather."""
    sent, text, _, state = _compiled(n, optax.sgd(0.1, momentum=0.9), shard_optimizer=True)
    padded = sum(-(-leaf.size // n) * n for leaf in jax.tree.leaves(state.params))
    assert _kinds(text) == {"reduce-scatter", "all-gather", "all-reduce"}  # the all-reduce: the scalar sums
    assert sent == padded * 4 + padded * 4 / n + _scalar_bytes(text)


@pytest.mark.parametrize("n", [2, 8])
def test_zero3_gathers_parameters_and_reduce_scatters_gradients(n):
    """Under shard_map: this device's slice of each parameter into the forward's all-gather, and the gradient
    reduce-scattered by the gather's transpose; no all-reduce but the scalar sums'. Breaks if the parameters are
    kept whole (an all-reduce of gradient size), or if the strategy adds a reduce-scatter of its own."""
    sent, text, _, state = _compiled(n, optax.adamw(1e-3), shard_params=True)
    padded = sum(-(-leaf.size // n) * n for leaf in jax.tree.leaves(state.params))
    assert _kinds(text) == {"reduce-scatter", "all-gather", "all-reduce"}
    assert sent == padded * 4 / n + padded * 4 + _scalar_bytes(text)


def test_zero3_under_jit_leaves_the_collectives_to_xla():
    """Under jit the sliced parameters carry their sharding and XLA's partitioner places the collectives: it
    all-gathers the parameters, and on XLA:CPU reduces the gradients with all-reduces, not reduce-scatters
    (docs/communication.md). What it sends is read, not predicted: more than the gathers of the slices alone,
    less than gathering and all-reducing every parameter whole. (On this MLP, 596 B against shard_map's 628 B:
    an all-reduce's operand is the unpadded gradient, a reduce-scatter's the padded one.)"""
    sent, text, _, state = _compiled(8, optax.sgd(0.1), shard_params=True, backend="jit")
    padded = sum(-(-leaf.size // 8) * 8 for leaf in jax.tree.leaves(state.params))
    assert "all-gather" in _kinds(text)
    assert padded * 4 / 8 + _scalar_bytes(text) < sent < padded * 4 + padded * 4 + _scalar_bytes(text)


@pytest.mark.parametrize("momentum", [None, 0.9])
def test_local_sgd_per_step_average_over_a_period(momentum):
    every, n = 2, 2
    sent, text, _, state = _compiled(n, optax.sgd(0.1, momentum=momentum), sync_every=every, check_replicas_every=every)
    state_copies = 1 if momentum is None else 2  # the parameters, and the momentum
    assert sent == _sizes(state.params) * 4 * state_copies / every + _scalar_bytes(text)


def test_diloco_sends_the_parameters_once_a_round():
    """The inner AdamW state stays on its device: only the parameters are averaged, once every H steps."""
    every = 4
    sent, text, _, state = _compiled(4, optax.adamw(1e-3), sync_every=every, outer_optimizer="nesterov",
                                  check_replicas_every=every)
    assert sent == _sizes(state.params) * 4 / every + _scalar_bytes(text)


def test_one_device_sends_nothing():
    sent, *_ = _compiled(1, optax.sgd(0.1))
    assert sent == 0


def test_fit_warns_once_when_the_bf16_payload_is_widened(capsys):
    """The warning comes from the compiled program (no bfloat16 collective left in it), not from the platform's
    name: breaks if `fit` stops reading the program, or warns under fp32."""
    x = np.random.default_rng(0).normal(size=(64, 6)).astype(np.float32)
    for dtype in ("fp32", "bf16"):
        result = jdp.fit(lambda: MLP(nnx.Rngs(0)), mse, {"x": x, "y": x.sum(1)}, optimizer=optax.sgd(0.1), steps=3,
                         global_batch_size=16, num_devices=2, allreduce_dtype=dtype)
        warned = capsys.readouterr().err.count("jdp: warning: AllReduce(dtype='bf16') saves nothing here")
        assert warned == (dtype == "bf16") and result.losses
