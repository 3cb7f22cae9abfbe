"""`jdp.fit` with models, losses and data defined here, as a researcher writes them: N devices equal one
device, uneven token weights give the one-device gradient, dropout is per device and per step yet
reproducible, and bad input is refused in one line before anything compiles."""

import fcntl
import functools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jdp
from jdp import checkpoint
from jdp.data.batching import RowOrder
from jdp.sync import base as sync_base
from jdp.trainer import FitOptions, prepare
from tests.helpers import max_abs_diff, records

BACKENDS = ("shard_map", "pmap", "jit")
RTOL = 1e-4


class Regressor(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, dropout: float = 0.0):
        self.hidden = nnx.Linear(6, 16, rngs=rngs)
        self.drop = nnx.Dropout(dropout, rngs=rngs)
        self.out = nnx.Linear(16, 1, rngs=rngs)

    def __call__(self, x):
        return self.out(self.drop(nnx.relu(self.hidden(x))))[:, 0]


class NormNet(nnx.Module):
    """BatchNorm written without any device axis: jdp syncs it."""

    def __init__(self, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(6, 16, rngs=rngs)
        self.norm = nnx.BatchNorm(16, rngs=rngs)
        self.out = nnx.Linear(16, 1, rngs=rngs)

    def __call__(self, x):
        return self.out(nnx.relu(self.norm(self.hidden(x))))[:, 0]


class TokenNet(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.embed = nnx.Embed(11, 8, rngs=rngs)
        self.out = nnx.Linear(8, 11, rngs=rngs)

    def __call__(self, ids):
        return self.out(self.embed(ids))


def mse(model, batch):
    err = model(batch["x"]) - batch["y"]
    return {"loss": err**2, "abs_err": jnp.abs(err)}


def token_loss(model, batch):
    logits = model(batch["ids"]).astype(jnp.float32)
    return {"loss": optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]),
            "weight": batch["weight"]}


def regression_data(n=256, seed=0):
    x = np.random.default_rng(seed).normal(size=(n, 6)).astype(np.float32)
    return {"x": x, "y": np.sin(x).sum(1).astype(np.float32)}


def token_data(n=128, t=6):
    """Rows of very different weight: a row keeps all its tokens or only one, so the devices of a global
    batch hold very different numbers of real tokens."""
    rng = np.random.default_rng(1)
    ids = rng.integers(0, 11, (n, t)).astype(np.int32)
    kept = np.array([t, 1, 1, 1])[np.arange(n) % 4]
    weight = (np.arange(t)[None, :] < kept[:, None]).astype(np.float32)
    return {"ids": ids, "targets": np.roll(ids, 1, axis=1), "weight": weight}


def _fit(model_cls, loss, data, **options):
    options = {"steps": 4, "global_batch_size": 32, "optimizer": optax.sgd(0.1), "log_every": 1, **options}
    return jdp.fit(lambda: model_cls(nnx.Rngs(0)), loss, data, **options)


CASES = {"regression": (Regressor, mse, regression_data()), "batchnorm": (NormNet, mse, regression_data()),
         "tokens": (TokenNet, token_loss, token_data())}


@functools.cache
def one_device(case):
    model_cls, loss, data = CASES[case]
    return _fit(model_cls, loss, data, backend="jit", num_devices=1)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(CASES))
def test_n_devices_equal_one_device(case, backend):
    model_cls, loss, data = CASES[case]
    reference = one_device(case)
    for n in (8, 2):
        result = _fit(model_cls, loss, data, backend=backend, num_devices=n)
        np.testing.assert_allclose(result.losses, reference.losses, rtol=RTOL, atol=1e-6)
        assert max_abs_diff(result.params, reference.params) < 1e-5
        assert max_abs_diff(result.model_state, reference.model_state) < 1e-5
    assert reference.losses[-1] < reference.losses[0]


def test_uneven_token_weights_give_the_one_device_gradient_where_per_device_means_do_not(monkeypatch):
    """DDP averages each rank's mean loss: with devices holding 1 or 24 real tokens, that weights a token
    by its device. jdp's weighted sums travel with the weight total, so 8 devices equal 1 device."""
    data = token_data()
    reference = one_device("tokens")
    exact = _fit(TokenNet, token_loss, data, num_devices=8)
    assert max_abs_diff(exact.params, reference.params) < 1e-5

    def per_device_means(tree, axis_name):  # what DDP computes: the mean over devices of each device's mean
        if axis_name is None or "grads" not in tree:
            return tree if axis_name is None else jax.lax.pmean(tree, axis_name)
        mean_weight = jax.lax.pmean(tree["weight"], axis_name)
        local_means = jax.tree.map(lambda g: g / tree["weight"] * mean_weight, tree["grads"])
        return jax.lax.pmean({**tree, "grads": local_means}, axis_name)

    monkeypatch.setattr(sync_base, "all_reduce_mean", per_device_means)
    biased = _fit(TokenNet, token_loss, data, num_devices=8)
    assert max_abs_diff(biased.params, reference.params) > 1e-3


