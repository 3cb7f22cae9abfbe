"""Every bad input gets one line naming the field or path and the fix, and its documented exit code, before
anything compiles where that is possible; `jdp.fit` raises the same lines as exceptions."""

import errno
import json
import logging
import math
import os
import re
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jdp
from jdp import distributed, storage
from jdp.cli import config as config_lib
from jdp.cli.train import main
from jdp.configs import base
from jdp.data.batching import Batcher
from jdp.metrics import MetricsWriter

TINY = ["--config", "digits_mlp", "--config.model.kwargs.hidden_sizes=(16,)", "--config.train.log_every=1",
        "--config.parallel.num_devices=2", "--config.train.global_batch_size=32"]


def one_line(capsys, code_expected: int, code: int, *expected: str) -> str:
    """The exit code, and one line on stderr holding every `expected` text (and a warning or two at most)."""
    out, err = capsys.readouterr()
    assert code == code_expected, err
    warnings = [line for line in err.splitlines() if line.startswith("jdp: warning: ")]
    err = "".join(line + "\n" for line in err.splitlines() if line not in warnings)
    assert err.count("\n") == 1 and "Traceback" not in err + out and len(warnings) <= 2, err
    for text in expected:
        assert text in err, err
    return err


def write(path, text: str):
    path.write_text(textwrap.dedent(text))
    return path


# -- 1. usage errors in the config file, the workdir and the data: exit 2 ------------------------------------

FILES = {
    "syntax error": ("def get_config(:\n    pass\n", "line 1"),
    "get_config raises": ("def get_config():\n    raise RuntimeError('no GPU here')\n",
                          "line 2: get_config() raised RuntimeError: no GPU here"),
    "not a ConfigDict": ("def get_config():\n    return {'train': {}}\n", "returned a dict; it must return an "
                                                                        "ml_collections.ConfigDict"),
    "string in an int field": ("from jdp.configs import base\ndef get_config():\n    c = base.get_config()\n"
                               "    c.train.steps = 'ten'\n    return c\n", "line 4: get_config() raised TypeError"),
    "string in an int section": ("import ml_collections\nfrom jdp.configs import base\ndef get_config():\n"
                                 "    c = base.get_config()\n    c.checkpoint = ml_collections.ConfigDict("
                                 "dict(every_steps='5', keep=3, allow_config_change=False))\n    return c\n",
                                 "checkpoint.every_steps='5' is a str; it must be a int"),
    "unknown key": ("from jdp.configs import base\ndef get_config():\n    c = base.get_config()\n"
                    "    c.train.stepz = 5\n    return c\n",
                    "sets an unknown key train.stepz; did you mean train.steps?"),
    "sys.exit(0) while loading": ("import sys\nsys.exit(0)\n", "line 2 exited while loading (sys.exit(0))"),
    "SystemExit in get_config": ("def get_config():\n    raise SystemExit('no')\n",
                                 "line 2 exited while loading (get_config() called sys.exit('no'))"),
    "missing key": ("import ml_collections\ndef get_config():\n    return ml_collections.ConfigDict({'seed': 0})\n",
                    "lacks checkpoint.allow_config_change and "),
}


@pytest.mark.parametrize("case", FILES, ids=list(FILES))
def test_a_bad_config_file_is_one_line(case, tmp_path, capsys):
    text, expected = FILES[case]
    path = write(tmp_path / "my_config.py", text)
    one_line(capsys, 2, main(["--config", str(path), "--workdir", str(tmp_path / "run")]), str(path), expected)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("case", ["a directory", "/dev/null", "an empty file"])
def test_a_config_path_that_is_no_python_file_says_what_it_is(case, tmp_path, capsys):
    """Not "not found": the path exists; the line says what it is and what --config takes."""
    (tmp_path / "empty.py").write_text("")
    path, expected = {"a directory": (tmp_path, "is a directory; pass --config PATH.py"),
                      "/dev/null": ("/dev/null", "is not a regular file (a device or a pipe); pass --config PATH.py"),
                      "an empty file": (tmp_path / "empty.py", "is empty; it must define get_config()")}[case]
    err = one_line(capsys, 2, main(["--config", str(path), "--workdir", str(tmp_path / "run")]),
                   f"config file {path} {expected}")
    assert "not found" not in err and not (tmp_path / "run").exists()


