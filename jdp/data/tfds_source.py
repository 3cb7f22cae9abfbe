"""`data.name=tfds:NAME`: a prepared tensorflow-datasets copy read by random access without TensorFlow, nothing
downloaded; images decoded on worker threads. No read-ahead thread: the trainer reads step i+1's batch while step i
runs (dispatch is asynchronous). The rest: docs/datasets.md."""

from __future__ import annotations

import functools
import logging
import math
import os
import resource
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from jdp.data import augment
from jdp.data.augment import ImageInput
from jdp.data.batching import DataError, RowOrder
from jdp.data.tfrecord import TfrecordRecords
from jdp.errors import one_line

if TYPE_CHECKING:
    import ml_collections

MIN_ROWS_PER_TASK = 16  # fewer rows than this per thread cost more in hand-offs than they save

TFDS_PREFIX = "tfds:"  # data.name=tfds:NAME is any prepared tensorflow-datasets dataset


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
    try:
        import tensorflow_datasets as tfds
    except ImportError as e:
        raise ValueError(f"data.name=tfds:... needs tensorflow-datasets ({e}); install it with "
                         "pip install -e '.[tfds]'") from None
    from tensorflow_datasets.core.utils import file_utils

    data_dir = os.path.expanduser(data_dir) if data_dir else None
    dirs = [os.fspath(d) for d in file_utils.list_data_dirs(data_dir)]
    if data_dir is not None and not Path(data_dir).is_dir():
        raise _not_prepared(name, dirs, " (that directory does not exist)")
    absl = logging.getLogger("absl")
    level = absl.level
    absl.setLevel(logging.ERROR)  # "Variant folder ... has no dataset_info.json" beside jdp's one line
    try:
        builder = tfds.builder(name, data_dir=data_dir)
        prepared = builder.is_prepared()
    except tfds.core.registered.DatasetNotFoundError:
        raise _not_prepared(name, dirs) from None
    except ValueError as e:  # tfds's own explanation of the name's format runs over many lines
        raise DataError(f"data.name=tfds:{name}: {one_line(e, typed=False)} Give tfds:NAME[/CONFIG][:VERSION], "
                        "e.g. tfds:cifar10 or tfds:imagenet2012:5.1.0") from None
    finally:
        absl.setLevel(level)
    if not prepared:
        raise _not_prepared(name, dirs)
    formats = builder.info.available_file_formats() or {builder.info.file_format}
    if not formats & {tfds.core.FileFormat.ARRAY_RECORD, tfds.core.FileFormat.TFRECORD}:
        stored = ", ".join(sorted(f.value for f in formats if f)) or "an unknown format"
        raise ValueError(
            f"tfds dataset {name!r} in {builder.data_dir} is stored as {stored}, which jdp cannot read by step; "
            f"prepare it again with `tfds build {name} --data_dir={dirs[0] if len(dirs) == 1 else 'DIR'} "
            "--file_format=array_record` (or tfrecord)")
    return builder


