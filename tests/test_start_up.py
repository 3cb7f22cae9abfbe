"""Start-up failures that used to hang, pass silently or end in a traceback: the variables JAX and XLA read, the
command line's paths, device and step counts, the launcher's command, a workdir behind a broken link, a disk that is
full or read-only, an unreadable config.json, a model that fails in its constructor. Each is one line naming what is
wrong and the fix, with its documented exit code; the cases are quick (nothing compiles) but the one slow
disk-full run."""

from __future__ import annotations

import errno
import json
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax.numpy as jnp
import optax
import pytest
from flax import nnx

import jdp
from jdp import environment, mesh, storage, workdir_lock
from jdp.cli import build
from jdp.cli import train as train_cli
from jdp.cli.train import main
from jdp.configs import base
from jdp.environment import MAX_CPU_DEVICES
from jdp.models import build_model

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--config", "digits_mlp", "--config.model.kwargs.hidden_sizes=(16,)", "--config.train.log_every=1",
        "--config.parallel.num_devices=2", "--config.train.global_batch_size=32"]
# What a child must not inherit from the test's environment: another job's settings, flags of the test run.
_INHERITED = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES",
              "JAX_PROCESS_ID", "JAX_NUM_CPU_DEVICES", "XLA_FLAGS", "JDP_KILL_AT")


