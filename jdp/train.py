"""`python -m jdp.train`: the command line, and `run(config)`, which wires the pieces and runs the loop.

The four steps of data parallelism live in their own places: split in `jdp.mesh` /
`DataParallel.shard_batch`, compute, all-reduce and update in `jdp.step.train_step`.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import time
from pathlib import Path

import jax
import ml_collections

from jdp import config as config_lib
from jdp import data as data_lib
from jdp import distributed as distributed_lib
from jdp import models
from jdp.checkpoint import Checkpointer, CheckpointError
from jdp.faults import kill_if_requested
from jdp.mesh import simulate_cpu_devices
from jdp.metrics import MetricsWriter, ThroughputClock
from jdp.parallel import DataParallel
from jdp.preemption import PreemptionRequest
from jdp.resume import check_workdir_config, restore_for_inference, restore_or_init
from jdp.runinfo import write_run_metadata
from jdp.step import TrainState
from jdp.wiring import Built, build  # noqa: F401 - part of jdp.train's API
from jdp.xla_flags import apply_communication_flags

EXIT_OK, EXIT_USAGE, EXIT_NONFINITE, EXIT_REPLICAS_DIFFER, EXIT_DISTRIBUTED, EXIT_PREEMPTED = 0, 2, 3, 4, 5, 75


class NonFiniteLossError(RuntimeError):
    pass


class ReplicaMismatchError(RuntimeError):
    pass


class Preempted(RuntimeError):
    pass


@dataclasses.dataclass
class RunResult:
    losses: list[float]  # per-step train loss (mean over the global batch), from the start step on
    eval_loss: float
    eval_accuracy: float
    params: dict  # final parameters, as numpy
    model_state: dict
    examples_per_sec: float


def evaluate(parallel: DataParallel, state: TrainState, source: data_lib.Source) -> tuple[float, float]:
    """Mean loss and accuracy over the whole eval split; padded rows are masked out."""
    totals = {"loss_sum": 0.0, "correct": 0.0, "count": 0.0}
    pending = None
    for rows in source.eval_batches():
        sums = parallel.eval_step(state, parallel.shard_batch(rows))
        if pending is not None:  # one batch late, so the host never queues the whole eval
            totals = {k: totals[k] + v for k, v in parallel.fetch(pending).items()}
        pending = sums
    totals = {k: totals[k] + v for k, v in parallel.fetch(pending).items()}
    return totals["loss_sum"] / totals["count"], totals["correct"] / totals["count"]


def run(cfg: ml_collections.ConfigDict, workdir: str | Path) -> RunResult:
    """Trains `cfg` into `workdir`, resuming from its latest checkpoint if there is one.

    Raises ConfigError before compiling anything if the config is bad."""
    t_start = time.perf_counter()
    b = build(cfg)
    parallel, source = b.parallel, b.source
    workdir = Path(workdir)
    is_main = jax.process_index() == 0
    echo = print if is_main else (lambda *_: None)
    checkpointer = Checkpointer(workdir / "checkpoints", keep=cfg.checkpoint.keep,
                                every_steps=cfg.checkpoint.every_steps)
    if checkpointer.steps():
        check_workdir_config(cfg, workdir, echo)
    if is_main:
        workdir.mkdir(parents=True, exist_ok=True)
        config_lib.save_config(cfg, workdir / "config.json")
        write_run_metadata(workdir, parallel.mesh)

    start_step, logical = restore_or_init(b, checkpointer, echo)
    state = parallel.to_devices(logical)
    batch_size, steps = cfg.train.global_batch_size, cfg.train.steps
    writer = MetricsWriter(workdir, total_steps=steps, start_step=start_step, enabled=is_main)
    mesh = parallel.mesh
    writer.echo(f"jdp: {mesh.size} {mesh.devices.flat[0].platform} devices x {batch_size // mesh.size} examples "
                f"= global batch {batch_size} ({jax.process_count()} process(es)); {cfg.model.name}: "
                f"{models.count_params(b.abstract_state.params):,} parameters; {cfg.data.name}: "
                f"{source.num_train} train / {source.num_eval} eval, {steps} steps = "
                f"{steps / source.steps_per_epoch:.1f} epochs; backend {cfg.parallel.backend}")
    if mesh.devices.flat[0].platform == "gpu":
        writer.echo(f"jdp: XLA_FLAGS in force: {os.environ.get('XLA_FLAGS', '')}")

    clock, losses, save_stalls = ThroughputClock(), [], []
    window = {"loss": 0.0, "accuracy": 0.0, "grad_norm": 0.0, "n": 0}  # means since the last train line
    compile_time = first_step_end = eval_loss = eval_accuracy = math.nan
    profile = config_lib.profile_steps(cfg.profile.steps)

    def record(step: int, metrics: dict) -> None:
        """Host side of step `step`, fetched one step late so the device queue stays short."""
        nonlocal compile_time, first_step_end
        values = parallel.fetch(metrics)
        if step == start_step + 1:  # the first step includes compilation: the clock starts after it
            compile_time = time.perf_counter() - t_first
            first_step_end = time.time()
            clock.start()
        else:
            clock.add(batch_size)
        if values["nonfinite"]:
            if cfg.train.on_nonfinite == "halt":
                raise NonFiniteLossError(f"non-finite loss or gradient at step {step} (loss {values['loss']}); "
                                         "the state from before it is saved; rerun to resume, with "
                                         "train.on_nonfinite=skip, or with a lower optim.lr or an "
                                         "optim.grad_clip_norm plus checkpoint.allow_config_change=True")
            writer.echo(f"warning: step {step} had a non-finite loss or gradient; its update was skipped")
        else:
            losses.append(values["loss"])
            for key in window.keys() & values.keys():
                window[key] += values[key]
            window["n"] += 1
        fp16 = {}
        if cfg.precision == "fp16":  # loss-scale overflows skip an update but are not failures
            fp16 = {"loss_scale": values["loss_scale"], "overflow_steps": int(values["overflow_steps"])}
        if (step % cfg.train.log_every == 0 or step == steps) and window["n"]:
            n = window["n"]
            means = {k: window[k] / n for k in ("loss", "accuracy", "grad_norm") if k in values}
            writer.train(step, **means, lr=values["lr"], examples_per_sec=clock.interval_rate(),
                         skipped_steps=int(values["skipped_steps"]), **fp16)
            window.update(loss=0.0, accuracy=0.0, grad_norm=0.0, n=0)

    def save(step: int) -> None:
        clock.pause()
        t = time.perf_counter()
        checkpointer.save(step, parallel.to_logical(state), data_position(step))
        save_stalls.append(time.perf_counter() - t)
        clock.start()

    def data_position(step: int) -> dict[str, int]:  # informative: the source reads any step directly
        return {"step": step, "epoch": step // source.steps_per_epoch}

    def check_replicas(step: int) -> None:
        leaf = parallel.first_differing_leaf({"params": state.params, "model_state": state.model_state})
        if leaf is not None:
            raise ReplicaMismatchError(f"replicas differ at step {step}: first differing parameter {leaf}")

    stop = distributed_lib.StopAgreement()  # every process stops at the same step after a signal
    stop_agreed = False
    pending = None
    t_first = time.perf_counter()
    try:
        with PreemptionRequest() as preemption:
            for step in range(start_step + 1, steps + 1):
                # Dispatch is asynchronous: this batch is read and put on the devices while the
                # previous step still runs, so the next batch is already there when it ends.
                batch = parallel.shard_batch(source.train_batch(step - 1))
                if profile and step == profile[0]:
                    jax.profiler.start_trace(workdir / "profile")
                state, metrics = parallel.train_step(state, batch)
                if profile and step == profile[1]:
                    jax.block_until_ready(metrics)
                    jax.profiler.stop_trace()
                    writer.echo(f"profile of steps {profile[0]}-{profile[1]} written to {workdir / 'profile'} "
                                "(open with TensorBoard's profile plugin or Perfetto)")
                kill_if_requested("step", step, before=checkpointer.wait)
                if pending is not None:
                    record(*pending)
                pending = (step, metrics)
                stop_agreed |= stop.should_stop(step, preemption.signal_name is not None)
                # Under local SGD the replicas agree only at sync points: stop at the next one.
                stopping = stop_agreed and step % cfg.parallel.sync_every == 0
                last = step == steps
                check_now = last or bool(cfg.parallel.check_replicas_every
                                         and step % cfg.parallel.check_replicas_every == 0)
                save_now = last or checkpointer.due(step)
                eval_now = last or step % cfg.train.eval_every == 0
                if stopping or check_now or save_now or eval_now:
                    record(*pending)
                    pending = None
                if stopping:
                    save(step)
                    checkpointer.wait()
                    cause = preemption.signal_name or "a signal to another process"
                    raise Preempted(f"{cause} at step {step}: checkpoint written to "
                                    f"{checkpointer.directory / str(step)}; rerun the same command to resume")
                if check_now:
                    check_replicas(step)
                if save_now:
                    save(step)
                if eval_now:
                    clock.pause()
                    eval_loss, eval_accuracy = evaluate(parallel, state, source)
                    writer.eval(step, loss=eval_loss, accuracy=eval_accuracy)
                    clock.start()
        if start_step < steps:
            stall = sum(save_stalls) / len(save_stalls) if save_stalls else 0.0
            writer.summary(eval_accuracy=eval_accuracy, examples_per_sec=clock.rate(), compile_time_s=compile_time,
                           total_time_s=time.perf_counter() - t_start, checkpoint_stall_s=stall,
                           first_step_end_unix=first_step_end)
            writer.echo(f"done: eval accuracy {eval_accuracy:.4f}, {clock.rate():,.0f} examples/s, first step "
                        f"(compile) {compile_time:.1f}s, checkpoint stall {stall * 1e3:.0f} ms/save; metrics in "
                        f"{workdir / 'metrics.jsonl'}")
        else:
            writer.echo(f"nothing to do: {workdir} is at step {start_step}, train.steps is {steps}")
    except NonFiniteLossError:
        # The compiled step froze the state before the bad update: keep it for inspection and resume.
        halted = parallel.to_logical(state)
        halted_step = int(halted.step.addressable_data(0))
        checkpointer.save(halted_step, halted, data_position(halted_step))
        raise
    finally:
        checkpointer.wait()
        checkpointer.close()
        writer.close()
        source.close()
    final = parallel.to_logical(state)
    return RunResult(losses, eval_loss, eval_accuracy, parallel.to_host(final.params),
                     parallel.to_host(final.model_state), clock.rate())


def evaluate_checkpoint(workdir: Path) -> tuple[float, float]:
    """`--eval_only`: evaluate the latest checkpoint of `workdir` and append the eval line."""
    step, b, state = restore_for_inference(workdir)
    loss, accuracy = evaluate(b.parallel, b.parallel.to_devices(state), b.source)
    b.source.close()
    writer = MetricsWriter(workdir, total_steps=step, resume=False, enabled=jax.process_index() == 0)
    writer.eval(step, loss=loss, accuracy=accuracy)
    writer.close()
    return loss, accuracy


class _ArgumentParser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line and exit 2, like every other usage error
        raise config_lib.ConfigError(f"{message}; see python -m jdp.train --help")


@dataclasses.dataclass
class CommandLine:
    cfg: ml_collections.ConfigDict
    workdir: Path
    eval_only: bool


def parse_command_line(argv: list[str]) -> CommandLine:
    parser = _ArgumentParser(prog="python -m jdp.train", allow_abbrev=False,
                             description="Data-parallel training. Override any config field with "
                                         "--config.SECTION.KEY=VALUE, e.g. --config.train.steps=500.")
    parser.add_argument("--config", help=f"config file (default: WORKDIR/config.json if it exists, else "
                                         f"{config_lib.DEFAULT_CONFIG})")
    parser.add_argument("--workdir", help="output directory; rerun on it to resume (default: runs/CONFIG_NAME)")
    parser.add_argument("--cpu_devices", type=int, help="simulate N CPU devices (sets parallel.cpu_devices)")
    parser.add_argument("--eval_only", action="store_true", help="evaluate the workdir's latest checkpoint")
    distributed_lib.add_arguments(parser)  # read by main() through distributed_lib.flags_from_argv
    args, rest = parser.parse_known_args(argv)
    overrides = config_lib.parse_overrides(rest)
    config_path = Path(args.config) if args.config else config_lib.DEFAULT_CONFIG
    workdir = Path(args.workdir or Path("runs") / config_path.stem)
    if args.config is None and (workdir / "config.json").exists():  # continue the run in that workdir
        cfg = config_lib.load_saved_config(workdir / "config.json")
    else:
        cfg = config_lib.load_config_file(config_path)
    cfg = config_lib.apply_overrides(cfg, overrides)
    if args.cpu_devices is not None:
        cfg.parallel.cpu_devices = args.cpu_devices
    return CommandLine(cfg, workdir, args.eval_only)


def _enable_compilation_cache(cache_dir: str) -> None:
    """Persistent XLA cache, unless disabled or already set through JAX's own JAX_COMPILATION_CACHE_DIR."""
    if cache_dir and not jax.config.jax_compilation_cache_dir:
        jax.config.update("jax_compilation_cache_dir", os.path.expanduser(cache_dir))


