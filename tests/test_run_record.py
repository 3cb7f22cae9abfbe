"""The run record `jdp.fit` writes (WORKDIR/run.json, key "fit") and what reads it back: the resume guard, which
refuses a resumed run whose numerics or data order changed, and the tools that reopen a run from Python
(`jdp.restore`, `jdp.evaluate`, `jdp.export_params`) and from the command line (`python -m jdp.export`,
`python -m jdp.train --eval_only`, `python -m jdp.sample`)."""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import jdp
from jdp import digest, reopen
from jdp import guard as guard_lib
from jdp import record as record_lib
from jdp.cli import export as export_cli
from jdp.cli import train as train_cli
from tests import user_models
from tests.helpers import max_abs_diff, records

REPO = Path(__file__).parent.parent
MODEL = functools.partial(user_models.make_call_time_cnn, seed=0, rate=0.2)
TRAIN = functools.partial(user_models.tiny_images, n=128)
EVAL = functools.partial(user_models.tiny_images, n=40, seed=1)
LOSS = user_models.call_time_loss
RTOL = 1e-6


def sgd(lr: float = 0.1, **kwargs) -> optax.GradientTransformation:
    """SGD at a constant schedule: its state holds a step count, as that of any schedule does, so a change to
    another schedule (or lr) keeps the checkpoint's layout and only the run record tells them apart."""
    return optax.sgd(optax.constant_schedule(lr), **kwargs)


def fit(workdir: Path, steps: int, **changes):
    """A tiny run: every piece importable (factories by import path), SGD at 0.1, 2 devices, checkpoints every
    2 steps; `changes` replace any argument of `jdp.fit`."""
    kwargs = {"model": MODEL, "loss_fn": LOSS, "train_data": TRAIN, "optimizer": sgd(),
              "global_batch_size": 32, "eval_data": EVAL, "num_devices": 2, "log_every": 1, "checkpoint_every": 2,
              **changes}
    model, loss_fn, train_data = kwargs.pop("model"), kwargs.pop("loss_fn"), kwargs.pop("train_data")
    return jdp.fit(model, loss_fn, train_data, steps=steps, workdir=workdir, **kwargs)


def abstract_params(params):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype), params)


