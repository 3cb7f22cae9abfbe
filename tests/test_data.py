"""Host data: the global batch is a function of (seed, step) only, and each process gets its own block."""

import random
import socket

import ml_collections
import numpy as np
import pytest

from jdp.data import DATASETS, Batcher, build_source, sources


def _ids_split(n: int) -> dict[str, np.ndarray]:
    """Row i has x = [i, i] and y = i, so a batch tells which rows it holds."""
    ids = np.arange(n)
    return {"x": np.stack([ids, ids], axis=1).astype(np.float32), "y": ids.astype(np.int32)}


def _batcher(
    n_train: int = 100,
    n_eval: int = 37,
    *,
    seed: int = 0,
    batch: int = 8,
    eval_batch: int = 8,
    p: int = 0,
    count: int = 1,
) -> Batcher:
    return Batcher(
        _ids_split(n_train),
        _ids_split(n_eval),
        seed=seed,
        global_batch_size=batch,
        eval_batch_size=eval_batch,
        process_index=p,
        process_count=count,
    )


def _data_cfg(name: str, **overrides: object) -> ml_collections.ConfigDict:
    cfg = ml_collections.ConfigDict(
        dict(
            name=name,
            num_classes=0,
            shape=(28, 28, 1),
            num_examples=256,
            num_eval_examples=64,
            normalize=True,
        )
    )
    cfg.update(overrides)
    return cfg


