"""Each sync strategy's `bytes_per_step(abstract_state, num_devices)` (`jdp.sync`) against the program jdp
compiles: the operand bytes that each device hands the all-reduces, reduce-scatters and all-gathers of the
lowered train step (shard_map: one device's program, before XLA combines or widens collectives).

The model has no scalar parameter, so the scalar collectives are the step's few sums (loss outputs, weight,
the guard's agreement, the gradient norm): the non-gradient payload, a few bytes, counted apart. What the
strategy counts is compared with the rest, exactly, beside ZeRO-1's padding of each leaf to a multiple of N.
Local SGD's parameter average runs in a branch of a conditional, once per `sync_every` steps: its bytes are
divided by the period.
"""

from __future__ import annotations

import math
import re

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from jdp import sync as sync_lib
from jdp.trainer import FitOptions, prepare
from tests.test_golden import MLP  # leaves of 16, 96, 1 and 16 elements: the 1 is padded under ZeRO-1

ITEMSIZE = {"f32": 4, "s32": 4, "u32": 4, "bf16": 2, "f16": 2, "pred": 1}
COLLECTIVE = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+ = (.+?) (all-reduce|reduce-scatter|all-gather)(?:-start)?\(")
SHAPE = re.compile(r"\b(f32|s32|u32|bf16|f16|pred)\[([\d,]*)\]")
COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([^\s(]+).*\{\s*$")  # an unindented line opening a computation


def mse(model, batch):
    err = model(batch["x"]) - batch["y"]
    return {"loss": err**2, "abs_err": abs(err)}


def _lowered(n: int, optimizer: optax.GradientTransformation, **options) -> tuple[str, object, sync_lib.Sync]:
    """The lowered train step's text, the abstract train state, and the strategy `prepare` picks for `options`."""
    x = np.random.default_rng(0).normal(size=(64, 6)).astype(np.float32)
    engine = prepare(lambda: MLP(nnx.Rngs(0)), mse, {"x": x, "y": x.sum(1)}, optimizer=optimizer,
                     global_batch_size=8 * n, options=FitOptions(num_devices=n, **options))
    state = engine.parallel.to_devices(engine.init_state())
    text = engine.parallel.lower_train(state, engine.parallel.shard_batch(engine.source.train_batch(0))).as_text(
        dialect="hlo")
    strategy = engine.parallel.sync
    params = engine.abstract_state.params
    assert all(leaf.ndim > 0 for leaf in jax.tree.leaves(params))  # so the scalar collectives are the sums
    return text, engine.abstract_state, strategy


def collective_bytes(text: str, n: int) -> dict[str, float]:
    """Operand bytes per device of the program's collectives: "gradient" (non-scalar, every step), "periodic"
    (non-scalar, inside a conditional's branch) and "scalars"; "ops" counts the non-scalar ones per kind.
    An all-gather's operand is its result / n, a reduce-scatter's its result * n."""
    found, branches, computation = [], set(), None
    for line in text.splitlines():
        if opened := COMPUTATION.match(line):
            computation = opened.group(1)
        if "conditional(" in line:
            listed = re.search(r"branch_computations=\{([^}]*)\}", line)
            named = re.findall(r"(?:true|false)_computation=%?([\w.\-]+)", line)
            branches.update([b.strip().lstrip("%") for b in listed.group(1).split(",")] if listed else named)
        if match := COLLECTIVE.match(line):
            shapes, op = match.groups()
            result = sum(ITEMSIZE[dtype] * math.prod(int(d) for d in dims.split(",") if d)
                         for dtype, dims in SHAPE.findall(shapes))
            scalar = all(dims == "" for _, dims in SHAPE.findall(shapes))
            found.append((computation, op, scalar, result * {"all-gather": 1 / n, "reduce-scatter": n}.get(op, 1)))
    out = {"gradient": 0.0, "periodic": 0.0, "scalars": 0.0, "ops": {}}
    for computation, op, scalar, operand in found:
        key = "scalars" if scalar else "periodic" if computation in branches else "gradient"
        out[key] += operand
        if not scalar:
            out["ops"][op] = out["ops"].get(op, 0) + 1
    return out


def _padding_bytes(params, n: int, itemsize: int) -> int:
    return sum((-leaf.size) % n for leaf in jax.tree.leaves(params)) * itemsize


def _sizes(params) -> int:
    return sum(leaf.size for leaf in jax.tree.leaves(params))


@pytest.mark.parametrize("n", [2, 8])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_mean_all_reduce(dtype, n):
    text, state, strategy = _lowered(n, optax.sgd(0.1), allreduce_dtype=dtype, log_grad_norm=True)
    params, sent = state.params, collective_bytes(text, n)
    assert set(sent["ops"]) == {"all-reduce"} and sent["periodic"] == 0
    assert sent["gradient"] == _sizes(params) * {"fp32": 4, "bf16": 2}[dtype]
    assert 0 < sent["scalars"] <= 8 * 4  # loss, abs_err, weight, the gradient norm's sum: a few scalars
    assert strategy.bytes_per_step(state, n) == sent["gradient"]


@pytest.mark.parametrize("n", [2, 8])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_zero1_reduce_scatter_and_all_gather(dtype, n):
    text, state, strategy = _lowered(n, optax.sgd(0.1, momentum=0.9), shard_optimizer=True, allreduce_dtype=dtype)
    params, sent = state.params, collective_bytes(text, n)
    assert sent["ops"] == {"reduce-scatter": len(jax.tree.leaves(params)), "all-gather": len(jax.tree.leaves(params))}
    itemsize = {"fp32": 4, "bf16": 2}[dtype]
    padded = _sizes(params) + _padding_bytes(params, n, 1)
    assert sent["gradient"] == padded * itemsize + padded * 4 / n  # the gradient, then the parameter slice
    assert 0 < sent["scalars"] <= 8 * 4
    assert strategy.bytes_per_step(state, n) == sent["gradient"]


@pytest.mark.parametrize("momentum", [
    None,
    0.9,
])
def test_local_sgd_per_step_average_over_a_period(momentum):
    every, n = 2, 2
    text, state, strategy = _lowered(n, optax.sgd(0.1, momentum=momentum), sync_every=every,
                                     check_replicas_every=every)
    params, sent = state.params, collective_bytes(text, n)
    assert sent["gradient"] == 0  # the gradient stays on its device
    state_copies = 1 if momentum is None else 2  # the parameters, and the momentum
    assert sent["periodic"] == _sizes(params) * 4 * state_copies
    assert 0 < sent["scalars"] <= 8 * 4
    assert strategy.bytes_per_step(state, n) == sent["periodic"] / every
