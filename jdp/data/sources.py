"""Offline data sources by `data.name`: MNIST-1D, scikit-learn digits and a synthetic task in memory, text
(`jdp.data.text`) and `tfds:NAME` (`jdp.data.tfds_source`), each importing its heavy libraries itself."""

import functools
import io
import random
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from jdp.data.batching import Batcher, DataError
from jdp.data.text import is_text, text_source
from jdp.data.tfds_source import TFDS_PREFIX, TfdsSource
from jdp.files import cache_dir, write_atomically
from jdp.registry import Registry

if TYPE_CHECKING:
    import ml_collections

Split = dict[str, np.ndarray]  # an in-memory split: "x" float32 (N, *input_shape), "y" int32 (N,)


@functools.cache
def _mnist1d() -> tuple[Split, Split]:
    """Standard MNIST-1D (4000 train / 1000 test, 40 features, 10 classes), generated once into the cache folder."""
    path = cache_dir() / "mnist1d-standard.npz"
    try:
        with np.load(path) as stored:
            d = {k: stored[k] for k in ("x", "y", "x_test", "y_test")}
    except (OSError, KeyError, ValueError, EOFError, zipfile.BadZipFile):  # absent, or damaged: make it anew
        d = _generate_mnist1d()
        buffer = io.BytesIO()
        np.savez(buffer, **d)
        write_atomically(path, buffer.getvalue())
    return _shared(**d)


def _shared(x: np.ndarray, y: np.ndarray, x_test: np.ndarray, y_test: np.ndarray) -> tuple[Split, Split]:
    """Cached splits, x float32 and y int32, shared by every caller in the process: an accidental write fails loudly."""
    splits = tuple({"x": a.astype(np.float32), "y": b.astype(np.int32)} for a, b in ((x, y), (x_test, y_test)))
    for array in (array for split in splits for array in split.values()):
        array.setflags(write=False)
    return splits


def _generate_mnist1d() -> dict[str, np.ndarray]:
    from mnist1d.data import get_dataset_args, make_dataset

    # make_dataset reseeds the global numpy and Python RNGs: give the caller theirs back.
    np_state, py_state = np.random.get_state(), random.getstate()
    try:
        d = make_dataset(get_dataset_args())
    finally:
        np.random.set_state(np_state)
        random.setstate(py_state)
    return {k: np.asarray(d[k]) for k in ("x", "y", "x_test", "y_test")}


@functools.cache
def _digits() -> tuple[Split, Split]:
    """scikit-learn's 8x8 digits scaled to [0, 1], (8, 8, 1), in a fixed split of 1437 train / 360 test."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x_train, x_test, y_train, y_test = train_test_split(digits.images[..., None] / 16.0, digits.target,
                                                        test_size=0.2, random_state=0, stratify=digits.target)
    return _shared(x_train, y_train, x_test, y_test)


def _synthetic(
    shape: tuple[int, ...], num_classes: int, num_train: int, num_eval: int
) -> tuple[Split, Split]:
    """Gaussian inputs labelled by a fixed random linear teacher (argmax), so the task is learnable. Teacher and
    splits use separate streams of seed 0 (not the run's): neither split depends on the other's size."""
    if num_classes < 2:
        raise ValueError(f"the synthetic source needs data.num_classes >= 2, got {num_classes}")
    dim = int(np.prod(shape))
    sizes = ((dim, num_classes), (num_train, *shape), (num_eval, *shape))  # streams 0, 1 and 2
    teacher, *xs = (np.random.default_rng([0, stream]).standard_normal(size, dtype=np.float32)
                    for stream, size in enumerate(sizes))
    return tuple({"x": x, "y": np.argmax(x.reshape(len(x), dim) @ teacher, axis=1).astype(np.int32)} for x in xs)


# data.name -> (the data section) -> (train, eval) splits in memory; `tfds:NAME` is read by TfdsSource.
DATASETS: Registry[Callable[["ml_collections.ConfigDict"], tuple[Split, Split]]] = Registry("data.name")
DATASETS.register("mnist1d")(lambda cfg: _mnist1d())
DATASETS.register("digits")(lambda cfg: _digits())
DATASETS.register("synthetic")(lambda cfg: _synthetic(tuple(int(d) for d in cfg.shape), cfg.num_classes,
                                                      cfg.num_examples, cfg.num_eval_examples))


def build_source(
    cfg: "ml_collections.ConfigDict",
    *,
    seed: int,
    global_batch_size: int,
    eval_batch_size: int,
    process_index: int = 0,
    process_count: int = 1,
    workdir: Path | None = None,
) -> Batcher | TfdsSource:
    """The source `cfg` (the config's `data` section) names, batched for this process. `seed` orders the train
    split, never changes the data; a text source keeps its vocabulary in `workdir` (None: not saved)."""
    layout = {"seed": seed, "global_batch_size": global_batch_size, "eval_batch_size": eval_batch_size,
              "process_index": process_index, "process_count": process_count}
    if is_text(cfg.name):
        return text_source(cfg, **layout, workdir=workdir)
    if cfg.name.startswith(TFDS_PREFIX):
        return TfdsSource(cfg, **layout)
    train, eval = DATASETS.get(cfg.name)(cfg)
    if cfg.normalize:  # by one scalar mean and std of the train features: the relative scale of pixels and
        # channels kept, and no division by a constant feature's zero std (digits' borders)
        mean, std = train["x"].mean(), train["x"].std()
        scale = 1 / std if std > 0 else np.float32(1)
        train, eval = ({**s, "x": (s["x"] - mean) * scale} for s in (train, eval))
    source = Batcher(train, eval, **layout)
    source.input_shape = tuple(train["x"].shape[1:])
    labels = np.concatenate([train["y"], eval["y"]])  # data.num_classes is checked against them; 0 = max label + 1
    if labels.min() < 0:
        raise DataError(f"labels must be >= 0, got {labels.min()}")
    seen = int(labels.max()) + 1
    if cfg.num_classes and cfg.num_classes < seen:
        raise DataError(f"data.num_classes is {cfg.num_classes} but the data has label {seen - 1}; raise it or set 0")
    source.num_classes = cfg.num_classes or seen
    return source