def test_model_kwargs_in_a_config_file_are_the_models_own(tmp_path):
    path = write(tmp_path / "c.py", """
        from jdp.configs import base
        def get_config():
            c = base.get_config()
            c.model.name = "mlp"
            c.model.kwargs.hidden_sizes = [8]
            c.optim.lr = 1  # an int for a float field
            return c
        """)
    cfg = config_lib.load_config_file(path)
    assert cfg.model.kwargs.hidden_sizes == [8] and cfg.optim.lr == 1.0 and isinstance(cfg.optim.lr, float)


OVERRIDES = {
    "hidden_sizes float": (["--config.model.kwargs.hidden_sizes=0.5"], "model.kwargs.hidden_sizes=(0.5,) must be"),
    "hidden_sizes negative": (["--config.model.kwargs.hidden_sizes=(-3,)"], "model.kwargs.hidden_sizes=(-3,)"),
    "hidden_sizes zero": (["--config.model.kwargs.hidden_sizes=(0,)"], "a tuple of positive ints"),
    "synthetic shape": (["--config.data.name=synthetic", "--config.data.num_classes=10", "--config.data.shape=(0,)"],
                        "data.shape=(0,) must be a tuple of positive sizes"),
    "no eval examples": (["--config.data.name=synthetic", "--config.data.num_classes=10",
                          "--config.data.num_eval_examples=0"], "data.num_eval_examples=0 must be at least 1"),
    "eval batch past the split": (["--config.train.eval_batch_size=2000000000"],
                                  "train.eval_batch_size=2000000000 is larger than the eval split needs (360 "
                                  "examples on 2 device(s)); set --config.train.eval_batch_size to at most 360"),
    "truncated init_from": (["--config.init_from=TRUNCATED"], "init_from=TRUNCATED cannot be read"),
    "a .npy as init_from": (["--config.init_from=array.npy"],  # a TypeError traceback: np.load's one array
                            "init_from=array.npy cannot be read (ValueError: array.npy is not an .npz file (a zip of "
                            "named arrays)); give a file written by python -m jdp.export"),
}


@pytest.mark.parametrize("case", OVERRIDES, ids=list(OVERRIDES))
def test_a_bad_setting_is_one_line_before_anything_compiles(case, tmp_path, capsys, monkeypatch):
    args, expected = OVERRIDES[case]
    monkeypatch.chdir(tmp_path)
    np.savez(tmp_path / "whole.npz", a=np.zeros(1000))
    (tmp_path / "TRUNCATED").write_bytes((tmp_path / "whole.npz").read_bytes()[:300])
    np.save(tmp_path / "array.npy", np.zeros(3))
    one_line(capsys, 2, main([*TINY, *args, "--workdir", "run"]), expected)
    assert not (tmp_path / "run").exists()


NOTHING_WRITTEN = {
    "bind_address garbage": (["--config.distributed.bind_address=garbage"],
                             "distributed.bind_address='garbage' is not HOST:PORT"),
    "mlflow uri ::::": (["--config.metrics.loggers=mlflow", "--config.metrics.mlflow_tracking_uri=::::"],
                        "metrics.mlflow_tracking_uri='::::' is neither a URI"),
    "loggers ,,": (["--config.metrics.loggers=,,"], "metrics.loggers=',,' has an empty name between its commas"),
}


@pytest.mark.parametrize("case", NOTHING_WRITTEN, ids=list(NOTHING_WRITTEN))
def test_a_bad_address_uri_or_logger_list_is_one_line_and_writes_nothing(case, tmp_path, capsys, monkeypatch):
    """Checked in a single-process run too: no workdir, and no directory named `::::` in the working directory."""
    args, expected = NOTHING_WRITTEN[case]
    monkeypatch.chdir(tmp_path)
    one_line(capsys, 2, main([*TINY, *args, "--workdir", "run"]), expected)
    assert list(tmp_path.iterdir()) == []


def test_mlflow_refuses_a_tracking_uri_that_is_neither_uri_nor_path():
    from jdp.loggers import MLflow

    with pytest.raises(jdp.UsageError, match=r"^MLflow\(tracking_uri='::::'\) is neither a URI"):
        MLflow(tracking_uri="::::")
    for uri in ("http://localhost:5000", "file:./mlruns", "sqlite:///m.db", "runs/mlruns"):
        MLflow(tracking_uri=uri)