def _allow_open_files(shards: int) -> None:
    """Both readers keep every shard file open (ImageNet: 1,088), past a common soft limit of 1,024: raise it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = shards + 1024  # headroom for JAX, sockets and the rest of the process
    if soft != resource.RLIM_INFINITY and soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want if hard == resource.RLIM_INFINITY else min(want, hard),
                                                    hard))


class _Records:
    """Random access to one split's (image, label) pairs, the image still encoded. A `tfds.features.Image`'s records
    are parsed here as `tf.train.Example` protos, ~10x cheaper than tfds's per-feature decoding."""

    def __init__(self, tfds, builder, split: str, image_key: str, label_key: str) -> None:
        info = builder.info
        if tfds.core.FileFormat.ARRAY_RECORD in (info.available_file_formats() or {info.file_format}):
            # What tfds.data_source(name, split, download=False) returns, from the builder checked above.
            raw = tfds.decode.DeserializeMethod.RAW_BYTES
            self._source = builder.as_data_source(split=split, deserialize_method=raw)
        else:  # tfrecord, checked by open_builder
            self._source = TfrecordRecords(info.splits[split].file_instructions)
        image, label = info.features[image_key], info.features[label_key]
        if (isinstance(image, tfds.features.Image) and image.np_dtype == np.uint8
                and isinstance(label, tfds.features.ClassLabel) and "/" not in image_key + label_key):
            from tensorflow_datasets.proto import tf_example_pb2

            def pair(record: bytes) -> tuple[Any, int]:
                feature = tf_example_pb2.Example.FromString(record).features.feature
                return feature[image_key].bytes_list.value[0], feature[label_key].int64_list.value[0]
        else:
            decoders = {image_key: tfds.decode.SkipDecoding()} if isinstance(image, tfds.features.Image) else None

            def pair(record: bytes) -> tuple[Any, int]:
                example = info.features.deserialize_example_np(record, decoders=decoders)
                return example[image_key], example[label_key]
        self._pair, self.split = pair, split

    def __len__(self) -> int:
        return len(self._source)

    def close(self) -> None:
        if isinstance(self._source, TfrecordRecords):  # tfds's array_record source closes itself
            self._source.close()

    def __getitems__(self, rows: np.ndarray) -> list[tuple[Any, int]]:
        """The (image, label) pairs at `rows`, read one by one: ~4x cheaper on CIFAR than the data source's
        `__getitems__`, which starts a thread pool per call (the parallelism is our worker threads')."""
        return [self._pair(self._source[int(r)]) for r in rows]