def saved_record(workdir: Path) -> dict:
    return json.loads((workdir / record_lib.RECORD_FILE).read_text())


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A run of 4 steps of 4, finished: checkpoints 2 and 4, an eval line at step 4. (workdir, FitResult)."""
    workdir = tmp_path_factory.mktemp("finished") / "run"
    return workdir, fit(workdir, 4)


@pytest.fixture(scope="module")
def stopped(tmp_path_factory):
    """A run of 8 steps stopped by an exception after step 4 (`jdp.faults`): checkpoint 4, record of steps=8."""
    workdir = tmp_path_factory.mktemp("stopped") / "run"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("JDP_KILL_AT", "raise:4")
        with pytest.raises(RuntimeError, match="JDP_KILL_AT=raise:4"):
            fit(workdir, 8)
    return workdir


class LocalCNN(user_models.CallTimeDropoutCNN):
    """Stands in for a class the record cannot name: `local_run` passes an instance (never importable back)."""


@pytest.fixture(scope="module")
def local_run(tmp_path_factory):
    """A finished run whose model was given as an instance of a class defined in a function (as in a script's
    __main__): its record names no factory. (workdir, FitResult, the class)."""

    class Scripted(LocalCNN):  # qualname test_run_record.local_run.<locals>.Scripted: not importable
        pass

    workdir = tmp_path_factory.mktemp("local") / "run"
    return workdir, fit(workdir, 4, model=Scripted(rate=0.2, rngs=nnx.Rngs(0))), Scripted


def copy_of(workdir: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(workdir, tmp_path / "run"))


# 1. The record ---------------------------------------------------------------------------------------------


def test_the_record_names_everything_that_produced_the_run(finished):
    """A missing or wrong entry here means tools cannot rebuild the run (factory, loss, data) and the resume guard
    compares nothing (or the wrong thing)."""
    workdir, result = finished
    saved = saved_record(workdir)
    assert saved["versions"]["jax"] == jax.__version__ and saved["versions"]["jdp"]
    assert saved["platform"] == "cpu" and len(saved["devices"]) == 2  # the run's 2 devices, not the 8 there are
    assert isinstance(saved["command"], list) and saved["process_count"] == 1
    record = saved["fit"]
    assert record["format"] == record_lib.FORMAT and record["steps"] == 4 and record["global_batch_size"] == 32
    options = record["options"]
    assert {k: options[k] for k in ("seed", "num_devices", "precision", "checkpoint_every", "backend")} == {
        "seed": 0, "num_devices": 2, "precision": "fp32", "checkpoint_every": 2, "backend": "shard_map"}
    assert options["workdir"] == str(workdir) and "eval_data" not in options

    model = record["model"]
    assert model["factory"] == {"path": "tests.user_models:make_call_time_cnn", "kwargs": {"seed": 0, "rate": 0.2}}
    assert model["class"].startswith("tests.user_models:make_call_time_cnn")
    sizes = [np.size(x) for x in jax.tree.leaves(result.params)]
    assert model["parameters"] == sum(sizes) == 228
    assert sorted(model["shapes"].values()) == sorted(list(np.shape(x)) for x in jax.tree.leaves(result.params))
    assert model["shapes"]["['conv']['kernel']"] == [3, 3, 1, 8]

    assert record["loss_fn"] == "tests.user_models:call_time_loss"
    assert record["imports"] == {"loss_fn": {"path": "tests.user_models:call_time_loss", "kwargs": {}},
                                 "eval_fn": None, "eval_derived": None}
    train = record["data"]["train"]
    assert {k: train[k] for k in ("keys", "shapes", "dtypes", "length", "factory")} == {
        "keys": ["x", "y"], "shapes": {"x": [8, 8, 1], "y": []}, "dtypes": {"x": "float32", "y": "int32"},
        "length": 128, "factory": {"path": "tests.user_models:tiny_images", "kwargs": {"n": 128}}}
    assert isinstance(train["sample_hash"], str) and len(train["sample_hash"]) == 24
    assert record["data"]["eval"] == {"length": 40, "factory": {"path": "tests.user_models:tiny_images",
                                                                "kwargs": {"n": 40, "seed": 1}}}
    # The fingerprint is that of the optimizer fit was given, on the model's parameter tree.
    assert record["optimizer"] == record_lib.describe_optimizer(sgd(), abstract_params(result.params))


def test_a_model_instance_is_recorded_by_class_without_a_factory(local_run):
    """An instance cannot be rebuilt from its record: a factory recorded for it would make `jdp.restore` build
    some other model."""
    workdir, _, scripted = local_run
    model = saved_record(workdir)["fit"]["model"]
    assert model["factory"] is None
    assert model["class"] == f"{__name__}:{scripted.__qualname__}" and "<locals>" in model["class"]


def test_import_path_refuses_what_cannot_be_imported_back():
    """A lambda, a local function or a partial with positional or non-JSON arguments recorded as importable would
    make the tools fail later, far from the cause."""

    def local():
        return MODEL()

    assert record_lib.import_path(MODEL) == {"path": "tests.user_models:make_call_time_cnn",
                                             "kwargs": {"seed": 0, "rate": 0.2}}
    assert record_lib.import_path(user_models.CallTimeDropoutCNN)["path"] == "tests.user_models:CallTimeDropoutCNN"
    for unimportable in (lambda: MODEL(), local, functools.partial(user_models.make_call_time_cnn, 0),
                         functools.partial(user_models.make_call_time_cnn, seed=np.int64(0))):
        assert record_lib.import_path(unimportable) is None
    rebuilt = record_lib.load(record_lib.import_path(MODEL))()
    assert isinstance(rebuilt, user_models.CallTimeDropoutCNN) and rebuilt.dropout.rate == 0.2


@pytest.fixture(scope="module")
def cnn_params():
    model = nnx.eval_shape(MODEL)
    return abstract_params(nnx.to_pure_dict(nnx.state(model, nnx.Param)))


def test_the_same_optimizer_built_twice_has_the_same_fingerprint(cnn_params):
    """Otherwise every resume would be refused."""
    for make in (lambda: optax.sgd(0.1), lambda: optax.adamw(1e-3, weight_decay=1e-4),
                 lambda: optax.sgd(optax.cosine_decay_schedule(0.1, 100))):
        assert record_lib.describe_optimizer(make(), cnn_params) == record_lib.describe_optimizer(make(), cnn_params)


@pytest.mark.parametrize("changed, parts", [
    (optax.sgd(0.2), {"optimizer", "schedule"}),  # the learning rate
    (optax.adam(0.1), {"optimizer", "schedule"}),  # the kind
    (optax.sgd(optax.cosine_decay_schedule(0.1, 100)), {"schedule"}),  # a schedule with the same first value
    (optax.sgd(optax.exponential_decay(0.1, 10, 0.5)), {"schedule"}),
    (optax.sgd(0.1, momentum=0.9), {"optimizer", "schedule"}),  # the second update carries the trace
], ids=["lr", "kind", "cosine", "exponential", "momentum"])
def test_a_changed_optimizer_changes_its_fingerprint(cnn_params, changed, parts):
    """A part that does not change lets a resume silently switch the optimizer; a schedule that changed the first
    part would be refused when a run is extended (`steps` changed, the schedule part not compared)."""
    base = record_lib.describe_optimizer(optax.sgd(0.1), cnn_params)
    new = record_lib.describe_optimizer(changed, cnn_params)
    assert {part for part in base if not record_lib.same_fingerprint(base[part], new[part])} == parts


def test_weight_decay_changes_the_fingerprint(cnn_params):
    """With adamw the weight decay is most of the update of a small gradient: a resume at another decay must be
    refused."""
    low = record_lib.describe_optimizer(optax.adamw(1e-3, weight_decay=1e-4), cnn_params)
    high = record_lib.describe_optimizer(optax.adamw(1e-3, weight_decay=1e-2), cnn_params)
    assert not record_lib.same_fingerprint(low["optimizer"], high["optimizer"])


def test_a_float64_perturbation_of_the_lr_keeps_the_fingerprint(cnn_params):
    """An lr differing by 1e-6 relative (a config value re-derived elsewhere, say; about 10 float32 ulps, so the
    updates' bits differ) must not refuse a resume: an exact comparison would."""
    base = record_lib.describe_optimizer(optax.sgd(0.1), cnn_params)
    near = record_lib.describe_optimizer(optax.sgd(0.1 * (1 + 1e-6)), cnn_params)
    assert base != near  # the values do differ: the tolerance is what keeps them the same optimizer
    assert all(record_lib.same_fingerprint(base[part], near[part]) for part in base)


def test_updates_one_float32_ulp_apart_keep_the_fingerprint(cnn_params):
    """The record's promise: a run resumes on another machine or XLA version, whose updates may differ in the last
    bit."""
    base = record_lib.describe_optimizer(optax.sgd(0.1), cnn_params)
    for factor in (1 + 2.0**-23, 1 - 2.0**-24):
        near = record_lib.describe_optimizer(optax.chain(optax.sgd(0.1), optax.scale(factor)), cnn_params)
        assert all(record_lib.same_fingerprint(base[part], near[part]) for part in base)


# 2. The resume guard ---------------------------------------------------------------------------------------

OPTIMIZER, SCHEDULE = "optimizer (its first update)", "schedule (the optimizer's later updates)"
LR = "learning rate"  # every update scaled alike, listed as "learning rate: every update is 2x the recorded run's"
DATA = "train data (keys, shapes, dtypes, length or sampled rows)"
CHANGES = {  # one change each: (fit's arguments, the keys a refusal lists when steps is unchanged / extended)
    "lr": ({"optimizer": sgd(0.2)}, {LR}, {LR}),
    # The later updates differ with the first: only the first is listed, never a schedule the run does not have.
    "optimizer kind": ({"optimizer": optax.adam(0.1)}, {OPTIMIZER}, {OPTIMIZER}),
    "momentum": ({"optimizer": sgd(momentum=0.9)}, {OPTIMIZER}, {OPTIMIZER}),
    # Extending a run may change a schedule built from `steps`: then only its first update is compared.
    "schedule": ({"optimizer": optax.sgd(optax.cosine_decay_schedule(0.1, 8))}, {SCHEDULE}, set()),
    "global batch size": ({"global_batch_size": 64}, {"global_batch_size"}, {"global_batch_size"}),
    "seed": ({"seed": 1}, {"seed"}, {"seed"}),
    "precision": ({"precision": "bf16"}, {"precision"}, {"precision"}),
    "data content": ({"train_data": functools.partial(user_models.tiny_images, n=128, seed=1)}, {DATA}, {DATA}),
    "model": ({"model": functools.partial(user_models.make_call_time_cnn, seed=0, rate=0.3)}, {"model"}, {"model"}),
}



def listed(message: str) -> set[str]:
    """The keys a refusal lists: `key: old -> new` or a fingerprint's name, joined by '; '."""
    inside = message.split("data order (", 1)[1].rsplit("); use a new workdir", 1)[0]
    return {item.split(": ", 1)[0] for item in inside.split("; ")}


@pytest.mark.parametrize("prepared", ["stopped at 4 of 8", "finished at 4 of 4, extended to 8"])
@pytest.mark.parametrize("change", list(CHANGES))
def test_a_resume_that_changes_the_numerics_or_data_order_is_refused_in_one_line(
        change, prepared, finished, stopped, tmp_path, capsys):
    """A resume with another lr, optimizer, schedule, batch, seed, precision, data or model would silently train
    a run that is neither the old one nor the new one; refused before anything is written, naming what differs."""
    workdir = copy_of(stopped if prepared.startswith("stopped") else finished[0], tmp_path)
    arguments, same_steps, extended = CHANGES[change]
    expected = same_steps if prepared.startswith("stopped") else extended
    before = (workdir / "run.json").read_text(), sorted(os.listdir(workdir / "checkpoints"))
    if not expected:  # accepted: the warning says the schedule was not compared
        assert fit(workdir, 8, **arguments).step == 8
        assert "steps changed from 4 to 8" in capsys.readouterr().err
        return
    with pytest.raises(jdp.FitError) as refused:
        fit(workdir, 8, **arguments)
    message = str(refused.value)
    assert "\n" not in message and str(workdir) in message and "allow_config_change=True" in message
    assert listed(message) == expected, message
    assert ((workdir / "run.json").read_text(), sorted(os.listdir(workdir / "checkpoints"))) == before
    assert max(r["step"] for r in records(workdir, "train")) == 4  # nothing trained


def test_a_resume_at_another_momentum_is_refused(tmp_path):
    """Momentum 0.9 -> 0.5 keeps the optimizer state's layout: only the record can tell the runs apart."""
    fit(tmp_path / "run", 2, optimizer=sgd(momentum=0.9))
    with pytest.raises(jdp.FitError, match="optimizer"):
        fit(tmp_path / "run", 4, optimizer=sgd(momentum=0.5))


def test_a_10x_lr_of_a_plain_adam_is_refused_naming_the_learning_rate_not_a_schedule(cnn_params):
    """optax.adam(1e-3) -> adam(1e-2): no schedule in either, so the refusal names the learning rate (every update
    10x), not "schedule (the optimizer's later updates)"; another optimizer names only its first update."""
    def record(tx, steps=8):
        return {"model": {"class": "M", "shapes": []}, "loss_fn": "loss", "global_batch_size": 32, "options": {},
                "steps": steps, "optimizer": record_lib.describe_optimizer(tx, cnn_params),
                "data": {"train": dict.fromkeys(("keys", "shapes", "dtypes", "length", "sample_hash"))}}

    adam = record(optax.adam(1e-3))
    for steps in (8, 16):  # the same steps, and a run extended
        assert record_lib.changes(adam, record(optax.adam(1e-2), steps)) == [
            "learning rate: every update is 10x the recorded run's"]
        assert record_lib.changes(adam, record(optax.sgd(1e-3), steps)) == [OPTIMIZER]
    assert record_lib.changes(adam, record(optax.adam(optax.cosine_decay_schedule(1e-3, 8)))) == [SCHEDULE]
    assert record_lib.changes(adam, record(optax.adam(1e-3))) == []


def test_a_float_lr_changed_to_a_schedule_is_refused_naming_the_schedule(tmp_path):
    """optax.sgd(0.1) -> optax.sgd(cosine_decay_schedule(0.1, ...)), steps unchanged: the same first update, then
    another schedule; the refusal must be the FitError naming the schedule."""
    fit(tmp_path / "run", 2, optimizer=optax.sgd(0.1))
    with pytest.raises(jdp.FitError, match=re.escape(SCHEDULE)):
        fit(tmp_path / "run", 2, optimizer=optax.sgd(optax.cosine_decay_schedule(0.1, 2)))


@pytest.mark.parametrize("prepared", ["stopped at 4 of 8", "finished at 4 of 4, extended to 8"])
def test_the_same_settings_resume(prepared, finished, stopped, tmp_path, capsys):
    """The guard must not refuse the run it guards: same settings (fresh optimizer and factory objects) resume and
    reach step 8 with one train line per step."""
    workdir = copy_of(stopped if prepared.startswith("stopped") else finished[0], tmp_path)
    result = fit(workdir, 8)
    out = capsys.readouterr().out
    assert "resumed from" in out and "other settings" not in out
    assert result.step == 8 and [r["step"] for r in records(workdir, "train")] == list(range(1, 9))
    assert saved_record(workdir)["fit"]["steps"] == 8


def test_allow_config_change_resumes_with_another_lr_and_records_it(finished, tmp_path, capsys):
    """The way out of a refusal: the run goes on, says what changed, and its record holds the new settings (so
    the next resume compares against them)."""
    workdir = copy_of(finished[0], tmp_path)
    result = fit(workdir, 8, optimizer=sgd(0.2), allow_config_change=True)
    out, err = capsys.readouterr()
    assert result.step == 8 and "resumed from" in out
    assert (f"jdp: warning: resuming {workdir} with other settings (allow_config_change): {LR}: every update is 2x "
            "the recorded run's") in err
    assert saved_record(workdir)["fit"]["optimizer"] == record_lib.describe_optimizer(
        sgd(0.2), abstract_params(result.params))
    assert fit(workdir, 10, optimizer=sgd(0.2)).step == 10  # the new settings are the run's now


def test_a_finished_run_rerun_with_other_settings_is_refused_too(finished, tmp_path):
    """A rerun at the same steps trains nothing, but a changed setting would otherwise be mistaken for the run's:
    refused, and the record left as it was."""
    workdir = copy_of(finished[0], tmp_path)
    before = (workdir / "run.json").read_text()
    with pytest.raises(jdp.FitError, match="seed: 0 -> 3"):
        fit(workdir, 4, seed=3)
    assert (workdir / "run.json").read_text() == before


# 2b. The guard inside every checkpoint: its fingerprint of the settings, whatever happened to run.json ----------

FIT_PARTS = guard_lib._FIT_PARTS  # the fingerprint's hash of fit's guarded parts, as a refusal names it
RUN_JSON_DAMAGE = {  # what a run.json may suffer: without the checkpoint's fingerprint each resumed unchecked
    "deleted": lambda path: path.unlink(),
    "emptied to {}": lambda path: path.write_text("{}"),
    "fit section removed": lambda path: path.write_text(json.dumps(
        {k: v for k, v in json.loads(path.read_text()).items() if k != "fit"})),
    "fit.format 2": lambda path: path.write_text(json.dumps(
        (lambda saved: saved | {"fit": saved["fit"] | {"format": 2}})(json.loads(path.read_text())))),
    "random bytes": lambda path: path.write_bytes(os.urandom(64)),
}


def against_checkpoint(message: str, checkpoint: Path) -> set[str]:
    """What a refusal decided by a checkpoint's fingerprint lists (one line, naming the checkpoint and the fix)."""
    assert "\n" not in message and "allow_config_change=True" in message, message
    head = f"(the settings differ from those checkpoint {checkpoint} was saved under: "
    assert head in message, message
    inside = message.split(head, 1)[1].rsplit("); use a new workdir", 1)[0]
    items = inside.split("; ")
    assert all(" -> " not in item for item in items), message  # a hash is named, never shown
    return {item.split(": ", 1)[0] for item in items}


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    """The run `stopped` belongs to, uninterrupted: 8 steps."""
    return fit(tmp_path_factory.mktemp("whole") / "run", 8)


@pytest.mark.parametrize("damage", list(RUN_JSON_DAMAGE))
def test_a_damaged_run_json_leaves_the_checkpoint_to_refuse_a_changed_lr(damage, stopped, whole, tmp_path, capsys):
    """run.json gone, emptied, without its fit section, of another format or unreadable: the checkpoint's own
    fingerprint refuses the resume at another learning rate in one line, before anything is trained or written; at
    the same settings the run resumes, bitwise, with no warning."""
    workdir = copy_of(stopped, tmp_path)
    RUN_JSON_DAMAGE[damage](workdir / "run.json")
    with pytest.raises(jdp.FitError) as refused:
        fit(workdir, 8, optimizer=sgd(0.2))
    assert against_checkpoint(str(refused.value), workdir / "checkpoints" / "4") == {LR}
    assert f"{LR}: every update is 2x the recorded run's" in str(refused.value)
    assert sorted(os.listdir(workdir / "checkpoints")) == ["2", "4"]
    assert max(r["step"] for r in records(workdir, "train")) == 4  # nothing trained
    capsys.readouterr()
    result = fit(workdir, 8)
    out = capsys.readouterr().out
    assert "resumed from" in out and "warning" not in out, out
    assert result.losses == whole.losses[4:] and max_abs_diff(result.params, whole.params) == 0
    assert saved_record(workdir)["fit"]["steps"] == 8  # written anew


@pytest.mark.parametrize("change", list(CHANGES))
def test_every_guarded_change_is_refused_by_the_checkpoint_alone(change, stopped, tmp_path):
    """With run.json deleted, each change the record names is still refused: the optimizer's by its probe (the
    learning rate named), the others by the fingerprint's hash."""
    workdir = copy_of(stopped, tmp_path)
    (workdir / "run.json").unlink()
    arguments, expected, _ = CHANGES[change]
    with pytest.raises(jdp.FitError) as refused:
        fit(workdir, 8, **arguments)
    named = {key if key in (LR, OPTIMIZER, SCHEDULE) else FIT_PARTS for key in expected}
    assert against_checkpoint(str(refused.value), workdir / "checkpoints" / "4") == named


@pytest.mark.parametrize("part", ["fit", "optimizer"])
def test_a_flipped_byte_of_the_stored_fingerprint_is_checkpoint_damage(part, finished, tmp_path, capsys):
    """The fingerprint lives in the checkpoint's data item, under its checksum: one changed character of it (its hash,
    or a number of the optimizer's probe) is damage like any other, so the run falls back to the checkpoint before,
    moves the damaged one aside and saves that step anew, rather than trusting or refusing on a damaged record."""
    workdir = copy_of(finished[0], tmp_path)
    damaged = workdir / "checkpoints" / "4"
    metadata = damaged / "data" / "metadata"
    text = metadata.read_text()
    stored = json.loads(text)["fingerprint"][part]
    value = f'"{part}": ' + json.dumps(stored if part == "fit" else [stored[0]])[:-1]  # the hash; the first number
    assert text.count(value) == 1, value
    flipped = value[:-2] + ("1" if value[-2] != "1" else "2") + value[-1:]
    metadata.write_text(text.replace(value, flipped))
    capsys.readouterr()
    result = fit(workdir, 4)
    out, err = capsys.readouterr()
    assert err.splitlines() == [
        f"jdp: warning: checkpoint {damaged} is unusable: its data item (data/metadata) does not match its checksum "
        "(damaged bytes); trying the previous one",
        f"jdp: warning: moved the damaged checkpoint {damaged} to {workdir / 'rejected' / '4'}"]
    assert f"resumed from {workdir / 'checkpoints' / '2'}" in out
    assert result.step == 4 and result.losses == finished[1].losses[2:]
    assert json.loads(metadata.read_text())["fingerprint"][part] == stored  # saved anew


def as_before_fingerprints(workdir: Path) -> None:
    """Every checkpoint's data item as a jdp from before fingerprints wrote it: sealed, without one."""
    for metadata in (workdir / "checkpoints").glob("*/data/metadata"):
        item = json.loads(metadata.read_text())
        metadata.write_text(json.dumps(digest.sealed(
            {k: v for k, v in item.items() if k not in ("fingerprint", "checksum")})))


def test_a_checkpoint_from_before_fingerprints_resumes_unchecked_with_one_warning(finished, tmp_path, capsys):
    """Without a fingerprint, run.json guards the resume as before; without a usable run.json either, the resume goes
    on with one warning that it is unchecked, and the checkpoints it saves carry the new run's fingerprint."""
    workdir = copy_of(finished[0], tmp_path)
    as_before_fingerprints(workdir)
    with pytest.raises(jdp.FitError, match=f"{LR}: every update is 2x"):  # run.json: checked, as before
        fit(workdir, 8, optimizer=sgd(0.2))
    record = (workdir / "run.json").read_bytes()
    (workdir / "run.json").write_bytes(os.urandom(64))  # unreadable: refused, as before (nothing to check against)
    with pytest.raises(jdp.FitError, match=re.escape(f"{workdir / 'run.json'} cannot be read")):
        fit(workdir, 4)
    (workdir / "run.json").write_bytes(record)
    (workdir / "run.json").unlink()
    capsys.readouterr()
    assert fit(workdir, 6, optimizer=sgd(0.2)).step == 6
    warnings = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert warnings == [f"jdp: warning: checkpoint {workdir / 'checkpoints' / '4'} carries no fingerprint of its "
                        f"settings (a jdp from before them saved it) and {workdir / 'run.json'} holds no usable "
                        "record: the resume is unchecked"]
    (workdir / "run.json").unlink()
    with pytest.raises(jdp.FitError) as refused:  # checkpoint 6 carries lr 0.2's fingerprint
        fit(workdir, 8)
    assert against_checkpoint(str(refused.value), workdir / "checkpoints" / "6") == {LR}


def test_allow_config_change_without_run_json_warns_once_and_saves_the_new_fingerprint(stopped, tmp_path, capsys):
    """A deliberate change to a checkpoint whose run.json is gone: one warning line, and the checkpoints saved from
    then on carry the new settings, so the old ones are refused against them."""
    workdir = copy_of(stopped, tmp_path)
    (workdir / "run.json").unlink()
    capsys.readouterr()
    assert fit(workdir, 8, optimizer=sgd(0.2), allow_config_change=True).step == 8
    warnings = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert warnings == [f"jdp: warning: resuming {workdir} with other settings (allow_config_change): the settings "
                        f"differ from those checkpoint {workdir / 'checkpoints' / '4'} was saved under: {LR}: every "
                        "update is 2x the recorded run's"]
    (workdir / "run.json").unlink()
    with pytest.raises(jdp.FitError) as refused:
        fit(workdir, 8)
    assert against_checkpoint(str(refused.value), workdir / "checkpoints" / "8") == {LR}
    assert fit(workdir, 8, optimizer=sgd(0.2)).step == 8  # the new settings are the checkpoint's now


# The CLI's guard is fit's, given the config's settings that change the numerics or the data order.
CLI = ["--config", "digits_mlp", "--config.model.kwargs.hidden_sizes=(16,)", "--config.parallel.num_devices=2",
       "--config.train.global_batch_size=32", "--config.train.log_every=1", "--config.train.eval_every=0",
       "--config.checkpoint.every_steps=2"]


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory):
    """`python -m jdp.train` (in this process) for 4 steps: checkpoints 2 and 4, config.json and run.json."""
    workdir = tmp_path_factory.mktemp("cli") / "run"
    assert train_cli.main([*CLI, "--config.train.steps=4", "--workdir", str(workdir)]) == 0
    return workdir