def _read_only_access(monkeypatch):
    """Root writes anywhere whatever the mode bits: then report them as a non-root user would see them."""
    if os.geteuid() == 0:
        real = os.access
        monkeypatch.setattr(os, "access", lambda p, mode: real(p, mode) and bool(os.stat(p).st_mode & 0o200))


@pytest.mark.parametrize("case", ["a file", "under a file", "read-only", "a name too long"])
def test_an_unusable_workdir_is_one_line(case, tmp_path, capsys, monkeypatch):
    (tmp_path / "f").write_text("")
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o555)
    _read_only_access(monkeypatch)
    workdir, expected = {"a file": (tmp_path / "f", "is a file, not a directory"),
                         "under a file": (tmp_path / "f" / "run", f"lies under {tmp_path / 'f'}, which is a file"),
                         "read-only": (locked / "run", f"({locked} is read-only to this user)"),
                         "a name too long": (tmp_path / ("a" * 300), "cannot be used (File name too long); pass "
                                                                     "another")}[case]  # was an OSError traceback
    one_line(capsys, 2, main([*TINY, "--workdir", str(workdir)]), str(workdir), expected)
    with pytest.raises(jdp.FitError, match=re.escape(expected)):
        jdp.fit(lambda: nnx.Linear(2, 1, rngs=nnx.Rngs(0)), _mse, _data(), optimizer=optax.sgd(0.1), steps=1,
                global_batch_size=8, workdir=workdir)


def test_a_garbage_config_json_in_the_workdir_is_one_line(tmp_path, capsys):
    (tmp_path / "config.json").write_text("{not json")
    one_line(capsys, 2, main(["--workdir", str(tmp_path)]), f"{tmp_path / 'config.json'} is not a readable jdp "
                                                            "config", "move it away, or pass --config")
    (tmp_path / "config.json").write_text(json.dumps({"train": {"steps": "many"}}))
    one_line(capsys, 2, main(["--workdir", str(tmp_path)]), "--config.train.steps=many is not a valid int")


# -- 2. one table of the valid range of every numeric field ---------------------------------------------------

def _numeric_fields(cfg) -> dict:
    return {k: v for k, v in distributed.flatten(cfg.to_dict()).items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)}


def test_every_numeric_field_of_base_has_a_range():
    fields = _numeric_fields(base.get_config())
    assert sorted(fields) == sorted(config_lib.RANGES)
    for key, value in fields.items():
        assert value in config_lib.RANGES[key], f"the default {key}={value} is outside its own range"


def _outside(valid: config_lib.Range) -> float:
    if valid.high != math.inf:
        return valid.high + 1
    return valid.low if valid.low_open else valid.low - 1


@pytest.mark.parametrize("key", list(config_lib.RANGES))
def test_each_numeric_field_refuses_a_value_out_of_its_range(key, tmp_path, capsys):
    value = _outside(config_lib.RANGES[key])
    value = int(value) if isinstance(base.get_config()[key], int) else float(value)
    one_line(capsys, 2, main([f"--config.{key}={value}", "--workdir", str(tmp_path)]),
             f"{key}={value} must ", f"set --config.{key} to a value")


def test_nan_is_outside_every_range(tmp_path, capsys):
    one_line(capsys, 2, main(["--config.optim.momentum=nan", "--workdir", str(tmp_path)]),
             "optim.momentum=nan must be finite and in [0, 1)")


@pytest.mark.parametrize("key,value", [("optim.lr", "inf"), ("optim.lr", "nan"), ("train.max_skipped_fraction",
                                                                                   "inf")])
def test_inf_and_nan_are_refused_as_not_finite(key, value, tmp_path, capsys):
    """`lr=inf` is positive: the line says what is wrong with it, that it is not finite (the config's own ranges
    and the training options' alike, and `fit`'s keywords, which share the check)."""
    workdir = tmp_path / "run"
    one_line(capsys, 2, main([f"--config.{key}={value}", "--workdir", str(workdir)]),
             f"{key}={value} must be finite and ")
    assert not workdir.exists()
    with pytest.raises(jdp.FitError, match=r"^max_skipped_fraction=inf must be finite and in \[0, 1\]$"):
        jdp.fit(lambda: nnx.Linear(2, 1, rngs=nnx.Rngs(0)), _mse, _data(), optimizer=optax.sgd(0.1), steps=1,
                global_batch_size=8, max_skipped_fraction=math.inf)


