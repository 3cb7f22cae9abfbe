"""Making a bigger model fit (`jdp.layers`): activation checkpointing (`remat`), scanned GPT blocks
(`scan_layers`), and ZeRO-3 gathering a scanned model's layers one at a time inside the loop.

Each equivalence is checked with plain SGD, whose update shows a wrong gradient scale; the memory claims are read
from what JAX saves for the backward (`saved_residuals`) and from the compiled program (`memory_analysis()`, the
HLO's while bodies)."""

from __future__ import annotations

import functools
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jdp
from jdp import hlo, params_file
from jdp.layers import Stack, saved_residual_bytes
from jdp.modeldef import state_groups
from jdp.models import build_model
from jdp.models.gpt import GPT
from jdp.perf import fits
from jdp.trainer import FitOptions, prepare
from tests.helpers import max_abs_diff

VOCAB, BLOCK = 32, 8
TOKENS = {"x": np.random.default_rng(0).integers(0, VOCAB, (256, BLOCK + 1)).astype(np.int32)}


def stack_blocks(params: dict) -> dict:
    """An unrolled GPT's pure parameter dict -> the scanned GPT's (`blocks.layers`, leaves stacked on axis 0)."""
    blocks = params["blocks"]
    layers = jax.tree.map(lambda *xs: jnp.stack(xs), *(blocks[i] for i in sorted(blocks)))
    return {**params, "blocks": {"layers": layers}}


def unstack_blocks(params: dict) -> dict:
    """A scanned GPT's pure parameter dict -> the unrolled GPT's (`blocks.0`, `blocks.1`, ...)."""
    layers = params["blocks"]["layers"]
    depth = jax.tree.leaves(layers)[0].shape[0]
    return {**params, "blocks": {i: jax.tree.map(lambda x, i=i: x[i], layers) for i in range(depth)}}


def lm_loss(model, batch):
    logits = model(batch["x"][:, :-1])
    return {"loss": optax.softmax_cross_entropy_with_integer_labels(logits, batch["x"][:, 1:])}


def gpt(scan: bool = False, remat: str = "none", layers: int = 3, width: int = 16, dropout: float = 0.0) -> GPT:
    """A tiny GPT; scanned, it holds the unrolled one's initial weights, stacked."""
    def make(scan_layers: bool) -> GPT:
        return GPT(VOCAB, BLOCK, num_layers=layers, num_heads=2, embed_dim=width, dropout=dropout, remat=remat,
                   scan_layers=scan_layers, rngs=nnx.Rngs(0))
    model = make(scan)
    if scan:
        state = nnx.state(model, nnx.Param)
        nnx.replace_by_pure_dict(state, stack_blocks(nnx.to_pure_dict(nnx.state(make(False), nnx.Param))))
        nnx.update(model, state)
    return model


def fit_gpt(scan: bool = False, remat: str = "none", dropout: float = 0.0, steps: int = 3, **options):
    result = jdp.fit(gpt(scan, remat, dropout=dropout), lm_loss, TOKENS, optimizer=optax.sgd(0.5), steps=steps,
                     global_batch_size=32, log_every=1, **options)
    return result.losses, unstack_blocks(result.params) if scan else result.params


def assert_same(run, expected, tol: float = 2e-6) -> None:
    np.testing.assert_allclose(run[0], expected[0], rtol=1e-5, atol=1e-6)
    assert max_abs_diff(run[1], expected[1]) < tol


@functools.cache
def unrolled_on_one_device(dropout: float = 0.0):
    return fit_gpt(dropout=dropout, backend="jit", num_devices=1)


# --- activation checkpointing -------------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", ["shard_map", "jit", "pmap"])
@pytest.mark.parametrize("remat", ["full", "dots"])
def test_remat_keeps_the_gradients_and_the_dropout_masks(backend, remat):
    """Attention and residual dropout (0.1, the explicit-softmax path), keys folded per step and device: if the
    recomputation in the backward drew other masks than the forward, or remat changed the function, the
    gradients and so the parameters after 3 SGD steps would differ from the run without remat."""
    expected = fit_gpt(dropout=0.1, backend=backend, num_devices=4)
    assert_same(fit_gpt(remat=remat, dropout=0.1, backend=backend, num_devices=4), expected)


def test_remat_with_dropout_on_4_devices_equals_1_under_jit():
    expected = unrolled_on_one_device(dropout=0.1)
    assert_same(fit_gpt(remat="full", dropout=0.1, backend="jit", num_devices=4), expected)


