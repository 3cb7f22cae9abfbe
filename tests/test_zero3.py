"""ZeRO-3 (`shard_params=True`, `jdp.sync.zero3`): N devices holding 1/N slices of the parameters, gradients and
optimizer state train as one device does, step by step, under shard_map and jit; the state on the devices is 1/N
of the replicated one; a checkpoint saved on 8 devices restores on 2 and on 1, its digests computed where the
slices live; what it cannot be combined with is refused in one line."""

from __future__ import annotations

import functools
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jdp
from jdp import digest
from jdp.errors import FitError
from jdp.mesh import DATA_AXIS, make_mesh
from jdp.models.mlp import MLP
from jdp.trainer import FitOptions, prepare
from tests.helpers import max_abs_diff
from tests.test_fit import CASES, _fit, mse, regression_data

OPTIMIZERS = {"sgd": lambda: optax.sgd(0.1), "adamw": lambda: optax.adamw(0.02, weight_decay=0.1)}


@functools.cache
def reference(case: str, optimizer: str):
    """Plain data parallelism on one device."""
    model_cls, loss, data = CASES[case]
    return _fit(model_cls, loss, data, backend="jit", num_devices=1, optimizer=OPTIMIZERS[optimizer](),
                eval_data=data)


def _assert_same(result, expected) -> None:
    np.testing.assert_allclose(result.losses, expected.losses, rtol=1e-5, atol=1e-6)
    assert max_abs_diff(result.params, expected.params) < 1e-5
    assert max_abs_diff(result.model_state, expected.model_state) < 1e-5
    assert jax.tree.map(np.shape, result.params) == jax.tree.map(np.shape, expected.params)  # whole, unpadded


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
@pytest.mark.parametrize("backend", ["shard_map", "jit"])
def test_sharded_parameters_train_as_one_device(backend, optimizer):
    """The regression model's leaves hold 96, 16, 16 and 1 elements: the 16s pad to 8 devices' multiple
    nowhere, the 1 pads to 8. Breaks if the reduce-scattered gradient is not divided by N (SGD shows the scale),
    if a device updates a slice other than the one it holds, or if the replicas' check compares the slices
    (`check_replicas_every=1` would stop the run)."""
    model_cls, loss, data = CASES["regression"]
    result = _fit(model_cls, loss, data, backend=backend, num_devices=8, optimizer=OPTIMIZERS[optimizer](),
                  shard_params=True, check_replicas_every=1, eval_data=data)
    expected = reference("regression", optimizer)
    _assert_same(result, expected)
    assert result.eval_metrics == pytest.approx(expected.eval_metrics, rel=1e-5)  # the eval step gathers too
    assert result.losses[-1] < result.losses[0]


@pytest.mark.parametrize("backend", ["shard_map", "jit"])
def test_gradient_accumulation_and_batchnorm(backend):
    """Two micro-batches a step, each gathering the parameters and reduce-scattering its gradient (shard_map), with
    BatchNorm's statistics synced across devices as under plain data parallelism."""
    model_cls, loss, data = CASES["batchnorm"]
    result = _fit(model_cls, loss, data, backend=backend, num_devices=8, shard_params=True, grad_accum_steps=2,
                  global_batch_size=64, optimizer=OPTIMIZERS["sgd"]())
    expected = _fit(model_cls, loss, data, backend="jit", num_devices=1, grad_accum_steps=2, global_batch_size=64,
                    optimizer=OPTIMIZERS["sgd"]())
    _assert_same(result, expected)


@pytest.mark.parametrize("options", [
    # fp16's dynamic loss scaling skips the overflowing first steps on every device alike: a device that skipped
    # alone would leave its slices behind.
    dict(precision="fp16", loss_scale=2.0**30, on_nonfinite="skip"),
    dict(precision="bf16"),  # the gathered float32 parameters cast for the forward, as plain's are
    dict(dropout=0.3),  # each device's own dropout masks, from the same RNG streams as plain's
], ids=["fp16_skip", "bf16", "dropout"])
def test_composes_with_precision_the_non_finite_guard_and_rng_streams(options):
    """Against plain data parallelism on the same 8 devices (dropout masks depend on the device count)."""
    model_cls, loss, data = CASES["regression"]
    if "dropout" in options:
        model_cls = functools.partial(model_cls, dropout=options.pop("dropout"))
    result = _fit(model_cls, loss, data, shard_params=True, num_devices=8, **options)
    expected = _fit(model_cls, loss, data, num_devices=8, **options)
    np.testing.assert_allclose(result.losses, expected.losses, rtol=1e-3)
    assert max_abs_diff(result.params, expected.params) < 1e-4