# -- jdp.fit: the same checks, raised as one-line FitErrors -----------------------------------------------------

def _mse(model, batch):
    return {"loss": (model(batch["x"])[:, 0] - batch["y"]) ** 2}


def _data(n: int = 64) -> dict:
    x = np.random.default_rng(0).normal(size=(n, 2)).astype(np.float32)
    return {"x": x, "y": x.sum(1)}


FIT_CASES = {
    "eval data without rows": (dict(eval_data=_data(0)), "the eval data has no rows"),
    "eval batch past the eval data": (dict(eval_data=_data(10), eval_batch_size=64, num_devices=2),
                                      "eval_batch_size=64 is larger than the eval data needs (10 examples on 2 "
                                      "device(s)); use at most 10"),
    "skipped fraction": (dict(max_skipped_fraction=1.5), "max_skipped_fraction=1.5 must be in [0, 1]"),
    "seed": (dict(seed=2**32), "seed=4294967296 must be in [0, 4294967295]"),
    # Found at the first eval, after training, before: its KeyError a traceback at every rerun.
    "eval_derived that fails": (dict(eval_data=_data(), eval_derived=lambda means: {"ppl": means["nope"]}),
                                "eval_derived failed on eval means of ['loss']: KeyError: 'nope'"),
    "steps of another period": (dict(sync_every=2, steps=3), "steps=3 is not a multiple of the sync period 2 "
                                                             "(sync_every=2); use a multiple"),
    "no steps": (dict(steps=0), "steps=0 must be positive and below 2**31"),
}


@pytest.mark.parametrize("case", FIT_CASES, ids=list(FIT_CASES))
def test_fit_refuses_in_one_line(case):
    options, expected = FIT_CASES[case]
    with pytest.raises(jdp.FitError) as raised:
        jdp.fit(lambda: nnx.Linear(2, 1, rngs=nnx.Rngs(0)), _mse, _data(), optimizer=optax.sgd(0.1),
                global_batch_size=8, **{"steps": 1, **options})
    assert expected in str(raised.value) and "\n" not in str(raised.value)


# -- 4. a full disk: exit 6, one line naming the path and the free space --------------------------------------

def test_a_full_disk_is_one_line_and_the_last_checkpoint_resumes(tmp_path, capsys, monkeypatch):
    """Simulated: the metrics file's writes fail with ENOSPC from step 5 on, after the checkpoint of step 4."""
    original = MetricsWriter._write

    def full_from_step_5(self, record):
        if record.get("step", 0) >= 5:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp_path / "metrics.jsonl"))
        original(self, record)

    monkeypatch.setattr(MetricsWriter, "_write", full_from_step_5)
    args = [*TINY, "--config.train.steps=8", "--config.checkpoint.every_steps=2", "--config.train.eval_every=8",
            "--workdir", str(tmp_path)]
    one_line(capsys, 6, main(args), f"jdp: disk: no space left on device writing {tmp_path / 'metrics.jsonl'} (",
             " free there); the last checkpoint, step 4, is intact: free space and rerun to resume")
    monkeypatch.undo()
    assert main(args) == 0
    assert f"resumed from {tmp_path / 'checkpoints' / '4'}" in capsys.readouterr().out


