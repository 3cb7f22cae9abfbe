"""The tfds source: prepared tensorflow-datasets copies read by random access, without TensorFlow or network.

Two kinds of data: the committed `tests/fixtures/tfds/tiny_cifar` (PNG-encoded images in array_record files,
like a user's prepared CIFAR-10; written with TensorFlow by tests/fixtures/make_tiny_cifar.py, which also
writes the same records as tfrecord files into `tests/fixtures/tfds_tfrecord`), and datasets
built here by real `tfds.core.GeneratorBasedBuilder`s with `file_format="array_record"` and `Tensor` images,
which need no TensorFlow. Every test reads through `build_source` with `data.name=tfds:NAME`, as a user does.
"""

import json
import logging
import math
import os
import re
import shutil
import socket
import sys
from pathlib import Path

import numpy as np
import pytest

if os.environ.get("CI"):
    import tensorflow_datasets as tfds  # in CI a missing `tfds` extra fails these tests, never skips them
else:
    tfds = pytest.importorskip("tensorflow_datasets")

from jdp.configs import base  # noqa: E402
from jdp.data import TfdsSource, augment, build_source  # noqa: E402
from jdp.data.augment import CROP_PADDING, pad_crop_flip  # noqa: E402
from tests.helpers import max_abs_diff, small_config  # noqa: E402

FIXTURES = Path(__file__).parent / "fixtures" / "tfds"


class _TensorImages(tfds.core.GeneratorBasedBuilder, skip_registration=True):
    """SHAPE uint8 `Tensor` images (written without TensorFlow) with NUM_CLASSES labels, SIZES per split."""

    VERSION = tfds.core.Version("1.0.0")
    SHAPE: tuple[int, int, int]
    NUM_CLASSES: int
    SIZES: dict[str, int]

    def _info(self):
        return tfds.core.DatasetInfo(
            builder=self,
            features=tfds.features.FeaturesDict({
                "image": tfds.features.Tensor(shape=self.SHAPE, dtype=np.uint8),
                "label": tfds.features.ClassLabel(num_classes=self.NUM_CLASSES),
            }),
            supervised_keys=("image", "label"),
        )

    def _split_generators(self, dl_manager):
        return {split: self._generate_examples(split) for split in self.SIZES}


class JdpIds(_TensorImages):
    """8x8x3 images whose first two pixels spell the example's id (id % 200, id // 200); labels id % 5."""

    SHAPE, NUM_CLASSES, SIZES = (8, 8, 3), 5, {"train": 100, "test": 37}

    def _generate_examples(self, split):
        offset = 0 if split == "train" else 1000
        for i in range(self.SIZES[split]):
            ident = offset + i
            image = np.full(self.SHAPE, 7, np.uint8)
            image[0, 0, 0], image[0, 0, 1] = ident % 200, ident // 200
            yield ident, {"image": image, "label": ident % 5}


class JdpLarge(_TensorImages):
    """ImageNet-like regime (taller than 64 px, so random-resized crops): 80x96 smooth random images."""

    SHAPE, NUM_CLASSES, SIZES = (80, 96, 3), 3, {"train": 24, "test": 10}

    def _generate_examples(self, split):
        rng = np.random.default_rng(0 if split == "train" else 1)
        ramp = np.linspace(0, 200, 96)[None, :, None]
        for i in range(self.SIZES[split]):
            image = (ramp + rng.integers(0, 50, (80, 1, 3))).astype(np.uint8)
            yield i, {"image": image, "label": i % 3}