def child_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _INHERITED and not k.startswith("SLURM_")}
    return {**env, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1", **extra}


def one_line(capsys, code_expected: int, code: int, *expected: str) -> str:
    out, err = capsys.readouterr()
    assert code == code_expected, err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    for text in expected:
        assert text in err, err
    return err


# -- the environment: checked before JAX is imported, each case a child that exits within a second ------------

TRAIN = [sys.executable, "-m", "jdp.train"]
LAUNCH = [sys.executable, "-m", "jdp.launch", "--nprocs", "2", "--"]
STARTS = {
    "JAX_NUM_CPU_DEVICES not a number": (TRAIN, {"JAX_NUM_CPU_DEVICES": "abc"}, 2,
                                         "jdp: error: JAX_NUM_CPU_DEVICES='abc' is not a device count; set it to an "
                                         f"integer from 1 to {MAX_CPU_DEVICES}, or unset it"),
    "JAX_NUM_CPU_DEVICES too many": (TRAIN, {"JAX_NUM_CPU_DEVICES": "100000"}, 2,
                                     f"JAX_NUM_CPU_DEVICES='100000' is more than the {MAX_CPU_DEVICES} CPU devices"),
    "XLA_FLAGS unknown flag": (TRAIN, {"XLA_FLAGS": "--no_such_flag"}, 2,
                               "jdp: error: XLA_FLAGS='--no_such_flag': XLA does not know --no_such_flag and would "
                               "abort; remove it from XLA_FLAGS"),
    "XLA_FLAGS bad value": (TRAIN, {"XLA_FLAGS": "--xla_cpu_multi_thread_eigen=maybe"}, 2,
                            "XLA cannot read 'maybe' as the value of --xla_cpu_multi_thread_eigen"),
    "launch a missing program": ([*LAUNCH, "/nonexistent/bin"], {}, 127,
                                 "[launch] cannot run /nonexistent/bin: No such file or directory (errno 2); give its "
                                 "path, or a program on PATH"),
}


@pytest.mark.parametrize("case", STARTS, ids=list(STARTS))
def test_a_bad_environment_or_command_is_one_line_before_jax_starts(case, tmp_path):
    command, env, code, expected = STARTS[case]
    t0 = time.monotonic()
    result = subprocess.run([*command, *(["--workdir", str(tmp_path / "run")] if command is TRAIN else [])],
                            cwd=ROOT, env=child_env(**env), capture_output=True, text=True, timeout=60)
    assert (result.returncode, len(result.stderr.splitlines()), result.stdout) == (code, 1, ""), result.stderr
    assert expected in result.stderr, result.stderr
    assert time.monotonic() - t0 < 20 and not (tmp_path / "run").exists()  # no JAX import, let alone a run


def test_xla_flags_that_xla_reads_pass_and_are_tried_once(monkeypatch):
    from jdp import environment

    tried = []
    real = subprocess.run
    monkeypatch.setattr(environment.subprocess, "run", lambda *a, **k: tried.append(1) or real(*a, **k))
    environment.check_environment({"XLA_FLAGS": "--xla_force_host_platform_device_count=2"})
    environment.check_environment({"XLA_FLAGS": "--xla_force_host_platform_device_count=2"})
    environment.check_environment({"XLA_FLAGS": "--xla_gpu_enable_latency_hiding_scheduler=false "
                                                "--xla_cpu_multi_thread_eigen=false"})  # jdp's own: no probe
    environment.check_environment({"JAX_NUM_CPU_DEVICES": "8", "XLA_FLAGS": ""})
    assert tried == [1]


# -- the command line: refused before JAX starts a device --------------------------------------------------------

ARGUMENTS = {
    "--cpu_devices far too many": (["--cpu_devices", "100000"],
                                   f"--cpu_devices 100000 is outside 0..{MAX_CPU_DEVICES}, the CPU devices jdp "
                                   f"simulates; pass at most {MAX_CPU_DEVICES}"),
    "--config empty": (["--config", ""], "--config is empty; give a config file or a shipped config's name "
                                         "(digits_mlp), or leave --config out to continue WORKDIR/config.json"),
    "--workdir empty": (["--workdir", " "], "--workdir is empty; give a directory, or leave --workdir out"),
    "train.steps past int32": (["--config.train.steps=100000000000000000000"],
                               "train.steps=100000000000000000000 must be in [1, 2147483647]"),
}


@pytest.mark.parametrize("case", ARGUMENTS, ids=list(ARGUMENTS))
def test_a_bad_start_up_argument_is_one_line(case, tmp_path, capsys, monkeypatch):
    args, expected = ARGUMENTS[case]
    monkeypatch.chdir(tmp_path)  # where runs/<config> would go
    one_line(capsys, 2, main([*TINY, "--workdir", "run", *args]), "jdp: config error: ", expected)
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(jdp.UsageError, match=f"jdp simulates at most {MAX_CPU_DEVICES}"):
        mesh.simulate_cpu_devices(MAX_CPU_DEVICES + 1)  # what jdp.fit's scripts and the benchmarks call


def test_a_workdir_behind_a_broken_link_is_one_line(tmp_path, capsys):
    (tmp_path / "loop").symlink_to("loop")
    (tmp_path / "dangling").symlink_to(tmp_path / "gone")
    cases = {tmp_path / "loop": "is a symbolic link loop (it leads back to itself)",
             tmp_path / "loop" / "run": f"lies under {tmp_path / 'loop'}, which is a symbolic link loop (it leads back "
                                        "to itself)",
             tmp_path / "dangling": f"is a symbolic link to {tmp_path / 'gone'}, which does not exist"}
    for workdir, expected in cases.items():
        one_line(capsys, 2, main([*TINY, "--workdir", str(workdir)]), f"jdp: error: workdir {workdir} {expected}; "
                 "pass another --workdir or fix the link")
        with pytest.raises(jdp.FitError, match="pass another workdir or fix the link"):
            jdp.fit(lambda: nnx.Linear(2, 1, rngs=nnx.Rngs(0)), lambda m, b: {"loss": m(b["x"])[:, 0] ** 2},
                    {"x": jnp.zeros((8, 2))}, optimizer=optax.sgd(0.1), steps=1, global_batch_size=8, workdir=workdir)
    assert not (tmp_path / "gone").exists()


def test_a_run_file_that_cannot_be_a_file_is_one_line(tmp_path, capsys):
    """A directory (or a link loop) where the run writes metrics.jsonl, config.json, ...: a traceback and exit 1
    from wherever it was first opened; so was a workdir under /proc, where no directory can be made."""
    for name in storage.RUN_FILES:
        workdir = tmp_path / name.replace(".", "_")
        (workdir / name).mkdir(parents=True)
        one_line(capsys, 2, main([*TINY, "--workdir", str(workdir)]), f"jdp: error: {workdir / name} is a directory: "
                 f"the run keeps its {name} there; move it away (or pass another --workdir) and rerun")
    (tmp_path / "loop").mkdir()
    (tmp_path / "loop" / "config.json").symlink_to("config.json")
    one_line(capsys, 2, main([*TINY, "--workdir", str(tmp_path / "loop")]),
             f"{tmp_path / 'loop' / 'config.json'} is a symbolic link loop (it leads back to itself): the run keeps")
    one_line(capsys, 2, main([*TINY, "--workdir", "/proc/jdp"]),
             "jdp: error: workdir /proc/jdp cannot hold a run (/proc/jdp: No such file or directory); pass another")


def test_a_run_writes_in_its_workdir_only_what_start_up_checks(tmp_path, capsys):
    """Each entry of a finished run's workdir is one `storage.check_writable` refuses in the wrong form: a file
    added to the run unlisted there could be a directory, and crash the run instead of being refused."""
    assert main([*TINY, "--workdir", str(tmp_path), "--config.train.steps=4"]) == 0
    assert {p.name for p in tmp_path.iterdir()} == {*storage.RUN_FILES, *storage.RUN_DIRECTORIES} - {"trackers"}


# -- the disk: the workdir named, and the fix that fits the error ----------------------------------------------

def test_a_compile_cache_dir_that_cannot_be_used_is_one_warning(tmp_path):
    """Under a file: JAX warned twice (a two-line UserWarning) at every program it compiled, and went on."""
    (tmp_path / "file").write_text("")
    code = ("import sys, jax; from jdp.cli.train import enable_compilation_cache\n"
            "enable_compilation_cache(sys.argv[1]); print(jax.config.jax_compilation_cache_dir)\n"
            "jax.jit(lambda x: x + 1)(1.0).block_until_ready()")
    for cache, expected in ((tmp_path / "file" / "xla", None), (tmp_path / "new" / "xla", tmp_path / "new" / "xla")):
        env = {k: v for k, v in child_env().items() if k != "JAX_COMPILATION_CACHE_DIR"}
        out = subprocess.run([sys.executable, "-c", code, str(cache)], capture_output=True, text=True, timeout=60,
                             env=env)
        assert out.returncode == 0 and out.stdout.strip() == str(expected), out.stderr
        if expected is None:
            assert out.stderr == (f"jdp: warning: compile_cache_dir={cache} cannot be used (Not a directory: {cache})"
                                  "; compiling without the persistent cache (set --config.compile_cache_dir= to say "
                                  "so, or a writable folder)\n")
        else:
            assert out.stderr == "" and cache.is_dir()


def test_a_full_disk_at_start_up_names_the_workdir(tmp_path, capsys, monkeypatch):
    """os.write on the lock file's descriptor: an OSError without a path. The line named the current directory."""
    def full(path):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(workdir_lock, "_acquire", full)
    workdir = tmp_path / "run"
    one_line(capsys, 6, main([*TINY, "--workdir", str(workdir)]),
             f"jdp: disk: no space left on device writing {workdir} (", " free there); free space and rerun")


def test_a_read_only_filesystem_is_not_told_to_free_space(tmp_path, capsys, monkeypatch):
    def read_only(workdir):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(workdir / "metrics.jsonl"))

    monkeypatch.setattr(train_cli, "evaluate_checkpoint", read_only)
    err = one_line(capsys, 6, main(["--workdir", str(tmp_path), "--eval_only"]),
                   f"jdp: disk: read-only file system writing {tmp_path / 'metrics.jsonl'} (",
                   "--eval_only appends its eval line to the workdir's metrics.jsonl: make the filesystem writable, "
                   "or rerun on a copy of the workdir")
    assert "free space" not in err
    during_training = str(storage.disk_error((errno.EROFS, "/w/metrics.jsonl"), Path("/w"), 8))
    assert during_training.endswith("the last checkpoint, step 8, is intact: make the filesystem writable (it is "
                                    "mounted read-only) and rerun to resume"), during_training