def main(argv: list[str] | None = None) -> int:
    failures = [(distributed_lib.DistributedUsageError, EXIT_USAGE, "distributed"),
                (config_lib.ConfigError, EXIT_USAGE, "config error"), (CheckpointError, EXIT_USAGE, "checkpoint"),
                (NonFiniteLossError, EXIT_NONFINITE, "halted"), (ReplicaMismatchError, EXIT_REPLICAS_DIFFER, "halted"),
                (distributed_lib.DistributedFailure, EXIT_DISTRIBUTED, "distributed"),
                (Preempted, EXIT_PREEMPTED, "preempted")]
    argv = sys.argv[1:] if argv is None else argv
    try:
        command = parse_command_line(argv)
        cfg = command.cfg
        job = distributed_lib.resolve(**distributed_lib.flags_from_argv(argv))  # checked before anything waits
        distributed_lib.check_timeouts(cfg.distributed.init_timeout_s, cfg.distributed.heartbeat_timeout_s)
        apply_communication_flags(cfg.parallel)  # before JAX initialises its backends
        simulate_cpu_devices(cfg.parallel.cpu_devices)  # before initialize, which fixes the device count
        if job is not None:
            distributed_lib.initialize(job, init_timeout_s=cfg.distributed.init_timeout_s,
                                       heartbeat_timeout_s=cfg.distributed.heartbeat_timeout_s)
            distributed_lib.check_same_run(distributed_lib.run_settings(cfg.to_dict(), command.workdir),
                                           timeout_s=cfg.distributed.init_timeout_s)
        _enable_compilation_cache(cfg.compile_cache_dir)
        if command.eval_only:
            evaluate_checkpoint(command.workdir)
        else:
            run(cfg, command.workdir)
    except tuple(error for error, _, _ in failures) as e:
        code, label = next((code, label) for error, code, label in failures if isinstance(e, error))
        print(f"jdp: {label}: {e}", file=sys.stderr)
        return code
    except jax.errors.JaxRuntimeError as e:  # a collective or barrier whose peer is gone
        if not distributed_lib.is_peer_failure(e):
            raise
        print(f"jdp: distributed: process {jax.process_index()} of {jax.process_count()} stopped: another process "
              f"or the coordinator failed ({distributed_lib.first_line(e)})", file=sys.stderr)
        return EXIT_DISTRIBUTED
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
