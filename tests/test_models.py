"""Model tests.

XLA:CPU takes ~1 s to compile each new random-init shape, so most models here are built abstractly
(nnx.eval_shape) and given parameter values from numpy: the graph is under test, not Flax's initializers.
"""

import flax.linen
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from jdp.modeldef import set_batchnorm_axis
from jdp.models import MODELS, build_model, count_params, max_pool_2x2, resnet18, resnet50, settings


def _cfg(name: str, **overrides) -> ml_collections.ConfigDict:
    cfg = dict(
        name=name,
        hidden_sizes=(16,),
        channels=(4, 6),
        kernel_sizes=(5, 3),
        strides=(2, 2),
        dense_sizes=(8,),
        width=8,
        stage_sizes=(1, 1, 1, 1),
        stem="auto",
        bn_momentum=0.9,
    )
    cfg = {**cfg, **overrides}
    accepted = settings(name, {}) if name in MODELS.names() else {}
    return ml_collections.ConfigDict({"name": name, "kwargs": {k: v for k, v in cfg.items() if k in accepted}})


def _build(cfg, input_shape, num_classes=10):
    return build_model(cfg.name, cfg.kwargs.to_dict(), input_shape, num_classes, seed=0)


def _split(cfg, input_shape, axis_name=None):
    """(graphdef, params, rest) as pure dicts of jax arrays: random params from numpy, fresh BN statistics;
    every BatchNorm on `axis_name`, as jdp.fit sets it."""
    model = nnx.eval_shape(lambda: _build(cfg, input_shape))
    set_batchnorm_axis(model, axis_name)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda s: rng.normal(0, 0.3, s.shape).astype(s.dtype), nnx.to_pure_dict(params))
    rest = jax.tree_util.tree_map_with_path(
        lambda path, s: (np.ones if path[-1].key == "var" else np.zeros)(s.shape, s.dtype),
        nnx.to_pure_dict(rest),
    )
    # Not numpy: an eager BatchNorm call writes its new statistics into a numpy-backed Variable in place.
    return graphdef, *jax.tree.map(jnp.asarray, (params, rest))


def _train_step(graphdef):
    """The trainer's pattern: merge inside the traced function, grad, read back the non-param state."""

    def step(params, rest, x):
        def loss_fn(params):
            m = nnx.merge(graphdef, params, rest)
            logits = m(x)
            return logits.sum(), (logits, nnx.to_pure_dict(nnx.state(m, nnx.Not(nnx.Param))))

        return jax.grad(loss_fn, has_aux=True)(params)

    return step


# (config, input shape without batch axis)
CASES = {
    "mlp": (_cfg("mlp"), (8, 8, 1)),
    "cnn1d": (_cfg("cnn1d"), (40,)),
    "cnn1d_channels": (_cfg("cnn1d"), (40, 2)),
    "cnn2d": (_cfg("cnn2d"), (8, 8, 1)),
    "cnn2d_odd_no_channel": (_cfg("cnn2d"), (9, 9)),
    "resnet_basic_cifar": (_cfg("resnet18"), (8, 8, 3)),
    "resnet_basic_imagenet": (_cfg("resnet34", stem="imagenet"), (8, 8, 3)),
    "resnet_bottleneck_cifar": (_cfg("resnet50"), (8, 8, 3)),
    "resnet_bottleneck_imagenet": (_cfg("resnet50", stem="imagenet"), (8, 8, 3)),
    "resnet_no_channel": (_cfg("resnet18", stage_sizes=(1,)), (8, 8)),
}


@pytest.mark.parametrize("case", CASES)
def test_shapes_and_state_structure(case):
    cfg, shape = CASES[case]
    graphdef, params, rest = _split(cfg, shape)
    x = jax.ShapeDtypeStruct((4, *shape), jnp.float32)
    grads, (logits, new_rest) = jax.eval_shape(_train_step(graphdef), params, rest, x)
    assert logits.shape == (4, 10) and logits.dtype == jnp.float32
    assert jax.tree.structure(grads) == jax.tree.structure(params)
    assert jax.tree.structure(new_rest) == jax.tree.structure(rest)
    assert (len(jax.tree.leaves(rest)) > 0) == cfg.name.startswith("resnet")


@pytest.mark.parametrize("case", ["mlp", "cnn1d", "cnn2d", "resnet_bottleneck_cifar"])
def test_jit_grad_runs(case):
    cfg, shape = CASES[case]
    if cfg.name.startswith("resnet"):
        cfg = _cfg(cfg.name, stage_sizes=(1,), width=4)  # less to compile; has a projection shortcut
    graphdef, params, rest = _split(cfg, shape)
    x = jax.random.normal(jax.random.key(1), (4, *shape))
    grads, (logits, new_rest) = jax.jit(_train_step(graphdef))(params, rest, x)
    assert all(bool(jnp.isfinite(g).all()) and bool((g != 0).any()) for g in jax.tree.leaves(grads))
    if new_rest:
        assert not np.allclose(new_rest["stem_bn"]["mean"], rest["stem_bn"]["mean"])
        def eval_forward(p, r, x):
            m = nnx.merge(graphdef, p, r)
            m.eval()
            return m(x)

        eval_logits = jax.jit(eval_forward)(params, new_rest, x)
        assert not np.allclose(eval_logits, logits)  # eval uses the running statistics