def _state_on_devices(**options):
    model_cls, loss, data = CASES["regression"]
    engine = prepare(lambda: Wide(nnx.Rngs(0)), loss, data, optimizer=optax.adamw(1e-3), global_batch_size=32,
                     options=FitOptions(num_devices=8, **options))
    parallel = engine.parallel
    state = parallel.to_devices(engine.init_state())
    batch = parallel.shard_batch(engine.source.train_batch(0))
    compiled = parallel.lower_train(state, batch).compile()
    return engine, state, compiled


class Wide(nnx.Module):
    """Big enough that scalars and padding do not count: 6 -> 256 -> 255 -> 1 (255 and 1 do not divide by 8)."""

    def __init__(self, rngs: nnx.Rngs):
        self.a = nnx.Linear(6, 256, rngs=rngs)
        self.b = nnx.Linear(256, 255, rngs=rngs)
        self.out = nnx.Linear(255, 1, rngs=rngs)

    def __call__(self, x):
        return self.out(nnx.relu(self.b(nnx.relu(self.a(x)))))[:, 0]


def test_each_device_holds_an_eighth_of_the_parameters_and_optimizer_state():
    """Per-device bytes of parameters plus AdamW's state, in the compiled step's arguments (XLA's
    `memory_analysis()`) and in the arrays' shards: at most 1.1/N of plain data parallelism's on 8 devices."""
    def persistent(state) -> int:
        return sum(leaf.addressable_shards[0].data.nbytes for leaf in jax.tree.leaves((state.params,
                                                                                        state.opt_state)))

    _, plain, plain_step = _state_on_devices()
    _, sharded, sharded_step = _state_on_devices(shard_params=True)
    zero1 = _state_on_devices(shard_optimizer=True)[1]
    assert persistent(sharded) <= 1.1 / 8 * persistent(plain)
    assert persistent(plain) > persistent(zero1) > persistent(sharded)
    # The rest of the step's arguments (batch, step counters) is the same in both programs.
    saved = plain_step.memory_analysis().argument_size_in_bytes - sharded_step.memory_analysis().argument_size_in_bytes
    assert saved >= (1 - 1.1 / 8) * persistent(plain)


def test_a_checkpoint_saved_on_8_devices_resumes_bitwise_on_8_and_restores_on_2_and_1(tmp_path):
    """Saved sharded, with digests computed on the devices (word sums: no leaf fetched whole to be hashed), and
    restored resharded: training goes on to the numbers of the run that never stopped (bitwise on 8 again)."""
    model_cls, loss, data = CASES["regression"]
    options = dict(optimizer=optax.adam(0.02), shard_params=True, log_every=1)
    straight = _fit(model_cls, loss, data, steps=8, num_devices=8, **options)
    _fit(model_cls, loss, data, steps=4, num_devices=8, workdir=tmp_path / "run", **options)
    digests = json.loads(next((tmp_path / "run" / "checkpoints" / "4" / "data").rglob("*metadata*")).read_text())
    hidden = digests["digests"][".params['hidden']['kernel']"]
    assert hidden[2].startswith("words:") and hidden[1] == [6, 16]  # saved whole-shaped, hashed where it lives
    for devices, sharded in ((8, True), (2, True), (1, False)):
        workdir = tmp_path / f"on{devices}"
        shutil.copytree(tmp_path / "run", workdir)
        resumed = _fit(model_cls, loss, data, steps=8, num_devices=devices, workdir=workdir,
                       **{**options, "shard_params": sharded})
        np.testing.assert_allclose(resumed.losses, straight.losses[4:], rtol=1e-5, atol=1e-6)
        assert max_abs_diff(resumed.params, straight.params) < 1e-5
        if devices == 8:  # on the devices that saved it, a resumed run is the uninterrupted one, bit for bit
            assert resumed.losses == straight.losses[4:]
            assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(resumed.params),
                                                            jax.tree.leaves(straight.params), strict=True))


