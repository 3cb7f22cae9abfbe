"""Checkpoints, exact resume and failure handling."""

import asyncio
import errno
import functools
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import optax
import pytest
import tensorstore as ts
from flax import nnx

from jdp import checkpoint as checkpoint_lib
from jdp import digest, params_file, storage
from jdp.checkpoint import Checkpointer, CheckpointError
from jdp.cli import config as config_lib
from jdp.cli import export, resume
from jdp.cli.build import build
from jdp.cli.optim import learning_rate
from jdp.cli.train import main, run
from jdp.data.batching import Batcher
from jdp.errors import DiskError
from jdp.parallel import DataParallel
from jdp.trainer import FitOptions, prepare
from tests.helpers import records, small_config, train_losses

# A short MLP run with a checkpoint every 4 steps, as a user would type it.
RUN = ["--config", "configs/mnist1d_mlp.py", "--config.model.kwargs.hidden_sizes=(32,)", "--config.train.steps=12",
       "--config.train.log_every=1", "--config.train.eval_every=6", "--config.checkpoint.every_steps=4"]
ENV = {**os.environ, "JAX_NUM_CPU_DEVICES": "2"}
ROOT = Path(__file__).resolve().parents[1]


def train(workdir, *args, env=None, timeout=120):
    return subprocess.run([sys.executable, "-m", "jdp.train", "--workdir", str(workdir), *args],
                          capture_output=True, text=True, timeout=timeout, env={**ENV, **(env or {})})


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run's workdir."""
    workdir = tmp_path_factory.mktemp("uninterrupted")
    out = train(workdir, *RUN)
    assert out.returncode == 0, out.stderr
    return workdir


@pytest.fixture(scope="module")
def uninterrupted(reference):
    return train_losses(reference)


@pytest.mark.parametrize("kill_at", ["step:7", "save:8"])
@pytest.mark.slow
def test_a_killed_run_resumes_bitwise(kill_at, uninterrupted, tmp_path):
    """SIGKILL right after step 7, or in the middle of writing checkpoint 8: the rerun (with only
    --workdir, so WORKDIR/config.json is used) resumes from the last complete checkpoint."""
    out = train(tmp_path, *RUN, env={"JDP_KILL_AT": kill_at})
    assert out.returncode == -signal.SIGKILL
    out = train(tmp_path)
    assert out.returncode == 0, out.stderr
    assert "resumed from" in out.stdout and "checkpoints/4" in out.stdout
    assert train_losses(tmp_path) == uninterrupted  # bitwise, and no duplicate steps
    assert "WARNING:absl" not in out.stderr  # orbax's "temporary directory ... already exists" of the cut save


@pytest.mark.slow
def test_a_real_kill_at_an_arbitrary_moment(tmp_path):
    args = [*RUN, "--config.train.steps=400", "--config.checkpoint.every_steps=50", "--config.train.eval_every=400"]
    reference = tmp_path / "reference"
    assert train(reference, *args).returncode == 0
    proc = subprocess.Popen([sys.executable, "-m", "jdp.train", "--workdir", str(tmp_path / "run"), *args],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=ENV)
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "run" / "checkpoints" / "50").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.13)
        proc.kill()
    finally:
        proc.wait(timeout=30)
    assert (tmp_path / "run" / "checkpoints" / "50").exists()  # the kill came after the first checkpoint
    out = train(tmp_path / "run")
    assert out.returncode == 0, out.stderr
    assert train_losses(tmp_path / "run") == train_losses(reference)


