"""`python -m jdp.train`: the command line, and `run(config)`, which trains the config's task with `jdp.fit`."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import errno
import os
import sys
import traceback
from pathlib import Path

import jax
import ml_collections

from jdp import distributed as distributed_lib
from jdp import kvstore, preemption, reopen, storage, trainer, workdir_lock
from jdp.checkpoint import CheckpointError
from jdp.cli import config as config_lib
from jdp.cli.build import build, build_task  # noqa: F401 - build is part of jdp.train's API
from jdp.cli.resume import initialised_from, record_config, report_finished_run, restore_for_inference
from jdp.cli.sample import sample_text
from jdp.environment import MAX_CPU_DEVICES, apply_communication_flags, check_environment
from jdp.errors import DiskError, NonFiniteLossError, Preempted, ReplicaMismatchError, UsageError, one_line, warn
from jdp.files import committed_steps
from jdp.mesh import simulate_cpu_devices
from jdp.metrics import MetricsWriter, console_may_close
from jdp.modeldef import replace_state
from jdp.trainer import FitResult

EXIT_OK, EXIT_UNEXPECTED, EXIT_USAGE, EXIT_NONFINITE, EXIT_REPLICAS_DIFFER, EXIT_DISTRIBUTED, EXIT_DISK = (
    0, 1, 2, 3, 4, 5, 6)
EXIT_PREEMPTED = preemption.EXIT_PREEMPTED
_FAILURES = ((distributed_lib.DistributedUsageError, EXIT_USAGE, "distributed"),
             (config_lib.ConfigError, EXIT_USAGE, "config error"), (CheckpointError, EXIT_USAGE, "checkpoint"),
             (UsageError, EXIT_USAGE, "error"),
             (NonFiniteLossError, EXIT_NONFINITE, "halted"), (ReplicaMismatchError, EXIT_REPLICAS_DIFFER, "halted"),
             (distributed_lib.DistributedFailure, EXIT_DISTRIBUTED, "distributed"), (DiskError, EXIT_DISK, "disk"),
             (Preempted, EXIT_PREEMPTED, "preempted"))


def run(cfg: ml_collections.ConfigDict, workdir: str | Path) -> FitResult:
    """Trains `cfg` into `workdir` with `jdp.fit`, resumed from its last checkpoint; ConfigError before compiling."""
    workdir = Path(workdir)
    storage.check_writable(workdir)
    task = build_task(cfg, workdir)
    vocab = getattr(task.source, "vocabulary", None)
    if cfg.sample.tokens and vocab is not None:  # the sample after training: its prompt checked before it
        try:
            vocab.encode(cfg.sample.prompt, f"sample.prompt={cfg.sample.prompt!r}")
        except UsageError as e:
            raise config_lib.ConfigError(f"{e}; set --config.sample.prompt to text of its characters, or "
                                         "--config.sample.tokens=0 for no sample") from None
    model = task.make_model
    if cfg.init_from and not committed_steps(workdir):  # read before fit makes the workdir: a bad file
        model = initialised_from(cfg.init_from, task.make_model())  # leaves nothing behind

    def on_start(start: int) -> None:
        if jax.process_index() != 0:
            return
        if start >= cfg.train.steps:  # a rerun of a finished run records nothing
            report_finished_run(cfg, workdir, start)
        else:
            record_config(cfg, workdir)  # beside run.json, the record jdp.fit writes
            if jax.devices()[0].platform == "gpu":
                print(f"jdp: XLA_FLAGS in force: {os.environ.get('XLA_FLAGS', '')}")

    result = trainer.run(model, task.loss_fn, task.source, optimizer=task.optimizer, steps=cfg.train.steps,
                         global_batch_size=cfg.train.global_batch_size,
                         options=dataclasses.replace(task.options, workdir=workdir, callbacks=(
                             *task.options.callbacks, *config_lib.make_loggers(cfg.metrics))), on_start=on_start,
                         settings=config_lib.guarded_settings(cfg))
    if cfg.sample.tokens and vocab is not None and jax.process_index() == 0:  # a language model: show a sample
        model = task.make_model()
        replace_state(model, result.params, result.model_state)
        model.eval()
        text = sample_text(model, vocab, cfg.sample.prompt, cfg.sample.tokens, temperature=cfg.sample.temperature,
                           top_k=cfg.sample.top_k, seed=cfg.seed)
        print(f"sample ({cfg.sample.tokens} tokens after {cfg.sample.prompt!r}, temperature {cfg.sample.temperature}, "
              f"top_k {cfg.sample.top_k}):\n{text}")
    return result


def evaluate_checkpoint(workdir: Path) -> dict[str, float]:
    """`--eval_only`: the eval line of the latest checkpoint of a jdp.train run, or of an importable jdp.fit run."""
    if not workdir.is_dir():  # refused below, with nothing made
        return reopen.evaluate_run(workdir)[1]
    with workdir_lock.held(workdir):
        if (workdir / "config.json").exists():
            step, engine, state = restore_for_inference(workdir)
            metrics = engine.parallel.evaluate(engine.parallel.to_devices(state), engine.source.eval_batches())
            engine.source.close()
        else:
            step, metrics = reopen.evaluate_run(workdir)
        writer = MetricsWriter(workdir, total_steps=step, resume=False, enabled=jax.process_index() == 0)
        writer.eval(step, metrics)
        writer.close()
    return metrics


def parse_command_line(argv: list[str]) -> argparse.Namespace:
    """The arguments, with the `cfg` they give and the `workdir` (a Path) resolved."""
    parser = config_lib.ArgumentParser(prog="python -m jdp.train", allow_abbrev=False,
                                       description="Data-parallel training. Override any config field with "
                                                   "--config.SECTION.KEY=VALUE, e.g. --config.train.steps=500.")
    parser.add_argument("--config", help=f"config file (default: WORKDIR/config.json if it exists, else "
                                         f"{config_lib.DEFAULT_CONFIG})")
    parser.add_argument("--workdir", help="output directory; rerun on it to resume (default: runs/CONFIG_NAME)")
    parser.add_argument("--cpu_devices", type=int, help="simulate N CPU devices (sets parallel.cpu_devices)")
    parser.add_argument("--eval_only", action="store_true", help="evaluate the workdir's latest checkpoint")
    distributed_lib.add_arguments(parser)  # read by main() through distributed_lib.flags_from_argv
    args, rest = parser.parse_known_args(argv)
    for flag, value, fix in (("--config", args.config, "a config file or a shipped config's name (digits_mlp), "
                              "or leave --config out to continue WORKDIR/config.json"),
                             ("--workdir", args.workdir, "a directory, or leave --workdir out for runs/CONFIG_NAME")):
        if value is not None and not value.strip():  # an unset shell variable: not a request for the default
            raise config_lib.ConfigError(f"{flag} is empty; give {fix}")
    if args.cpu_devices is not None and not 0 <= args.cpu_devices <= MAX_CPU_DEVICES:
        raise config_lib.ConfigError(f"--cpu_devices {args.cpu_devices} is outside 0..{MAX_CPU_DEVICES}, the CPU "
                                     f"devices jdp simulates; pass at most {MAX_CPU_DEVICES}")
    overrides = config_lib.parse_overrides(rest)
    config_path = Path(args.config) if args.config else config_lib.DEFAULT_CONFIG
    workdir = Path(args.workdir or Path("runs") / config_path.stem)
    saved, history, recorded = workdir / "config.json", workdir / "config_history.jsonl", None
    if args.config is None and saved.exists():  # continue the run in that workdir
        cfg = config_lib.load_saved_config(saved)
    elif args.config is None and history.exists():
        raise config_lib.ConfigError(f"{workdir} holds a jdp.train run without its config.json; restore it from the "
                                     f"last line of {history}, or pass --config")
    else:
        cfg = config_lib.load_config_file(config_path)
        with contextlib.suppress(config_lib.ConfigError):  # an unreadable record is the resume's to refuse
            recorded = config_lib.load_saved_config(saved)
    cfg = config_lib.apply_command_line(cfg, overrides, recorded=recorded)  # the file's settings overrides make wrong
    if args.cpu_devices is not None:
        cfg.parallel.cpu_devices = args.cpu_devices
    config_lib.check_ranges(cfg)  # before any value is used: a negative device count, a NaN timeout
    args.cfg, args.workdir = cfg, workdir
    return args


def enable_compilation_cache(cache_dir: str) -> None:
    """Persistent XLA cache, unless off or set by JAX_COMPILATION_CACHE_DIR; a bad folder: one warning, not JAX's."""
    if not cache_dir or jax.config.jax_compilation_cache_dir:
        return
    path = Path(os.path.expanduser(cache_dir))
    try:
        path.mkdir(parents=True, exist_ok=True)
        if not os.access(path, os.W_OK | os.X_OK):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
    except OSError as e:
        warn(f"compile_cache_dir={cache_dir} cannot be used ({e.strerror}: {e.filename}); compiling without "
             "the persistent cache (set --config.compile_cache_dir= to say so, or a writable folder)")
        return
    jax.config.update("jax_compilation_cache_dir", str(path))


