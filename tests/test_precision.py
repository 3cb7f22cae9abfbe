"""precision=bf16 computes in bfloat16: judged on the train step's program as jdp asks for it, before XLA's
own passes (XLA:CPU upcasts bfloat16 products to float32 afterwards; a GPU runs them on its tensor cores)."""

from __future__ import annotations

import re

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jdp
from jdp import models, precision
from jdp.cli.build import build
from jdp.trainer import prepare
from tests.helpers import MODELS, small_config

IMAGE = {"name": "synthetic", "shape": (8, 8, 3), "num_classes": 4, "num_examples": 64, "num_eval_examples": 8}
# Small settings per registered model; a model registered later without an entry here is tried on small images,
# and if it needs other data this test fails for it: give it an entry.
SMALL = {
    "mlp": ({"hidden_sizes": (16,)}, IMAGE),
    "cnn1d": ({"channels": (4, 4), "kernel_sizes": (3, 3), "strides": (2, 2)},
              {**IMAGE, "shape": (16, 2)}),
    "cnn2d": ({"channels": (4,), "dense_sizes": (8,)}, IMAGE),
    **{name: ({"stage_sizes": (1, 1), "width": 4}, IMAGE) for name in models.ARCHS},
}


@pytest.mark.parametrize("name", models.MODELS.names())
def test_every_model_computes_in_bf16(name):
    """Every dot and convolution of the train step, forward and backward, produces bf16 under precision=bf16.
    Fails if a model's layers fix dtype=float32 (Flax then promotes the cast parameters back to float32)."""
    if name in MODELS:  # the tests' own small settings, task included (the GPT's language-model loss)
        cfg = small_config(name, num_devices=2, precision="bf16")
        if name == "gpt":  # a block unlike the head size (8), so only the attention scores end in the block
            cfg.data.block_size = 12
    else:
        kwargs, data = SMALL.get(name, ({}, IMAGE))
        cfg = small_config("mlp", num_devices=2, precision="bf16", model={"name": name, "kwargs": kwargs}, data=data)
    engine = build(cfg)
    batch = engine.parallel.shard_batch(engine.source.train_batch(0))
    text = engine.parallel.lower_train(engine.abstract_state, batch).as_text(dialect="hlo")  # lowered, not compiled
    if name == "gpt":  # jax's XLA attention keeps its scores (last axis: the block of keys) in float32
        block = cfg.data.block_size
        scores = re.findall(rf"= f32\[[\d,]*,{block}\]\{{[\d,]*\}} dot\(", text)
        assert 0 < len(scores) <= 3 * cfg.model.kwargs.num_layers  # forward and backward, per layer
        # Those scores, and the query and key gradients taken from them, multiply bf16 operands into a float32
        # result (algorithm dot_bf16_bf16_f32); a dot of float32 operands is still counted as float32.
        text = "\n".join(line for line in text.splitlines()
                          if not (re.search(r"= f32\[", line) and "algorithm=dot_bf16_bf16_f32" in line))
    counts = precision.hlo_matmul_dtypes(text)
    assert counts and set(counts) == {"bf16"}, f"{name}: {precision.summary(counts)}"


def test_hlo_count_reads_both_kinds_of_product():
    text = ("  dot.1 = bf16[4,8]{1,0} dot(a, b), lhs_contracting_dims={1}\n"
            "  conv.2 = f32[2,4,4,8]{3,2,1,0} convolution(x, w), window={size=3x3}\n"
            "  add.3 = bf16[4,8]{1,0} add(dot.1, dot.1)\n")
    assert precision.hlo_matmul_dtypes(text) == {"bf16": 1, "f32": 1}