def test_cnn1d_is_mnist1d_convbase():
    cfg = _cfg("cnn1d", channels=(25, 25, 25), kernel_sizes=(5, 3, 3), strides=(2, 2, 2))
    model = nnx.eval_shape(lambda: _build(cfg, (40,)))
    assert model.head.in_features == 125  # 25 channels x length 5, as with torch Conv1d(padding=1)


def test_resnet_param_counts_match_torchvision():
    r18 = nnx.eval_shape(lambda: resnet18(1000, rngs=nnx.Rngs(0)))
    r50 = nnx.eval_shape(lambda: resnet50(1000, rngs=nnx.Rngs(0)))
    assert count_params(nnx.state(r18, nnx.Param)) == 11_689_512
    assert count_params(nnx.state(r50, nnx.Param)) == 25_557_032


def test_build_model_init_and_count_params():
    model = _build(_cfg("mlp", hidden_sizes=(3,)), (4,), 2)
    assert count_params(nnx.to_pure_dict(nnx.state(model, nnx.Param))) == 4 * 3 + 3 + 3 * 2 + 2
    again = _build(_cfg("mlp", hidden_sizes=(3,)), (4,), 2)
    np.testing.assert_array_equal(model.layers[0].kernel[...], again.layers[0].kernel[...])


def test_resnet_bfloat16_gives_float32_logits():
    model = nnx.eval_shape(
        lambda: resnet18(10, width=4, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    )
    x = jax.ShapeDtypeStruct((2, 32, 32, 3), jnp.float32)
    assert jax.eval_shape(lambda m, x: m(x), model, x).dtype == jnp.float32


@pytest.mark.parametrize("hw", [(8, 8), (7, 9)])
def test_max_pool_matches_flax(hw):
    x = jax.random.normal(jax.random.key(0), (2, *hw, 3))
    np.testing.assert_array_equal(max_pool_2x2(x), nnx.max_pool(x, (2, 2), (2, 2)))
    np.testing.assert_array_equal(max_pool_2x2(x), flax.linen.max_pool(x, (2, 2), (2, 2)))


def _train_forward_on_mesh(axis_name, params, rest, x):
    """Tiny ResNet train-mode forward under shard_map on all devices: logits and device 0's statistics."""
    graphdef, _, _ = _split(_cfg("resnet18", stage_sizes=(1,), width=4), (8, 8, 3), axis_name)
    mesh = jax.make_mesh((len(jax.devices()),), ("data",), axis_types=(jax.sharding.AxisType.Auto,))

    def forward(params, rest, x):
        m = nnx.merge(graphdef, params, rest)
        return m(x), nnx.to_pure_dict(nnx.state(m, nnx.Not(nnx.Param)))

    specs = dict(in_specs=(P(), P(), P("data")), out_specs=(P("data"), P()))
    return jax.jit(jax.shard_map(forward, mesh=mesh, check_vma=False, **specs))(params, rest, x)


def test_batchnorm_axis_name_syncs_statistics_across_devices():
    n = len(jax.devices())
    graphdef, params, rest = _split(_cfg("resnet18", stage_sizes=(1,), width=4), (8, 8, 3))
    # Per-example scales make every device's slice statistically different.
    x = jax.random.normal(jax.random.key(0), (4 * n, 8, 8, 3)) * jnp.arange(1, 4 * n + 1)[:, None, None, None]
    model = nnx.merge(graphdef, params, rest)
    ref_logits = model(x)
    ref_stats = nnx.to_pure_dict(nnx.state(model, nnx.BatchStat))

    logits, stats = _train_forward_on_mesh("data", params, rest, x)
    np.testing.assert_allclose(logits, ref_logits, rtol=1e-4, atol=1e-4)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5), stats, ref_stats)

    if n < 2:
        pytest.skip("per-device statistics equal the global ones on a single device")
    logits, stats = _train_forward_on_mesh(None, params, rest, x)
    assert not np.allclose(stats["stem_bn"]["var"], ref_stats["stem_bn"]["var"], rtol=1e-2)
    assert not np.allclose(logits, ref_logits, rtol=1e-2)


def test_unknown_model_name():
    with pytest.raises(ValueError, match="model.name='vgg' is unknown.*mlp.*resnet50"):
        _build(_cfg("vgg"), (8, 8, 1))
    assert MODELS.names() == ("mlp", "cnn1d", "cnn2d", "resnet18", "resnet34", "resnet50", "gpt")


def test_a_resnet_width_is_one_positive_int():
    """A tuple passed the old check of sizes and then broke the ResNet."""
    with pytest.raises(ValueError, match=r"model.kwargs.width=\(64,\) must be a positive int"):
        build_model("resnet18", {"width": (64,), "stage_sizes": (1, 1)}, (8, 8, 3), 10, seed=0)