class TfdsSource(RowOrder):
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
    ) -> None:
        """`num_threads` decode images in parallel; 0 = one per CPU core (at most 16)."""
        self.name = cfg.name[len(TFDS_PREFIX):]
        builder = open_builder(self.name, cfg.data_dir)
        import tensorflow_datasets as tfds  # imported by open_builder
        features, keys = builder.info.features, builder.info.supervised_keys
        if not (isinstance(keys, tuple) and len(keys) == 2 and all(isinstance(k, str) for k in keys)):
            if "image" not in features or "label" not in features:
                raise ValueError(f"tfds dataset {builder.name!r} has no supervised (image, label) keys and no "
                                 f"'image' and 'label' features (it has {', '.join(features)})")
            keys = "image", "label"
        image_key, label_key = keys

        shards = 0
        for key in ("train_split", "eval_split"):
            try:
                shards += len(builder.info.splits[cfg[key]].file_instructions)
            except (ValueError, KeyError, AssertionError) as e:
                raise ValueError(f"data.{key}={cfg[key]!r} is not a split of {self.name} (splits: "
                                 f"{', '.join(builder.info.splits)}): {str(e).splitlines()[0]}") from None
        _allow_open_files(shards)
        self._train, self._eval = (_Records(tfds, builder, split, image_key, label_key)
                                   for split in (cfg.train_split, cfg.eval_split))

        stored = tuple(features[image_key].shape)
        self._channels = channels = stored[-1] or 3
        self._small = None not in stored[:2] and stored[0] <= augment.SMALL_IMAGE_MAX_HEIGHT
        self._augment = bool(cfg.augment)
        self.input_shape = (*(stored[:2] if self._small else (cfg.image_size,) * 2), channels)
        mean, std = augment.channel_stats(self.name, channels) if cfg.normalize else ((0,) * channels, (1,) * channels)
        self.device_input = ImageInput(tuple(map(float, mean)), tuple(map(float, std)))

        self.num_classes: int = cfg.num_classes or getattr(features[label_key], "num_classes", 0)
        if not self.num_classes:
            raise ValueError(f"the label feature {label_key!r} of {self.name} has no number of classes; set "
                             "data.num_classes")
        self._seed = seed
        super().__init__(seed=seed, num_train=len(self._train), num_eval=len(self._eval),
                         global_batch_size=global_batch_size, eval_batch_size=eval_batch_size,
                         process_index=process_index, process_count=process_count,
                         train_split=f"the train split {cfg.train_split!r} of {self.name}")
        if self.num_eval == 0:
            raise ValueError(f"the eval split {cfg.eval_split!r} of {self.name} is empty")
        if cfg.cache_decoded_mb < 0:
            raise ValueError(f"data.cache_decoded_mb={cfg.cache_decoded_mb} must be >= 0 (0 = no cache)")
        decoded_mb = (self.num_train + self.num_eval) * math.prod(self.input_shape) / 2**20
        cached = self._small and decoded_mb <= cfg.cache_decoded_mb
        # Decoded small images (pixels, labels, filled), whose pages are touched only as rows are first read.
        self._train_cache, self._eval_cache = ((np.empty((n, *self.input_shape), np.uint8), np.empty(n, np.int32),
                                                np.zeros(n, bool)) if cached else None
                                               for n in (self.num_train, self.num_eval))

        self._threads = num_threads or min(os.cpu_count() or 1, 16)
        self._workers = ThreadPoolExecutor(self._threads, thread_name_prefix="jdp-tfds")

    def _read(self, source: _Records, rows: np.ndarray, params: augment.BatchParams | None = None,
              cache: tuple | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(pixels uint8, labels int32) of `rows`, a chunk per thread; large images cropped by `params` or centred,
        small ones decoded once into `cache` (if any) and then served from it."""
        if cache is not None:
            pixels, labels, filled = cache
            missing = np.unique(rows[~filled[rows]])
            if len(missing):  # written once the workers are done, rows before their flags
                pixels[missing], labels[missing] = self._read(source, missing)
                filled[missing] = True
            return pixels[rows], labels[rows]
        n = len(rows)
        pixels = np.empty((n, *self.input_shape), np.uint8)
        labels = np.empty(n, np.int32)

        def decoded(image: bytes | np.ndarray, i: int) -> np.ndarray:
            if self._small:
                return augment.decode(image, self._channels)
            box = (augment.center_box if params is None
                   else functools.partial(augment.random_resized_box, uniforms=params.uniforms[i]))
            return augment.decode_crop(image, self._channels, box, self.input_shape[0],
                                       params is not None and bool(params.flips[i]))

        def task(lo: int, hi: int) -> None:
            for i, (image, label) in zip(range(lo, hi), source.__getitems__(rows[lo:hi]), strict=True):
                pixels[i] = decoded(image, i)
                labels[i] = label

        tasks = max(1, min(self._threads, n // MIN_ROWS_PER_TASK))
        bounds = np.linspace(0, n, tasks + 1).astype(int)
        if tasks == 1:
            task(0, n)
        else:
            list(self._workers.map(task, bounds[:-1], bounds[1:]))  # waits for every task, raises the first error
        if len(bad := labels[(labels < 0) | (labels >= self.num_classes)]):
            raise DataError(f"split {source.split!r} of {self.name} has label {bad[0]}, outside [0, {self.num_classes})"
                            f" for {self.num_classes} classes; raise data.num_classes above {bad[0]} (0 = from the "
                            "dataset info), or use a labelled split (imagenet2012's test split has none)")
        return pixels, labels

    def train_batch(self, step: int) -> dict[str, np.ndarray]:
        """This process's rows of the train batch at `step`: {'x': uint8 (B/P, H, W, C), 'y'}, plus 'crop' and 'flip'
        for augmented small images."""
        params = (augment.batch_params(self._seed, step, self.global_batch_size, self.train_block)
                  if self._augment else None)
        pixels, labels = self._read(self._train, self.train_rows(step), params, self._train_cache)
        if self._small and params is not None:
            return {"x": pixels, "y": labels, "crop": params.offsets.astype(np.int32), "flip": params.flips}
        return {"x": pixels, "y": labels}

    def _eval_rows(self, ids: np.ndarray, real: np.ndarray) -> dict[str, np.ndarray]:
        n = int(real.sum())  # real rows come first: padding (zeros) is only ever at the end of the split
        pixels = np.zeros((len(ids), *self.input_shape), np.uint8)
        labels = np.zeros(len(ids), np.int32)
        pixels[:n], labels[:n] = self._read(self._eval, ids[:n], cache=self._eval_cache)
        return {"x": pixels, "y": labels}

    def close(self) -> None:
        """Stop the worker threads and close the files (also done at interpreter exit)."""
        self._workers.shutdown(wait=True, cancel_futures=True)
        self._train.close()
        self._eval.close()