def test_a_users_remat_with_call_time_rngs_keeps_the_masks():
    """A user's own `nnx.remat` around a block taking call-time `rngs` (keys of seed, step, micro-batch, device)."""
    class Net(nnx.Module):
        def __init__(self, rngs: nnx.Rngs, checkpointed: bool):
            self.hidden = nnx.Linear(6, 32, rngs=rngs)
            self.drop = nnx.Dropout(0.3)
            self.out = nnx.Linear(32, 1, rngs=rngs)
            self.checkpointed = checkpointed

        def __call__(self, x, rngs=None):
            def block(model, x, rngs):
                return model.drop(nnx.relu(model.hidden(x)), rngs=rngs)
            h = (nnx.remat(block) if self.checkpointed else block)(self, x, rngs)
            return self.out(h)[:, 0]

    def loss(model, batch, rngs):
        return {"loss": (model(batch["x"], rngs=rngs) - batch["y"]) ** 2}

    x = np.random.default_rng(0).normal(size=(128, 6)).astype(np.float32)
    data = {"x": x, "y": x.sum(1)}
    runs = [jdp.fit(Net(nnx.Rngs(0), checkpointed), loss, data, optimizer=optax.sgd(0.1), steps=3,
                    global_batch_size=32, grad_accum_steps=2, num_devices=4, log_every=1)
            for checkpointed in (False, True)]
    assert_same((runs[1].losses, runs[1].params), (runs[0].losses, runs[0].params))


def test_resnet_remat_updates_batchnorm_statistics_once_a_step():
    """The recomputed forward of a checkpointed block must not update the running statistics a second time."""
    def run(remat):
        model = build_model("resnet18", {"stage_sizes": (1, 1), "width": 4, "remat": remat}, (8, 8, 3), 10, seed=0)
        rng = np.random.default_rng(0)
        data = {"x": rng.normal(size=(64, 8, 8, 3)).astype(np.float32), "y": rng.integers(0, 10, 64)}

        def loss(model, batch):
            return {"loss": optax.softmax_cross_entropy_with_integer_labels(model(batch["x"]), batch["y"])}
        return jdp.fit(model, loss, data, optimizer=optax.sgd(0.1), steps=2, global_batch_size=16, num_devices=4,
                       bn_sync=True, log_every=1)

    plain, checkpointed = run("none"), run("full")
    assert max_abs_diff(checkpointed.model_state, plain.model_state) < 1e-6
    assert max_abs_diff(checkpointed.params, plain.params) < 1e-6


def residual_bytes(model: GPT) -> int:
    graph, params, rest = nnx.split(model, nnx.Param, ...)
    params, rest = nnx.to_pure_dict(params), nnx.to_pure_dict(rest)
    tokens = TOKENS["x"][:4, :-1]

    def loss(params):
        return jnp.sum(nnx.merge(graph, params, rest)(tokens))

    return saved_residual_bytes(loss, params)


@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scanned"])
def test_remat_saves_fewer_residual_bytes(scan):
    """What JAX keeps for the backward: full < dots < none (on XLA:CPU the unrolled model's compiled temporaries
    need not fall, docs/performance.md; the scanned model's do, below)."""
    saved = {remat: residual_bytes(gpt(scan, remat, layers=4, width=64)) for remat in ("none", "dots", "full")}
    assert saved["full"] < saved["dots"] < saved["none"]


def compiled(layers: int, remat: str, *, scan: bool = True, width: int = 64, **options):
    """The train step compiled from shapes on 8 devices (nothing run): (its HLO text, memory_analysis())."""
    engine = prepare(lambda: gpt(scan, remat, layers=layers, width=width), lm_loss, TOKENS, optimizer=optax.sgd(0.1),
                     global_batch_size=32, options=FitOptions(num_devices=8, **options))
    state = engine.parallel.step_shapes(engine.abstract_state)
    executable = engine.parallel.lower_train(state, engine.parallel.shard_batch(engine.source.train_batch(0))).compile()
    engine.source.close()
    return executable.as_text(), executable.memory_analysis()


def test_remat_lowers_the_compiled_temporaries_of_a_scanned_model():
    assert compiled(4, "full")[1].temp_size_in_bytes < compiled(4, "none")[1].temp_size_in_bytes


# --- scanned blocks -----------------------------------------------------------------------------------------------