def test_orbax_write_failures_are_recognised_and_kept_quiet():
    """The text orbax 0.12 raised (and logged from each of its threads) when a real 2 MB tmpfs filled up."""
    text = ('RESOURCE_EXHAUSTED: Error writing "params.layers.0.bias/0" in OCDBT database at local file "/w/c/6.orbax-'
            'checkpoint-tmp/ocdbt.process_0/": Failed writing: "/w/c/6.orbax-checkpoint-tmp/ocdbt.process_0/d/aa2a": '
            "Failed to write 733997 bytes to file 12: No space left on device [os_error_code='28']")
    try:
        try:
            raise ValueError(text)
        except ValueError as inner:
            raise RuntimeError("Save Finalize thread (save_finalize) failed.") from inner
    except RuntimeError as outer:
        error = outer
    assert storage.disk_failure(error) == (errno.ENOSPC, "/w/c/6.orbax-checkpoint-tmp/ocdbt.process_0/d/aa2a")
    assert storage.disk_failure(ValueError("shapes differ")) is None
    assert storage.disk_failure(FileNotFoundError(errno.ENOENT, "gone", "x")) is None  # not the disk's fault
    quiet = storage.quiet_disk_failures

    def record(message, exc_info=None):
        return logging.LogRecord("absl", logging.ERROR, "f", 1, message, (), exc_info)

    assert not quiet(record("thread failed", (RuntimeError, error, None)))
    assert not quiet(record(text))
    # asyncio's word on a read task orbax gave up on: jdp retries that read, and reports it if it stays unreadable.
    unreadable = PermissionError(errno.EACCES, "Permission denied", "/w/c/12/state/d/aa2a")
    assert not quiet(record("_GatheringFuture exception was never retrieved", (PermissionError, unreadable, None)))
    assert quiet(record("something else failed"))


# -- 5. skipping non-finite steps has a limit, and the halt says what was not finite --------------------------

def test_skipping_past_max_skipped_fraction_halts_with_exit_3(tmp_path, capsys, monkeypatch):
    original = Batcher.train_batch

    def nan_from_step_3(self, step):
        rows = original(self, step)
        return {**rows, "x": np.full_like(rows["x"], np.nan)} if step >= 2 else rows

    monkeypatch.setattr(Batcher, "train_batch", nan_from_step_3)
    code = main([*TINY, "--config.train.steps=40", "--config.train.on_nonfinite=skip",
                 "--config.train.max_skipped_fraction=0.05", "--workdir", str(tmp_path)])
    err = one_line(capsys, 3, code, "jdp: halted: 6 of the last 8 steps were skipped as non-finite, more than "
                   "max_skipped_fraction=0.05", "the latest, step 8, had non-finite inputs (batch key 'x')")
    assert "state is saved" in err and sorted(p.name for p in (tmp_path / "checkpoints").iterdir())


def test_nan_in_the_eval_data_is_one_warning_naming_the_key_and_the_summary_lists_the_evals(tmp_path, capsys):
    """NaN in the train data halts (exit 3); in the eval data the run goes on, its eval losses null: one line
    says why, naming the key, and the summary line says which evals were affected."""
    eval_data = _data(16)
    eval_data["x"][3, 1] = np.nan
    result = jdp.fit(lambda: nnx.Linear(2, 1, rngs=nnx.Rngs(0)), _mse, _data(), optimizer=optax.sgd(0.1), steps=2,
                     global_batch_size=8, eval_data=eval_data, eval_every=1, num_devices=2, workdir=tmp_path / "run")
    assert result.step == 2 and math.isnan(result.eval_metrics["loss"])
    warnings = [line for line in capsys.readouterr().err.splitlines() if "eval" in line and "warning" in line]
    assert warnings == ["jdp: warning: the eval split holds non-finite inputs (key 'x'), so the eval loss at step 1 is "
                        "nan (null in metrics.jsonl; the summary line lists such evals under nonfinite_eval_steps); "
                        "fix the eval data"], warnings
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines if r["split"] == "eval" and r["loss"] is None] == [1, 2]
    assert lines[-1]["split"] == "summary" and lines[-1]["nonfinite_eval_steps"] == [1, 2]
    clean = jdp.fit(lambda: nnx.Linear(2, 1, rngs=nnx.Rngs(0)), _mse, _data(), optimizer=optax.sgd(0.1), steps=1,
                    global_batch_size=8, eval_data=_data(16), num_devices=2, workdir=tmp_path / "clean")
    assert math.isfinite(clean.eval_metrics["loss"]) and "nonfinite_eval_steps" not in json.loads(
        (tmp_path / "clean" / "metrics.jsonl").read_text().splitlines()[-1])


class _Linear(nnx.Module):
    def __init__(self):
        self.w = nnx.Param(jnp.ones((2,)))

    def __call__(self, x):
        return x @ self.w[...]


