"""N devices must equal one device on the same global batch, under every backend (plain SGD)."""

import jax
import numpy as np
import pytest

from jdp.cli.train import ReplicaMismatchError, run
from jdp.sync import base as sync_base
from tests.helpers import max_abs_diff, small_config

BACKENDS = ("shard_map", "pmap", "jit")
RTOL = 1e-4  # float32 sums in a different order; a wrong gradient scale is off by far more


def assert_same_run(result, reference):
    np.testing.assert_allclose(result.losses, reference.losses, rtol=RTOL, atol=1e-6)
    for got, want in zip(jax.tree.leaves(result.params), jax.tree.leaves(reference.params), strict=True):
        np.testing.assert_allclose(got, want, rtol=RTOL, atol=1e-5)
    for got, want in zip(jax.tree.leaves(result.model_state), jax.tree.leaves(reference.model_state), strict=True):
        np.testing.assert_allclose(got, want, rtol=RTOL, atol=1e-5)


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """One-device runs, computed once per model (and with clipping for the MLP)."""
    cache = {}

    def get(model, **sections):
        key = (model, repr(sections))
        if key not in cache:
            cfg = small_config(model, backend="jit", num_devices=1, **sections)
            cache[key] = run(cfg, tmp_path_factory.mktemp(f"ref-{model}"))
        return cache[key]

    return get


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("model", ["mlp", "cnn1d", pytest.param("resnet", marks=pytest.mark.slow)])
def test_n_devices_equal_one_device(model, backend, references, tmp_path):
    reference = references(model)
    for num_devices in (8,) if model == "resnet" else (8, 2):  # the ResNet's 2-device runs cost CI a minute
        result = run(small_config(model, backend=backend, num_devices=num_devices), tmp_path / str(num_devices))
        assert_same_run(result, reference)
    if model != "resnet":  # five noisy steps on random images need not lower the tiny ResNet's loss
        assert reference.losses[-1] < reference.losses[0]


@pytest.mark.parametrize("backend", BACKENDS)
def test_clipping_applies_to_the_averaged_gradient(backend, references, tmp_path):
    # A clip norm well below the gradient norm: clipping per device before the all-reduce differs.
    clip = {"optim": {"grad_clip_norm": 0.05}}
    result = run(small_config("mlp", backend=backend, num_devices=8, **clip), tmp_path)
    assert_same_run(result, references("mlp", **clip))
    assert max_abs_diff(references("mlp", **clip).params, references("mlp").params) > 1e-3  # it did clip


@pytest.mark.parametrize("backend", ["shard_map", "pmap"])
def test_a_missing_all_reduce_is_caught(backend, monkeypatch, tmp_path):
    """Without the average each replica applies its own gradient: the replica check stops the run."""
    monkeypatch.setattr(sync_base, "all_reduce_mean", lambda tree, axis_name: tree)
    with pytest.raises(ReplicaMismatchError, match="replicas differ at step 5"):
        run(small_config("mlp", backend=backend, num_devices=8), tmp_path)


@pytest.mark.parametrize("backend", ["shard_map", "pmap"])
def test_a_summed_instead_of_averaged_gradient_is_caught(backend, references, monkeypatch, tmp_path):
    """A gradient summed rather than averaged over the devices (the weight totals still averaged) keeps
    the replicas identical but scales the gradient by 8: equivalence must fail."""
    def summed_gradient(tree, axis_name):
        if axis_name is None:
            return tree
        averaged = jax.lax.pmean(tree, axis_name)
        if "grads" in tree:
            averaged["grads"] = jax.lax.psum(tree["grads"], axis_name)
        return averaged

    monkeypatch.setattr(sync_base, "all_reduce_mean", summed_gradient)
    result = run(small_config("mlp", backend=backend, num_devices=8), tmp_path)
    reference = references("mlp")
    assert max_abs_diff(result.params, reference.params) > 1e-2
    with pytest.raises(AssertionError):
        assert_same_run(result, reference)


@pytest.mark.slow
def test_per_device_batchnorm_agrees_across_backends(references, tmp_path):
    """bn_sync=False normalises each device's rows alone (like DDP without SyncBatchNorm): the jit
    backend must group the global batch by device to match shard_map and pmap."""
    ghost = {"model": {"bn_sync": False}}
    runs = {b: run(small_config("resnet", backend=b, num_devices=8, **ghost), tmp_path / b) for b in BACKENDS}
    assert_same_run(runs["pmap"], runs["shard_map"])
    assert_same_run(runs["jit"], runs["shard_map"])
    with pytest.raises(AssertionError):  # per-device statistics really differ from global ones
        assert_same_run(runs["shard_map"], references("resnet"))
