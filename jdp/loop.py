"""One `jdp.fit` run: restore or initialise, the four steps and the callbacks of every step, the summary."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax

from jdp import callbacks as callbacks_lib
from jdp import distributed as distributed_lib
from jdp import guard as guard_lib
from jdp import memory, noise_scale, precision, storage, workdir_lock
from jdp import record as record_lib
from jdp.checkpoint import Checkpointer
from jdp.data.batching import Source, optional
from jdp.errors import NonFiniteLossError, Preempted, ReplicaMismatchError, warn
from jdp.metrics import MetricsWriter, ThroughputClock
from jdp.modeldef import ModelDef
from jdp.options import FitOptions
from jdp.parallel import DataParallel
from jdp.preemption import PreemptionRequest
from jdp.step import TrainState

RESULTS_TIMEOUT_S = 120.0  # process 0 reads metrics.jsonl while the others wait for its answer


@dataclasses.dataclass
class Engine:
    """Everything a run compiles, checked: `fit`'s, and that of tools that drive the step (`jdp.bench`)."""

    parallel: DataParallel
    source: Source
    model: ModelDef
    init_state: Callable[[], TrainState]  # a fresh logical state, created on the devices
    abstract_state: TrainState  # shapes, dtypes and replicated shardings of the logical state


@dataclasses.dataclass
class FitResult:
    losses: list[float]  # per-step train loss (weighted mean over the global batch; NaN if it weighs nothing),
    # from the step it started or resumed from ([] for a finished run: the history is metrics.jsonl's train lines)
    eval_metrics: dict[str, float]  # the last eval's weighted means ({} without eval data)
    params: dict  # final parameters, numpy
    model_state: dict  # final non-trainable state (BatchNorm statistics), numpy
    step: int
    examples_per_sec: float

    @property
    def eval_loss(self) -> float:
        return self.eval_metrics.get("loss", math.nan)

    @property
    def eval_accuracy(self) -> float:
        return self.eval_metrics.get("accuracy", math.nan)


def train(engine: Engine, options: FitOptions, steps: int, global_batch_size: int, fit_record: dict | None,
          on_start: Callable[[int], None]) -> tuple[FitResult, Any]:
    """Runs `engine` to `steps` under the workdir's lock (`jdp.trainer.run` says what `on_start` gets); a full disk
    raises `DiskError`. Returns the result and the final logical state (numpy)."""
    if options.workdir is None:
        return _train(engine, options, steps, global_batch_size, None, None, fit_record, on_start)
    workdir = Path(options.workdir)
    with workdir_lock.held(workdir):
        checkpointer = None
        try:
            checkpointer = Checkpointer(workdir / "checkpoints", keep=options.keep_checkpoints,
                                        every_steps=options.checkpoint_every,
                                        fingerprint=guard_lib.fingerprint(fit_record) if fit_record else None)
            return _train(engine, options, steps, global_batch_size, workdir, checkpointer, fit_record, on_start)
        except Exception as e:
            if failure := storage.disk_failure(e):
                last = checkpointer.steps()[-1] if checkpointer is not None and checkpointer.steps() else None
                raise storage.disk_error(failure, workdir, last) from None
            # Else: the workdir, or something in it, deleted or moved meanwhile?
            if lost := storage.lost_workdir(e, workdir.absolute(), getattr(checkpointer, "vanished", lambda: None)):
                raise storage.lost_error(lost, workdir.absolute()) from None
            raise


