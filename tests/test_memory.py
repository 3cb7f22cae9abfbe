"""The memory a run takes, said before its first step (`jdp.memory`): the per-device bytes of parameters, gradients
and optimizer state, and the compiled train step's peak, read from the one executable the steps run (the train
step is compiled once, explicitly, before the first step), and kept in metrics.jsonl's summary line."""

from __future__ import annotations

import collections
import time
from types import SimpleNamespace

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from jax._src.interpreters import pxla

import jdp
from jdp import hlo, memory
from jdp.trainer import FitOptions, prepare
from tests.helpers import records

BACKENDS = ("shard_map", "pmap", "jit")
FIELDS = ("params", "grads", "opt_state", "argument", "output", "temp", "alias", "peak")


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(6, 32, rngs=rngs)
        self.out = nnx.Linear(32, 1, rngs=rngs)

    def __call__(self, x):
        return self.out(nnx.relu(self.hidden(x)))[:, 0]


def mse(model, batch):
    return {"loss": (model(batch["x"]) - batch["y"]) ** 2}


DATA = {"x": np.random.default_rng(0).normal(size=(128, 6)).astype(np.float32)}
DATA["y"] = np.sin(DATA["x"]).sum(1).astype(np.float32)
ARGS = dict(optimizer=optax.adam(1e-2), global_batch_size=32)


def _fit(tmp_path, backend: str, steps: int = 2):
    return jdp.fit(lambda: MLP(nnx.Rngs(0)), mse, DATA, steps=steps, num_devices=8, backend=backend, log_every=1,
                   workdir=str(tmp_path), **ARGS)


def _independent(backend: str) -> tuple[dict[str, int], float]:
    """The figures of the run's train step from a compile of its own, read without `jdp.memory`: (bytes per
    device, comm_bytes_per_step)."""
    engine = prepare(lambda: MLP(nnx.Rngs(0)), mse, DATA, options=FitOptions(num_devices=8, backend=backend), **ARGS)
    try:
        state = engine.parallel.to_devices(engine.init_state())
        batch = engine.parallel.shard_batch(engine.source.train_batch(0))
        compiled = engine.parallel.lower_train(state, batch).compile()
    finally:
        engine.source.close()
    stats = compiled.memory_analysis()
    whole = {name: sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))  # replicated: whole on each
             for name, tree in (("params", engine.abstract_state.params),
                                ("opt_state", engine.abstract_state.opt_state))}
    figures = {"params": whole["params"], "grads": whole["params"], "opt_state": whole["opt_state"],
               "argument": stats.argument_size_in_bytes, "output": stats.output_size_in_bytes,
               "temp": stats.temp_size_in_bytes, "alias": stats.alias_size_in_bytes}
    figures["peak"] = figures["argument"] + figures["output"] + figures["temp"] - figures["alias"]
    return {f"{k}_bytes": v for k, v in figures.items()}, hlo.collectives(compiled.as_text(), 8, 1).total


@pytest.mark.parametrize("backend", BACKENDS)
def test_memory_is_said_before_the_first_step_and_kept_in_the_summary(backend, tmp_path, capsys):
    _fit(tmp_path, backend)
    lines = capsys.readouterr().out.splitlines()
    expected, sent = _independent(backend)
    assert expected["opt_state_bytes"] > 2 * expected["params_bytes"] > 0 and expected["temp_bytes"] > 0
    said = [i for i, line in enumerate(lines) if line.startswith("memory per device:")]
    first_step = next(i for i, line in enumerate(lines) if line.startswith("step 1:"))
    assert len(said) == 1 and lines[0].startswith("jdp: 8 cpu devices") and 0 < said[0] < first_step, lines
    mb = memory.mb
    assert lines[said[0]] == (
        f"memory per device: params {mb(expected['params_bytes'])} MB, grads {mb(expected['grads_bytes'])} MB, "
        f"optimizer state {mb(expected['opt_state_bytes'])} MB; compiled step peak {mb(expected['peak_bytes'])} MB "
        f"(arguments {mb(expected['argument_bytes'])} + outputs {mb(expected['output_bytes'])} + temporaries "
        f"{mb(expected['temp_bytes'])} - aliased {mb(expected['alias_bytes'])}; XLA's figures for these devices)")
    summary = records(tmp_path, "summary")[-1]
    assert {k: summary[f"{k}_bytes_per_device"] for k in FIELDS} == {k: expected[f"{k}_bytes"] for k in FIELDS}
    assert summary["comm_bytes_per_step"] == sent > 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_train_step_is_compiled_once_before_the_first_step(backend, tmp_path, monkeypatch):
    """One explicit compile (`Lowered.compile`), and no other request to compile the train step's program (XLA's
    in-memory cache would hide a second one from jax's compile events, so the requests are counted where every
    compile, implicit in a jitted call or explicit, goes). The 'first step (compile)' time includes it."""
    explicit, requests, compile_s = [], collections.Counter(), []
    lowered_compile, mesh_compile = jax.stages.Lowered.compile, pxla.MeshComputation.compile

    def counted_explicit(self, *args, **kwargs):
        explicit.append(self._lowering._name)
        t0 = time.perf_counter()
        compiled = lowered_compile(self, *args, **kwargs)
        compile_s.append(time.perf_counter() - t0)
        return compiled

    def counted_request(self, *args, **kwargs):
        requests[self._name] += 1
        return mesh_compile(self, *args, **kwargs)

    monkeypatch.setattr(jax.stages.Lowered, "compile", counted_explicit)
    monkeypatch.setattr(pxla.MeshComputation, "compile", counted_request)
    _fit(tmp_path, backend, steps=3)
    assert len(explicit) == 1 and requests[explicit[0]] == 1, (explicit, requests)
    assert records(tmp_path, "summary")[-1]["compile_time_s"] >= compile_s[0]


def test_peak_is_arguments_plus_outputs_plus_temporaries_less_aliased():
    stats = SimpleNamespace(argument_size_in_bytes=100, output_size_in_bytes=40, temp_size_in_bytes=7,
                            alias_size_in_bytes=30, peak_memory_in_bytes=1)
    figures = memory.memory_analysis(SimpleNamespace(memory_analysis=lambda: stats))
    assert figures == {"argument_bytes": 100, "output_bytes": 40, "temp_bytes": 7, "alias_bytes": 30,
                       "peak_bytes": 117}
    assert memory.memory_analysis(SimpleNamespace(memory_analysis=lambda: None)) == {}
    state = {"params_bytes": 3 * 2**20, "grads_bytes": 3 * 2**20, "opt_state_bytes": 0}
    assert memory.describe(state) == ("memory per device: params 3.00 MB, grads 3.00 MB, optimizer state 0.0000 MB; "
                                      "compiled step peak unknown (XLA gives no memory analysis for these devices)")
    assert memory.summary_fields({**state, **figures})["peak_bytes_per_device"] == 117
    split = jax.sharding.NamedSharding(jax.make_mesh((8,), ("data",)), jax.sharding.PartitionSpec("data"))
    assert memory.per_device_bytes({"w": jax.ShapeDtypeStruct((16, 2), np.float32, sharding=split)}) == 2 * 2 * 4