def test_a_scanned_gpt_trains_as_the_unrolled_one():
    """Given the same weights, stacked: the same losses and parameters after 3 SGD steps, on 1 device and on 8."""
    expected = unrolled_on_one_device()
    assert_same(fit_gpt(scan=True, backend="jit", num_devices=1), expected)
    assert_same(fit_gpt(scan=True, num_devices=8), expected)


def test_a_scanned_gpt_samples_as_the_unrolled_one_with_the_kv_cache():
    unrolled, scanned = gpt(), gpt(scan=True)
    tokens = jnp.asarray(TOKENS["x"][:2, :BLOCK])
    logits, cache = scanned.decode(tokens[:, :5], scanned.empty_cache(2), 0)
    step, _ = scanned.decode(tokens[:, 5:6], cache, 5)
    np.testing.assert_allclose(step[:, 0], unrolled(tokens[:, :6])[:, 5], atol=1e-5)
    np.testing.assert_allclose(logits, unrolled.decode(tokens[:, :5], unrolled.empty_cache(2), 0)[0], atol=1e-5)
    assert cache[0].shape[0] == 3  # one stacked cache: (layers, batch, positions, heads, head size)


# --- ZeRO-3, one layer at a time ----------------------------------------------------------------------------------

@pytest.mark.parametrize("remat", ["none", "full"])
@pytest.mark.parametrize("backend", ["shard_map", "jit"])
def test_zero3_on_a_scanned_gpt_trains_as_one_device(backend, remat):
    """8 devices, each holding 1/8 of every stacked leaf, gathering one layer inside the scan: the same run as one
    device and as plain data parallelism. Breaks if a layer's gathered gradient is not reduce-scattered and divided
    by N, or if a layer computes with another device's slice."""
    expected = unrolled_on_one_device()
    assert_same(fit_gpt(scan=True, remat=remat, backend=backend, num_devices=8, shard_params=True), expected)
    assert_same(fit_gpt(scan=True, backend=backend, num_devices=8), expected)


class LayerScaled(nnx.Module):
    """A scanned model whose layers hold a size-1 parameter (a per-layer scale, as ReZero's): its slice on each
    device has the layer's logical shape, one value or zero padding; and an empty one, which stays whole."""

    def __init__(self, rngs: nnx.Rngs):
        class Block(nnx.Module):
            def __init__(self, rngs: nnx.Rngs):
                self.linear, self.scale = nnx.Linear(8, 8, rngs=rngs), nnx.Param(jnp.full((1,), 0.5))
                self.empty = nnx.Param(jnp.zeros((0,)))

            def __call__(self, x):
                return x + self.scale * nnx.relu(self.linear(x)) + self.empty.sum(), None

        self.blocks, self.out = Stack(Block, 3, rngs=rngs), nnx.Linear(8, 1, rngs=rngs)

    def __call__(self, x):
        return self.out(self.blocks(x)[0])[:, 0]


@pytest.mark.parametrize("options", [{}, {"shard_group": 2}, {"backend": "jit", "grad_accum_steps": 2}],
                         ids=["zero3", "hybrid", "zero3-jit-accumulated"])
def test_zero3_gathers_a_layers_size_1_parameter_whose_slice_looks_whole(options):
    """Breaks if the per-layer gather skips a leaf whose slice has the logical shape (three devices of four then
    scale their layer by zero padding), or gathers an empty one (the compiler refuses a gather of size 0). Under jit
    with accumulation the carry's sharding constraint sat inside the lanes' vmap, on its spmd axis: a ValueError."""
    x = np.random.default_rng(0).normal(size=(64, 8)).astype(np.float32)
    data = {"x": x, "y": np.sin(x).sum(1)}

    def run(**kw):
        result = jdp.fit(LayerScaled(nnx.Rngs(0)), lambda m, b: {"loss": (m(b["x"]) - b["y"]) ** 2}, data,
                         optimizer=optax.sgd(0.05), steps=3, global_batch_size=16, log_every=1, **kw)
        return result.losses, result.params

    assert_same(run(num_devices=4, shard_params=True, **options), run(num_devices=1))


def _collectives(text: str, op: str) -> dict[str, list[str]]:
    """Result shapes of `op` (e.g. "all-gather") in each computation of a compiled HLO text."""
    found, computation = {}, None
    for line in text.splitlines():
        if opened := re.match(r"^(?:ENTRY\s+)?%?([^\s(]+)\s.*\{\s*$", line):
            computation = opened.group(1)
        elif re.search(rf"\s{op}(-start)?\(", line):
            found.setdefault(computation, []).append(line.split("=", 1)[1].split(op)[0].strip())
    return found