def _train(engine: Engine, options: FitOptions, steps: int, global_batch_size: int, workdir: Path | None,
           checkpointer: Checkpointer | None, fit_record: dict | None, on_start: Callable[[int], None]
           ) -> tuple[FitResult, Any]:
    t_start = time.perf_counter()
    parallel, source = engine.parallel, engine.source
    start, logical, record = _begin(engine, options, steps, workdir, checkpointer, fit_record)
    on_start(start)
    writer = MetricsWriter(workdir, total_steps=steps, start_step=start, enabled=jax.process_index() == 0)
    run = callbacks_lib.Run(parallel, source, writer, ThroughputClock(), workdir, steps, start, global_batch_size,
                          parallel.to_devices(logical), options, optional(source, "tokens_per_example"))
    _header(run, engine, options)
    callbacks = [callbacks_lib.as_callback(c) for c in options.callbacks]
    writer.listeners = [c.on_line for c in callbacks]  # called by process 0 alone, which writes the lines
    for callback in callbacks:
        callback.on_start(start, workdir, record)
    log = callbacks_lib.TrainLog(run)
    evaluation = callbacks_lib.Evaluation(run, options.eval_every)
    checkpoints = callbacks_lib.Checkpoints(run, checkpointer) if checkpointer is not None else None
    eval_missing, summary_missing = _missing_results(run, options.eval_every)
    try:
        if start < steps:
            if eval_missing:  # the run was stopped between saving the checkpoint at `start` and its eval line
                evaluation.on_step(start, {}, run.state)
            with PreemptionRequest() as preemption:
                _steps(run, [*callbacks_lib.builtin(run, checkpoints, preemption, log, evaluation), *callbacks])
            _summary(run, log, evaluation, checkpoints, time.perf_counter() - t_start)
        else:
            writer.echo(f"nothing to do: {workdir} is at step {start}, steps is {steps}")
            evaluation.metrics = parallel.evaluate(run.state, source.eval_batches())
            if eval_missing and evaluation.metrics:  # stopped during the final eval: write what it lost
                writer.eval(start, evaluation.metrics)
            if summary_missing:  # the timings died with the process that trained; the eval results are known
                writer.summary(**{f"eval_{k}": v for k, v in evaluation.metrics.items()})
    except NonFiniteLossError:
        # The compiled step froze the state before the bad update: saved, where the replicas agree on it.
        logical = parallel.to_logical(run.state)
        halted = int(logical.step.addressable_data(0))
        if checkpoints is not None and halted % parallel.sync.agrees_every == 0:
            checkpoints.on_step(halted, {}, logical)
        raise
    except BaseException as e:
        if jax.process_count() > 1 and not isinstance(e, (NonFiniteLossError, Preempted, ReplicaMismatchError)):
            # Only this process failed (every process raises those at one step): the checkpointer's closing barrier
            # would meet the others' step collective out of order and abort them; the launcher stops them.
            checkpointer = None
        raise
    finally:
        with contextlib.ExitStack() as closing:  # each closes, whatever the others raise
            closing.callback(writer.close)
            if checkpointer is not None:
                closing.callback(checkpointer.close)
                checkpointer.wait()
    final = parallel.to_host(parallel.to_logical(run.state))
    return FitResult(log.losses, evaluation.metrics, final.params, final.model_state, int(final.step),
                     run.clock.rate()), final


def _begin(engine: Engine, options: FitOptions, steps: int, workdir: Path | None, checkpointer: Checkpointer | None,
           fit_record: dict | None) -> tuple[int, Any, dict | None]:
    """(start step, logical state, the record as written to run.json or None): restored and guarded, or fresh."""
    echo, caution = (print, warn) if jax.process_index() == 0 else (lambda _: None,) * 2  # all would say the same
    guard = (guard_lib.Guard(fit_record, workdir, options.allow_config_change, caution)
             if fit_record and checkpointer is not None and checkpointer.steps() else None)  # a resume to check
    try:
        if guard is not None:  # before the restore, which would refuse an optimizer of another state tree without
            guard.check_record()  # naming the change
        restored = None if checkpointer is None else checkpointer.restore_latest(
            engine.abstract_state, per_device=engine.parallel.per_device,
            check=guard.check_checkpoint if guard is not None else None)
        start, logical = (0, engine.init_state()) if restored is None else restored[:2]
        if restored is not None:
            echo(f"resumed from {checkpointer.directory / str(start)} (data position {restored[2]})")
            leaves = jax.tree_util.tree_flatten_with_path(logical, is_leaf=lambda x: x is None)[0]
            if missing := [jax.tree_util.keystr(path) for path, x in leaves if x is None]:
                caution(f"the per-device state ({', '.join(missing)}) was saved on another device count: it "
                        "starts afresh")
                logical = engine.parallel.sync.restart(logical, engine.init_state())
            logical = logical._replace(halted=logical.halted * 0)  # a halted run may go on (e.g. at a lower lr)
    except BaseException:
        if checkpointer is not None and jax.process_count() == 1:  # a refused rerun in a notebook leaks nothing
            checkpointer.close()
        raise
    old_steps = guard.restored(start) if guard is not None else steps
    record = None  # as written to run.json, for the callbacks' `on_start`
    if fit_record is not None and start < steps:  # a finished run's rerun records nothing
        if start and old_steps != steps:
            caution(f"steps changed from {old_steps} to {steps}: the run goes on from step {start}; a "
                    "learning-rate schedule built from steps changes from here on (it is not compared)")
        if jax.process_index() == 0:
            metadata = record_lib.run_metadata(engine.parallel.mesh)
            record_lib.write(workdir, fit_record, metadata)
            record = json.loads(json.dumps({**metadata, "fit": fit_record}, default=str))
    return start, logical, record


def _missing_results(run: callbacks_lib.Run, eval_every: int) -> tuple[bool, bool]:
    """(the resume step's due eval has no line, the finished run no summary), as process 0's metrics.jsonl says."""
    if run.workdir is None or run.start == 0:
        return False, False
    finished = run.start >= run.steps
    eval_due = finished or bool(eval_every and run.start % eval_every == 0)
    missing = (eval_due and run.start not in run.writer.eval_steps, finished and not run.writer.summary_written)
    answer = distributed_lib.broadcast("missing results", json.dumps(missing), RESULTS_TIMEOUT_S)
    return tuple(json.loads(answer))