def main(argv: list[str] | None = None) -> int:
    with preemption.ExitOnSignal(), console_may_close():  # the first already in force as python -m jdp.train
        argv = sys.argv[1:] if argv is None else argv
        command = None
        try:
            check_environment()  # python -m jdp.train checked it before importing JAX; before any backend starts here
            command = parse_command_line(argv)
            cfg = command.cfg
            job = distributed_lib.resolve(**distributed_lib.flags_from_argv(argv))  # checked before anything waits
            apply_communication_flags(cfg.parallel)  # before JAX initialises its backends
            simulate_cpu_devices(cfg.parallel.cpu_devices)  # before initialize, which fixes the device count
            if job is not None:
                distributed_lib.initialize(job, init_timeout_s=cfg.distributed.init_timeout_s,
                                           heartbeat_timeout_s=cfg.distributed.heartbeat_timeout_s,
                                           bind_address=cfg.distributed.bind_address)
                distributed_lib.check_same_run(cfg.to_dict(), command.workdir, timeout_s=cfg.distributed.init_timeout_s)
            enable_compilation_cache(cfg.compile_cache_dir)
            if command.eval_only:
                evaluate_checkpoint(command.workdir)
            else:
                run(cfg, command.workdir)
        except tuple(error for error, _, _ in _FAILURES) as e:
            code, label = next((code, label) for error, code, label in _FAILURES if isinstance(e, error))
            print(f"jdp: {label}: {e}", file=sys.stderr)
            # A halt and a preemption are agreed by every process, whose normal exits meet in JAX's shutdown barrier;
            # any other error may be this process's alone, its peers blocked in a collective with it.
            return code if code in (EXIT_NONFINITE, EXIT_PREEMPTED) else _exit_now(code)
        except Exception as e:  # noqa: BLE001 - a peer gone, a full disk or I/O error outside the training, a bug
            if isinstance(e, jax.errors.JaxRuntimeError) and distributed_lib.is_peer_failure(e):  # in a collective
                print(f"jdp: distributed: process {jax.process_index()} of {jax.process_count()} stopped: another "
                      f"process or the coordinator failed ({one_line(e, typed=False)})", file=sys.stderr)
                return _exit_now(EXIT_DISTRIBUTED)
            failure = storage.disk_failure(e)
            if failure is None:  # a bug: its traceback
                traceback.print_exc()
                return _exit_now(EXIT_UNEXPECTED)
            # Without a path in the error (os.write on a descriptor, say), the workdir is where this run writes.
            where = command.workdir if command is not None else Path.cwd()
            fix = f"{storage.remedy(failure[0])} and rerun"
            if command is not None and command.eval_only and failure[0] == errno.EROFS:
                fix = ("--eval_only appends its eval line to the workdir's metrics.jsonl: make the filesystem "
                       "writable, or rerun on a copy of the workdir")
            print(f"jdp: disk: {storage.describe(failure, where)}; {fix}", file=sys.stderr)
            return _exit_now(EXIT_DISK)
        return EXIT_OK


def _exit_now(code: int) -> int:
    """`code`; in a multi-process run the process ends here: a normal exit would wait in JAX's shutdown barrier for
    a failed peer until it aborts (134) or the launcher kills it (137)."""
    if jax.distributed.is_initialized():
        sys.stdout.flush()
        sys.stderr.flush()
        kvstore.leaving()
        os._exit(code)
    return code

