"""`jdp.fit` with Flax models written in the styles current Flax docs use: a Dropout that takes its key at call
time (`loss_fn(model, batch, rngs)`), layers created with vmap and run with scan (RNG keys with a leading layer
axis, values sown with `sow`), a Linen model bridged with `nnx.bridge.ToNNX`, and NNX containers (`nnx.List`,
`nnx.Dict`) next to integer and boolean `nnx.Variable`s. Each test names what breaks when jdp gets it wrong."""

import functools
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
from jdp.checkpoint import read_arrays
from jdp.modeldef import ModelDef
from jdp.trainer import FitOptions, prepare
from tests.helpers import max_abs_diff
from tests.user_models import (
    call_time_loss,
    linen_loss,
    make_call_time_cnn,
    make_linen_cnn,
    make_scanned_mlp,
    scanned_loss,
    tiny_images,
)

B = 32  # global batch
LR = 0.1
DATA = tiny_images(256)


def _fit(model, loss, **options):
    options = {"steps": 4, "global_batch_size": B, "optimizer": optax.sgd(LR), "log_every": 1, **options}
    return jdp.fit(model, loss, DATA, **options)


def _checkpoint(workdir, step=None):
    """The arrays of the run's checkpoint (latest, or of `step`), read back from disk."""
    return read_arrays(workdir / "checkpoints", step)


def _keys(tree):
    """Every dict key at any depth of a nested dict."""
    return set() if not isinstance(tree, dict) else {k for key, value in tree.items() for k in ({key} | _keys(value))}


# 1. A Dropout built without rngs, its key passed at call time: loss_fn(model, batch, rngs).


def _plain_nnx_loop(model, steps):
    """The same model trained by a plain NNX/optax loop on fit's batches (jdp.Batcher's order from seed 0)."""
    batches = jdp.Batcher(DATA, seed=0, global_batch_size=B)
    optimizer = nnx.Optimizer(model, optax.sgd(LR), wrt=nnx.Param)
    rngs = nnx.Rngs(0)

    @nnx.jit
    def train_step(model, optimizer, rngs, batch):
        def mean_loss(model, rngs):
            return call_time_loss(model, batch, rngs)["loss"].mean()

        loss, grads = nnx.value_and_grad(mean_loss)(model, rngs)
        optimizer.update(model, grads)
        return loss

    losses = [float(train_step(model, optimizer, rngs, batches.train_batch(step))) for step in range(steps)]
    batches.close()
    return losses


@functools.cache
def call_time_fit_without_dropout():
    return _fit(lambda: make_call_time_cnn(rate=0.0), call_time_loss, num_devices=1, steps=6)


def test_call_time_rngs_cnn_trains_like_a_plain_nnx_loop():
    """A loss taking `rngs` is called with them and differentiated as the two-argument form is: with dropout off,
    fit's losses and parameters equal a plain NNX loop's on the same batches. If fit called the loss without rngs
    (or mis-detected the signature) it would fail; if BatchNorm's statistics or the gradient scale were wrong,
    the losses would part from step 2 on. With dropout on, both fall comparably."""
    result = call_time_fit_without_dropout()
    model = make_call_time_cnn(rate=0.0)
    reference = _plain_nnx_loop(model, steps=6)
    np.testing.assert_allclose(result.losses, reference, rtol=1e-5, atol=1e-6)
    assert max_abs_diff(result.params, nnx.to_pure_dict(nnx.state(model, nnx.Param))) < 1e-5
    assert max_abs_diff(result.model_state, nnx.to_pure_dict(nnx.state(model, nnx.BatchStat))) < 1e-5

    steps = 30
    dropped = _fit(lambda: make_call_time_cnn(rate=0.3), call_time_loss, num_devices=1, steps=steps)
    plain = _plain_nnx_loop(make_call_time_cnn(rate=0.3), steps=steps)
    fit_end, plain_end = np.mean(dropped.losses[-5:]), np.mean(plain[-5:])
    assert fit_end < 0.8 * np.mean(dropped.losses[:3]) and plain_end < 0.8 * np.mean(plain[:3])
    assert abs(fit_end - plain_end) < 0.25 * plain_end


class Recorder(nnx.Variable):
    """An integer model-state leaf: never averaged across replicas, so each device's copy shows its own masks."""