def test_a_corrupt_config_json_does_not_suggest_the_config_already_passed(tmp_path, capsys):
    """config.json is the CLI's record of its settings, not its guard (jdp.fit's guard checks a resume): a run to
    resume with a config.json that does not read resumes and writes it anew; a finished run's rerun, which compares
    its settings with config.json's to say which differ, names the file and a fix other than passing --config."""
    args = [*TINY, "--config.train.eval_every=0", "--workdir", str(tmp_path)]
    assert main([*args, "--config.train.steps=2"]) == 0
    (tmp_path / "config.json").write_text("{not json")
    assert main([*args, "--config.train.steps=3"]) == 0
    assert json.loads((tmp_path / "config.json").read_text())["train"]["steps"] == 3
    capsys.readouterr()
    (tmp_path / "config.json").write_text("{not json")
    err = one_line(capsys, 2, main([*args, "--config.train.steps=3"]),
                   f"{tmp_path / 'config.json'} is not a readable jdp config",
                   "which a finished run's rerun is compared with: restore it (config_history.jsonl holds each run "
                   "segment's config), or move it away")
    assert "pass --config" not in err


# -- a model that fails in its constructor: where, and the fix --------------------------------------------------

class Branching(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs) -> None:
        self.linear = nnx.Linear(4, 2, rngs=rngs)
        if jnp.ones(3).sum() > 0:  # a Python value from an array: nnx.eval_shape has none
            pass


