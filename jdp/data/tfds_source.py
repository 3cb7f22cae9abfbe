"""`data.name=tfds:NAME`: a prepared tensorflow-datasets copy, read by random access without TensorFlow.

The dataset must already be prepared (`tfds build NAME`); nothing is ever downloaded. array_record copies
are read through `tfds.data_source`, tfrecord copies (tfds's default format) through an index of their
frames (`jdp.data.tfrecord`); both give random access to a split, and the batching scheme is `Batcher`'s:
the global batch at a step is a slice of a permutation drawn from (seed, epoch), and process p of P reads
only rows [p*B/P, (p+1)*B/P) of it, so the global batch does not depend on the process or device count, no
process reads the whole dataset, and the iterator state is just the step.

Images are decoded and augmented (`jdp.data.augment`) on a pool of worker threads, and the batch for the
next step is read ahead in the background while the caller trains on this one.
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from jdp.data import augment
from jdp.data.batching import RowOrder
from jdp.data.sources import TFDS_PREFIX
from jdp.data.tfrecord import TfrecordRecords

if TYPE_CHECKING:
    import ml_collections

MIN_ROWS_PER_TASK = 16  # fewer rows than this per thread cost more in hand-offs than they save


def _import_tfds():
    try:
        import tensorflow_datasets as tfds
    except ImportError as e:
        raise ValueError(f"data.name=tfds:... needs tensorflow-datasets ({e}); install it with "
                         "pip install -e '.[tfds]'") from None
    return tfds


def _searched_dirs(tfds, data_dir: str | None) -> list[str]:
    from tensorflow_datasets.core.utils import file_utils

    return [os.fspath(d) for d in file_utils.list_data_dirs(data_dir)]


def _not_prepared(name: str, dirs: list[str], why: str = "") -> ValueError:
    target = dirs[0] if len(dirs) == 1 else "DIR"
    manual = " --manual_dir=DIR_WITH_THE_TAR_FILES" if name.startswith("imagenet2012") else ""
    folder = name.split("/")[0].split(":")[0]
    return ValueError(
        f"tfds dataset {name!r} is not prepared (searched: {', '.join(dirs)}{why}); prepare it on a machine "
        f"with internet with `tfds build {name} --data_dir={target} --file_format=array_record{manual}` and "
        f"copy {target}/{folder} to this machine, or set data.data_dir to a directory that holds it; nothing is "
        "downloaded at run time")


def open_builder(name: str, data_dir: str):
    """The prepared builder for `name` in `data_dir` ("" = tfds's default directories), or a ValueError."""
    tfds = _import_tfds()
    data_dir = os.path.expanduser(data_dir) if data_dir else None
    dirs = _searched_dirs(tfds, data_dir)
    if data_dir is not None and not Path(data_dir).is_dir():
        raise _not_prepared(name, dirs, " (that directory does not exist)")
    try:
        builder = tfds.builder(name, data_dir=data_dir)
    except tfds.core.registered.DatasetNotFoundError:
        raise _not_prepared(name, dirs) from None
    if not builder.is_prepared():
        raise _not_prepared(name, dirs)
    formats = builder.info.available_file_formats() or {builder.info.file_format}
    if not formats & {tfds.core.FileFormat.ARRAY_RECORD, tfds.core.FileFormat.TFRECORD}:
        stored = ", ".join(sorted(f.value for f in formats if f)) or "an unknown format"
        raise ValueError(
            f"tfds dataset {name!r} in {builder.data_dir} is stored as {stored}, which jdp cannot read by step; "
            f"prepare it again with `tfds build {name} --data_dir={dirs[0] if len(dirs) == 1 else 'DIR'} "
            "--file_format=array_record` (or tfrecord)")
    return builder


def _feature_keys(builder) -> tuple[str, str]:
    keys = builder.info.supervised_keys
    if isinstance(keys, tuple) and len(keys) == 2 and all(isinstance(k, str) for k in keys):
        return keys
    features = builder.info.features
    if "image" in features and "label" in features:
        return "image", "label"
    raise ValueError(f"tfds dataset {builder.name!r} has no supervised (image, label) keys and no 'image' and "
                     f"'label' features (it has {', '.join(features)})")


class _Records:
    """Random access to one split's (image, label) pairs; the image still encoded (bytes) or an array.

    Serialized records come from tfds's data source (array_record) or, for tfrecord copies, from
    `TfrecordRecords`. Images stored as `tfds.features.Image` (CIFAR-10, ImageNet, ...) take a fast path:
    the records are parsed here as `tf.train.Example` protos, which is ~10x cheaper than tfds's generic
    per-feature decoding; anything else goes through tfds's decoding with the Image left encoded.
    """

    def __init__(self, tfds, builder, split: str, image_key: str, label_key: str) -> None:
        info = builder.info
        if tfds.core.FileFormat.ARRAY_RECORD in (info.available_file_formats() or {info.file_format}):
            raw = tfds.decode.DeserializeMethod.RAW_BYTES
            self._source = builder.as_data_source(split=split, deserialize_method=raw)
        else:  # tfrecord, checked by open_builder
            self._source = TfrecordRecords(info.splits[split].file_instructions)
        image, label = info.features[image_key], info.features[label_key]
        self._fast = (isinstance(image, tfds.features.Image) and image.np_dtype == np.uint8
                      and isinstance(label, tfds.features.ClassLabel) and "/" not in image_key + label_key)
        if self._fast:
            from tensorflow_datasets.proto import tf_example_pb2

            self._parse = tf_example_pb2.Example.FromString
        else:
            decoders = {image_key: tfds.decode.SkipDecoding()} if isinstance(image, tfds.features.Image) else None
            self._decode = functools.partial(info.features.deserialize_example_np, decoders=decoders)
        self._image_key, self._label_key = image_key, label_key

    def __len__(self) -> int:
        return len(self._source)

    def __getitems__(self, rows: np.ndarray) -> list[tuple[Any, int]]:
        """The (image, label) pairs at `rows`, in that order.

        One record at a time: for CIFAR-sized records that is ~4x cheaper than the data source's own
        `__getitems__`, which starts a thread pool per call; parallelism comes from our worker threads.
        """
        records = [self._source[int(r)] for r in rows]
        if not self._fast:
            return [(d[self._image_key], d[self._label_key]) for d in map(self._decode, records)]
        pairs = []
        for record in records:
            feature = self._parse(record).features.feature
            pairs.append((feature[self._image_key].bytes_list.value[0], feature[self._label_key].int64_list.value[0]))
        return pairs


class TfdsSource:
    """This process's rows of every global batch of a prepared tfds dataset; the interface of `Batcher`."""

    def __init__(
        self,
        cfg: ml_collections.ConfigDict,
        *,
        seed: int,
        global_batch_size: int,
        eval_batch_size: int,
        process_index: int = 0,
        process_count: int = 1,
        num_threads: int = 0,
        read_ahead: bool = True,
    ) -> None:
        """`num_threads` 0 = one per CPU core (at most 16); `read_ahead` prepares step+1 in the background."""
        if seed < 0:
            raise ValueError(f"seed must be >= 0, got {seed}")
        self.name = cfg.name[len(TFDS_PREFIX):]
        tfds = _import_tfds()
        builder = open_builder(self.name, cfg.data_dir)
        image_key, label_key = _feature_keys(builder)
        features = builder.info.features
        image_feature, label_feature = features[image_key], features[label_key]

        def split(key: str) -> _Records:
            spec = cfg[key]
            try:
                return _Records(tfds, builder, spec, image_key, label_key)
            except (ValueError, KeyError, AssertionError) as e:
                raise ValueError(f"data.{key}={spec!r} is not a split of {self.name} (splits: "
                                 f"{', '.join(builder.info.splits)}): {str(e).splitlines()[0]}") from None

        self._train, self._eval = split("train_split"), split("eval_split")

        stored = tuple(image_feature.shape)
        channels = stored[-1] or 3
        self._channels = channels
        self._small = augment.is_small(stored)
        self._augment = bool(cfg.augment)
        if self._small:
            self.input_shape: tuple[int, ...] = (stored[0], stored[1], channels)
        else:
            if cfg.image_size <= 0:
                raise ValueError(f"data.image_size={cfg.image_size} must be positive")
            self.input_shape = (cfg.image_size, cfg.image_size, channels)
        mean, std = augment.channel_stats(self.name, channels) if cfg.normalize else (
            np.zeros(channels, np.float32), np.ones(channels, np.float32))
        self._normalize = augment.Normalizer(mean, std)

        self.num_classes: int = cfg.num_classes or getattr(label_feature, "num_classes", 0)
        if not self.num_classes:
            raise ValueError(f"the label feature {label_key!r} of {self.name} has no number of classes; set "
                             "data.num_classes")
        self._seed = seed
        self._order = RowOrder(seed=seed, num_train=len(self._train), num_eval=len(self._eval),
                               global_batch_size=global_batch_size, eval_batch_size=eval_batch_size,
                               process_index=process_index, process_count=process_count,
                               train_split=f"the train split {cfg.train_split!r} of {self.name}")
        self.num_train, self.num_eval = len(self._train), len(self._eval)
        self.global_batch_size, self.eval_batch_size = global_batch_size, eval_batch_size
        self.local_batch_size = global_batch_size // process_count
        self.steps_per_epoch: int = self._order.steps_per_epoch
        if self.num_eval == 0:
            raise ValueError(f"the eval split {cfg.eval_split!r} of {self.name} is empty")

        self._threads = num_threads or min(os.cpu_count() or 1, 16)
        self._workers = ThreadPoolExecutor(self._threads, thread_name_prefix="jdp-tfds")
        self._ahead_pool = ThreadPoolExecutor(1, thread_name_prefix="jdp-tfds-ahead") if read_ahead else None
        self._ahead: tuple[Any, Future] | None = None  # (key, batch being read): a cache, not iterator state
        self._lock = threading.Lock()

    # -- reading ---------------------------------------------------------------------------------------

    def _read(self, source: _Records, rows: np.ndarray, transform: Callable[[np.ndarray, int], np.ndarray],
              shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
        """Rows of `source` -> (pixels uint8 (n, *shape), labels int32), `transform(image, i)` per row i.

        The rows are cut into contiguous chunks, one task per worker thread (one task in all for small
        batches); each task reads, decodes and transforms its rows into its own slots, so the result does not
        depend on the schedule. Labels outside [0, num_classes) are refused.
        """
        n = len(rows)
        pixels = np.empty((n, *shape), np.uint8)
        labels = np.empty(n, np.int32)

        def task(lo: int, hi: int) -> None:
            for i, (image, label) in zip(range(lo, hi), source.__getitems__(rows[lo:hi]), strict=True):
                pixels[i] = transform(augment.decode(image, self._channels), i)
                labels[i] = label

        tasks = max(1, min(self._threads, n // MIN_ROWS_PER_TASK))
        bounds = np.linspace(0, n, tasks + 1).astype(int)
        if tasks == 1:
            task(0, n)
        else:
            for f in [self._workers.submit(task, lo, hi) for lo, hi in zip(bounds[:-1], bounds[1:], strict=True)]:
                f.result()
        if labels.min() < 0 or labels.max() >= self.num_classes:
            bad = labels[(labels < 0) | (labels >= self.num_classes)][0]
            raise ValueError(f"{self.name} has label {bad}, outside [0, {self.num_classes}); unlabelled splits (such "
                             "as imagenet2012's test) cannot be trained or evaluated on, and data.num_classes must "
                             "cover every label")
        return pixels, labels

    def _make_train_batch(self, step: int) -> dict[str, np.ndarray]:
        rows = self._order.train_rows(step)
        params = augment.batch_params(self._seed, step, self.global_batch_size).rows(self._order.train_block)
        size = self.input_shape[0]
        if self._small and self._augment:
            def transform(image: np.ndarray, i: int) -> np.ndarray:
                return augment.pad_crop_flip(image, params.offsets[i], bool(params.flips[i]))

            pixels, labels = self._read(self._train, rows, transform, self.input_shape)
        elif self._small:
            pixels, labels = self._read(self._train, rows, self._eval_transform, self.input_shape)
        elif self._augment:
            def transform(image: np.ndarray, i: int) -> np.ndarray:
                box = augment.random_resized_box(image.shape[0], image.shape[1], params.uniforms[i])
                return augment.resize_box(image, box, size, bool(params.flips[i]))

            pixels, labels = self._read(self._train, rows, transform, self.input_shape)
        else:
            pixels, labels = self._read(self._train, rows, self._eval_transform, self.input_shape)
        return {"x": self._normalize(pixels), "y": labels}

    def _eval_transform(self, image: np.ndarray, i: int) -> np.ndarray:
        if self._small:
            return image
        return augment.resize_box(image, augment.center_box(image.shape[0], image.shape[1]), self.input_shape[0],
                                  False)

    def _make_eval_batch(self, i: int) -> dict[str, np.ndarray]:
        ids, real = self._order.eval_rows(i)
        n = int(real.sum())  # real rows come first: padding is only ever at the end of the split
        pixels = np.zeros((len(ids), *self.input_shape), np.uint8)
        labels = np.zeros(len(ids), np.int32)
        if n:
            pixels[:n], labels[:n] = self._read(self._eval, ids[:n], self._eval_transform, self.input_shape)
        return {"x": self._normalize(pixels), "y": labels, "mask": real.astype(np.float32)}

    def _get(self, key: tuple[str, int], make: Callable[[int], dict], next_key: tuple[str, int] | None) -> dict:
        """`make(key[1])`, from the read-ahead if it holds that key; then start reading `next_key` ahead."""
        with self._lock:
            ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead[0] == key:
            batch = ahead[1].result()
        else:
            if ahead is not None:
                ahead[1].cancel()  # a guess that missed (e.g. eval after a train step): drop it if not started
            batch = make(key[1])
        if self._ahead_pool is not None and next_key is not None:
            future = self._ahead_pool.submit(make, next_key[1])
            with self._lock:
                self._ahead = (next_key, future)
        return batch

    # -- the Batcher interface ---------------------------------------------------------------------------

    def train_batch(self, step: int) -> dict[str, np.ndarray]:
        """This process's rows of the global train batch at `step`: {'x': (B/P, H, W, C) float32, 'y'}."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        return self._get(("train", step), self._make_train_batch, ("train", step + 1))

    def num_eval_batches(self) -> int:
        return self._order.num_eval_batches()

    def eval_batches(self) -> Iterator[dict[str, np.ndarray]]:
        """The eval split once, in order; padded rows (zeros, `mask` 0) only in the last batch.

        Every process yields num_eval_batches() items, so collectives over eval batches stay in lockstep.
        """
        count = self.num_eval_batches()
        for i in range(count):
            yield self._get(("eval", i), self._make_eval_batch, ("eval", i + 1) if i + 1 < count else None)

    def close(self) -> None:
        """Stop the worker threads (also done at interpreter exit)."""
        if self._ahead_pool is not None:
            self._ahead_pool.shutdown(wait=True, cancel_futures=True)
        self._workers.shutdown(wait=True, cancel_futures=True)