class CallTimeMaskProbe(nnx.Module):
    """Records the dropout mask of the first row of each call (a rolling history of the last `history` calls)."""

    def __init__(self, rngs: nnx.Rngs, history: int = 2, width: int = 32):
        self.out = nnx.Linear(6, 1, rngs=rngs)
        self.drop = nnx.Dropout(0.5)  # no rngs: they come at call time
        self.masks = Recorder(jnp.zeros((history, width), jnp.int32))

    def __call__(self, x, rngs):
        kept = self.drop(jnp.ones((x.shape[0], self.masks[...].shape[1])), rngs=rngs)
        self.masks[...] = jnp.concatenate([self.masks[...][1:], (kept[:1] > 0).astype(jnp.int32)])
        return self.out(x)[:, 0] + 0 * kept.sum()


def probe_loss(model, batch, rngs):
    return {"loss": (model(batch["x"][:, 0, :6, 0], rngs) - batch["y"]) ** 2}


def _probe_masks(steps=2, num_devices=4, grad_accum_steps=2):
    """masks[step][device] = (grad_accum_steps, width): the mask of each micro-batch, as each device drew it."""
    engine = prepare(lambda: CallTimeMaskProbe(nnx.Rngs(0), history=grad_accum_steps), probe_loss, DATA,
                     optimizer=optax.sgd(0.0), global_batch_size=16,
                     options=FitOptions(num_devices=num_devices, grad_accum_steps=grad_accum_steps))
    state = engine.parallel.to_devices(engine.init_state())
    masks = []
    for step in range(steps):
        state, _ = engine.parallel.train_step(state, engine.parallel.shard_batch(engine.source.train_batch(step)))
        masks.append([np.asarray(s.data) for s in state.model_state["masks"].addressable_shards])
    engine.source.close()
    return np.array(masks)  # (steps, devices, micro-batches, width)


def test_call_time_masks_differ_across_devices_steps_and_micro_batches(monkeypatch):
    """Under shard_map with grad_accum_steps=2 on 4 devices, each of the 2 x 4 x 2 (step, device, micro-batch)
    calls draws its own mask. Without folding the step, steps repeat masks; without the device index, devices
    share them; without the micro-batch index, the two micro-batches of a step share masks (checked below by
    dropping that fold: the probe does catch it)."""
    masks = _probe_masks()
    assert masks.shape == (2, 4, 2, 32)
    assert len({m.tobytes() for m in masks.reshape(-1, 32)}) == 16
    assert 0.3 < masks.mean() < 0.7

    call_key = ModelDef.call_key
    monkeypatch.setattr(ModelDef, "call_key", lambda self, folds: call_key(self, (folds[0], *folds[2:])))
    unfolded = _probe_masks()
    np.testing.assert_array_equal(unfolded[:, :, 0], unfolded[:, :, 1])


def test_call_time_dropout_under_jit_does_not_depend_on_the_device_count():
    """Under jit the call-time key is (seed, step, micro-batch), one mask over the global batch: 4 devices give
    1 device's losses with dropout on. Folding a device or group index under jit would make them differ."""
    runs = [_fit(lambda: make_call_time_cnn(rate=0.3), call_time_loss, backend="jit", num_devices=n)
            for n in (1, 4)]
    np.testing.assert_allclose(runs[1].losses, runs[0].losses, rtol=1e-5, atol=1e-6)
    assert max_abs_diff(runs[1].params, runs[0].params) < 1e-5
    assert max_abs_diff(runs[1].model_state, runs[0].model_state) < 1e-5
    assert runs[0].losses != call_time_fit_without_dropout().losses[:4]  # dropout really ran


def test_call_time_dropout_training_resumes_bitwise(tmp_path):
    """6 steps straight equal 3 steps, a checkpoint, and a resume to 6: the call-time key is a function of the
    restored step, not of anything the process kept in memory (a host-side counter or key would repeat masks)."""
    def run(steps, workdir):
        return _fit(lambda: make_call_time_cnn(rate=0.3), call_time_loss, num_devices=2, steps=steps,
                    workdir=workdir)

    whole = run(6, tmp_path / "whole")
    run(3, tmp_path / "resumed")
    resumed = run(6, tmp_path / "resumed")
    assert resumed.losses == whole.losses[3:]
    assert max_abs_diff(resumed.params, whole.params) == 0
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(resumed.params), jax.tree.leaves(whole.params),
                                                     strict=True))