def test_the_state_between_steps_is_sliced_and_the_logical_state_split_whole():
    """Between steps each leaf keeps its rank, split on its longest axis that divides by 8 (the 256-wide kernel on
    its 256 axis), else zero-padded on its longest (the bias of 1 to 8); what callbacks and checkpoints get keeps
    the shape, split on an axis that divides or whole where none does."""
    engine, state, _ = _state_on_devices(shard_params=True)
    kernel = state.params["b"]["kernel"]
    assert kernel.shape == (256, 255) and kernel.addressable_shards[0].data.shape == (32, 255)
    bias = state.params["out"]["bias"]
    assert bias.shape == (8,) and bias.addressable_shards[0].data.shape == (1,)
    logical = engine.parallel.to_logical(state)
    whole = logical.params["b"]["kernel"]
    assert whole.shape == (256, 255) and whole.addressable_shards[0].data.shape == (32, 255)
    assert logical.params["out"]["bias"].sharding.is_fully_replicated  # 1 element: no axis divides by 8


@pytest.mark.parametrize("shard_params", [True, False], ids=["zero3", "zero1"])
def test_a_callback_sees_an_eighth_of_leaves_no_axis_of_which_divides_by_8(shard_params):
    """A 64-256-250-10 MLP: the 250 x 10 kernel and the biases of 250 and 10 have no axis that divides by 8, and
    held whole they put 15.4% of the parameters on each device. Split as far as their factors allow (250 x 10 four
    ways, over a 2 x 2 x 2 view of the devices), each device's share of the parameters and of AdamW's state, as a
    callback gets them, is at most 1.1/8. Breaks if such leaves are replicated in the logical layout."""
    class Shares:
        every, seen = 2, []

        def on_step(self, step, metrics, state):
            def share(tree):
                held = [0] * 8
                for leaf in jax.tree.leaves(tree):
                    for shard in leaf.addressable_shards:
                        held[shard.device.id] += shard.data.nbytes
                return max(held) / sum(leaf.nbytes for leaf in jax.tree.leaves(tree))
            self.seen.append((share(state.params), share(state.opt_state)))

        def on_end(self, result):
            pass

    rng = np.random.default_rng(0)
    data = {"x": rng.normal(size=(64, 64)).astype(np.float32), "y": rng.integers(0, 10, 64).astype(np.int32)}

    def xent(model, batch):
        return {"loss": optax.softmax_cross_entropy_with_integer_labels(model(batch["x"]), batch["y"])}

    callback = Shares()
    jdp.fit(lambda: MLP(64, (256, 250), 10, rngs=nnx.Rngs(0)), xent, data, steps=2, global_batch_size=16,
            num_devices=8, optimizer=optax.adamw(1e-3), callbacks=[callback],
            **({"shard_params": True} if shard_params else {"shard_optimizer": True}))
    (params, opt_state), = callback.seen
    assert opt_state <= 1.1 / 8
    assert params <= 1.1 / 8 if shard_params else params == 1.0  # ZeRO-1 keeps the parameters whole


@pytest.mark.parametrize("options,message", [
    (dict(backend="pmap"), "shard_params=True needs backend='shard_map' or jit"),
    (dict(sync_every=2), "cannot be combined with sync_every > 1"),
    (dict(sync="powersgd"), "cannot be combined with sync_every > 1 (local SGD, DiLoCo) or sync=powersgd"),
    (dict(allreduce_dtype="bf16"), "use allreduce_dtype='fp32'"),
    (dict(log_noise_scale=True), "log_noise_scale needs each device's whole gradient"),
    (dict(optimizer=optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.1))),
     "shard_params=True runs the optimizer on slices of each parameter"),
])
def test_what_it_cannot_be_combined_with_is_refused_in_one_line(options, message):
    with pytest.raises(FitError, match="^" + ".*" + message.replace("(", r"\(").replace(")", r"\)")) as caught:
        _fit(CASES["regression"][0], mse, regression_data(), num_devices=8, shard_params=True, **options)
    assert "\n" not in str(caught.value)




CLIPPED_ADAMW = optax.chain(optax.clip_by_global_norm(0.1), optax.adamw(0.02))