def _build(builder_cls, data_dir: Path) -> None:
    sys_had_tf = "tensorflow" in sys.modules
    builder_cls(data_dir=str(data_dir), file_format="array_record").download_and_prepare()
    assert sys_had_tf or "tensorflow" not in sys.modules  # built without TensorFlow


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A temporary data_dir holding a copy of tiny_cifar and the two datasets built here."""
    tfds.disable_progress_bar()
    root = tmp_path_factory.mktemp("tfds")
    shutil.copytree(FIXTURES / "tiny_cifar", root / "tiny_cifar")
    _build(JdpIds, root)
    _build(JdpLarge, root)
    return root


@pytest.fixture
def make(data_dir: Path):
    """make(NAME, **data_overrides, batch=, eval_batch=, p=, count=, seed=, threads=) -> a TfdsSource,
    closed after."""
    made = []

    def factory(name: str, *, batch: int = 16, eval_batch: int = 16, p: int = 0, count: int = 1, seed: int = 0,
                threads: int = 0, **data) -> TfdsSource:
        cfg = base.get_config().data
        cfg.update({"name": f"tfds:{name}", "data_dir": str(data_dir), **data})
        if threads:  # build_source picks the thread count itself
            source = TfdsSource(cfg, seed=seed, global_batch_size=batch, eval_batch_size=eval_batch,
                                process_index=p, process_count=count, num_threads=threads)
        else:
            source = build_source(cfg, seed=seed, global_batch_size=batch, eval_batch_size=eval_batch,
                                  process_index=p, process_count=count)
        made.append(source)
        return source

    yield factory
    for source in made:
        source.close()


def _ids(batch: dict) -> np.ndarray:
    """The example ids of a jdp_ids batch read with augment=False (x = the stored pixels)."""
    pixels = batch["x"][:, 0, 0, :2].astype(int)
    return pixels[:, 0] + 200 * pixels[:, 1]


def _model_input(source: TfdsSource, batch: dict) -> np.ndarray:
    """What the model sees: the batch prepared as the compiled step prepares it, on the device."""
    return np.asarray(source.device_input(batch)["x"])


def _assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        np.testing.assert_array_equal(a[key], b[key])


PLAIN = dict(normalize=False, augment=False)


def test_prepared_cifar_like_fixture_reads_without_tensorflow(make) -> None:
    source = make("tiny_cifar", batch=32)
    assert isinstance(source, TfdsSource)
    shapes = (source.input_shape, source.num_classes, source.num_train, source.num_eval, source.steps_per_epoch)
    assert shapes == ((32, 32, 3), 10, 200, 50, 6)
    batch = source.train_batch(0)
    assert batch["x"].shape == (32, 32, 32, 3) and batch["x"].dtype == np.uint8
    assert batch["y"].shape == (32,) and batch["y"].dtype == np.int32
    assert batch["y"].min() >= 0 and batch["y"].max() < 10
    x = _model_input(source, batch)
    assert x.shape == (32, 32, 32, 3) and x.dtype == np.float32 and np.isfinite(x).all()
    assert "tensorflow" not in sys.modules
    assert make("tiny_cifar", num_classes=12).num_classes == 12  # the config wins over the dataset info
    with pytest.raises(ValueError, match=r"split 'train' of tiny_cifar has label \d+, outside \[0, 3\) for 3 classes"):
        make("tiny_cifar", num_classes=3).train_batch(0)


def test_png_pixels_decode_exactly(make, data_dir) -> None:
    """Unaugmented, unnormalised eval rows are the stored PNGs' pixels, as tfds itself decodes them."""
    source = make("tiny_cifar", eval_batch=50, **PLAIN)
    (batch,) = source.eval_batches()
    reference = tfds.data_source("tiny_cifar", split="test", data_dir=str(data_dir), download=False)
    expected = np.stack([reference[i]["image"] for i in range(50)])
    np.testing.assert_array_equal(batch["x"], expected)
    np.testing.assert_array_equal(batch["y"], [reference[i]["label"] for i in range(50)])