# 2. Layers created with vmap and run with scan: BatchNorm, stored-rngs Dropout (keys with a leading layer
# axis) and a value sown with `sow`.


@pytest.mark.slow
def test_scanned_mlp_under_jit_does_not_depend_on_the_device_count():
    """ScannedMLP (dropout on) under jit: 4 devices give 1 device's losses. Its RNG keys have a leading layer
    axis: a fold that treated them as one key would fail to trace. The 1-device run is given an instance that
    already sowed `features` (an eval-mode call): fit drops it, trains, and leaves none in the instance; a sown
    value kept as state would change shape with the batch and break the step, or the equality."""
    sown = make_scanned_mlp()
    sown.eval()
    sown(DATA["x"][:5])
    sown.train()
    assert "features" in nnx.to_pure_dict(nnx.state(sown, nnx.Intermediate))
    one = _fit(sown, scanned_loss, backend="jit", num_devices=1)
    four = _fit(make_scanned_mlp, scanned_loss, backend="jit", num_devices=4)
    np.testing.assert_allclose(four.losses, one.losses, rtol=1e-5, atol=1e-6)
    assert max_abs_diff(four.params, one.params) < 1e-5
    assert max_abs_diff(four.model_state, one.model_state) < 1e-5
    assert not nnx.to_pure_dict(nnx.state(sown, nnx.Intermediate))
    assert max_abs_diff(nnx.to_pure_dict(nnx.state(sown, nnx.Param)), one.params) == 0


@pytest.mark.slow
def test_scanned_mlp_resumes_bitwise_and_its_layer_keys_survive_the_checkpoint(tmp_path):
    """6 steps straight equal 3 + a resume to 6 (shard_map, 2 devices). The sown `features` are in neither the
    result's model_state nor the checkpoint. The RNG keys keep their leading layer axis through the checkpoint
    (raw key data (3, 2)), unchanged from the seeded initial keys, and the per-layer counters count the 6 steps:
    a checkpoint that lost the layer axis, or restored keys or counts wrongly, would break the bitwise resume."""
    def run(steps, workdir):
        return _fit(make_scanned_mlp, scanned_loss, num_devices=2, steps=steps, workdir=workdir)

    whole = run(6, tmp_path / "whole")
    run(3, tmp_path / "resumed")
    resumed = run(6, tmp_path / "resumed")
    assert resumed.losses == whole.losses[3:]
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(resumed.params), jax.tree.leaves(whole.params),
                                                     strict=True))
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(resumed.model_state),
                                                     jax.tree.leaves(whole.model_state), strict=True))

    step, arrays = _checkpoint(tmp_path / "resumed")
    assert step == 6
    assert "features" not in _keys(resumed.model_state) and "features" not in _keys(arrays)
    assert set(resumed.model_state) == {"blocks"} and set(arrays["model_state"]) == {"blocks"}
    initial_keys = ModelDef.split(make_scanned_mlp(), seed=0)[2]["keys"]
    saved = arrays["rng_state"]["keys"]["blocks"]["dropout"]["rngs"]["key"]
    assert saved.shape == (3, 2) and saved.dtype == np.uint32
    np.testing.assert_array_equal(saved, initial_keys["blocks"]["dropout"]["rngs"]["key"])
    assert len({tuple(k) for k in saved}) == 3  # one key per layer
    np.testing.assert_array_equal(arrays["rng_state"]["counts"]["blocks"]["dropout"]["rngs"]["count"], [6, 6, 6])

    restored = jdp.restore(tmp_path / "resumed", make_scanned_mlp)
    key = restored.blocks.dropout.rngs.key[...]
    assert key.shape == (3,)
    np.testing.assert_array_equal(jax.random.key_data(key), saved)
    np.testing.assert_array_equal(restored.blocks.dropout.rngs.count[...], [6, 6, 6])
    assert not nnx.to_pure_dict(nnx.state(restored, nnx.Intermediate))


# 3. A Linen CNN (BatchNorm, Dropout switched by `train`) bridged with nnx.bridge.ToNNX. model.eval() does not
# reach a Linen `train` flag: the train and eval losses say it.

LINEN_TRAIN = functools.partial(linen_loss, train=True)
LINEN_EVAL = functools.partial(linen_loss, train=False)


