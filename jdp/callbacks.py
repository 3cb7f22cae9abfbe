"""The hook protocol `jdp.Callback` (docs/api.md, "Callbacks") and jdp's own callbacks, registered by `builtin`."""

from __future__ import annotations

import collections
import dataclasses
import math
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jdp import distributed as distributed_lib
from jdp import faults
from jdp.checkpoint import Checkpointer
from jdp.errors import NonFiniteLossError, Preempted, ReplicaMismatchError
from jdp.metrics import MetricsWriter, ThroughputClock
from jdp.noise_scale import NoiseScale
from jdp.parallel import DataParallel
from jdp.preemption import PreemptionRequest

# Step counters, flags and the noise scale's inputs: not averaged over a window.
_AS_REPORTED = ("skipped_steps", "lr", "loss_scale", "overflow_steps", "overflow", "nonfinite", "weight",
                "noise_small_sq", "noise_big_sq", "noise_small_batch")


@dataclasses.dataclass
class Run:
    """What the actions of one run share."""

    parallel: DataParallel
    source: Any  # jdp.Source
    writer: MetricsWriter
    clock: ThroughputClock
    workdir: Path | None
    steps: int  # the last step
    start: int  # the step the run started (or resumed) from
    batch_size: int
    state: Any  # the train state after the latest step, in the compiled step's layout
    options: Any  # jdp.FitOptions
    tokens_per_example: int = 0  # a language model's tokens per example (0: not counted in tokens)


class Callback:
    """Called by `fit` on every process; every hook is optional. `every`: the period of `on_step` (0 = never),
    unless `due` says otherwise (a condition: a signal, a sync point)."""

    every: int = 0
    reads_devices = False  # jdp's own: reads `run.state` (the compiled step's layout), so gets no logical state

    def on_start(self, start: int, workdir: Path | None, record: dict[str, Any] | None) -> None:
        """Once, before the first step: the start (or resumed) step, the workdir, and the run record this segment
        wrote to run.json (process 0; None elsewhere, without a workdir, and for a finished run's rerun)."""

    def before_step(self, step: int) -> None:
        """Right before step `step` is dispatched."""

    def due(self, step: int) -> bool:
        return bool(self.every) and step % self.every == 0

    def on_metrics(self, step: int, metrics: dict[str, float]) -> None:
        """Every step's metrics (global-batch means and jdp's counters), in order, one step late."""

    def on_step(self, step: int, metrics: dict[str, float], state: Any) -> None:
        """When due: the metrics of `step` and the train state after it (logical layout: each leaf at its own
        shape, ZeRO's sharded leaves split across the devices; `run.parallel.to_host` makes numpy of it, called
        by every process together)."""

    def on_line(self, line: dict[str, Any]) -> None:
        """Each line written to metrics.jsonl (train, eval, summary), as written; process 0 only."""

    def on_end(self, result: Any) -> None:
        """Once, with the `jdp.FitResult`."""


class Every(Callback):
    """Due every `every` steps (0 = never) and at the run's last step."""

    def __init__(self, run: Run, every: int) -> None:
        self.run, self.every = run, every

    def due(self, step: int) -> bool:
        return step == self.run.steps or bool(self.every and step % self.every == 0)


def as_callback(given: Any) -> Callback:
    """A user's object with `every` or `due`, `on_step` and `on_end` (and any other hook it has) as a Callback."""
    if isinstance(given, Callback):
        return given
    callback = Callback()
    vars(callback).update({name: getattr(given, name) for name in ("every", "on_start", "before_step", "due",
                           "on_metrics", "on_step", "on_line", "on_end") if hasattr(given, name)})
    return callback