@pytest.mark.parametrize("options,message", [
    (dict(shard_optimizer=True, optimizer=CLIPPED_ADAMW), "on slices"),
    (dict(shard_params=True, optimizer=CLIPPED_ADAMW), "on slices"),
    (dict(shard_params=True, backend="jit", optimizer=optax.adafactor(0.02)), "on zero-padded copies"),
    (dict(shard_optimizer=True, optimizer=optax.chain(jdp.sync.clip_by_global_norm(0.1, DATA_AXIS),
                                                      optax.adamw(0.02))), "on slices"),
], ids=["zero1-clipped-adamw", "zero3-clipped-adamw", "zero3-jit-adafactor", "zero1-sliced-clip-unwrapped"])
def test_an_optimizer_right_on_the_first_step_alone_is_refused(options, message):
    """Adam's first update is blind to the clipping factor, so clipping per slice shows from the second; under jit
    the optimizer sees leaves zero-padded to a multiple of 8, and Adafactor's per-leaf means count the zeros.
    Breaks if the probe looks at one update only, or skips the padded whole leaves of jit. jdp's own clipping
    left out of `Sliceable` is probed too, not an unbound axis name."""
    with pytest.raises(FitError, match=f"runs the optimizer {message} of each parameter"):
        _fit(CASES["regression"][0], mse, regression_data(), num_devices=8, **options)


@pytest.mark.parametrize("options", [dict(shard_optimizer=True), dict(shard_params=True),
                                     dict(shard_params=True, backend="jit"), {}],
                         ids=["zero1", "zero3", "zero3-jit", "allreduce"])
def test_clipping_that_sums_the_slices_norms_trains_as_one_device_clipping_whole_leaves(options):
    """`jdp.sync.clip_by_global_norm(max_norm, "data")` in a chain vouched for by `jdp.sync.Sliceable`: what the
    probe's refusal suggests. Breaks if the slices' squared norms are not summed across devices, or if they are
    where the optimizer sees whole leaves (the norm sqrt(8) too large; under jit, an axis that is not bound)."""
    model_cls, loss, data = CASES["regression"]
    sliced = jdp.sync.Sliceable(*optax.chain(jdp.sync.clip_by_global_norm(0.1, DATA_AXIS), optax.adamw(0.02)))
    result = _fit(model_cls, loss, data, num_devices=8, optimizer=sliced, **options)
    _assert_same(result, _fit(model_cls, loss, data, backend="jit", num_devices=1, optimizer=CLIPPED_ADAMW))


class WithAnEmptyParameter(nnx.Module):
    """The regression model beside a parameter with no elements (an adapter of width 0)."""

    def __init__(self, rngs: nnx.Rngs):
        self.model, self.empty = CASES["regression"][0](rngs), nnx.Param(jnp.zeros((3, 0)))

    def __call__(self, x):
        return self.model(x) + self.empty.sum()


@pytest.mark.parametrize("options", [dict(shard_params=True), dict(shard_params=True, backend="jit"),
                                     dict(shard_optimizer=True)], ids=["zero3", "zero3-jit", "zero1"])
def test_a_parameter_with_no_elements_stays_whole(options):
    """No collective splits an empty array (the compiler refuses a gather of size 0): it stays whole, as a scalar
    does. Breaks if `is_sharded` counts an empty leaf."""
    data = regression_data()
    _assert_same(_fit(WithAnEmptyParameter, mse, data, num_devices=8, **options),
                 _fit(WithAnEmptyParameter, mse, data, backend="jit", num_devices=1))


def test_word_sum_digests_do_not_depend_on_the_layout_and_find_damage():
    """A split leaf's digest is computed where its parts are, and equals the same leaf's digest whole on the host
    (a checkpoint restores on any device count); one changed element is found. Breaks if positions follow each
    device's part instead of the leaf's row-major order."""
    mesh = make_mesh(8)
    rng = np.random.default_rng(0)
    leaves = {"w": rng.standard_normal((5, 16)).astype(np.float32), "mask": rng.random(16) > 0.5,
              "ids": rng.integers(-9, 9, (8, 3)).astype(np.int8), "h": rng.standard_normal((8, 2)).astype(jnp.bfloat16)}
    split_on = {"w": (None, DATA_AXIS), "mask": (DATA_AXIS,), "ids": (DATA_AXIS, None), "h": (DATA_AXIS, None)}
    placed = {k: jax.device_put(v, NamedSharding(mesh, P(*split_on[k]))) for k, v in leaves.items()}
    saved = digest.pending(placed)()
    assert all(value[2].startswith(digest.WORDS) for value in saved.values())
    assert digest.mismatch(saved, leaves) is None  # whole, on the host
    assert digest.mismatch(saved, placed) is None
    assert digest.mismatch(saved, {k: jax.device_put(v, NamedSharding(mesh, P())) for k, v in leaves.items()}) is None
    damaged = dict(leaves, w=leaves["w"].copy())
    damaged["w"][3, 7] += 1.0
    assert digest.mismatch(saved, damaged) == ("the digest of ['w'] does not match the one saved with it "
                                               "(damaged bytes)")