def test_a_bridged_linen_cnn_trains_through_fit():
    """Synced Linen BatchNorm (axis_name="data") and dropout under shard_map on 2 devices: the loss falls, and the
    eval loss (train=False: running statistics, no dropout) is finite. A Linen BatchNorm whose batch_stats were not
    written back as model state would leave the running statistics at their init."""
    result = _fit(functools.partial(make_linen_cnn, dropout=0.1, axis_name="data"), LINEN_TRAIN, num_devices=2,
                  steps=20, eval_fn=LINEN_EVAL, eval_data=tiny_images(64, seed=1), log_every=5)
    assert np.mean(result.losses[-5:]) < 0.8 * np.mean(result.losses[:3])
    assert np.isfinite(result.eval_loss) and result.eval_accuracy > 0.4
    stats = result.model_state["BatchNorm_0"]
    assert np.abs(stats["mean"]).max() > 1e-3 and np.abs(stats["var"] - 1).max() > 1e-3


@pytest.mark.slow
def test_a_bridged_linen_cnn_on_n_devices_equals_one_device_without_dropout():
    """With dropout off, 4 devices give 1 device's losses: under jit (Linen BatchNorm axis_name None: jit sees the
    global batch) and under shard_map (axis_name="data", synced over the devices). A per-device BatchNorm, or a
    gradient averaged with the wrong scale, would part them."""
    for backend, axis_name in (("jit", None), ("shard_map", "data")):
        make = functools.partial(make_linen_cnn, dropout=0.0, axis_name=axis_name)
        one, four = (_fit(make, LINEN_TRAIN, backend=backend, num_devices=n, eval_fn=LINEN_EVAL) for n in (1, 4))
        np.testing.assert_allclose(four.losses, one.losses, rtol=1e-5, atol=1e-6, err_msg=backend)
        assert max_abs_diff(four.params, one.params) < 1e-5, backend
        assert max_abs_diff(four.model_state, one.model_state) < 1e-5, backend


@pytest.mark.slow
def test_the_api_docs_linen_program_runs_as_printed(tmp_path):
    """docs/api.md's Linen CNN (BatchNorm synced over 2 devices, Dropout), trained with the call the page names,
    `logits = model(x, train=True, mutable=["batch_stats"])`: it learns the quadrant task (chance 0.25) and its
    running means moved from their init (0), so the updates ToNNX applies in place reached the model state."""
    page = (Path(__file__).resolve().parents[1] / "docs" / "api.md").read_text()
    section = page.split("## Layers in a scan, and Linen modules", 1)[1].split("\n## ", 1)[0]
    program = section.split("```python\n", 1)[1].split("```", 1)[0]
    assert 'logits = model(batch["x"], train=True, mutable=["batch_stats"])' in program
    out = subprocess.run([sys.executable, "-c", program], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    accuracy, spread = map(float, out.stdout.strip().splitlines()[-1].split())
    assert accuracy > 0.9 and spread > 1e-3


# 4. Other NNX state: nnx.List and nnx.Dict of layers, an integer counter and a boolean nnx.Variable.


class Containers(nnx.Module):
    """Layers in an nnx.List and an nnx.Dict, a BatchNorm; `calls` counts the calls (int32); with `flag`, a
    constant bool `use_b` switches a head on."""

    def __init__(self, rngs: nnx.Rngs, flag: bool = False):
        self.layers = nnx.List([nnx.Linear(64, 16, rngs=rngs), nnx.Linear(16, 16, rngs=rngs)])
        self.norm = nnx.BatchNorm(16, rngs=rngs)
        self.heads = nnx.Dict(a=nnx.Linear(16, 4, rngs=rngs), b=nnx.Linear(16, 4, rngs=rngs))
        self.calls = nnx.Variable(jnp.zeros((), jnp.int32))
        if flag:
            self.use_b = nnx.Variable(jnp.array(True))

    def __call__(self, x):
        self.calls[...] = self.calls[...] + 1
        h = x.reshape(x.shape[0], -1)
        for layer in self.layers:
            h = nnx.relu(layer(h))
        h = self.norm(h)
        use_b = self.use_b[...] if hasattr(self, "use_b") else True
        return self.heads["a"](h) + jnp.where(use_b, 1, 0).astype(h.dtype) * self.heads["b"](h)


SEEN = {}  # the dtypes containers_loss saw, at trace time


def containers_loss(model, batch):
    SEEN.update(calls=model.calls[...].dtype, kernel=model.layers[0].kernel[...].dtype,
                **({"use_b": model.use_b[...].dtype} if hasattr(model, "use_b") else {}))
    logits = model(batch["x"]).astype(jnp.float32)
    return {"loss": optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])}