@pytest.mark.slow
def test_a_crash_campaign_of_three_kills():
    """benchmarks/crash_campaign.py, small: one run killed three times at seeded moments (seed 1: twice during a save,
    once from outside), then rerun and compared bitwise with an uninterrupted run; and two of its tampered-checkpoint
    cases: a later step's name, and a flipped bit in the settings' fingerprint (the others are the tests above)."""
    out = subprocess.run([sys.executable, "benchmarks/crash_campaign.py", "--kills", "3", "--kills_per_run", "3",
                          "--seed", "1", "--steps", "12", "--tampers", "renamed,fingerprint"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300, env=ENV)
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    assert out.stdout.splitlines()[-4:] == ["survived 3 / tried 3", "tampered checkpoint 99 (renamed): survived",
                                            "tampered checkpoint 12 (fingerprint): survived",
                                            "tampered: survived 2 / tried 2"]


@pytest.mark.slow
def test_sigterm_checkpoints_and_exits_75(tmp_path):
    args = [*RUN, "--config.train.steps=100000", "--config.checkpoint.every_steps=0"]
    proc = subprocess.Popen([sys.executable, "-m", "jdp.train", "--workdir", str(tmp_path), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "metrics.jsonl").exists() or len(train_losses(tmp_path)) < 20:
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 75, err
    assert "preempted: SIGTERM at step" in err and "checkpoint written to" in err
    step = int(err.split("SIGTERM at step ")[1].split(":")[0])
    assert (tmp_path / "checkpoints" / str(step)).is_dir()
    out = train(tmp_path, f"--config.train.steps={step + 2}")
    assert out.returncode == 0, out.stderr
    assert f"resumed from {tmp_path / 'checkpoints' / str(step)}" in out.stdout
    assert "jdp: warning: steps changed from 100000" in out.stderr
    assert [s for s, _ in train_losses(tmp_path)][-3:] == [step, step + 1, step + 2]


def evals(workdir):
    return [(r["step"], r["loss"], r["accuracy"]) for r in records(workdir, "eval")]


def _change_a_stored_value(checkpoint):
    """Rewrites one value of the stored first kernel through tensorstore (the store orbax writes): the checkpoint
    stays readable and consistent, with a wrong value, as flipped bits in its data file can leave it."""
    import tensorstore as ts

    kernel = ts.open({"driver": "zarr", "kvstore": {"driver": "ocdbt", "base": f"file://{checkpoint / 'state'}",
                                                    "path": "params.layers.0.kernel/"}}).result()
    kernel[3, 5].write(kernel[3, 5].read().result() + 1).result()


@pytest.mark.slow
def test_a_damaged_checkpoint_is_moved_aside_and_saved_anew(reference, tmp_path):
    shutil.copytree(reference, tmp_path, dirs_exist_ok=True)
    damaged = tmp_path / "checkpoints" / "12"
    _change_a_stored_value(damaged)  # the final checkpoint: without digests it restores without complaint
    out = train(tmp_path)  # the same run again
    assert out.returncode == 0, out.stderr
    assert out.stderr.splitlines() == [  # a handled fallback: jdp's warnings on stderr, nothing else
        f"jdp: warning: checkpoint {damaged} is unusable: the digest of .params['layers'][0]['kernel'] does not "
        "match the one saved with it (damaged bytes); trying the previous one",
        f"jdp: warning: moved the damaged checkpoint {damaged} to {tmp_path / 'rejected' / '12'}"]
    assert "warning" not in out.stdout and "resumed from" in out.stdout and "checkpoints/8" in out.stdout
    assert train_losses(tmp_path) == train_losses(reference)  # steps 9-12 trained again, bitwise
    assert evals(tmp_path) == evals(reference)
    out = train(tmp_path)  # step 12 was saved anew: nothing to do, nothing unusable
    assert out.returncode == 0 and "nothing to do" in out.stdout and "unusable" not in out.stdout, out.stdout

    for step in ("4", "8", "12"):
        for path in (tmp_path / "checkpoints" / step).rglob("*"):
            if path.is_file():
                path.unlink()
    out = train(tmp_path, "--config.train.steps=20")
    assert out.returncode == 2
    assert f"no usable checkpoint in {tmp_path / 'checkpoints'}" in out.stderr and "Traceback" not in out.stderr
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["12", "4", "8"]  # none usable: none moved


def _tamper(reference, workdir, *commands):
    """A copy of the reference run with `commands` (shell, run in its checkpoints directory) applied."""
    shutil.copytree(reference, workdir, dirs_exist_ok=True)
    for command in commands:
        subprocess.run(command, shell=True, cwd=workdir / "checkpoints", check=True)
    return workdir / "checkpoints"


@pytest.mark.slow
def test_a_copied_or_renamed_checkpoint_is_moved_aside_and_trained_again(reference, tmp_path):
    """The step a checkpoint holds, not its directory's name, says where the run is: checkpoint 12 renamed to 99
    (steps 13-99 were never trained) and checkpoint 4 copied over 8 are both named, moved aside, and the run goes on
    from 4, bitwise as the uninterrupted run; a handled fallback prints no traceback."""
    checkpoints = _tamper(reference, tmp_path, "mv 12 99", "rm -r 8 && cp -a 4 8")
    out = train(tmp_path)
    assert out.returncode == 0, out.stderr
    rejected = tmp_path / "rejected"
    assert out.stderr.splitlines() == [
        f"jdp: warning: checkpoint {checkpoints / '99'} is unusable: it holds step 12, not step 99 as its directory's "
        "name says: a checkpoint copied or renamed from another step; trying the previous one",
        f"jdp: warning: checkpoint {checkpoints / '8'} is unusable: it holds step 4, not step 8 as its directory's "
        "name says: a checkpoint copied or renamed from another step; trying the previous one",
        f"jdp: warning: moved the damaged checkpoint {checkpoints / '99'} to {rejected / '99'}",
        f"jdp: warning: moved the damaged checkpoint {checkpoints / '8'} to {rejected / '8'}"]
    assert f"resumed from {checkpoints / '4'}" in out.stdout
    assert train_losses(tmp_path) == train_losses(reference) and evals(tmp_path) == evals(reference)
    assert sorted(p.name for p in checkpoints.iterdir()) == ["12", "4", "8"]


@pytest.fixture(scope="module")
def reference_state(reference):
    """The reference run's abstract train state, built in this process (8 devices) from its config.json."""
    engine = build(config_lib.load_saved_config(reference / "config.json"))
    engine.source.close()
    return engine.abstract_state


def _restore_latest(checkpoints, abstract_state):
    """restore_latest as a run calls it: (step restored, warning lines)."""
    warnings = []
    checkpointer = Checkpointer(checkpoints, keep=3, every_steps=4)
    try:
        restored = checkpointer.restore_latest(abstract_state, warnings.append)
    finally:
        checkpointer.close()
    return restored[0], warnings


# What a data item written before digests lacks (the checksum and the settings' fingerprint came after them).
BEFORE_DIGESTS_LACKS = ("checksum", "digests", "fingerprint")


def _unsealed(metadata):
    """The data item as jdp wrote it before data items carried a checksum (format 2 all the same), and so before
    they carried the settings' fingerprint."""
    item = json.loads(metadata.read_text())
    del item["checksum"], item["fingerprint"]
    metadata.write_text(json.dumps(item))


# One flipped bit in data/metadata, made by hand: a digest's shape, a digest's dtype, the format.
KERNEL, BIAS = "\".params['layers'][0]['kernel']\": [", "\".params['layers'][0]['bias']\": ["
FLIPS = {"shape": (KERNEL + '"float32", [40, 32]', KERNEL + '"float32", [41, 32]'),
         "dtype": (BIAS + '"float32"', BIAS + '"float16"'), "format": ('"format": 2', '"format": 3')}


@pytest.mark.parametrize("sealed", [True, False], ids=["with_checksum", "before_checksums"])
@pytest.mark.parametrize("flip", FLIPS)
@pytest.mark.slow
def test_a_flipped_bit_in_checkpoint_metadata_is_damage_not_a_config_change(flip, sealed, reference, reference_state,
                                                                            tmp_path):
    """Checkpoint 12's metadata with a flipped shape, dtype or format: moved aside, and the run restores 8 instead of
    stopping with exit 2 (it was read as a model that changed, or a newer jdp's format). Caught by the data item's
    checksum, or, in a checkpoint from before it, by its digests' layout against orbax's metadata of its arrays and
    by a format no jdp wrote without a checksum."""
    checkpoints = _tamper(reference, tmp_path)
    metadata = checkpoints / "12" / "data" / "metadata"
    if not sealed:
        _unsealed(metadata)
    text = metadata.read_text()
    before, after = FLIPS[flip]
    assert text.count(before) == 1
    metadata.write_text(text.replace(before, after))
    step, warnings = _restore_latest(checkpoints, reference_state)
    assert step == 8
    cause = {("shape", False): "its digests give params/layers/0/kernel as float32(41, 32), its arrays as "
                                "float32(40, 32) (damaged bytes)",
             ("dtype", False): "its digests give params/layers/0/bias as float16(32,), its arrays as float32(32,) "
                                "(damaged bytes)",
             ("format", False): "its data item says format 3 without a checksum: no jdp wrote that (damaged bytes)"
             }.get((flip, sealed), "its data item (data/metadata) does not match its checksum (damaged bytes)")
    assert warnings == [f"checkpoint {checkpoints / '12'} is unusable: {cause}; trying the previous one",
                        f"moved the damaged checkpoint {checkpoints / '12'} to {tmp_path / 'rejected' / '12'}"]


@pytest.mark.slow
def test_an_intact_checkpoint_of_another_format_or_model_is_refused_not_moved(reference, reference_state, tmp_path):
    """What passes its checksum, or has no digests and orbax's metadata of its arrays does not fit the model, is a
    config change: CheckpointError (exit 2), nothing moved."""
    checkpoints = _tamper(reference, tmp_path)
    metadata = checkpoints / "12" / "data" / "metadata"
    metadata.write_text(json.dumps(digest.sealed({**json.loads(metadata.read_text()), "format": 3})))
    with pytest.raises(CheckpointError, match=f"checkpoint {checkpoints / '12'} has format 3, this jdp reads format 2"):
        _restore_latest(checkpoints, reference_state)
    item = json.loads(metadata.read_text())
    metadata.write_text(json.dumps({k: v for k, v in item.items() if k not in BEFORE_DIGESTS_LACKS} | {"format": 2}))
    wider = jax.tree_util.tree_map_with_path(  # the model with 64 hidden units, as --config.model.kwargs gives it
        lambda path, leaf: jax.ShapeDtypeStruct((64,), leaf.dtype, sharding=leaf.sharding)
        if jax.tree_util.keystr(path) == ".params['layers'][0]['bias']" else leaf, reference_state)
    with pytest.raises(CheckpointError, match=r"does not fit this model \(.params\['layers'\]\[0\]\['bias'\] is "
                                              r"float32\(32,\) there, float32\(64,\) in the model\)"):
        _restore_latest(checkpoints, wider)
    assert not (tmp_path / "rejected").exists()


@pytest.mark.slow
def test_a_checkpoint_without_digests_that_fails_to_read_is_moved_aside(reference, reference_state, tmp_path):
    """A checkpoint from before digests whose arrays fail to read (a flipped byte in a b-tree node of its arrays'
    database, which tensorstore's CRC finds) fits the model by orbax's metadata, so it is damage: moved aside, and
    step 12 is saved anew instead of skipped for good because it exists."""
    checkpoints = _tamper(reference, tmp_path)
    metadata = checkpoints / "12" / "data" / "metadata"
    item = json.loads(metadata.read_text())
    metadata.write_text(json.dumps({k: v for k, v in item.items() if k not in BEFORE_DIGESTS_LACKS}))
    data = max((checkpoints / "12" / "state" / "d").iterdir(), key=lambda p: p.stat().st_size)
    damaged = bytearray(data.read_bytes())
    damaged[len(damaged) // 2] ^= 1
    data.write_bytes(bytes(damaged))
    step, warnings = _restore_latest(checkpoints, reference_state)
    assert step == 8
    assert warnings[-1] == f"moved the damaged checkpoint {checkpoints / '12'} to {tmp_path / 'rejected' / '12'}"
    assert warnings[0].startswith(f"checkpoint {checkpoints / '12'} is unusable: ValueError: DATA_LOSS")


def _without_dac_override() -> list[str]:
    """A command prefix under which mode 000 stops a read: root (as in CI) reads any file through
    CAP_DAC_OVERRIDE, so the child drops it."""
    if os.geteuid() != 0:
        return []
    if shutil.which("setpriv") is None:
        pytest.skip("running as root without setpriv (util-linux): mode 000 would not stop a read")
    return ["setpriv", "--bounding-set=-dac_override,-dac_read_search"]


@pytest.mark.slow
def test_an_unreadable_checkpoint_stops_with_exit_6_and_moves_nothing(reference, tmp_path):
    """Checkpoint 12's largest data file and checkpoint 8's state/_METADATA unreadable (a permission, as a network
    filesystem may give for a moment): retried, then one line naming the file and the error, exit 6, without "free
    space", and both checkpoints left in place (they were moved aside, and the run restarted from step 4)."""
    checkpoints = _tamper(reference, tmp_path)
    largest = max((p for p in (checkpoints / "12" / "state").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    for path in (largest, checkpoints / "8" / "state" / "_METADATA"):
        path.chmod(0)
    out = subprocess.run([*_without_dac_override(), sys.executable, "-m", "jdp.train", "--workdir", str(tmp_path)],
                         capture_output=True, text=True, timeout=120, env=ENV)
    assert out.returncode == 6, out.stderr
    assert out.stderr.splitlines() == [
        f"jdp: disk: cannot read {checkpoints / '12'}: permission denied (EACCES) on {largest}, 4 tries over 3.5 s; "
        "it is left in place, since this error is not about its content: make it readable and rerun"]
    assert sorted(p.name for p in checkpoints.iterdir()) == ["12", "4", "8"] and not (tmp_path / "rejected").exists()
    assert train_losses(tmp_path) == train_losses(reference)  # nothing was trained or dropped


def test_a_step_that_is_a_symbolic_link_loop_is_named_moved_aside_and_saved_anew(tmp_path, capsys):
    """checkpoints/4 a symbolic link to itself: orbax skipped it on restore, then its save of step 4 died renaming
    its temporary directory onto the link (NotADirectoryError, a traceback, exit 1, 4.orbax-checkpoint-tmp left).
    Named in one line and moved aside as damage is: the rerun resumes from step 2 and saves step 4 anew."""
    cfg = small_config("mlp", steps=4, checkpoint={"every_steps": 2})
    run(cfg, tmp_path)
    losses, checkpoints = train_losses(tmp_path), tmp_path / "checkpoints"
    shutil.rmtree(checkpoints / "4")
    (checkpoints / "4").symlink_to("4")
    capsys.readouterr()
    assert run(cfg, tmp_path).step == 4
    assert capsys.readouterr().err.splitlines() == [
        f"jdp: warning: checkpoint {checkpoints / '4'} is unusable: a symbolic link loop (it leads back to itself) "
        "stands where its directory belongs; moving it aside",
        f"jdp: warning: moved the damaged checkpoint {checkpoints / '4'} to {tmp_path / 'rejected' / '4'}"]
    assert sorted(p.name for p in checkpoints.iterdir()) == ["2", "4"] and (checkpoints / "4").is_dir()
    assert (tmp_path / "rejected" / "4").is_symlink()
    assert train_losses(tmp_path) == losses  # steps 3-4 trained again from step 2, bitwise


# tensorstore's text for a read that EACCES stopped, as orbax raises it (a ValueError), and the same read once
# tensorstore has the failure cached: without the errno.
_DENIED = ('PERMISSION_DENIED: Error opening "zarr" driver: Error reading "step/.zarray" in OCDBT database at local '
           'file "/w/checkpoints/12/state/": Error reading Byte range [0, 4985) of local file "/w/checkpoints/12/'
           'state/d/bae7": Failed to open: "/w/checkpoints/12/state/d/bae7": Permission denied{} [tensorstore_spec=')
_CRC = ('DATA_LOSS: Error opening "zarr" driver: Error reading "step/.zarray" in OCDBT database at local file '
        '"/w/checkpoints/12/state/": Error decoding b-tree node: CRC-32C checksum verification failed')


def _raising(error, calls):
    def read():
        calls.append(1)
        raise error

    return read


def test_read_failures_not_about_the_bytes_are_retried_then_one_line(monkeypatch):
    """Errors that say nothing about the bytes read (a permission, a stale NFS handle), whether an errno or
    tensorstore's text, are retried with the documented delays, then raised as a DiskError naming the file; a
    checksum failure or a missing file is damage, raised at once."""
    denied = "/w/checkpoints/12/state/d/bae7"
    assert storage.read_failure(ValueError(_DENIED.format(" [os_error_code='13']"))) == (errno.EACCES, denied)
    assert storage.read_failure(ValueError(_DENIED.format(""))) == (errno.EACCES, denied)
    assert storage.read_failure(OSError(errno.ESTALE, "Stale file handle", "/w/x")) == (errno.ESTALE, "/w/x")
    try:
        raise RuntimeError("orbax's wrapper") from PermissionError(errno.EACCES, "Permission denied", "/w/m")
    except RuntimeError as e:
        assert storage.read_failure(e) == (errno.EACCES, "/w/m")
    for damage in (ValueError(_CRC), FileNotFoundError(errno.ENOENT, "No such file", "/w/m"), ValueError("bad")):
        assert storage.read_failure(damage) is None

    slept, calls = [], []
    monkeypatch.setattr(storage.time, "sleep", slept.append)

    def stale_twice():
        calls.append(1)
        if len(calls) <= 2:
            raise OSError(errno.ESTALE, "Stale file handle", "/w/x")
        return "read"

    assert storage.read_retrying(stale_twice, Path("/w/checkpoints/12")) == "read" and slept == [0.5, 1.0]
    calls.clear()
    with pytest.raises(ValueError, match="DATA_LOSS"):
        storage.read_retrying(_raising(ValueError(_CRC), calls), Path("/w"))
    assert len(calls) == 1
    slept.clear()
    with pytest.raises(DiskError) as raised:
        storage.read_retrying(_raising(ValueError(_DENIED.format("")), calls), Path("/w/checkpoints/12"))
    assert len(calls) == 5
    assert slept == [0.5, 1.0, 2.0]
    assert str(raised.value) == (f"cannot read /w/checkpoints/12: permission denied (EACCES) on {denied}, 4 tries over "
                                 "3.5 s; it is left in place, since this error is not about its content: make it "
                                 "readable and rerun")


def _two_checkpoints(workdir):
    """Checkpoints 1 and 2 of a one-layer model (a 64 x 512 kernel: its bytes in a file of their own) in
    workdir/checkpoints; returns the abstract state that restores them."""
    engine = prepare(lambda: nnx.Linear(64, 512, rngs=nnx.Rngs(0)), lambda m, b: {"loss": m(b["x"]).sum(-1)},
                     {"x": np.zeros((8, 64), np.float32)}, optimizer=optax.sgd(0.1), global_batch_size=8,
                     options=FitOptions(num_devices=1))
    state = engine.parallel.to_devices(engine.init_state())
    writer = Checkpointer(workdir / "checkpoints", keep=2, every_steps=1)
    for step in (1, 2):
        writer.save(step, state._replace(step=state.step + step), {"step": step})
        writer.wait()
    writer.close()
    return engine.abstract_state


@pytest.mark.parametrize("damage", ["truncated", "missing"])
def test_a_truncated_or_missing_array_file_is_named_in_tensorstores_words(tmp_path, damage):
    """orbax wraps a failed array read in an Exception whose text is the repr of a method (`<bound method
    pybind11_detail_function_record_...spec of TensorStore(...)>`); the warning quotes the error it wraps."""
    abstract_state = _two_checkpoints(tmp_path)
    largest = max((p for p in (tmp_path / "checkpoints" / "2" / "state").rglob("*") if p.is_file()),
                  key=lambda p: p.stat().st_size)  # the kernel's bytes, in a file of their own
    if damage == "truncated":
        os.truncate(largest, 100)
    else:
        largest.unlink()
    step, warnings = _restore_latest(tmp_path / "checkpoints", abstract_state)
    assert step == 1 and len(warnings) == 2, warnings
    assert warnings[0].startswith(f"checkpoint {tmp_path / 'checkpoints' / '2'} is unusable: ValueError: ")
    assert "Error reading" in warnings[0] and "bound method" not in warnings[0], warnings[0]


@pytest.mark.parametrize("damage", ["deleted", "cut short", "a key renamed"])
def test_orbaxs_step_metadata_damaged_restores_without_absl_lines(tmp_path, caplog, damage):
    """STEP/_CHECKPOINT_METADATA is orbax's (handler names, timestamps): jdp reads nothing from it, so the checkpoint
    restores as it is, and orbax's `ERROR:absl:` / `WARNING:absl:` lines about it are not printed."""
    abstract_state = _two_checkpoints(tmp_path)
    metadata = tmp_path / "checkpoints" / "2" / "_CHECKPOINT_METADATA"
    if damage == "deleted":
        metadata.unlink()
    elif damage == "cut short":
        metadata.write_bytes(metadata.read_bytes()[:40])
    else:  # one flipped bit
        metadata.write_text(metadata.read_text().replace('"metrics"', '"metpics"'))
    step, warnings = _restore_latest(tmp_path / "checkpoints", abstract_state)
    assert step == 2 and warnings == []
    assert [r.getMessage() for r in caplog.records if r.name == "absl" and r.levelno >= logging.WARNING] == []


class _Pending:
    def __await__(self):
        yield


async def _read_given_up():
    try:
        await _Pending()
    except BaseException as e:  # as orbax's _read_array_index_and_device_put does
        raise Exception("Encountered error while reading array index") from e


def test_what_an_abandoned_orbax_read_leaves_prints_nothing(monkeypatch):
    """orbax stops awaiting a restore at its first failed leaf and closes its event loop. The other leaves' reads
    end later, and tensorstore reports their callbacks' `Event loop is closed` as unraisable; the coroutines still
    reading are closed, and raise an Exception for their GeneratorExit, unraisable too: a traceback each. jdp's hook
    drops those, and passes on any other."""
    seen = []
    monkeypatch.setattr(sys, "unraisablehook", functools.partial(checkpoint_lib._quiet_abandoned_reads,
                                                                   previous=seen.append))
    loop = asyncio.new_event_loop()
    loop.close()
    promise, future = ts.Promise.new()
    future.add_done_callback(lambda _: loop.call_soon_threadsafe(print))
    future.add_done_callback(lambda _: 1 / 0)
    promise.set_result(1)
    future.result()
    reading = _read_given_up()
    reading.send(None)  # suspended mid-read
    del reading  # closed, as orbax's abandoned reads are
    assert [u.exc_type for u in seen] == [ZeroDivisionError]


@pytest.mark.slow
def test_a_kill_before_an_eval_loses_no_result(reference, tmp_path):
    """Killed after checkpoint 12 was written, before its (final) eval: the rerun writes that eval and the summary,
    and nothing else; a further rerun writes nothing; a run resumed at such a step redoes its eval."""
    finished, extended = tmp_path / "finished", tmp_path / "extended"
    assert train(finished, *RUN, env={"JDP_KILL_AT": "step:12"}).returncode == -signal.SIGKILL
    shutil.copytree(finished, extended)
    holder = (finished / "jdp.lock").read_text()  # the killed process's lock file: it does not block the rerun
    out = train(finished)
    assert out.returncode == 0 and "nothing to do" in out.stdout, out.stderr
    assert (finished / "jdp.lock").read_text() != holder
    assert evals(finished) == evals(reference)
    assert [r["split"] for r in records(finished, "summary")] == ["summary"]
    written = {p: p.read_bytes() for p in finished.rglob("*") if p.is_file() and p.name != "jdp.lock"}
    out = train(finished)  # rerunning the finished run: nothing to do, nothing written, the summary kept
    assert out.returncode == 0 and "nothing to do" in out.stdout, out.stderr
    assert {p: p.read_bytes() for p in finished.rglob("*") if p.is_file() and p.name != "jdp.lock"} == written

    out = train(extended, "--config.train.steps=16")
    assert out.returncode == 0, out.stderr
    assert evals(extended)[:2] == evals(reference)
    lines = [(r["split"], r.get("step")) for r in records(extended, "train") + records(extended, "eval")]
    assert lines.count(("eval", 12)) == 1 and ("eval", 16) in lines
    history = [json.loads(line) for line in (extended / "config_history.jsonl").read_text().splitlines()]
    assert [(h["latest_checkpoint_step"], h["config"]["train"]["steps"]) for h in history] == [(0, 12), (12, 16)]


@pytest.mark.slow
def test_sigterm_during_start_up_or_restore_exits_75(tmp_path):
    """Safe to requeue: nothing was trained since the last checkpoint."""
    out = train(tmp_path, *RUN, env={"JDP_KILL_AT": "restore:0"})  # SIGTERM while restoring
    assert out.returncode == 75, out.stderr
    assert out.stderr.strip().splitlines()[-1] == (
        "jdp: preempted: SIGTERM outside the training steps; exiting with code 75 (no step was lost: a rerun "
        "resumes from the last checkpoint, or starts over without one)")
    proc = subprocess.Popen([sys.executable, "-m", "jdp.train", "--workdir", str(tmp_path), *RUN],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    time.sleep(1.0)  # still importing JAX (about 3 s here)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 75 and "Traceback" not in err, err


@pytest.mark.slow
def test_a_changed_model_is_refused_with_the_differing_keys(tmp_path):
    assert train(tmp_path, *RUN).returncode == 0
    out = train(tmp_path, *RUN, "--config.model.kwargs.hidden_sizes=(64,)", "--config.optim.lr=0.5")
    assert out.returncode == 2
    assert "model.kwargs.hidden_sizes: (32,) -> (64,)" in out.stderr and "optim.lr: 0.01 -> 0.5" in out.stderr
    assert "allow_config_change=True" in out.stderr
    # Allowed on purpose, the shapes no longer fit: a config change, not damage, so nothing is moved aside.
    out = train(tmp_path, *RUN, "--config.model.kwargs.hidden_sizes=(64,)",
                "--config.checkpoint.allow_config_change=True")
    assert out.returncode == 2
    assert (f"checkpoint {tmp_path / 'checkpoints' / '12'} does not fit this model (.params['layers'][0]['bias'] is "
            "float32(32,) there, float32(64,) in the model)") in out.stderr
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["12", "4", "8"]
    assert not (tmp_path / "rejected").exists()


@pytest.mark.slow
def test_elastic_restore_from_8_devices_to_4_and_1(tmp_path):
    cfg = small_config("resnet", steps=4, num_devices=8)
    reference = run(small_config("resnet", steps=8, num_devices=8), tmp_path / "reference")
    run(cfg, tmp_path / "run")
    for num_devices, steps in ((4, 6), (1, 8)):
        cfg = small_config("resnet", steps=steps, num_devices=num_devices)
        result = run(cfg, tmp_path / "run")
    got = [loss for _, loss in train_losses(tmp_path / "run")]
    np.testing.assert_allclose(got, reference.losses, rtol=1e-4)
    for a, b in zip(jax.tree.leaves(result.params), jax.tree.leaves(reference.params), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_the_replica_guard_stops_a_run_whose_copies_differ(monkeypatch, tmp_path, capsys):
    original = DataParallel.train_step
    calls = []

    def corrupt_device_5_at_step_3(self, state, batch):
        state, metrics = original(self, state, batch)
        calls.append(1)
        if len(calls) == 3:
            bias = state.params["layers"][0]["bias"]
            shards = [s.data for s in bias.addressable_shards]
            shards[5] = shards[5] + 1.0
            bias = jax.make_array_from_single_device_arrays(bias.shape, bias.sharding, shards)
            state = state._replace(params={**state.params, "layers": {**state.params["layers"],
                                                                      0: {**state.params["layers"][0], "bias": bias}}})
        return state, metrics

    monkeypatch.setattr(DataParallel, "train_step", corrupt_device_5_at_step_3)
    code = main(["--config", "configs/mnist1d_mlp.py", "--workdir", str(tmp_path), "--config.train.steps=10",
                 "--config.parallel.check_replicas_every=2", "--config.train.eval_every=10"])
    assert code == 4
    err = capsys.readouterr().err
    assert "replicas differ at step 4: first differing parameter ['params']['layers'][0]['bias']" in err


def _nan_at_index(monkeypatch, index):
    original = Batcher.train_batch

    def poisoned(self, step):
        rows = original(self, step)
        return {**rows, "x": np.full_like(rows["x"], np.nan)} if step == index else rows

    monkeypatch.setattr(Batcher, "train_batch", poisoned)


def test_nonfinite_halt_saves_the_state_before_the_bad_step(monkeypatch, tmp_path, capsys):
    args = ["--config", "configs/mnist1d_mlp.py", "--config.train.steps=10", "--config.train.eval_every=10",
            "--config.checkpoint.every_steps=0", "--config.optim.schedule=constant"]
    clean = tmp_path / "clean"
    assert main([*args, "--workdir", str(clean), "--config.train.steps=5"]) == 0
    _nan_at_index(monkeypatch, 5)  # the batch of step 6
    assert main([*args, "--workdir", str(tmp_path / "bad")]) == 3
    assert "non-finite inputs (batch key 'x'), hence the loss (nan) at step 6" in capsys.readouterr().err
    assert sorted(p.name for p in (tmp_path / "bad" / "checkpoints").iterdir()) == ["5"]
    monkeypatch.undo()
    for workdir in (clean, tmp_path / "bad"):
        assert export.main(["--workdir", str(workdir), "--out", str(workdir / "p.npz")]) == 0
    with np.load(clean / "p.npz") as a, np.load(tmp_path / "bad" / "p.npz") as b:
        assert a.files == b.files and all(np.array_equal(a[k], b[k]) for k in a.files)
    # Rerun once the bad batch is gone: the halted run resumes from step 5 and finishes.
    assert main([*args, "--workdir", str(tmp_path / "bad")]) == 0


def test_nonfinite_skip_drops_the_update_and_counts_it(monkeypatch, tmp_path):
    _nan_at_index(monkeypatch, 3)
    skip = {"train": {"on_nonfinite": "skip"}, "checkpoint": {"every_steps": 2},
            "optim": {"name": "sgd", "lr": 0.2, "schedule": "linear"}}
    first = small_config("mlp", steps=6, **skip)
    run(first, tmp_path)
    result = run(small_config("mlp", steps=8, **skip), tmp_path)  # resumed: the count carries over
    train_lines = records(tmp_path, "train")
    assert [r["step"] for r in train_lines] == [1, 2, 3, 5, 6, 7, 8]  # step 4's NaN loss is not logged
    assert train_lines[-1]["skipped_steps"] == 1
    # The logged lr is the one the update used: the schedule stands still over the skipped step.
    schedule = learning_rate(first.optim, first.train.global_batch_size, 6)
    np.testing.assert_allclose([r["lr"] for r in train_lines[:5]], [schedule(n) for n in range(5)], rtol=1e-6)
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(result.params))


@pytest.mark.slow
def test_export_eval_only_and_init_from_work_whatever_device_count_the_run_used(tmp_path):
    """A run on 4 devices, exported and evaluated in processes that have 1 device, started from on 2."""
    first = run(small_config("mlp", steps=2, num_devices=4), tmp_path / "a")
    one_device = {"env": {"JAX_NUM_CPU_DEVICES": "1"}}
    out = subprocess.run([sys.executable, "-m", "jdp.export", "--workdir", str(tmp_path / "a"), "--out",
                          str(tmp_path / "p.npz")], capture_output=True, text=True, timeout=120,
                         env={**os.environ, **one_device["env"]})
    assert out.returncode == 0, out.stderr
    out = train(tmp_path / "a", "--eval_only", **one_device)
    assert out.returncode == 0, out.stderr
    assert records(tmp_path / "a", "eval")[-1]["loss"] == pytest.approx(first.eval_loss, rel=1e-5)
    with np.load(tmp_path / "p.npz") as stored:
        exported = params_file.flatten(first.params, "params")
        assert all(np.array_equal(stored[k], v) for k, v in exported.items())
    second = small_config("mlp", steps=1, num_devices=2, init_from=str(tmp_path / "p.npz"))
    second.optim.lr = 1e-12
    assert run(second, tmp_path / "b").eval_loss == pytest.approx(first.eval_loss, rel=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("sync", [
    {"sync": "powersgd", "powersgd_rank": 2, "powersgd_start_step": 0},
    {"sync_every": 2, "outer_optimizer": "nesterov"},
    {"sync": "jdp.sync.streaming:StreamingDiLoCo", "sync_kwargs": {"every": 2, "fragments": 2}},
    {"shard_group": 2},
], ids=["powersgd", "diloco", "streaming_diloco", "hybrid"])
def test_export_and_eval_only_of_a_run_with_per_device_state_work_on_fewer_devices(monkeypatch, tmp_path, sync):
    """PowerSGD's error feedback, DiLoCo's inner optimizer state and Streaming DiLoCo's parameters hold one row per
    device (4 here), and hybrid sharding needs its groups of 2; export and --eval_only on 1 device read none of it.
    Breaks if they restore the rows at the model's shape (a config change, exit 2), or keep hybrid's groups (a
    group of 2 does not divide 1 device)."""
    first = run(small_config("mlp", steps=2, num_devices=4, parallel={"num_devices": 4, **sync}), tmp_path)
    monkeypatch.setattr(resume, "inference_devices", lambda cfg: 1)  # what a machine with 1 device gets
    assert export.main(["--workdir", str(tmp_path), "--out", str(tmp_path / "p.npz")]) == 0
    with np.load(tmp_path / "p.npz") as stored:
        exported = params_file.flatten(first.params, "params")
        assert all(np.array_equal(stored[k], v) for k, v in exported.items())
    assert main(["--workdir", str(tmp_path), "--eval_only"]) == 0
    assert records(tmp_path, "eval")[-1]["loss"] == pytest.approx(first.eval_loss, rel=1e-5)


@pytest.mark.slow
def test_export_round_trips_into_a_new_run(tmp_path, capsys):
    first = run(small_config("resnet", steps=3), tmp_path / "a")
    assert export.main(["--workdir", str(tmp_path / "a"), "--out", str(tmp_path / "p.npz")]) == 0
    with np.load(tmp_path / "p.npz") as stored:
        assert "params/stem_conv/kernel" in stored.files and "model_state/stem_bn/mean" in stored.files
        assert int(stored["step"]) == 3
    exported = params_file.flatten(first.params, "params") | params_file.flatten(first.model_state, "model_state")
    params, model_state = params_file.load_into(tmp_path / "p.npz", first.params, first.model_state)
    loaded = params_file.flatten(params, "params") | params_file.flatten(model_state, "model_state")
    assert all(np.array_equal(exported[k], loaded[k]) for k in exported)
    capsys.readouterr()
    missing = tmp_path / "missing" / "p.npz"  # these two were tracebacks, exit 1
    for out, refusal in ((missing, f"cannot write {missing}: {missing.parent} is not an existing folder; make it, "
                                   "or give another path"),
                         (tmp_path, f"cannot write {tmp_path}: it is a folder; give a file path such as "
                                    f"{tmp_path / 'params.npz'}")):
        assert export.main(["--workdir", str(tmp_path / "a"), "--out", str(out)]) == 2
        assert capsys.readouterr().err == f"jdp.export: {refusal}\n"
    assert export.main(["--workdir", str(tmp_path / "a"), "--out", str(tmp_path / "q")]) == 0
    assert capsys.readouterr().out.startswith(f"wrote {tmp_path / 'q.npz'}: ")  # the file written, not "q"

    # A new run from the file evaluates like the run it came from, before its first update.
    assert main(["--workdir", str(tmp_path / "a"), "--eval_only"]) == 0
    evals = records(tmp_path / "a", "eval")
    assert evals[-1]["step"] == 3 and evals[-1]["loss"] == pytest.approx(first.eval_loss, rel=1e-6)
    second = small_config("resnet", steps=1, init_from=str(tmp_path / "p.npz"))
    second.optim.lr = 1e-12
    second.model.kwargs.bn_momentum = 1.0  # keep the loaded running statistics through the one step
    result = run(second, tmp_path / "b")
    assert result.eval_loss == pytest.approx(first.eval_loss, rel=1e-5)


def test_only_committed_steps_count(tmp_path, monkeypatch):
    """In a multi-process run orbax lists a save still under its temporary name: a disk error's line called it "the
    last checkpoint, intact", and the rerun, finding nothing to restore, started over."""
    checkpointer = Checkpointer(tmp_path / "checkpoints", keep=3, every_steps=4)
    try:
        (tmp_path / "checkpoints" / "4").mkdir()
        (tmp_path / "checkpoints" / "8.orbax-checkpoint-tmp").mkdir()
        monkeypatch.setattr(checkpointer._manager, "all_steps", lambda: [4, 8])
        assert checkpointer.steps() == [4]
    finally:
        checkpointer.close()