def _while_bodies(text: str) -> list[str]:
    return re.findall(r"\bwhile\(.*\bbody=%?([\w.\-]+)", text)


@pytest.mark.parametrize("backend", ["shard_map", "jit"])
def test_zero3_gathers_each_layer_inside_the_forward_and_backward_loops(backend):
    """In the compiled program: both while bodies (forward, backward) all-gather the layer's weight matrices, and no
    all-gather outside them has a stacked (layers, ...) leaf's shape: nothing gathers the whole stack."""
    layers, width = 3, 64
    text, _ = compiled(layers, "none", width=width, shard_params=True, backend=backend)
    gathers = _collectives(text, "all-gather")
    bodies = _while_bodies(text)
    assert len(bodies) == 2
    matrices = {f"{width},{3 * width}", f"{width},{width}", f"{width},{4 * width}", f"{4 * width},{width}"}
    for body in bodies:
        shapes = {re.sub(r"\{.*", "", s).removeprefix("f32[").rstrip("]") for s in gathers.get(body, [])}
        assert matrices <= shapes, (body, shapes)
    outside = [s for computation, shapes in gathers.items() if computation not in bodies for s in shapes]
    assert not [s for s in outside if s.startswith(f"f32[{layers},")], outside


def test_zero3_counts_the_per_layer_gathers_once_per_layer():
    """comm_bytes_per_step grows by the same bytes for every added layer (the while bodies count their trip count
    times), and each layer sends at least its weight matrices' shards twice (forward and backward gathers)."""
    sent = {layers: hlo.collectives(compiled(layers, "none", shard_params=True)[0], 8).total for layers in (2, 3, 4)}
    per_layer = sent[3] - sent[2]
    assert sent[4] - sent[3] == pytest.approx(per_layer, rel=1e-6)
    matrices = 12 * 64 * 64 * 4  # qkv, proj, fc, proj of one block, float32
    assert per_layer >= 2 * matrices * 7 / 8 / 8  # each device hands the gathers (N-1)/N... of its 1/N shards


def test_zero3_temporaries_grow_by_less_than_a_block_per_block():
    """ZeRO-3 + scan + remat (full): each added block adds less to the compiled temporaries than one block's whole
    parameters, so the gathered weights of the blocks are not all alive at once."""
    width = 128
    block = (12 * width * width + 13 * width) * 4  # one block's parameters, float32
    temps = {layers: compiled(layers, "full", width=width, shard_params=True)[1].temp_size_in_bytes
             for layers in (2, 6)}
    assert (temps[6] - temps[2]) / 4 < block


def test_a_zero3_checkpoint_of_a_scanned_gpt_restores_on_2_devices_and_on_1(tmp_path):
    straight = fit_gpt(scan=True, steps=4, num_devices=8, shard_params=True)
    fit_gpt(scan=True, steps=2, num_devices=8, shard_params=True, workdir=tmp_path / "run")
    for devices in (2, 1):
        workdir = tmp_path / f"on{devices}"
        shutil.copytree(tmp_path / "run", workdir)
        resumed = fit_gpt(scan=True, steps=4, num_devices=devices, shard_params=devices > 1, workdir=workdir)
        assert_same(resumed, (straight[0][2:], straight[1]))


@pytest.mark.parametrize("saved_scanned", [False, True], ids=["unrolled_file", "scanned_file"])
def test_a_parameter_file_of_one_layout_loads_into_the_other(tmp_path, saved_scanned):
    """`python -m jdp.export`'s file (and so `init_from`): the unrolled model's `blocks/<i>/...` and the scanned
    model's stacked `blocks/layers/...` are the same weights."""
    saved, target = gpt(saved_scanned), GPT(VOCAB, BLOCK, num_layers=3, num_heads=2, embed_dim=16,
                                             scan_layers=not saved_scanned, rngs=nnx.Rngs(7))
    np.savez(tmp_path / "p.npz", **params_file.flatten(nnx.to_pure_dict(nnx.state(saved, nnx.Param)), "params"))
    params, model_state = params_file.load_into(tmp_path / "p.npz", *state_groups(target))
    expected = nnx.to_pure_dict(nnx.state(gpt(not saved_scanned), nnx.Param))
    assert max_abs_diff(params, expected) == 0