def test_a_batch_that_weighs_nothing_makes_no_update_and_is_not_a_failure():
    data = {**token_data(), "weight": np.zeros((128, 6), np.float32)}
    model = TokenNet(nnx.Rngs(0))
    before = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    result = jdp.fit(model, token_loss, data, optimizer=optax.adam(0.1), steps=3, global_batch_size=32,
                     num_devices=8, on_nonfinite="halt")
    assert max_abs_diff(result.params, before) == 0
    assert result.step == 3 and len(result.losses) == 3 and np.isnan(result.losses).all()


def test_local_sgd_syncs_at_a_sync_step_that_makes_no_update():
    """Local SGD: the replicas drift apart between syncs. A sync step whose batch weighs nothing holds the
    update back, and must still average the replicas, or the replica check at that step stops the run."""
    data = token_data()
    order = RowOrder(seed=0, num_train=128, num_eval=0, global_batch_size=32, eval_batch_size=32,
                     process_index=0, process_count=1)
    data["weight"][order.train_rows(1)] = 0  # the global batch of step 2, a sync step
    result = jdp.fit(lambda: TokenNet(nnx.Rngs(0)), token_loss, data, optimizer=optax.sgd(0.3), steps=4,
                     global_batch_size=32, num_devices=8, sync_every=2, check_replicas_every=2, log_every=1)
    # One loss per step, by step: step 2 weighed nothing, so it has no mean.
    assert len(result.losses) == 4 and np.isnan(result.losses[1]) and np.isfinite(result.losses[::2]).all()


def test_integer_tokens_reach_embed_uncast_under_bf16():
    result = _fit(TokenNet, token_loss, token_data(), num_devices=2, precision="bf16", optimizer=optax.adam(0.05),
                  steps=20)
    assert all(x.dtype == np.float32 for x in jax.tree.leaves(result.params))
    assert result.losses[-1] < result.losses[0]


def test_keep_fp32_leaves_a_regression_target_in_float32():
    seen = {}

    def spy(model, batch):
        seen["y"], seen["x"] = batch["y"].dtype, batch["x"].dtype
        return mse(model, batch)

    _fit(Regressor, spy, regression_data(), num_devices=2, precision="bf16", keep_fp32=("y",), steps=1)
    assert seen == {"y": jnp.float32, "x": jnp.bfloat16}


class Recorder(nnx.Variable):
    """An integer model-state leaf: never averaged across replicas, so each device's copy shows its mask."""