class Fixed(nnx.Module):
    """A user's model whose layers fix their compute dtype."""

    def __init__(self, dtype, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(6, 16, dtype=dtype, rngs=rngs)
        self.out = nnx.Linear(16, 1, dtype=dtype, rngs=rngs)

    def __call__(self, x):
        return self.out(nnx.relu(self.hidden(x)))[:, 0]


def _prepare(dtype, precision_: str, capsys) -> list[str]:
    x = np.random.default_rng(0).standard_normal((64, 6)).astype(np.float32)
    prepare(lambda: Fixed(dtype, nnx.Rngs(0)), lambda m, b: {"loss": (m(b["x"]) - b["y"]) ** 2},
            {"x": x, "y": x.sum(1)}, optimizer=optax.sgd(0.1), global_batch_size=32,
            options=jdp.FitOptions(precision=precision_, num_devices=2, keep_fp32=("y",)))
    return [line for line in capsys.readouterr().err.splitlines() if "dots/convolutions" in line]


def test_bf16_warns_about_a_model_that_stays_float32(capsys):
    """The check traces the forward as the step casts it: fails if it warns for a model that follows the cast,
    under fp32, or not at all for layers built with dtype=float32."""
    stuck = _prepare(jnp.float32, "bf16", capsys)
    assert len(stuck) == 1 and stuck[0].startswith("jdp: warning: precision=bf16, but all 2 dots/convolutions")
    assert _prepare(None, "bf16", capsys) == [] and _prepare(jnp.float32, "fp32", capsys) == []


def test_a_precision_slower_than_fp32_on_these_devices_is_said_once(capsys):
    """On CPU devices bf16 and fp16 make the step no faster (docs/benchmarks.md): fit says so once, with the
    reason, and says nothing under fp32 or on another platform."""
    x = np.random.default_rng(0).normal(size=(32, 6)).astype(np.float32)
    for name in ("fp32", "bf16", "fp16"):
        jdp.fit(lambda: nnx.Linear(6, 1, rngs=nnx.Rngs(0)), lambda m, b: {"loss": (m(b["x"])[:, 0] - b["y"]) ** 2},
                {"x": x, "y": x.sum(1)}, optimizer=optax.sgd(0.1), steps=2, global_batch_size=16, precision=name)
        said = capsys.readouterr().err.count(f"jdp: warning: precision={name} runs no faster than fp32 on CPU devices")
        assert said == (name != "fp32"), name
    assert precision.slower_than_fp32("bf16", "gpu") is None and precision.slower_than_fp32("fp16", "tpu") is None


def test_keep_fp32_is_a_tuple_of_the_batches_keys():
    """A str matched its substrings (keep_fp32='why' kept 'y', and 'x' too for 'xy'); a key the batches lack (a
    typo) kept nothing, without a word."""
    x = np.random.default_rng(0).standard_normal((64, 6)).astype(np.float32)
    with pytest.raises(jdp.FitError, match=r"^keep_fp32='why' must be a tuple$"):
        jdp.FitOptions(keep_fp32="why")
    with pytest.raises(jdp.FitError, match=r"^keep_fp32 names \['y_typo'\], which the batches do not hold \(their "
                                           r"keys: \['x', 'y'\]\); name batch keys$"):
        prepare(lambda: Fixed(None, nnx.Rngs(0)), lambda m, b: {"loss": (m(b["x"]) - b["y"]) ** 2},
                {"x": x, "y": x.sum(1)}, optimizer=optax.sgd(0.1), global_batch_size=32,
                options=jdp.FitOptions(precision="bf16", num_devices=2, keep_fp32=("y_typo",)))


def test_the_gpt_trains_in_fp16_on_cpu_devices():
    """XLA's CPU dot takes no float16 operands with a float32 accumulator, which jax's attention asks for: the GPT
    under fp16 ended in a raw XLA error before its first step (the MLP trained). The attention runs in float32
    there, and the step still compiles and trains."""
    engine = build(small_config("gpt", num_devices=2, precision="fp16"))
    state = engine.parallel.to_devices(engine.init_state())
    for step in range(2):
        state, metrics = engine.parallel.train_step(state, engine.parallel.shard_batch(engine.source.train_batch(step)))
    assert np.isfinite(engine.parallel.fetch(metrics)["loss"])