@pytest.mark.parametrize("decoder", ["pil", "opencv"])
def test_decode_converts_modes(decoder: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import io

    from PIL import Image

    if decoder == "opencv":
        pytest.importorskip("cv2")
    else:
        monkeypatch.setattr(augment, "_opencv", lambda: None)
    rgb = np.random.default_rng(0).integers(0, 256, (5, 7, 3), dtype=np.uint8)

    def png(array: np.ndarray, mode: str) -> bytes:
        buffer = io.BytesIO()
        Image.fromarray(array).convert(mode).save(buffer, format="PNG")
        return buffer.getvalue()

    np.testing.assert_array_equal(augment.decode(png(rgb, "RGB"), 3), rgb)
    np.testing.assert_array_equal(augment.decode(png(rgb, "RGBA"), 3), rgb)  # alpha dropped
    gray = np.asarray(Image.fromarray(rgb).convert("L"))
    np.testing.assert_array_equal(augment.decode(png(rgb, "L"), 1), gray[..., None])
    np.testing.assert_array_equal(augment.decode(png(rgb, "L"), 3), np.repeat(gray[..., None], 3, axis=2))
    assert augment.decode(png(rgb, "RGB"), 1).shape == (5, 7, 1)
    np.testing.assert_array_equal(augment.decode(rgb, 3), rgb)  # already decoded (tfds Tensor features)


def _jpeg(height: int, width: int, seed: int = 0) -> bytes:
    """A photo-like JPEG: ramps across and down (red, green), smooth blobs (blue), mild noise."""
    import io

    from PIL import Image

    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    rng = np.random.default_rng(seed)
    blobs = sum(np.sin(x / rng.uniform(8, 40) + rng.uniform(0, 6)) * np.cos(y / rng.uniform(8, 40)) for _ in range(4))
    rgb = np.stack([255 * x / width, 255 * y / height, 128 + 30 * blobs], -1) + rng.normal(0, 4, (height, width, 3))
    buffer = io.BytesIO()
    Image.fromarray(np.clip(rgb, 0, 255).astype(np.uint8)).save(buffer, format="JPEG", quality=90)
    return buffer.getvalue()


@pytest.mark.parametrize("decoder", ["pil", "opencv"])
def test_reduced_jpeg_decoding_keeps_the_crop(decoder: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A JPEG whose crop box is k times the output size is decoded at 1/k (k = 2, 4, 8) and gives the crop of
    the full decode up to resampling noise. Fails if the box is not scaled to the smaller image (the ramps
    move by tens of levels) or if the reduced decode is not used."""
    if decoder == "opencv":
        pytest.importorskip("cv2")
    else:
        monkeypatch.setattr(augment, "_opencv", lambda: None)
    value, size = _jpeg(375, 500), 32
    full = augment.decode(value, 3)
    reduced_calls = []
    decode = augment.decode
    monkeypatch.setattr(augment, "decode", lambda v, c, k=1: (k > 1 and reduced_calls.append(k)) or decode(v, c, k))
    for box, k in [((10, 20, 90, 100), 2), ((100, 30, 240, 250), 4), ((0, 0, 500, 375), 8), ((37, 11, 99, 70), 1)]:
        assert augment.reduction(box, size) == k
        for flip in (False, True):
            got = augment.decode_crop(value, 3, lambda h, w, box=box: box, size, flip).astype(np.float32)
            want = augment.resize_box(full, box, size, flip).astype(np.float32)
            assert got.shape == (size, size, 3)
            assert np.abs(got - want).mean() < 2.5 and np.abs(got - want).max() < 40, (box, k)
    assert reduced_calls == [2, 2, 4, 4, 8, 8]
    gray = augment.decode_crop(value, 1, augment.center_box, size, False)
    assert gray.shape == (size, size, 1)


def test_splits_and_slicing(make) -> None:
    source = make("jdp_ids", train_split="train[:80%]", eval_split="train[80%:]", **PLAIN)
    assert (source.num_train, source.num_eval) == (80, 20)
    train = np.concatenate([_ids(source.train_batch(s)) for s in range(source.steps_per_epoch)])
    held_out = np.concatenate([_ids(b)[b["mask"] == 1] for b in source.eval_batches()])
    assert not set(train) & set(held_out)
    with pytest.raises(ValueError, match="validation.*splits: train, test"):
        make("jdp_ids", eval_split="validation")


def test_same_seed_same_batches_any_thread_count(make) -> None:
    a, b = make("tiny_cifar", seed=3), make("tiny_cifar", seed=3)
    c = make("tiny_cifar", seed=4)
    for step in (0, 5, 13, 2):
        _assert_same(a.train_batch(step), b.train_batch(step))
    assert not np.array_equal(a.train_batch(0)["y"], c.train_batch(0)["y"])
    one, four = (make("jdp_large", batch=8, image_size=32, threads=n) for n in (1, 4))
    np.testing.assert_array_equal(one.train_batch(1)["x"], four.train_batch(1)["x"])


def test_resume_equals_an_uninterrupted_read(make) -> None:
    """Reading from step k on (a fresh source, as after a restart) continues the uninterrupted read exactly."""
    whole = make("tiny_cifar")
    expected = [whole.train_batch(step) for step in range(20)]  # crosses epochs (12 steps each)
    resumed = make("tiny_cifar")
    for step in range(9, 20):
        _assert_same(resumed.train_batch(step), expected[step])
    out_of_order = make("tiny_cifar")  # random access, in any order (a restore jumps to its step)
    for step in (4, 4, 17, 3, 12, 13):
        _assert_same(out_of_order.train_batch(step), expected[step])


@pytest.mark.parametrize("step", [0, 5, 6, 13])
def test_processes_read_disjoint_blocks_of_one_global_batch(make, step: int) -> None:
    whole = _ids(make("jdp_ids", **PLAIN).train_batch(step))
    assert len(set(whole)) == 16
    for count in (1, 2, 4):
        blocks = [_ids(make("jdp_ids", p=p, count=count, **PLAIN).train_batch(step)) for p in range(count)]
        assert all(len(b) == 16 // count for b in blocks)
        np.testing.assert_array_equal(np.concatenate(blocks), whole)  # disjoint, in order, the same batch


def test_augmented_global_batch_does_not_depend_on_the_process_count(make) -> None:
    whole = make("tiny_cifar").train_batch(7)
    for count in (2, 4):
        parts = [make("tiny_cifar", p=p, count=count).train_batch(7) for p in range(count)]
        _assert_same({k: np.concatenate([b[k] for b in parts]) for k in whole}, whole)


def test_an_epoch_visits_each_row_at_most_once(make) -> None:
    source = make("jdp_ids", **PLAIN)
    assert source.steps_per_epoch == 6
    for epoch in range(2):
        ids = np.concatenate([_ids(source.train_batch(epoch * 6 + i)) for i in range(6)])
        assert len(np.unique(ids)) == 96 and ids.max() < 100
    assert not np.array_equal(_ids(source.train_batch(0)), _ids(source.train_batch(6)))


@pytest.mark.parametrize("count", [1, 2, 4])
def test_eval_covers_the_split_once_in_every_process(make, count: int) -> None:
    per_process = [list(make("jdp_ids", eval_batch=8, p=p, count=count, **PLAIN).eval_batches())
                   for p in range(count)]
    assert all(len(batches) == math.ceil(37 / 8) == 5 for batches in per_process)
    seen = []
    for i in range(5):
        items = [batches[i] for batches in per_process]
        assert all(it["x"].shape == (8 // count, 8, 8, 3) and it["mask"].dtype == np.float32 for it in items)
        mask = np.concatenate([it["mask"] for it in items])
        np.testing.assert_array_equal(mask, np.arange(i * 8, (i + 1) * 8) < 37)
        seen.extend(np.concatenate([_ids(it) for it in items])[mask == 1])
    assert sorted(seen) == list(range(1000, 1037))


def test_eval_is_deterministic(make) -> None:
    for name in ("tiny_cifar", "jdp_large"):
        source = make(name, image_size=32)
        first, second = list(source.eval_batches()), list(source.eval_batches())
        assert len(first) == source.num_eval_batches()
        for a, b in zip(first, second, strict=True):
            np.testing.assert_array_equal(a["x"], b["x"])
        source.train_batch(0)  # a train read in between changes nothing
        np.testing.assert_array_equal(next(source.eval_batches())["x"], first[0]["x"])


def test_small_image_augmentation(make) -> None:
    plain, augmented = make("tiny_cifar", augment=False), make("tiny_cifar")
    a, b = plain.train_batch(2), augmented.train_batch(2)
    assert a.keys() == {"x", "y"} and b.keys() == {"x", "y", "crop", "flip"}
    np.testing.assert_array_equal(a["x"], b["x"])  # the same rows, as stored: augmented on the device
    np.testing.assert_array_equal(a["y"], b["y"])
    xa, xb = _model_input(plain, a), _model_input(augmented, b)
    assert xb.shape == (16, 32, 32, 3) and np.isfinite(xb).all()
    mean, std = augment.channel_stats("tiny_cifar", 3)
    assert (xb >= -mean / std - 1e-6).all() and (xb <= (1 - mean) / std + 1e-6).all()
    np.testing.assert_allclose(xa, (a["x"] / 255 - mean) / std, atol=1e-6)
    moved = (b["crop"] != CROP_PADDING).any(axis=1) | b["flip"]
    np.testing.assert_array_equal(np.abs(xa - xb).max(axis=(1, 2, 3)) > 0, moved)
    assert moved.sum() > 8  # most rows are moved or mirrored

    params = augment.batch_params(0, 2, 4096)
    assert 0.4 < params.flips.mean() < 0.6
    assert set(np.unique(params.offsets)) == set(range(2 * CROP_PADDING + 1))


def test_pad_crop_flip_on_the_device() -> None:
    image = np.arange(10 * 12, dtype=np.uint8).reshape(10, 12, 1) + 1
    p = CROP_PADDING
    padded = np.pad(image, ((p, p), (p, p), (0, 0)))
    offsets = [(p, p), (0, 0), (0, 2 * p), (2 * p, 1), (3, 5)]
    images = np.stack([image] * len(offsets) * 2)
    at = np.array(offsets * 2, np.int32)
    flips = np.repeat([False, True], len(offsets))
    out = np.asarray(pad_crop_flip(images, at, flips))
    for i, (dy, dx) in enumerate(offsets * 2):
        window = padded[dy : dy + 10, dx : dx + 12]
        np.testing.assert_array_equal(out[i], window[:, ::-1] if flips[i] else window)
    np.testing.assert_array_equal(out[0], image)  # the centre window is the image itself


def test_decoded_images_are_cached_and_change_nothing(make, monkeypatch: pytest.MonkeyPatch) -> None:
    cached, uncached = (make("tiny_cifar", batch=40, cache_decoded_mb=mb) for mb in (1, 0))
    decodes = []
    real_decode = augment.decode
    monkeypatch.setattr(augment, "decode", lambda *a: decodes.append(1) or real_decode(*a))
    for step in range(12):  # 5 steps per epoch: every row is read more than once
        _assert_same(cached.train_batch(step), uncached.train_batch(step))
    for a, b in zip(cached.eval_batches(), uncached.eval_batches(), strict=True):
        _assert_same(a, b)
    assert len(decodes) == (12 * 40 + 50) + (200 + 50)  # the cached source decoded each row once
    assert cached._train_cache is not None and uncached._train_cache is None  # 250 images = 0.7 MiB
    with pytest.raises(ValueError, match="cache_decoded_mb=-1"):
        make("tiny_cifar", cache_decoded_mb=-1)


def test_large_image_random_resized_crop_and_centre_crop(make) -> None:
    source = make("jdp_large", image_size=40)
    assert source.input_shape == (40, 40, 3)
    batch = source.train_batch(0)
    assert batch.keys() == {"x", "y"} and batch["x"].shape == (16, 40, 40, 3)  # cropped on the host
    x = _model_input(source, batch)
    assert np.isfinite(x).all() and (np.abs(x) <= 1 + 1e-6).all()  # 0.5/0.5 normalisation of [0, 1]
    evaluated = next(source.eval_batches())
    assert evaluated["x"].shape == (16, 40, 40, 3)
    # The eval crop is the centre square of side 0.875 * 80 = 70 of the 80x96 image, resized to 40x40.
    box = augment.center_box(80, 96)
    assert box == pytest.approx((13, 5, 83, 75))

    rng = np.random.default_rng(0)
    for _ in range(2000):
        height, width = (int(v) for v in rng.integers(20, 400, 2))
        left, top, right, bottom = augment.random_resized_box(height, width, rng.random(2 * augment.RRC_TRIES + 2))
        assert 0 <= left < right <= width and 0 <= top < bottom <= height
    # With every try failing (scale 1, extreme ratios), the fallback is the centre crop clamped to 4/3.
    assert augment.random_resized_box(100, 400, np.r_[np.ones(10) - 1e-9, np.zeros(10), 0.5, 0.5]) == (
        133, 0, 266, 100)


def test_flip_is_visible_on_large_images(make) -> None:
    """Rows flipped by the batch parameters are mirrored: the ramp in the stored images runs the other way."""
    source = make("jdp_large", image_size=16)
    batch = source.train_batch(1)
    flips = augment.batch_params(0, 1, 16).flips
    slope = batch["x"][..., 0].mean(axis=1, dtype=np.float32)  # (16, W): the left-to-right ramp, averaged over rows
    rising = slope[:, -1] > slope[:, 0]
    np.testing.assert_array_equal(rising, ~flips)
    assert 0 < flips.sum() < 16


def test_an_unprepared_dataset_is_one_clear_error_without_network(make, data_dir, monkeypatch, tmp_path,
                                                                    caplog) -> None:
    def no_network(*args: object) -> None:
        raise AssertionError("tried the network")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    for name in ("cifar10", "not_a_tfds_dataset"):  # a registered builder, and an unknown name
        where = re.escape(str(tmp_path))
        with pytest.raises(ValueError, match=rf"'{name}' is not prepared \(searched: {where}\).*"
                                             rf"tfds build {name} --data_dir={where} --file_format=array_record"):
            make(name, data_dir=str(tmp_path))
    with pytest.raises(ValueError, match="does not exist"):
        make("cifar10", data_dir=str(tmp_path / "missing"))
    monkeypatch.setenv("TFDS_DATA_DIR", str(tmp_path))  # tfds's default: it logged "Variant folder ... has no
    with caplog.at_level(logging.WARNING, logger="absl"), pytest.raises(ValueError, match="is not prepared"):
        make("cifar10", data_dir="")  # dataset_info.json" beside jdp's one line
    assert not [r for r in caplog.records if r.name == "absl"]
    with pytest.raises(ValueError, match=r"^data.name=tfds:tiny-cifar: Parsing builder name string tiny-cifar "
                                         r"failed. Give tfds:NAME\[/CONFIG\]\[:VERSION\], e.g. tfds:cifar10") as bad:
        make("tiny-cifar", data_dir=str(tmp_path))
    assert "\n" not in str(bad.value)  # tfds's explanation of the format was 17 lines


TFRECORD_FIXTURES = FIXTURES.parent / "tfds_tfrecord"  # the same records, in tfds's default tfrecord files


@pytest.mark.parametrize("count", [1, 2])
def test_a_tfrecord_copy_gives_the_same_batches_as_the_array_record_copy(make, count: int) -> None:
    """Breaks if the frame index is off by one record or a byte, or ignores a split's slice."""
    def pair(**data):
        return [(make("tiny_cifar", batch=16, p=p, count=count, seed=4, **data),
                 make("tiny_cifar", batch=16, p=p, count=count, seed=4, data_dir=str(TFRECORD_FIXTURES), **data))
                for p in range(count)]

    for array_record, tfrecord in pair(train_split="train[10%:90%]", eval_split="test[-7:]"):
        assert tfrecord.num_train == array_record.num_train == 160 and tfrecord.num_eval == 7
        for step in (0, 1, 9, 10):  # 10 steps per epoch: 9 and 10 straddle an epoch boundary
            a, b = array_record.train_batch(step), tfrecord.train_batch(step)
            assert np.array_equal(a["x"], b["x"]) and np.array_equal(a["y"], b["y"])
        for a, b in zip(array_record.eval_batches(), tfrecord.eval_batches(), strict=True):
            assert all(np.array_equal(a[k], b[k]) for k in a)
    assert "tensorflow" not in sys.modules


def test_tfrecord_rows_are_the_records_tfds_load_streams() -> None:
    """The rows read by step are, in order, what `tfds.load` gives (needs TensorFlow, so CI skips it)."""
    pytest.importorskip("tensorflow")
    from jdp.data.tfds_source import _Records, open_builder

    builder = open_builder("tiny_cifar", str(TFRECORD_FIXTURES))
    records = _Records(tfds, builder, "train[5:45]", "image", "label")
    loaded = tfds.load("tiny_cifar", split="train[5:45]", data_dir=str(TFRECORD_FIXTURES), download=False,
                       shuffle_files=False, decoders={"image": tfds.decode.SkipDecoding()})
    expected = [(ex["image"], int(ex["label"])) for ex in tfds.as_numpy(loaded)]
    assert records.__getitems__(np.arange(len(records))) == expected and len(expected) == 40


def test_a_damaged_or_missing_tfrecord_file_is_one_clear_error(make, tmp_path) -> None:
    shutil.copytree(TFRECORD_FIXTURES / "tiny_cifar", tmp_path / "tiny_cifar")
    train = next((tmp_path / "tiny_cifar" / "1.0.0").glob("*-train.tfrecord-*"))
    train.write_bytes(train.read_bytes()[:-100])
    with pytest.raises(ValueError, match=r"^\S+-train\.tfrecord-\S+ is truncated .*prepare the dataset again$"):
        make("tiny_cifar", data_dir=str(tmp_path))
    train.unlink()
    with pytest.raises(ValueError, match=r"^cannot open \S+-train\.tfrecord-\S+ \(No such file or directory\); "
                                         "copy or prepare the dataset again$"):
        make("tiny_cifar", data_dir=str(tmp_path))


def test_tfrecord_rows_span_files_and_their_slices(tmp_path) -> None:
    """Row i of a split is the i-th record of its files' [skip, skip + take) slices, in order."""
    import struct
    from types import SimpleNamespace

    from jdp.data.tfrecord import TfrecordRecords

    def write(path: Path, records: list[bytes]) -> None:  # tfrecord frames; the reader does not check CRCs
        path.write_bytes(b"".join(struct.pack("<Q", len(r)) + b"crc!" + r + b"crc!" for r in records))

    files = {"a": [b"a0", b"a1-longer", b"", b"a3"], "b": [b"b0", b"b1"], "c": [b"c0" * 50, b"c1", b"c2"]}
    for name, records in files.items():
        write(tmp_path / name, records)
    slices = [("a", 1, 3), ("b", 0, 2), ("c", 2, 1)]
    records = TfrecordRecords([SimpleNamespace(filename=tmp_path / name, skip=skip, take=take,
                                               examples_in_shard=len(files[name])) for name, skip, take in slices])
    assert len(records) == 6
    assert [records[i] for i in range(6)] == [b"a1-longer", b"", b"a3", b"b0", b"b1", b"c2"]
    records.close()
    records.close()  # closing twice is harmless


def test_the_compiled_steps_see_the_prepared_input() -> None:
    """Train and eval losses are those of the model on `device_input(batch)`: breaks if the step fed the
    model the raw uint8 pixels (flax would promote them) or skipped the crop and flip."""
    import jax.numpy as jnp
    import optax

    from jdp.cli.train import build
    from tests.helpers import logits_and_state

    cfg = small_config("tiny_cifar", backend="jit", num_devices=1)
    b = build(cfg)
    state = b.parallel.to_devices(b.init_state())
    logical = b.parallel.to_host(b.parallel.to_logical(state))
    train, evaluate = b.source.train_batch(0), next(b.source.eval_batches())
    assert "crop" in train

    def loss(batch: dict, training: bool):
        x = jnp.asarray(b.source.device_input(batch)["x"])
        logits, _ = logits_and_state(b.model, logical.params, logical.model_state, x, train=training)
        return optax.softmax_cross_entropy_with_integer_labels(logits, jnp.asarray(batch["y"]))

    _, metrics = b.parallel.train_step(state, b.parallel.shard_batch(train))
    np.testing.assert_allclose(float(b.parallel.fetch(metrics)["loss"]), float(loss(train, True).mean()),
                               rtol=1e-5)
    sums = b.parallel.fetch(b.parallel.eval_step(state, b.parallel.shard_batch(evaluate)))
    np.testing.assert_allclose(sums["loss"], float((loss(evaluate, False) * evaluate["mask"]).sum()),
                               rtol=1e-5)
    b.source.close()


def test_a_format_without_random_access_is_refused_with_the_fix(make, tmp_path) -> None:
    copy = tmp_path / "tiny_cifar"
    shutil.copytree(FIXTURES / "tiny_cifar", copy)
    info_path = copy / "1.0.0" / "dataset_info.json"
    info = json.loads(info_path.read_text())
    info["fileFormat"] = "riegeli"
    info_path.write_text(json.dumps(info))
    with pytest.raises(ValueError, match="stored as riegeli.*--file_format=array_record"):
        make("tiny_cifar", data_dir=str(tmp_path))


def test_the_trainer_turns_it_into_a_one_line_config_error(tmp_path, capsys) -> None:
    from jdp.cli.train import main

    code = main(["--config.data.name=tfds:cifar10", f"--config.data.data_dir={tmp_path}",
                 f"--workdir={tmp_path / 'run'}", "--config.compile_cache_dir="])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "tfds build cifar10" in err


@pytest.fixture(scope="module")
def one_device_run(tmp_path_factory):
    from jdp.cli.train import run

    return run(small_config("tiny_cifar", backend="jit", num_devices=1, steps=3), tmp_path_factory.mktemp("one"))


def test_trains_end_to_end_on_the_fixture(one_device_run) -> None:
    assert len(one_device_run.losses) == 3 and np.isfinite(one_device_run.losses).all()
    assert np.isfinite(one_device_run.eval_loss) and 0 <= one_device_run.eval_accuracy <= 1


@pytest.mark.parametrize("backend", ["shard_map", "pmap", "jit"])
@pytest.mark.slow
def test_augmented_training_on_8_devices_equals_1_device(backend: str, one_device_run, tmp_path) -> None:
    """Crops, flips and normalisation run on each device's rows: breaks if 'crop' and 'flip' were not split
    with the pixels, or if a device augmented with another device's numbers."""
    from jdp.cli.train import run

    result = run(small_config("tiny_cifar", backend=backend, num_devices=8, steps=3), tmp_path)
    np.testing.assert_allclose(result.losses, one_device_run.losses, rtol=1e-4)
    assert max_abs_diff(result.params, one_device_run.params) < 1e-5


def test_a_label_past_num_classes_exits_2_in_one_line(tmp_path, capsys) -> None:
    """Found where the labels are first read (before anything compiles), naming the label, the class count and the
    split."""
    from jdp.cli.train import main
    from tests.helpers import TINY_CIFAR

    code = main(["--config", "synthetic_cnn2d", "--config.data.name=tfds:tiny_cifar",
                 f"--config.data.data_dir={TINY_CIFAR}", "--config.data.num_classes=3",
                 "--config.train.global_batch_size=32", "--workdir", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert re.match(r"jdp: error: split 'train' of tiny_cifar has label \d, outside \[0, 3\) for 3 classes; raise "
                    r"data.num_classes above \d", err), err