def make_containers():
    return Containers(nnx.Rngs(0))


def make_flagged_containers():
    return Containers(nnx.Rngs(0), flag=True)


def _bf16_fit(make, steps, **options):
    return _fit(make, containers_loss, num_devices=2, precision="bf16", steps=steps, **options)


def test_nnx_list_and_dict_layers_and_an_integer_counter_train_uncast_and_resume(tmp_path):
    """Under bf16 on 2 devices, layers in an nnx.List / nnx.Dict train (float32 masters, cast to bf16 for the
    forward), and the int32 call counter is neither cast nor averaged (a pmean would make it float): it counts one
    call per step on every replica, 3, then 6 after a checkpoint and a resume, bitwise equal to 6 steps straight.
    Casting model state with the parameters, or averaging non-float leaves, would make it a float or lose counts;
    list indices as state keys must survive orbax's resume."""
    SEEN.clear()
    first = _bf16_fit(make_containers, 3, workdir=tmp_path / "run")
    assert SEEN == {"calls": jnp.int32, "kernel": jnp.bfloat16}
    assert first.model_state["calls"].dtype == np.int32 and int(first.model_state["calls"]) == 3
    assert set(first.params["layers"]) == {0, 1} and set(first.params["heads"]) == {"a", "b"}
    assert all(x.dtype == np.float32 for x in jax.tree.leaves(first.params))
    assert first.losses[-1] < first.losses[0]

    resumed = _bf16_fit(make_containers, 6, workdir=tmp_path / "run")
    assert resumed.model_state["calls"].dtype == np.int32 and int(resumed.model_state["calls"]) == 6
    straight = _bf16_fit(make_containers, 6)
    assert resumed.losses == straight.losses[3:]
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves((resumed.params, resumed.model_state)),
                                                     jax.tree.leaves((straight.params, straight.model_state)),
                                                     strict=True))
    model = make_containers()
    _bf16_fit(model, 2)
    assert model.calls[...].dtype == jnp.int32 and int(model.calls[...]) == 2  # written back into the instance



def test_a_boolean_variable_stays_a_bool_and_round_trips_a_checkpoint(tmp_path):
    """A constant bool nnx.Variable is neither cast (bf16) nor averaged: it is still a True bool after fit, in the
    checkpoint and after a resume. Averaging it would make it a float; casting it would fail; the replica check
    bitcasts booleans as bytes (lax refuses to bitcast a bool)."""
    SEEN.clear()
    first = _bf16_fit(make_flagged_containers, 2, workdir=tmp_path / "run")
    assert SEEN["use_b"] == jnp.bool_
    assert first.model_state["use_b"].dtype == np.bool_ and bool(first.model_state["use_b"])
    resumed = _bf16_fit(make_flagged_containers, 4, workdir=tmp_path / "run")
    assert resumed.model_state["use_b"].dtype == np.bool_ and bool(resumed.model_state["use_b"])
    assert int(resumed.model_state["calls"]) == 4



def test_a_model_with_nnx_list_layers_restores_from_its_checkpoint(tmp_path):
    """jdp.restore fills a model whose layers are in an nnx.List (integer state keys, which orbax names "0", "1")
    from a fit run's checkpoint: the int32 counter and the list's parameters come back."""
    result = _bf16_fit(make_containers, 2, workdir=tmp_path / "run")
    _, arrays = _checkpoint(tmp_path / "run")
    assert arrays["model_state"]["calls"].dtype == np.int32 and int(arrays["model_state"]["calls"]) == 2
    restored = jdp.restore(tmp_path / "run", make_containers)
    assert int(restored.calls[...]) == 2 and restored.calls[...].dtype == jnp.int32
    np.testing.assert_array_equal(restored.layers[1].kernel[...], result.params["layers"][1]["kernel"])
    np.testing.assert_array_equal(restored.heads["b"].bias[...], result.params["heads"]["b"]["bias"])