@pytest.mark.parametrize("step", [0, 5, 12, 13, 40])
def test_process_shards_concatenate_to_the_global_batch(step: int) -> None:
    whole = _batcher(batch=16).train_batch(step)["y"]
    for count in (1, 2, 4):
        shards = [_batcher(batch=16, p=p, count=count).train_batch(step) for p in range(count)]
        assert all(s["y"].shape == (16 // count,) and s["x"].shape == (16 // count, 2) for s in shards)
        np.testing.assert_array_equal(np.concatenate([s["y"] for s in shards]), whole)
        assert len(set(np.concatenate([s["y"] for s in shards]))) == 16  # disjoint


def test_train_batch_dtypes_and_row_identity() -> None:
    batch = _batcher().train_batch(3)
    assert batch["x"].dtype == np.float32 and batch["y"].dtype == np.int32
    np.testing.assert_array_equal(batch["x"][:, 0], batch["y"])


def test_train_batch_is_a_function_of_seed_and_step() -> None:
    a, b = _batcher(seed=1), _batcher(seed=1)
    for step in (7, 0, 30, 7, 12):  # any order: random access, no iterator state
        np.testing.assert_array_equal(a.train_batch(step)["y"], b.train_batch(step)["y"])
    assert not np.array_equal(a.train_batch(0)["y"], _batcher(seed=2).train_batch(0)["y"])


def test_an_epoch_visits_each_row_at_most_once() -> None:
    b = _batcher(n_train=100, batch=8)
    assert b.steps_per_epoch == 12  # the last 4 rows of each epoch are dropped
    for epoch in range(3):
        rows = np.concatenate([b.train_batch(epoch * 12 + i)["y"] for i in range(12)])
        assert len(np.unique(rows)) == 96
    assert not np.array_equal(b.train_batch(0)["y"], b.train_batch(12)["y"])  # a new permutation each epoch


@pytest.mark.parametrize("eval_batch", [8, 24])
@pytest.mark.parametrize("count", [1, 2])
def test_eval_covers_every_example_once(eval_batch: int, count: int) -> None:
    n = 37  # divisible by neither batch size
    per_process = [
        list(_batcher(n_eval=n, eval_batch=eval_batch, p=p, count=count).eval_batches()) for p in range(count)
    ]
    expected = -(-n // eval_batch)
    assert all(len(batches) == expected for batches in per_process)
    assert _batcher(n_eval=n, eval_batch=eval_batch).num_eval_batches() == expected
    seen = []
    for i in range(expected):  # a global batch is the processes' blocks in order
        items = [per_process[p][i] for p in range(count)]
        assert all(it["x"].shape == (eval_batch // count, 2) for it in items)
        assert all(it["mask"].dtype == np.float32 for it in items)
        y = np.concatenate([it["y"] for it in items])
        mask = np.concatenate([it["mask"] for it in items])
        np.testing.assert_array_equal(mask, np.arange(i * eval_batch, (i + 1) * eval_batch) < n)
        seen.extend(y[mask == 1])
    assert seen == list(range(n))  # in order, each exactly once


def test_batch_sizes_are_checked() -> None:
    with pytest.raises(ValueError, match="multiple of the process count 4"):
        _batcher(batch=6, count=4)
    with pytest.raises(ValueError, match="eval batch size"):
        _batcher(eval_batch=6, count=4)
    with pytest.raises(ValueError, match="fewer than one global batch"):
        _batcher(n_train=10, batch=16)


def test_unknown_name() -> None:
    with pytest.raises(ValueError, match="mnist1d"):
        build_source(_data_cfg("imagenet"), seed=0, global_batch_size=8, eval_batch_size=8)
    assert DATASETS.names() == ("mnist1d", "digits", "synthetic")


def test_mnist1d_is_generated_offline_and_leaves_global_rngs_alone(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    def no_network(*args: object) -> None:
        raise AssertionError("mnist1d tried the network")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.setenv("JDP_CACHE_DIR", str(tmp_path))  # empty: generated here, then kept
    sources._mnist1d.cache_clear()
    np.random.seed(123)
    random.seed(123)
    np_before, py_before = np.random.get_state()[1].copy(), random.getstate()
    source = build_source(_data_cfg("mnist1d"), seed=0, global_batch_size=128, eval_batch_size=100)
    np.testing.assert_array_equal(np.random.get_state()[1], np_before)
    assert random.getstate() == py_before
    shapes = (source.num_train, source.num_eval, source.input_shape, source.num_classes)
    assert shapes == (4000, 1000, (40,), 10)
    assert source.train_batch(0)["x"].shape == (128, 40)
    assert source.steps_per_epoch == 31

    # Kept: the next process reads the same data back without generating it.
    assert [p.name for p in tmp_path.iterdir()] == ["mnist1d-standard.npz"]
    generated = sources._mnist1d()
    sources._mnist1d.cache_clear()
    monkeypatch.setattr(sources, "_generate_mnist1d", lambda: pytest.fail("generated again"))
    for a, b in zip(sources._mnist1d(), generated, strict=True):
        assert all(np.array_equal(a[k], b[k]) for k in ("x", "y"))
    sources._mnist1d.cache_clear()


def test_digits_split_is_fixed() -> None:
    a = build_source(_data_cfg("digits", normalize=False), seed=0, global_batch_size=32, eval_batch_size=32)
    assert (a.num_train, a.num_eval, a.input_shape, a.num_classes) == (1437, 360, (8, 8, 1), 10)
    train, _ = sources._digits()
    assert train["x"].min() == 0.0 and train["x"].max() == 1.0
    sources._digits.cache_clear()
    b = build_source(_data_cfg("digits", normalize=False), seed=0, global_batch_size=32, eval_batch_size=32)
    np.testing.assert_array_equal(next(a.eval_batches())["x"], next(b.eval_batches())["x"])
    np.testing.assert_array_equal(a.train_batch(3)["y"], b.train_batch(3)["y"])


def test_normalize_uses_train_statistics() -> None:
    source = build_source(_data_cfg("digits"), seed=0, global_batch_size=1437, eval_batch_size=8)
    x = source.train_batch(0)["x"]
    assert abs(x.mean()) < 1e-5 and abs(x.std() - 1) < 1e-5


@pytest.mark.parametrize("shape", [(28, 28, 1), (784,)])
def test_synthetic_shapes_determinism_and_balance(shape: tuple[int, ...]) -> None:
    cfg = _data_cfg("synthetic", shape=shape, num_classes=10)
    a = build_source(cfg, seed=0, global_batch_size=64, eval_batch_size=64)
    b = build_source(cfg, seed=5, global_batch_size=64, eval_batch_size=64)
    assert (a.num_train, a.num_eval, a.input_shape, a.num_classes) == (256, 64, shape, 10)
    assert a.train_batch(0)["x"].shape == (64, *shape)
    # The data is fixed; the run seed only orders it.
    np.testing.assert_array_equal(next(a.eval_batches())["x"], next(b.eval_batches())["x"])
    assert np.bincount(next(a.eval_batches())["y"], minlength=10).max() < 32  # not one class


def test_synthetic_labels_follow_a_linear_teacher() -> None:
    train, _ = sources._synthetic((6,), 3, 2000, 10)
    # least squares on one-hot labels recovers a linear rule that beats chance by far
    w, *_ = np.linalg.lstsq(train["x"], np.eye(3)[train["y"]], rcond=None)
    assert (np.argmax(train["x"] @ w, axis=1) == train["y"]).mean() > 0.8


def test_synthetic_needs_num_classes() -> None:
    with pytest.raises(ValueError, match="num_classes"):
        build_source(_data_cfg("synthetic"), seed=0, global_batch_size=8, eval_batch_size=8)