def test_a_checkpoint_of_the_unrolled_model_is_refused_by_the_scanned_one(tmp_path):
    """The stacked parameter tree is another model's: resuming across layouts is refused in one line (a parameter
    file converts instead, above)."""
    fit_gpt(steps=2, num_devices=2, workdir=tmp_path)
    with pytest.raises(jdp.FitError, match=r"other settings .*\(model parameter shapes\)"):
        fit_gpt(scan=True, steps=4, num_devices=2, workdir=tmp_path)


# --- what fits, said before anything runs -------------------------------------------------------------------------

def test_bench_compile_only_gives_a_row_per_sharding_and_remat_setting(tmp_path, monkeypatch):
    """A scanned GPT: 3 shardings x 3 remat settings, compiled from shapes (no step runs); ZeRO-3 with full remat
    holds the least per device."""
    from jdp.parallel import DataParallel
    from jdp.perf import bench

    monkeypatch.setattr(DataParallel, "train_step", lambda *a: pytest.fail("--compile_only ran a step"))
    tiny = ["--config.model.kwargs.num_layers=2", "--config.model.kwargs.num_heads=2",
            "--config.model.kwargs.embed_dim=32", "--config.data.block_size=16", "--config.train.global_batch_size=8",
            "--config.model.kwargs.scan_layers=True", "--config.model.kwargs.dropout=0.0"]
    assert bench.main(["--config", "configs/shakespeare_char_cpu.py", "--devices", "8", "--compile_only", "--out",
                       str(tmp_path), *tiny]) == 0
    rows = json.loads((tmp_path / "bench.json").read_text())["rows"]
    assert {(r["sharding"], r["remat"]) for r in rows} == {(s, m) for s in ("plain", "zero1", "zero3")
                                                          for m in ("none", "dots", "full")}
    peak = {(r["sharding"], r["remat"]): r["argument_bytes"] + r["temp_bytes"] for r in rows}
    assert min(peak, key=peak.get) == ("zero3", "full")
    assert "| 8 | zero3 | full |" in (tmp_path / "bench.md").read_text()


def test_fits_compiles_each_shape_in_a_capped_child_and_tables_it():
    """In-process, a tiny shape: the figures of one compile, host RSS included; a child over its cap is a row
    that says so, not a hang."""
    row = fits.measure_one("2x2x16", "ZeRO-3 + scan + remat", 8)
    assert row["scanned"] and row["remat"] == "full" and row["host_rss_bytes"] > 0
    assert row["peak_bytes"] == row["argument_bytes"] + row["output_bytes"] + row["temp_bytes"] - row["alias_bytes"]
    capped = fits.measure("GPT 6.7B", "plain", 8, timeout_s=1)
    assert capped == {"error": "compile over 1 s"}
    table = fits.table([{"shape": "2x2x16", "strategy": "ZeRO-3 + scan + remat", **row},
                        {"shape": "GPT 6.7B", "strategy": "plain", **capped}], memory_gb=16, devices=8)
    assert "| 2x2x16 |" in table and "| yes |" in table and "compile over 1 s" in table


def test_a_stack_takes_a_models_own_method_as_its_layer_factory():
    """`Stack(self.make_block, ...)`: a bound method builds the same layers as a lambda (nnx.vmap refuses a bound
    method given to it directly)."""
    class Net(nnx.Module):
        def __init__(self, width: int, rngs: nnx.Rngs, by_method: bool):
            self.width = width
            make = self.make_block if by_method else (lambda r: nnx.Linear(width, width, rngs=r))
            self.blocks = Stack(make, 3, rngs=rngs)

        def make_block(self, rngs: nnx.Rngs) -> nnx.Module:
            return nnx.Linear(self.width, self.width, rngs=rngs)

    by_method, by_lambda = (nnx.state(Net(4, nnx.Rngs(0), flag), nnx.Param) for flag in (True, False))
    assert max_abs_diff(nnx.to_pure_dict(by_method), nnx.to_pure_dict(by_lambda)) == 0


@pytest.mark.slow
def test_the_api_docs_stack_program_runs_as_printed(tmp_path):
    """docs/api.md's `Stack` program: 8 layers scanned, remat, ZeRO-3 on 8 simulated devices; it learns (the
    targets' variance is ~3.4) and says its memory before the first step."""
    page = (Path(__file__).resolve().parents[1] / "docs" / "api.md").read_text()
    program = page.split("## A model that barely fits", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    out = subprocess.run([sys.executable, "-c", program], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "memory per device: params" in out.stdout
    assert float(out.stdout.strip().splitlines()[-1]) < 1.0