@jax.custom_vjp
def _nan_gradient(x):
    return x


_nan_gradient.defvjp(lambda x: (x, None), lambda _, g: (g * jnp.nan,))

LOSSES = {
    "loss": (lambda m, b: {"loss": (m(b["x"]) - b["y"] + 1) ** 2 * jnp.inf},
             "non-finite loss (inf) from finite inputs"),
    "gradients": (lambda m, b: {"loss": (_nan_gradient(m(b["x"])) - b["y"]) ** 2},
                  "non-finite gradients (the loss, "),
}


@pytest.mark.parametrize("what", LOSSES)
def test_the_halt_says_whether_the_loss_or_the_gradients_were_not_finite(what):
    loss_fn, expected = LOSSES[what]
    with pytest.raises(jdp.NonFiniteLossError, match=re.escape(expected)):
        jdp.fit(_Linear(), loss_fn, _data(), optimizer=optax.sgd(0.1), steps=2, global_batch_size=8, num_devices=1)
    with pytest.raises(jdp.NonFiniteLossError, match="3 of the last 3 steps were skipped"):
        jdp.fit(_Linear(), loss_fn, _data(), optimizer=optax.sgd(0.1), steps=8, global_batch_size=8, num_devices=1,
                on_nonfinite="skip", max_skipped_fraction=0.02)


# -- 6. a command that trains nothing writes nothing ----------------------------------------------------------

def test_a_finished_run_met_with_other_settings_says_so_and_writes_nothing(tmp_path, capsys):
    args = [*TINY, "--config.train.steps=3", "--config.train.eval_every=3", "--workdir", str(tmp_path)]
    assert main(args) == 0
    def files():  # the lock file excepted: every run, even one with nothing to do, takes the workdir's lock
        return {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in tmp_path.rglob("*")
                if p.is_file() and p.name != "jdp.lock"}

    before = files()
    capsys.readouterr()
    assert main([*args, "--config.checkpoint.keep=5", "--config.train.log_every=2"]) == 0
    out, err = capsys.readouterr()
    assert err == (f"jdp: warning: {tmp_path} holds a run finished at step 3 with other settings (checkpoint.keep: "
                   "3 -> 5; train.log_every: 1 -> 2); nothing was trained or written: to train with these settings "
                   "pass a new --workdir, or raise --config.train.steps to extend this run\n")
    assert f"nothing to do: {tmp_path} is at step 3, steps is 3" in out
    assert files() == before


def test_a_resume_allowed_a_change_that_no_longer_fits_and_a_workdir_that_cannot_be_made_are_fit_errors(tmp_path):
    """With allow_config_change=True, an optimizer whose state no longer fits the checkpoint was a CheckpointError
    traceback (exit 1) telling a fit user of --workdir; a workdir under /proc raised WorkdirLocked, which
    `except jdp.FitError` missed."""
    def fit(workdir, optimizer, **options):
        return jdp.fit(lambda: nnx.Linear(2, 1, rngs=nnx.Rngs(0)), _mse, _data(), optimizer=optimizer, steps=2,
                       global_batch_size=8, num_devices=2, workdir=workdir, **options)

    fit(tmp_path / "run", optax.adam(0.1))
    with pytest.raises(jdp.FitError, match=r"does not fit this model \(.*\); the model or optimizer settings "
                                           r"changed: resume with the settings that wrote it, or use a new workdir$"):
        fit(tmp_path / "run", optax.sgd(0.1), allow_config_change=True)
    with pytest.raises(jdp.FitError, match=r"^workdir /proc/jdp_run cannot hold a run"):
        fit("/proc/jdp_run", optax.sgd(0.1))


def test_evals_asked_for_without_eval_data_are_one_warning(capsys):
    """eval_every (or an eval_fn) without eval data ran no eval, without a word."""
    jdp.fit(lambda: nnx.Linear(2, 1, rngs=nnx.Rngs(0)), _mse, _data(), optimizer=optax.sgd(0.1), steps=2,
            global_batch_size=8, num_devices=2, eval_every=1)
    assert capsys.readouterr().err == ("jdp: warning: eval_every is set, but there is no eval data: no eval runs; "
                                       "give eval_data\n")