class TrainLog(Callback):
    """Per-step losses, the clock (from the first step's end), the noise scale; train lines of means every `every`."""

    def __init__(self, run: Run) -> None:
        self.run = run
        self.noise_scale: NoiseScale | None = None
        self.losses: list[float] = []
        self.window: dict[str, float] = {}
        self.window_steps = 0
        self.compile_time = self.first_step_end = math.nan
        self._t_first = time.perf_counter()

    def on_metrics(self, step: int, metrics: dict[str, float]) -> None:
        run = self.run
        if step == run.start + 1:
            self.compile_time = time.perf_counter() - self._t_first
            self.first_step_end = time.time()
            run.clock.start()
        else:
            run.clock.examples += run.batch_size
        self.losses.append(metrics["loss"] if metrics["weight"] > 0 else math.nan)
        # Dropped, fp16-overflowed (gradients non-finite) and weightless steps have no means to report.
        if not metrics["nonfinite"] and not metrics.get("overflow") and metrics["weight"] > 0:
            if "noise_small_sq" in metrics:
                self.noise_scale = self.noise_scale or NoiseScale()
                self.noise_scale.update(metrics)
            self.window.update({k: self.window.get(k, 0.0) + v for k, v in metrics.items() if k not in _AS_REPORTED})
            self.window_steps += 1
        if (step % run.options.log_every == 0 or step == run.steps) and self.window_steps:
            line = {k: v / self.window_steps for k, v in self.window.items()}
            # Fewer than log_every: the first line after a resume, the last one, or steps left out above.
            line["window_steps"] = self.window_steps
            line.update({k: metrics[k] for k in ("lr",) if k in metrics})
            if self.noise_scale is not None:
                line["grad_noise_scale"] = self.noise_scale.value
            rate = line["examples_per_sec"] = run.clock.interval_rate()  # None (null) before a timed step
            if run.tokens_per_example:
                line["tokens_per_sec"] = None if rate is None else rate * run.tokens_per_example
            line["skipped_steps"] = int(metrics["skipped_steps"])
            line["comm_bytes_per_step"] = run.parallel.comm_bytes_per_step
            if run.parallel.comm_cross_group_bytes_per_step is not None:  # a hybrid mesh: what crosses its groups
                line["comm_cross_group_bytes_per_step"] = run.parallel.comm_cross_group_bytes_per_step
            if run.options.precision == "fp16":  # loss-scale overflows skip an update but are not failures
                line.update(loss_scale=metrics["loss_scale"], overflow_steps=int(metrics["overflow_steps"]))
            run.writer.train(step, line)
            self.window, self.window_steps = {}, 0


# A lower learning rate or clipped gradients, as fit and the CLI take them.
FIXES = "optax.clip_by_global_norm; --config.optim.lr, --config.optim.grad_clip_norm"


class NonFiniteGuard(Callback):
    """`halt`: stop at the first non-finite step (the loop saves the state from before it). `skip`: warn and go on,
    but stop once more than `max_skipped_fraction` of the last `WINDOW` steps were skipped."""

    WINDOW = 100

    def __init__(self, run: Run) -> None:
        self.run = run
        self.recent: collections.deque[bool] = collections.deque(maxlen=self.WINDOW)
        self.warned = False

    def on_metrics(self, step: int, metrics: dict[str, float]) -> None:
        bad = bool(metrics["nonfinite"])
        self.recent.append(bad)
        if not bad:
            return
        options, period = self.run.options, self.run.parallel.sync.agrees_every
        if options.on_nonfinite == "halt":
            saved = ("the state from before it is saved" if (step - 1) % period == 0 else
                     f"the last checkpoint stays the latest (local SGD saves only at sync points, every "
                     f"{period} steps)")
            raise NonFiniteLossError(
                f"non-finite {self._cause(step, metrics)} at step {step}; {saved}; rerun to resume, skipping such "
                "steps (on_nonfinite='skip'; --config.train.on_nonfinite=skip), or with a lower learning rate or "
                f"clipped gradients ({FIXES}) and allow_config_change=True "
                "(--config.checkpoint.allow_config_change=True)")
        skipped = sum(self.recent)
        if skipped > options.max_skipped_fraction * self.WINDOW:
            raise NonFiniteLossError(
                f"{skipped} of the last {len(self.recent)} steps were skipped as non-finite, more than "
                f"max_skipped_fraction={options.max_skipped_fraction:g} of {self.WINDOW} "
                f"(--config.train.max_skipped_fraction); the latest, step {step}, had non-finite "
                f"{self._cause(step, metrics)}; the state is saved; fix the data, lower the learning rate or clip "
                f"gradients ({FIXES})")
        if not self.warned:  # later ones are counted in the train lines' skipped_steps
            self.warned = True
            self.run.writer.warn(f"step {step} had non-finite {self._cause(step, metrics)}; its update was "
                                 "skipped, as later ones will be (counted as skipped_steps in the train lines)")

    def _cause(self, step: int, metrics: dict[str, float]) -> str:
        """What was not finite: this process's rows of the batch (read again), else the loss, else the gradients."""
        loss = metrics["loss"]
        bad_keys = [k for k, v in self.run.source.train_batch(step - 1).items()
                    if np.issubdtype(np.asarray(v).dtype, np.floating) and not np.isfinite(v).all()]
        if bad_keys:
            return f"inputs (batch key {', '.join(repr(k) for k in bad_keys)}), hence the loss ({loss})"
        if not math.isfinite(loss):
            # Loss scaling rescues gradients, not the forward pass: a float16 overflow there is not retried.
            fp16 = ("; under precision=fp16 the forward pass overflowed float16; precision=bf16 has float32's range"
                    if self.run.options.precision == "fp16" else "")
            return f"loss ({loss}) from finite inputs{fp16}"
        return f"gradients (the loss, {loss:.4g}, was finite)"