def _steps(run: callbacks_lib.Run, callbacks: list[callbacks_lib.Callback]) -> None:
    parallel, source = run.parallel, run.source
    pending = None  # (step, metrics) not yet fetched: the host reads each step's metrics one step late

    def deliver(step: int, metrics: dict) -> dict[str, float]:
        values = parallel.fetch(metrics)
        for callback in callbacks:
            callback.on_metrics(step, values)
        return values

    for step in range(run.start + 1, run.steps + 1):
        for callback in callbacks:
            callback.before_step(step)
        # 1. split. Dispatch is asynchronous: this batch is read and put on the devices while the previous step runs.
        batch = parallel.shard_batch(source.train_batch(step - 1))
        if step == run.start + 1:  # compiled once, in the first step's time: every step runs that executable
            parallel.compile_train(run.state, batch)
            run.writer.echo(memory.describe(parallel.memory))
            if parallel.compiled_warning:
                run.writer.warn(parallel.compiled_warning)
        # 2-4. compute, all-reduce, update.
        run.state, metrics = parallel.train_step(run.state, batch)
        if pending is not None:
            deliver(*pending)
        pending = (step, metrics)
        due = [callback for callback in callbacks if callback.due(step)]
        if due:
            values = deliver(*pending)
            pending = None
            # Laid out logically (ZeRO's padded slices cut back, pmap's stacked copies) only for those that read it.
            logical = None if all(c.reads_devices for c in due) else parallel.to_logical(run.state)
            for callback in due:
                callback.on_step(step, values, logical)


def _header(run: callbacks_lib.Run, engine: Engine, options: FitOptions) -> None:
    mesh, n = run.parallel.mesh, run.parallel.mesh.size
    params = sum(x.size for x in jax.tree.leaves(engine.abstract_state.params))
    what = f"{options.description}: " if options.description else ""
    run.writer.echo(
        f"jdp: {n} {mesh.devices.flat[0].platform} devices x {run.batch_size // n} examples = global batch "
        f"{run.batch_size} ({jax.process_count()} process(es)); {what}{params:,} parameters, "
        f"{run.source.num_train} train examples, {run.steps} steps = {run.steps / run.source.steps_per_epoch:.1f} "
        f"epochs; backend {options.backend}, sync {run.parallel.sync!r}")
    if slower := precision.slower_than_fp32(options.precision, mesh.devices.flat[0].platform):
        run.writer.warn(slower)


def _summary(run: callbacks_lib.Run, log: callbacks_lib.TrainLog, evaluation: callbacks_lib.Evaluation,
             checkpoints: callbacks_lib.Checkpoints | None, total_time_s: float) -> None:
    stall = statistics.fmean(checkpoints.stalls) if checkpoints and checkpoints.stalls else 0.0
    # Waited for here, so that a summary line means the final checkpoint is committed.
    final_save = checkpoints.finish_final() if checkpoints else 0.0
    rate = run.clock.rate()
    noise = {"grad_noise_scale": log.noise_scale.value} if log.noise_scale else {}
    tokens = {"tokens_per_sec": rate * run.tokens_per_example} if run.tokens_per_example else {}
    sent, across = run.parallel.comm_bytes_per_step, run.parallel.comm_cross_group_bytes_per_step
    cross_group = {} if across is None else {"comm_cross_group_bytes_per_step": across}  # a hybrid mesh's groups
    run.writer.summary(**{f"eval_{k}": v for k, v in evaluation.metrics.items()}, examples_per_sec=rate, **tokens,
                       compile_time_s=log.compile_time, total_time_s=total_time_s, checkpoint_stall_s=stall,
                       final_checkpoint_s=final_save,
                       comm_bytes_per_step=sent, **cross_group,
                       first_step_end_unix=log.first_step_end, **memory.summary_fields(run.parallel.memory or {}),
                       **noise)
    evaluated = "  ".join(f"eval {k} {v:.4f}" for k, v in evaluation.metrics.items())
    where = f"; metrics in {run.workdir / 'metrics.jsonl'}" if run.workdir else ""
    if log.noise_scale:
        run.writer.echo(f"batch size: {noise_scale.advice(log.noise_scale.global_batch, log.noise_scale.value)}")
    per_sec = f"{rate:,.0f} examples/s" + (f" ({tokens['tokens_per_sec']:,.0f} tokens/s)" if tokens else "")
    per_sec += f", comm_bytes_per_step {sent:,.0f}" if sent is not None else ""
    per_sec += f" ({across:,.0f} across groups)" if across is not None else ""
    run.writer.echo(f"done: {evaluated + ', ' if evaluated else ''}{per_sec}, first step (compile) "
                    f"{log.compile_time:.1f}s, checkpoint stall {stall * 1e3:.0f} ms/save, final save "
                    f"{final_save:.2f}s{where}")