def test_the_cli_refuses_a_changed_lr_with_config_json_and_run_json_deleted(cli_run, tmp_path, capsys):
    workdir = copy_of(cli_run, tmp_path)
    (workdir / "config.json").unlink()
    (workdir / "run.json").unlink()
    capsys.readouterr()
    assert train_cli.main([*CLI, "--config.train.steps=4", "--config.optim.lr=0.03", "--workdir", str(workdir)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("jdp: error: "), err
    assert "--config.checkpoint.allow_config_change=True" in err
    assert against_checkpoint(err.strip(), workdir / "checkpoints" / "4") == {guard_lib._SETTINGS, LR}


@pytest.mark.parametrize("eval_only", [False, True])
def test_a_workdir_without_its_config_json_points_to_its_history(cli_run, tmp_path, capsys, eval_only):
    """`--workdir W` alone, config.json gone: neither the default config nor a jdp.fit run's record is tried."""
    workdir = copy_of(cli_run, tmp_path)
    (workdir / "config.json").unlink()
    capsys.readouterr()
    assert train_cli.main(["--workdir", str(workdir), *["--eval_only"] * eval_only]) == 2
    assert capsys.readouterr().err == (f"jdp: config error: {workdir} holds a jdp.train run without its config.json; "
                                       f"restore it from the last line of {workdir / 'config_history.jsonl'}, or "
                                       "pass --config\n")


def test_a_changed_step_count_on_the_cli_is_one_warning_line(cli_run, tmp_path, capsys):
    workdir = copy_of(cli_run, tmp_path)
    capsys.readouterr()
    assert train_cli.main([*CLI, "--config.train.steps=6", "--workdir", str(workdir)]) == 0
    out, err = capsys.readouterr()
    assert "warning" not in out and err.splitlines() == [
        "jdp: warning: steps changed from 4 to 6: the run goes on from step 4; a learning-rate schedule built from "
        "steps changes from here on (it is not compared)"]


def test_a_config_setting_fit_cannot_see_is_refused_by_its_key(cli_run, tmp_path, capsys):
    """Extended to 6 steps under another decay: the optimizer's first update is the same, and a schedule is not
    compared when steps change, but the config's optim.schedule is guarded: named from run.json, and by the
    checkpoint's fingerprint of the config's settings once run.json is gone."""
    workdir = copy_of(cli_run, tmp_path)
    args = [*CLI, "--config.train.steps=6", "--config.optim.schedule=linear", "--workdir", str(workdir)]
    capsys.readouterr()
    assert train_cli.main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and listed(err.strip()) == {"optim.schedule"}, err
    assert "optim.schedule: 'cosine' -> 'linear'" in err
    (workdir / "run.json").unlink()
    assert train_cli.main(args) == 2
    assert against_checkpoint(capsys.readouterr().err.strip(), workdir / "checkpoints" / "4") == {guard_lib._SETTINGS}


def test_a_workdir_whose_record_lacks_the_configs_keys_says_what_its_resume_checks(cli_run, tmp_path, capsys):
    """A workdir of a jdp from before run.json held the config's keys (and before fingerprints): its resume checks
    fit's own settings, says in one line that the config's keys were not checked, and records them for the next."""
    workdir = copy_of(cli_run, tmp_path)
    as_before_fingerprints(workdir)
    record = json.loads((workdir / "run.json").read_text())
    record["fit"]["settings"] = None
    (workdir / "run.json").write_text(json.dumps(record))
    capsys.readouterr()
    assert train_cli.main([*CLI, "--config.train.steps=6", "--workdir", str(workdir)]) == 0
    warnings = [line for line in capsys.readouterr().err.splitlines() if "holds no record of the config's keys" in line]
    assert len(warnings) == 1 and warnings[0].startswith("jdp: warning: ")
    assert json.loads((workdir / "run.json").read_text())["fit"]["settings"]


def test_a_resume_may_shard_the_optimizer_state_from_fit_and_from_the_cli_alike(stopped, whole, cli_run, tmp_path,
                                                                                capsys):
    """ZeRO-1 computes what the mean all-reduce does, so a run that no longer fits resumes with its optimizer state
    sharded, from fit and from the CLI alike (the CLI once refused it by its own key); a change of the strategy's
    numerics is still refused, by its record and by the checkpoint alone."""
    workdir = copy_of(stopped, tmp_path / "fit")
    result = fit(workdir, 8, shard_optimizer=True)
    assert "resumed from" in capsys.readouterr().out
    np.testing.assert_allclose(result.losses, whole.losses[4:], rtol=RTOL)
    workdir = copy_of(cli_run, tmp_path / "cli")
    assert train_cli.main([*CLI, "--config.train.steps=6", "--config.parallel.shard_optimizer=True",
                           "--workdir", str(workdir)]) == 0
    capsys.readouterr()
    bf16 = [*CLI, "--config.train.steps=6", "--config.parallel.allreduce_dtype=bf16", "--workdir", str(workdir)]
    assert train_cli.main(bf16) == 2
    assert listed(capsys.readouterr().err.strip()) == {"sync strategy"}
    (workdir / "run.json").unlink()
    assert train_cli.main(bf16) == 2
    assert against_checkpoint(capsys.readouterr().err.strip(), workdir / "checkpoints" / "6") == {FIT_PARTS}


def test_a_cli_workdir_whose_guard_held_the_sync_flags_resumes_and_is_still_guarded(cli_run, tmp_path, capsys):
    """An older jdp guarded the sync flags among the config's keys too (run.json's settings, and the hash of them in
    a version-1 fingerprint): its workdir resumes under this jdp, and a changed learning rate is still refused by
    run.json and, without it, by the checkpoint's fingerprint."""
    workdir = copy_of(cli_run, tmp_path)
    record = json.loads((workdir / "run.json").read_text())
    record["fit"]["settings"]["parallel.shard_optimizer"] = False
    (workdir / "run.json").write_text(json.dumps(record))
    for metadata in (workdir / "checkpoints").glob("*/data/metadata"):
        item = json.loads(metadata.read_text())
        item["fingerprint"] |= {"version": 1, "settings": "a hash of other keys"}
        metadata.write_text(json.dumps(digest.sealed({k: v for k, v in item.items() if k != "checksum"})))
    args = [*CLI, "--config.optim.lr=0.03", "--workdir", str(workdir)]
    assert train_cli.main(args) == 2
    assert "every update is" in capsys.readouterr().err
    (workdir / "run.json").unlink()
    assert train_cli.main(args) == 2
    assert against_checkpoint(capsys.readouterr().err.strip(), workdir / "checkpoints" / "4") == {LR}
    assert train_cli.main([*CLI, "--config.train.steps=6", "--workdir", str(workdir)]) == 0


# 3. Reopened from Python ----------------------------------------------------------------------------------


@pytest.mark.parametrize("how", [{"num_devices": 2}, {"global_batch_size": 16}], ids=["as fit", "8 devices, padded"])
def test_restore_and_evaluate_reproduce_the_runs_last_eval(finished, how):
    """`jdp.restore` must rebuild the run's model from its record with the last checkpoint's parameters and
    BatchNorm statistics, and `jdp.evaluate` must weigh every row once (padding masked) on any device count."""
    workdir, result = finished
    model = jdp.restore(workdir)
    assert isinstance(model, user_models.CallTimeDropoutCNN) and model.dropout.rate == 0.2
    metrics = jdp.evaluate(model, LOSS, EVAL, **how)
    last = records(workdir, "eval")[-1]
    assert last["step"] == 4 and set(metrics) == set(result.eval_metrics) == {"loss", "accuracy"}
    for key, value in metrics.items():
        np.testing.assert_allclose(value, result.eval_metrics[key], rtol=RTOL)
        np.testing.assert_allclose(value, last[key], rtol=RTOL)


def test_evaluate_refuses_bad_devices_and_data_in_one_line(finished):
    """num_devices=-1 ran on all devices but the last and -2 was a ZeroDivisionError; an empty dict a bare
    StopIteration; arrays of unequal lengths were called "the train data"."""
    model = jdp.restore(finished[0])
    x, y = EVAL()["x"], EVAL()["y"]
    for data, num_devices, refusal in (
            (EVAL, -1, "num_devices=-1 must be a whole number of devices, or 0 for all of them"),
            (EVAL, -2, "num_devices=-2 must be a whole number of devices, or 0 for all of them"),
            ({}, 0, "evaluate's data is an empty dict; give a dict of arrays that share a leading length"),
            ({"x": x, "y": y[:-1]}, 0, f"evaluate's data: the arrays' leading lengths differ (x: {len(x)}, y: "
                                       f"{len(x) - 1})")):
        with pytest.raises(jdp.FitError, match=f"^{re.escape(refusal)}"):
            jdp.evaluate(model, LOSS, data, num_devices=num_devices)


def test_a_folder_that_holds_no_run_is_named_as_such(tmp_path, capsys):
    """An empty folder (a mistyped --workdir) was told to pass the model, on the command line too."""
    refusal = (f"{tmp_path} holds no run (neither run.json nor checkpoints); pass the workdir of a jdp.train or "
               "jdp.fit run")
    with pytest.raises(jdp.FitError, match=f"^{re.escape(refusal)}$"):
        jdp.restore(tmp_path)
    assert export_cli.main(["--workdir", str(tmp_path), "--out", str(tmp_path / "p.npz")]) == 2
    assert capsys.readouterr().err == f"jdp.export: {refusal}\n"


def test_restore_fills_a_given_instance_and_takes_a_step(finished):
    """A given module is filled in place (its parameters those of the checkpoint); `step` picks an older one."""
    workdir, result = finished
    instance = user_models.make_call_time_cnn(seed=7, rate=0.2)  # other initial values
    assert jdp.restore(workdir, instance) is instance
    params = nnx.to_pure_dict(nnx.state(instance, nnx.Param))
    assert max_abs_diff(jax.tree.map(np.asarray, params), result.params) == 0
    older = nnx.to_pure_dict(nnx.state(jdp.restore(workdir, step=2), nnx.Param))
    assert max_abs_diff(jax.tree.map(np.asarray, older), result.params) > 0
    with pytest.raises(jdp.FitError, match="no checkpoint of step 3") as missing:
        jdp.restore(workdir, step=3)
    assert "\n" not in str(missing.value)


def test_restore_of_a_run_whose_model_cannot_be_imported_asks_for_it(local_run):
    """A model the record cannot name fails in one line saying to pass it, and works when it is passed."""
    workdir, result, scripted = local_run
    with pytest.raises(jdp.FitError, match=r"pass it: jdp.restore\(workdir, model\)") as refused:
        jdp.restore(workdir)
    assert "\n" not in str(refused.value) and "Scripted" in str(refused.value)
    model = jdp.restore(workdir, scripted(rate=0.2, rngs=nnx.Rngs(3)))
    params = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    assert max_abs_diff(params, result.params) == 0
    metrics = jdp.evaluate(model, LOSS, EVAL(), num_devices=2)
    np.testing.assert_allclose(metrics["loss"], result.eval_metrics["loss"], rtol=RTOL)


def test_export_of_a_run_whose_model_cannot_be_imported_names_jdp_export(local_run, tmp_path):
    """The refusal names the function called, and how it takes the model: jdp.export_params(workdir, path, model)."""
    workdir, result, scripted = local_run
    with pytest.raises(jdp.FitError, match=r"pass it: jdp.export_params\(workdir, path, model\)$") as refused:
        jdp.export_params(workdir, tmp_path / "p.npz")
    assert "jdp.restore" not in str(refused.value) and not (tmp_path / "p.npz").exists()
    step, _ = jdp.export_params(workdir, tmp_path / "p.npz", scripted(rate=0.2, rngs=nnx.Rngs(3)))
    with np.load(tmp_path / "p.npz") as exported:
        np.testing.assert_array_equal(exported["params/conv/kernel"], result.params["conv"]["kernel"])
    assert step == 4


def test_restore_refuses_a_model_of_other_shapes_in_one_line(finished):
    """Loading a checkpoint into a model of other shapes must say so, not fail deep in Flax."""
    with pytest.raises(jdp.FitError, match="do not match the checkpoint") as refused:
        jdp.restore(finished[0], user_models.CallTimeDropoutCNN(features=4, rngs=nnx.Rngs(0)))
    assert "\n" not in str(refused.value)


def test_a_missing_workdir_is_named_as_missing(tmp_path):
    """jdp.restore, export and the export command on a workdir that is not there blamed its absent run.json."""
    (tmp_path / "file").write_text("")
    for workdir, why in ((tmp_path / "gone", "does not exist"), (tmp_path / "file", "is not a directory")):
        with pytest.raises(jdp.FitError, match=f"^workdir {workdir} {why}; pass the workdir of a run$"):
            jdp.restore(workdir)
        with pytest.raises(jdp.FitError, match=why):
            jdp.export_params(workdir, tmp_path / "p.npz", user_models.CallTimeDropoutCNN(features=4,
                                                                                        rngs=nnx.Rngs(0)))
    assert not (tmp_path / "p.npz").exists()


def test_export_writes_the_parameters_and_state_of_the_last_checkpoint(finished, tmp_path):
    """`jdp.export_params` writes what `init_from` reads: params/... and model_state/... of the
    last checkpoint, and its step."""
    workdir, result = finished
    step, count = jdp.export_params(workdir, tmp_path / "params.npz")
    with np.load(tmp_path / "params.npz") as exported:
        arrays = dict(exported)
    assert step == 4 and int(arrays.pop("step")) == 4 and count == len(arrays)
    assert {"params/conv/kernel", "params/bn/scale", "params/head/bias", "model_state/bn/mean",
            "model_state/bn/var"} <= set(arrays)
    assert all(k.startswith(("params/", "model_state/")) for k in arrays)
    np.testing.assert_array_equal(arrays["params/conv/kernel"], result.params["conv"]["kernel"])
    np.testing.assert_array_equal(arrays["model_state/bn/mean"], result.model_state["bn"]["mean"])
    missing = tmp_path / "missing" / "params.npz"  # was a raw FileNotFoundError, after the restore
    with pytest.raises(jdp.FitError, match=f"^cannot write {missing}: {missing.parent} is not an existing folder; "
                                           "make it, or give another path$"):
        jdp.export_params(workdir, missing)


def test_evaluate_run_names_the_piece_given_as_an_object(finished, tmp_path):
    """Data given as arrays has no import path: `--eval_only` must name the eval data as what is missing (the model
    and loss are importable), and the data's description must not depend on how it was given."""
    fit(tmp_path / "run", 2, train_data=TRAIN(), eval_data=EVAL())
    data = saved_record(tmp_path / "run")["fit"]["data"]
    assert data["train"]["factory"] is None and data["eval"]["factory"] is None
    assert data["train"]["sample_hash"] == saved_record(finished[0])["fit"]["data"]["train"]["sample_hash"]
    with pytest.raises(jdp.FitError, match="whose eval data cannot be imported") as refused:
        reopen.evaluate_run(tmp_path / "run")
    assert "\n" not in str(refused.value)


# 4. On the command line -----------------------------------------------------------------------------------


def jdp_command(module: str, *args) -> subprocess.CompletedProcess:
    """`python -m MODULE ARGS` on 2 CPU devices, from the repo root (so `tests.user_models` imports)."""
    return subprocess.run([sys.executable, "-m", module, *map(str, args)], cwd=REPO, capture_output=True, text=True,
                          timeout=180, env={**os.environ, "JAX_NUM_CPU_DEVICES": "2"})


def one_line(out: subprocess.CompletedProcess, *expected: str) -> str:
    assert out.returncode == 2, out.stderr[-2000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr[-2000:]
    for text in expected:
        assert text in lines[0]
    return lines[0]


@pytest.mark.slow
def test_the_export_command_writes_what_jdp_export_writes(finished, tmp_path):
    """`python -m jdp.export` on a fit workdir (model importable from its record) must write the same file."""
    workdir, _ = finished
    out = jdp_command("jdp.export", "--workdir", workdir, "--out", tmp_path / "cli.npz")
    assert out.returncode == 0, out.stderr[-2000:]
    assert "of step 4" in out.stdout
    jdp.export_params(workdir, tmp_path / "python.npz")
    with np.load(tmp_path / "cli.npz") as cli, np.load(tmp_path / "python.npz") as python:
        assert sorted(cli) == sorted(python)
        for key in cli:
            np.testing.assert_array_equal(cli[key], python[key])


@pytest.mark.slow
def test_eval_only_on_a_fit_workdir_appends_the_runs_eval(finished, tmp_path):
    """`python -m jdp.train --eval_only` rebuilds model, loss and eval data from the record and evaluates as fit
    did: the appended line equals the run's last."""
    workdir = copy_of(finished[0], tmp_path)
    out = jdp_command("jdp.train", "--workdir", workdir, "--eval_only")
    assert out.returncode == 0, out.stderr[-2000:]
    first, again = records(workdir, "eval")
    assert again["step"] == first["step"] == 4
    for key in ("loss", "accuracy"):
        np.testing.assert_allclose(again[key], first[key], rtol=RTOL)
    assert not (workdir / "config.json").exists()  # still a fit workdir, not mistaken for a jdp.train one


@pytest.mark.slow
def test_the_commands_on_a_run_whose_model_cannot_be_imported_say_what_is_missing(local_run, tmp_path):
    """Without an importable model both commands must exit 2 with one line naming the model, not a traceback;
    `python -m jdp.sample` (language-model runs of jdp.train) says a fit run is not one."""
    workdir, _, _ = local_run
    line = one_line(jdp_command("jdp.export", "--workdir", workdir, "--out", tmp_path / "p.npz"),
                    "jdp.export:", "cannot be rebuilt", "jdp.export_params(workdir, path, model)")
    assert not (tmp_path / "p.npz").exists(), line
    before = len(records(workdir, "eval"))
    one_line(jdp_command("jdp.train", "--workdir", workdir, "--eval_only"), "model cannot be imported",
             "jdp.evaluate(jdp.restore(workdir, model), loss_fn, data)")
    assert len(records(workdir, "eval")) == before
    one_line(jdp_command("jdp.sample", "--workdir", workdir), "is a jdp.fit run", "jdp.restore(workdir, model)")