class ReplicaCheck(Every):
    """Each device checksums its copy of the replicated state; a mismatch stops the run."""

    reads_devices = True  # `run.state`, not the logical state

    def on_step(self, step: int, metrics: dict[str, float], state: Any) -> None:
        with self.run.clock.paused():  # the first check also compiles the checksum program
            leaf = self.run.parallel.first_differing_leaf(self.run.parallel.replicated(self.run.state))
        if leaf is not None:
            raise ReplicaMismatchError(f"replicas differ at step {step}: first differing parameter {leaf}")


class Checkpoints(Every):
    """Asynchronous orbax saves of the whole train state and the data position; the clock stops meanwhile."""

    def __init__(self, run: Run, checkpointer: Checkpointer) -> None:
        super().__init__(run, checkpointer.every_steps)
        self.checkpointer = checkpointer
        self.stalls: list[float] = []  # the blocking time of each save made during training
        self.final_call_s: float | None = None  # the final save's: nothing trains behind it, so not a stall

    def on_step(self, step: int, metrics: dict[str, float], state: Any) -> None:
        """Saves `state`, the logical train state after `step` (also on a halt or a signal: `metrics` unused)."""
        with self.run.clock.paused():
            t = time.perf_counter()
            # The data position is informative: a source reads any step directly.
            self.checkpointer.save(step, state, {"step": step, "epoch": step // self.run.source.steps_per_epoch})
            elapsed = time.perf_counter() - t
        if step == self.run.steps:
            self.final_call_s = elapsed
        else:
            self.stalls.append(elapsed)

    def finish_final(self) -> float:
        """Waits for the final save's commit; returns that save's blocking time (0 without a final save)."""
        if self.final_call_s is None:
            return 0.0
        with self.run.clock.paused():
            t = time.perf_counter()
            self.checkpointer.wait()
            return self.final_call_s + time.perf_counter() - t


class Evaluation(Every):
    """The whole eval split, weighted means written as an eval line; the clock stops meanwhile."""

    reads_devices = True

    def __init__(self, run: Run, every: int) -> None:
        super().__init__(run, every)
        self.metrics: dict[str, float] = {}
        self.warned = False

    def on_step(self, step: int, metrics: dict[str, float], state: Any) -> None:
        with self.run.clock.paused():
            result = self.run.parallel.evaluate(self.run.state, self.run.source.eval_batches())
            if result:
                self.metrics = result
                self.run.writer.eval(step, result)
                if not self.warned and not math.isfinite(result.get("loss", 0.0)):
                    self.warned = True  # once: the summary line lists every such eval
                    self.run.writer.warn(self._nonfinite(step, result["loss"]))

    def _nonfinite(self, step: int, loss: float) -> str:
        """Why the eval loss is not finite, as this process's rows of the eval split tell."""
        bad = sorted({k for batch in self.run.source.eval_batches() for k, v in batch.items()
                      if np.issubdtype(np.asarray(v).dtype, np.floating) and not np.isfinite(v).all()})
        noted = "(null in metrics.jsonl; the summary line lists such evals under nonfinite_eval_steps)"
        if bad:
            return (f"the eval split holds non-finite inputs (key {', '.join(repr(k) for k in bad)}), so the eval "
                    f"loss at step {step} is {loss} {noted}; fix the eval data")
        return f"the eval loss at step {step} is {loss}, from finite eval inputs {noted}"


class Profile(Callback):
    """A JAX profiler trace of steps first..last into WORKDIR/profile."""

    def __init__(self, run: Run, first: int, last: int) -> None:
        self.run, self.first, self.last = run, first, last

    def before_step(self, step: int) -> None:
        if step == self.first:
            jax.profiler.start_trace(self.run.workdir / "profile")

    def due(self, step: int) -> bool:
        return step == self.last

    def on_step(self, step: int, metrics: dict[str, float], state: Any) -> None:
        jax.profiler.stop_trace()
        self.run.writer.echo(f"profile of steps {self.first}-{self.last} written to {self.run.workdir / 'profile'} "
                             "(open with TensorBoard's profile plugin or Perfetto)")


class StopOnSignal(Callback):
    """SIGTERM or SIGINT to any process: every process stops at the same step (a sync point), checkpoints there and
    raises Preempted."""

    def __init__(self, run: Run, preemption: PreemptionRequest, checkpoints: Checkpoints | None) -> None:
        self.run, self.preemption, self.checkpoints = run, preemption, checkpoints
        self.agreement = distributed_lib.StopAgreement()
        self.agreed = False

    def due(self, step: int) -> bool:
        self.agreed |= self.agreement.should_stop(step, self.preemption.signal_name is not None)
        return self.agreed and step % self.run.parallel.sync.agrees_every == 0

    def on_step(self, step: int, metrics: dict[str, float], state: Any) -> None:
        cause = self.preemption.signal_name or "a signal to another process"
        if self.checkpoints is None:
            raise Preempted(f"{cause} at step {step}; no workdir, so no checkpoint was written")
        self.checkpoints.on_step(step, metrics, state)
        self.checkpoints.checkpointer.wait()
        raise Preempted(f"{cause} at step {step}: checkpoint written to "
                        f"{self.checkpoints.checkpointer.directory / str(step)}; rerun the same command to resume")


class KillAfterStep(Callback):
    """`JDP_KILL_AT=step:STEP` or `raise:STEP` (`jdp.faults`): SIGKILL or an exception after STEP's checkpoint."""

    def __init__(self, step: int, checkpoints: Checkpoints | None) -> None:
        self.step, self.checkpoints = step, checkpoints

    def due(self, step: int) -> bool:
        return step == self.step

    def on_step(self, step: int, metrics: dict[str, float], state: Any) -> None:
        faults.inject("step", step, before=self.checkpoints.checkpointer.wait if self.checkpoints else lambda: None)
        faults.inject("raise", step)


def builtin(run: Run, checkpoints: Checkpoints | None, preemption: PreemptionRequest, log: TrainLog,
            evaluation: Evaluation) -> list[Callback]:
    """jdp's own callbacks, in the order they run."""
    kill_at, options, every = faults.requested_step(), run.options, run.parallel.sync.agrees_every
    return [log, NonFiniteGuard(run), StopOnSignal(run, preemption, checkpoints),
            # Replicas agree every `every` steps: the default period rounds up to a multiple (others are refused).
            ReplicaCheck(run, -(-options.check_replicas_every // every) * every),
            *([checkpoints] if checkpoints else []),
            *([KillAfterStep(kill_at, checkpoints)] if kill_at is not None else []),
            evaluation,
            *([Profile(run, *options.profile_steps)] if options.profile_steps and run.workdir is not None else [])]