class Mismatched(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs) -> None:
        jnp.ones((2, 3)) @ jnp.ones((4, 5))


def test_a_model_that_fails_in_its_constructor_is_one_line():
    def built(name: str, **kwargs) -> str:
        with pytest.raises(build.config_lib.ConfigError) as raised:
            build.abstract_model(lambda: build_model(f"tests.test_start_up:{name}", kwargs, (4,), 2, seed=0))
        assert "\n" not in str(raised.value)
        return str(raised.value)

    line = Branching.__init__.__code__.co_firstlineno
    assert built("Branching") == (
        "the model cannot be built: TracerBoolConversionError: Attempted boolean conversion of traced array with "
        f"shape bool[]. (raised at test_start_up.py line {line + 2} in its constructor); jdp builds the model with "
        "nnx.eval_shape, where arrays have no values: compute no Python value from an array in the constructor; fix "
        "the model's code or its settings (model.kwargs)")
    assert built("Mismatched").startswith("the model cannot be built: TypeError: dot_general requires contracting "
                                          "dimensions to have the same shape, got (3,) and (4,).")
    assert built("Branching", width=3) == ("model.name='tests.test_start_up:Branching' with model.kwargs ['width']: "
                                           "got an unexpected keyword argument 'width'")


# -- a disk that fills during a save: the exit-6 line and nothing else -----------------------------------------

@pytest.mark.slow
def test_a_disk_that_fills_during_a_save_prints_one_line(tmp_path):
    """A file size limit (RLIMIT_FSIZE, SIGXFSZ ignored) fails the checkpoint's larger files with EFBIG while the
    smaller ones are written: orbax gives up at the first failed leaf and closes its event loop, and the writes
    still in flight then ended in `RuntimeError: Event loop is closed` tracebacks, 16 to 54 of them."""
    def limit_file_size() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))

    env = child_env(JAX_NUM_CPU_DEVICES="2")
    env.pop("JAX_COMPILATION_CACHE_DIR", None)  # its entries pass the limit: a cache write would fail too
    workdir = tmp_path / "run"
    result = subprocess.run([*TRAIN, *TINY, "--config.model.kwargs.hidden_sizes=(256,256)", "--config.train.steps=2",
                             "--config.checkpoint.every_steps=2", "--config.train.eval_every=0",
                             "--config.compile_cache_dir=", "--workdir", str(workdir)],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=240, preexec_fn=limit_file_size)
    assert result.returncode == 6, result.stderr[-3000:]
    assert result.stderr.splitlines() == [result.stderr.strip()], result.stderr[-3000:]
    assert result.stderr.startswith(f"jdp: disk: file too large writing {workdir / 'checkpoints'}")
    assert result.stderr.strip().endswith("no checkpoint was written yet: raise the file size limit (ulimit -f) or use "
                                          "a filesystem that allows larger files and rerun")


def test_the_parallel_sections_xla_flags_join_xla_flags_where_it_does_not_set_them(monkeypatch):
    parallel = base.get_config().parallel
    parallel.update(allreduce_combine_threshold_bytes=0, latency_hiding_scheduler=True)
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_latency_hiding_scheduler=false --xla_dump_to=/tmp/x")
    environment.apply_communication_flags(parallel)  # the user's scheduler setting wins; 0 adds no threshold
    assert os.environ["XLA_FLAGS"] == "--xla_gpu_enable_latency_hiding_scheduler=false --xla_dump_to=/tmp/x"
    parallel.allreduce_combine_threshold_bytes = 2**25
    monkeypatch.setenv("XLA_FLAGS", "")
    environment.apply_communication_flags(parallel)
    assert os.environ["XLA_FLAGS"] == ("--xla_gpu_all_reduce_combine_threshold_bytes=33554432 "
                                       "--xla_gpu_enable_latency_hiding_scheduler=true")