class DropoutProbe(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.out = nnx.Linear(6, 1, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)
        self.mask = Recorder(jnp.zeros((16,), jnp.int32))

    def __call__(self, x):
        kept = self.drop(jnp.ones((x.shape[0], 16)))
        self.mask.value = (kept[0] > 0).astype(jnp.int32)  # the mask of this device's first row
        return self.out(x)[:, 0] + 0 * kept.sum()


def test_dropout_masks_differ_across_devices_and_steps():
    engine = prepare(lambda: DropoutProbe(nnx.Rngs(0)), mse, regression_data(), optimizer=optax.sgd(0.1),
                     global_batch_size=32, options=FitOptions(num_devices=8))
    state = engine.parallel.to_devices(engine.init_state())
    masks = []
    for step in range(2):
        state, _ = engine.parallel.train_step(state, engine.parallel.shard_batch(engine.source.train_batch(step)))
        masks.append([np.asarray(s.data) for s in state.model_state["mask"].addressable_shards])
    assert len({m.tobytes() for m in masks[0]}) == 8  # a different mask on every device
    assert all(a.tobytes() != b.tobytes() for a, b in zip(masks[0], masks[1], strict=True))  # and every step
    assert 0 < np.mean(masks) < 1


def test_dropout_training_resumes_bitwise(tmp_path):
    def dropout_fit(steps, workdir):
        return jdp.fit(lambda: Regressor(nnx.Rngs(0), dropout=0.3), mse, regression_data(), optimizer=optax.sgd(0.1),
                       steps=steps, global_batch_size=32, num_devices=8, workdir=workdir, log_every=1)

    whole = dropout_fit(6, tmp_path / "whole")
    dropout_fit(3, tmp_path / "resumed")
    resumed = dropout_fit(6, tmp_path / "resumed")
    assert resumed.losses == whole.losses[3:]
    assert max_abs_diff(resumed.params, whole.params) == 0
    # While another run holds the workdir, a fit on it is refused before it restores or trains anything.
    lock = os.open(tmp_path / "resumed" / "jdp.lock", os.O_RDWR)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(jdp.UsageError, match="is in use by another run"):
            dropout_fit(8, tmp_path / "resumed")
    finally:
        os.close(lock)


def test_dropout_under_jit_does_not_depend_on_the_device_count():
    runs = [jdp.fit(lambda: Regressor(nnx.Rngs(0), dropout=0.3), mse, regression_data(), optimizer=optax.sgd(0.1),
                    steps=3, global_batch_size=32, num_devices=n, backend="jit", log_every=1) for n in (1, 2, 8)]
    for result in runs[1:]:
        np.testing.assert_allclose(result.losses, runs[0].losses, rtol=RTOL)
    no_dropout = _fit(Regressor, mse, regression_data(), num_devices=1, backend="jit", optimizer=optax.sgd(0.1),
                      steps=3)
    assert runs[0].losses[1:] != no_dropout.losses[1:]  # dropout really ran


def test_the_model_passed_in_holds_the_result_and_callbacks_run():
    class Every2:
        every, steps, ended = 2, [], None

        def on_step(self, step, metrics, state):
            self.steps.append((step, sorted(metrics)))

        def on_end(self, result):
            self.ended = result

    callback = Every2()
    model = Regressor(nnx.Rngs(0))
    result = jdp.fit(model, mse, regression_data(), optimizer=optax.sgd(0.1), steps=4, global_batch_size=32,
                     num_devices=2, callbacks=[callback], eval_data=regression_data(40, seed=1))
    assert [s for s, _ in callback.steps] == [2, 4] and "abs_err" in callback.steps[0][1]
    assert callback.ended is result and set(result.eval_metrics) == {"loss", "abs_err"}
    np.testing.assert_array_equal(model.out.kernel[...], result.params["out"]["kernel"])
    assert model(regression_data(4)["x"]).shape == (4,)  # still usable outside jdp (no device axis left on it)


@pytest.mark.parametrize("model_cls", [functools.partial(Regressor, dropout=0.5), NormNet], ids=["dropout", "bn"])
def test_the_model_passed_in_runs_in_train_mode_after_fit(model_cls):
    """Its RNG counts and BatchNorm statistics were the host's read-only copies of device arrays: a call in train mode
    after fit, which updates them in place, was `ValueError: output array is read-only`."""
    model = model_cls(nnx.Rngs(0))
    jdp.fit(model, mse, regression_data(), optimizer=optax.sgd(0.1), steps=2, global_batch_size=32, num_devices=2)
    model.train()
    assert model(regression_data(4)["x"]).shape == (4,)


@pytest.mark.parametrize("error, closed", [(RuntimeError("a bug in one process"), False),
                                            (jdp.Preempted("SIGTERM at step 2"), True)])
def test_an_error_of_one_process_skips_the_checkpointers_closing_barrier(monkeypatch, tmp_path, error, closed):
    """Of a multi-process run, a process that alone raises must not enter orbax's closing barrier: a device
    collective that meets the others' step collective out of order and aborts them (gloo: "Received data size
    doesn't match expected size"), so the launch ends 134 instead of the failed process's 1. An error every
    process raises at the same step (preemption, a non-finite loss) closes the checkpointer as usual."""
    closes = []
    close = checkpoint.Checkpointer.close
    monkeypatch.setattr(checkpoint.Checkpointer, "close", lambda self: (closes.append(1), close(self)))

    class FailsAtStep2:
        every = 1

        def on_step(self, step, metrics, state):
            if step == 2:
                monkeypatch.setattr(jax, "process_count", lambda: 2)  # from here on, one process of two
                raise error

    with pytest.raises(type(error)):
        jdp.fit(Regressor(nnx.Rngs(0)), mse, regression_data(), optimizer=optax.sgd(0.1), steps=4,
                global_batch_size=32, num_devices=2, callbacks=[FailsAtStep2()], workdir=tmp_path / "run")
    assert bool(closes) == closed


class Rows:
    """A random-access dataset: __len__ and __getitem__ returning a dict."""

    def __init__(self, arrays):
        self.arrays = arrays

    def __len__(self):
        return len(self.arrays["x"])

    def __getitem__(self, i):
        return {k: v[i] for k, v in self.arrays.items()}


def test_each_train_line_says_how_many_steps_it_averages(tmp_path):
    """window_steps: log_every, but fewer in the first line after a resume (from step 2 with log_every=3: step 3
    alone) and in a last line that comes early (step 7)."""
    _fit(Regressor, mse, regression_data(), num_devices=1, steps=2, log_every=3, workdir=tmp_path)
    _fit(Regressor, mse, regression_data(), num_devices=1, steps=7, log_every=3, workdir=tmp_path)
    assert [(r["step"], r["window_steps"]) for r in records(tmp_path, "train")] == [(2, 2), (3, 1), (6, 3), (7, 1)]


def test_a_script_whose_stdout_reader_goes_away_trains_to_the_end(monkeypatch, capsys):
    """`python script.py | head -1`: fit's next train line after the pipe closed raised BrokenPipeError out of fit;
    now one warning, and the run goes on (the CLI's case: test_workdir)."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    with open(write_end, "w") as closed_pipe:
        monkeypatch.setattr(sys, "stdout", closed_pipe)
        result = _fit(Regressor, mse, regression_data(), num_devices=1)
    assert len(result.losses) == 4
    assert capsys.readouterr().err.count("jdp: warning: stdout was closed by its reader") == 1


def test_the_checkpoint_stall_leaves_out_the_final_save(monkeypatch, tmp_path):
    """checkpoint_stall_s is what the saves made during training held the training up; the final save, with
    nothing left to train behind it, is final_checkpoint_s (its call, here made 1.5 s slower, and its commit): counted
    in the stall, it would take it over 1.5 s, while the save at step 2 stays well under 1 s on a busy machine."""
    save = checkpoint.Checkpointer.save

    def slow_final_save(self, step, state, position):
        save(self, step, state, position)
        if step == 4:
            time.sleep(1.5)

    monkeypatch.setattr(checkpoint.Checkpointer, "save", slow_final_save)
    _fit(Regressor, mse, regression_data(), num_devices=1, steps=4, checkpoint_every=2, workdir=tmp_path)
    (summary,) = records(tmp_path, "summary")
    assert summary["checkpoint_stall_s"] < 1.0 and summary["final_checkpoint_s"] >= 1.5


def test_a_key_of_strings_is_left_out_of_the_batches_with_one_warning(capsys):
    """A tfds record's `id` (bytes), which the README's tfds.data_source holds: JAX refused it at the step's
    lowering, so such a dataset could not train at all."""
    named = _fit(Regressor, mse, {**regression_data(), "id": np.array([b"row"] * 256)}, num_devices=2)
    assert named.losses == _fit(Regressor, mse, regression_data(), num_devices=2).losses
    assert capsys.readouterr().err.count("jdp: warning: the data's key 'id' (|S3) holds strings or objects, which a "
                                         "compiled step cannot take: left out of the batches") == 1


def test_a_random_access_dataset_trains_like_the_same_arrays():
    arrays = _fit(Regressor, mse, regression_data(), num_devices=2)
    rows = _fit(Regressor, mse, Rows(regression_data()), num_devices=2)
    assert rows.losses == arrays.losses


@pytest.mark.parametrize("case, message", [
    ({"num_devices": 16}, "16 devices asked for"),
    ({"loss": lambda m, b: {"err": mse(m, b)["loss"]}}, "must return a dict with a 'loss'"),
    ({"loss": lambda m, b: {"loss": mse(m, b)["loss"].mean()}}, "one value per example"),
    ({"data": {"x": np.zeros((64, 6), np.float32), "y": np.zeros(63, np.float32)}}, "leading lengths differ"),
    ({"data": regression_data(16)}, "fewer than one global batch"),
    ({"eval_data": {"x": np.zeros((8, 6), np.float32)}}, "eval data's keys"),
    ({"shard_optimizer": True, "optimizer": optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.1))},
     "updates them differently"),
    ({"backend": "tpu"}, "backend='tpu' is unknown"),
    ({"eval_evry": 4}, "did you mean 'eval_every'"),
    ({"data": {**regression_data(), "mask": np.ones(256, np.float32)}}, "key 'mask'"),
    ({"data": jdp.Batcher(regression_data(), seed=0, global_batch_size=64)}, "global batches of 64 rows"),
    ({"sync_every": 2, "steps": 5, "check_replicas_every": 2}, r"steps=5 is not a multiple of the sync period 2"),
    ({"workdir": ""}, r"^workdir='' names no folder; give a path, or None to write nothing$"),  # wrote into .
    ({"eval_every": "5"}, r"^eval_every='5' must be an int$"),  # a TypeError in the range check
    ({"log_every": 2.5}, r"^log_every=2.5 must be an int$"),  # lines at steps 5 and 10 of 10
    ({"bn_sync": 1}, r"^bn_sync=1 must be True or False$"),
    ({"steps": 4.0}, r"^steps=4.0 must be an int$"),
    ({"global_batch_size": 32.0}, r"^global_batch_size=32.0 must be an int$"),  # numpy's "seed must be integer"
    ({"callbacks": jdp.Callback()}, r"^callbacks=<jdp.callbacks.Callback object at .*> is not a list of callbacks; "
                                    r"give a list, e.g. callbacks=\[MyCallback\(\)\]$"),  # was a raw TypeError
    ({"callbacks": "abc"}, "^callbacks='abc' is not a list of callbacks"),  # was "callback 'a' needs an every"
    ({"callbacks": [type("Every2", (jdp.Callback,), {"every": "2"})()]},  # was a raw TypeError at the comparison
     r"has every='2'; give an int: the steps between calls, or 0 for none$"),
])
def test_bad_input_is_refused_in_one_line_before_compiling(case, message):
    case = dict(case)
    loss, data = case.pop("loss", mse), case.pop("data", regression_data())
    with pytest.raises(jdp.FitError, match=message) as error:
        _fit(Regressor, loss, data, **case)
    assert "\n" not in str(error.value)


def _with_an_integer_kernel() -> Regressor:
    model = Regressor(nnx.Rngs(0))
    model.out.kernel = nnx.Param(jnp.zeros((16, 1), jnp.int32))
    return model


@pytest.mark.parametrize("given, message", [
    ({"model": lambda x: x}, r"model: calling <lambda>\(\) failed \(TypeError: "),
    ({"model": 3}, "model is of type int; give an nnx.Module, or a function"),
    ({"model": lambda: 3}, r"model: <lambda>\(\) returned an object of type int, not an nnx.Module"),
    ({"optimizer": "adam"}, r"optimizer='adam' is of type str, not an optax.GradientTransformation; build it, e.g. "
                            r"optax.adam\(1e-3\)"),
    ({"optimizer": optax.adam}, "optimizer=adam is of type function, not an optax.GradientTransformation; call adam"),
    ({"optimizer": None}, "optimizer=None is of type NoneType"),
    ({"optimizer": jdp.sync.Sliceable(jdp.sync.clip_by_global_norm(1.0, "data"), optax.sgd(0.1))},
     r"optimizer=Sliceable is of type Sliceable, not an optax.GradientTransformation; its items are transforms; "
     r"chain them: Sliceable\(\*optax.chain\(...\)\)"),
    ({"optimizer": (optax.clip(1.0), optax.sgd(0.1))}, "its items are transforms; chain them: optax.chain"),
    ({"model": _with_an_integer_kernel}, "model parameter out.kernel is int32, and parameters are trained by "
                                           "their gradient, which needs a float dtype"),
])
def test_what_is_no_model_or_optimizer_is_refused_in_one_line(given, message):
    """Not a model or not an optimizer at all: a FitError naming it, not a TypeError or AttributeError from inside
    JAX or optax."""
    arguments = {"model": Regressor(nnx.Rngs(0)), "optimizer": optax.sgd(0.1), **given}
    with pytest.raises(jdp.FitError, match=message) as error:
        jdp.fit(arguments["model"], mse, regression_data(), optimizer=arguments["optimizer"], steps=2,
                global_batch_size=32)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("steps", [0, 2**31])
def test_steps_outside_the_int32_step_counter_are_refused(steps):
    with pytest.raises(jdp.FitError, match=rf"^steps={steps} must be positive and below 2\*\*31$"):
        jdp.fit(Regressor(nnx.Rngs(0)), mse, regression_data(), optimizer=optax.sgd(0.1), steps=steps,
                global_batch_size=32)


def test_an_element_wise_optimizer_is_accepted_with_a_sharded_optimizer():
    plain = _fit(Regressor, mse, regression_data(), num_devices=8, optimizer=optax.adam(0.01))
    sharded = _fit(Regressor, mse, regression_data(), num_devices=8, optimizer=optax.adam(0.01), shard_optimizer=True)
    np.testing.assert_allclose(sharded.losses, plain.losses, rtol=1e-5)


def test_a_multi_process_environment_must_be_joined_first(monkeypatch):
    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "127.0.0.1:1")
    monkeypatch.setenv("JAX_NUM_PROCESSES", "2")
    monkeypatch.setenv("JAX_PROCESS_ID", "1")
    with pytest.raises(jdp.FitError, match=r"call jdp.initialize\(\) before any other JAX work"):
        _fit(Regressor, mse, regression_data())


def test_a_checkpoint_without_rng_state_is_refused(monkeypatch, tmp_path):
    monkeypatch.setattr(checkpoint, "FORMAT", 1)  # as written before the RNG state was saved
    _fit(Regressor, mse, regression_data(), num_devices=1, workdir=tmp_path)
    monkeypatch.setattr(checkpoint, "FORMAT", 2)
    with pytest.raises(checkpoint.CheckpointError, match="has format 1, this jdp reads format 2"):
        _fit(Regressor, mse, regression_data(), num_devices=1, workdir=tmp_path, steps=6)


def _readme_program(index: int) -> str:
    """The `index`-th Python block of the README's "Your own model" section (0: its program, 1: the scanned model)."""
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    section = readme.split("## Your own model", 1)[1].split("\n## ", 1)[0]
    return section.split("```python\n")[1 + index].split("```", 1)[0]


def _run_program(program: str, cwd: Path) -> list[str]:
    out = subprocess.run([sys.executable, "-c", program], cwd=cwd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip().splitlines()[-1].split()


@pytest.mark.slow
def test_the_readme_program_runs_as_printed(tmp_path):
    """The README's "Your own model" program, run as printed in a fresh process and directory: its eval loss
    (targets' variance 16; a plain optax loop reaches ~0.15) must be below 1, and the run restored into a new
    model and evaluated by jdp.evaluate gives fit's own eval loss."""
    fit_loss, loss, abs_err = map(float, _run_program(_readme_program(0), tmp_path))
    assert loss < 1.0 and abs_err < 1.0
    assert loss == pytest.approx(fit_loss, rel=1e-6)
    assert (tmp_path / "runs" / "regression" / "metrics.jsonl").exists()
    record = json.loads((tmp_path / "runs" / "regression" / "run.json").read_text())["fit"]
    assert record["loss_fn"] == "__main__:loss_fn" and record["steps"] == 300


@pytest.mark.slow
def test_the_readme_scanned_model_runs_as_printed(tmp_path):
    """The README's scan-over-layers model (vmapped layers, RNG keys with a layer axis, BatchNorm inside the
    scan) trains through fit: its eval loss is well below the targets' variance (~3.4)."""
    (loss,) = map(float, _run_program(_readme_program(1), tmp_path))
    assert loss < 1.0


class _Recorder(jdp.Callback):
    """Every hook of the one protocol, due on a condition (odd steps) rather than a period."""

    def __init__(self):
        self.before, self.metrics, self.due_steps, self.lines, self.ended = [], [], [], [], None

    def before_step(self, step):
        self.before.append(step)

    def due(self, step):
        return step % 2 == 1

    def on_metrics(self, step, metrics):
        self.metrics.append(step)

    def on_step(self, step, metrics, state):
        self.due_steps.append((step, int(state.step)))

    def on_line(self, line):
        self.lines.append(line)

    def on_end(self, result):
        self.ended = result.step


def test_a_callback_gets_every_hook_and_the_lines_as_written(tmp_path):
    """jdp's own actions and a user's jdp.Callback share one protocol: before each step, every step's metrics in
    order, on_step when its own condition is due (with the state after that step), each metrics.jsonl line as
    written (a tracker logs these: the same numbers as the file), and the result at the end."""
    recorder = _Recorder()
    _fit(Regressor, mse, regression_data(), num_devices=2, steps=5, log_every=2, eval_data=regression_data(64, 1),
         eval_every=5, workdir=tmp_path, callbacks=[recorder])
    assert recorder.before == recorder.metrics == [1, 2, 3, 4, 5]
    assert recorder.due_steps == [(1, 1), (3, 3), (5, 5)]
    written = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert recorder.lines == written and [r["split"] for r in written] == ["train", "train", "train", "eval",
                                                                           "summary"]
    assert recorder.ended == 5
