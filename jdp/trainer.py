"""`jdp.fit`: any Flax NNX model, any loss, any data, trained data-parallel over every device of the run.

The loop keeps the four steps in sight: the batch is split over the `data` axis (`DataParallel.shard_batch`),
and the compiled step computes, all-reduces and updates (`jdp.step.train_step`); everything else (logging,
eval, checkpoints, replica checks, the stop agreement, user callbacks) runs by period between steps.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jdp import distributed as distributed_lib
from jdp import optim as optim_lib
from jdp import zero
from jdp.checkpoint import Checkpointer
from jdp.data.batching import Batcher
from jdp.errors import NonFiniteLossError, Preempted, ReplicaMismatchError, UsageError
from jdp.faults import kill_if_requested
from jdp.mesh import DATA_AXIS, make_mesh, replicated
from jdp.metrics import MetricsWriter, ThroughputClock
from jdp.modeldef import LossFn, ModelDef
from jdp.parallel import BACKENDS, DataParallel
from jdp.preemption import PreemptionRequest
from jdp.step import (
    ALLREDUCE_DTYPES,
    COMPUTE_DTYPES,
    NONFINITE_POLICIES,
    StepOptions,
    TrainState,
    run_loss,
)


class FitError(UsageError):
    """Bad input to `fit`, found before anything compiles: one line naming it and the fix."""


class Source(Protocol):
    """What `fit` reads data through; jdp's own sources (tfds, MNIST-1D, digits, synthetic) and `Batcher`
    (dicts of arrays, random-access datasets) are Sources. A Source is made for one layout of the run
    (seed, global and eval batch size, this process's index and the process count) and hands this process
    its own rows of every global batch."""

    num_train: int  # train examples
    steps_per_epoch: int

    def train_batch(self, step: int) -> dict[str, np.ndarray]:
        """This process's rows of the global train batch at `step` (0-based), a function of (seed, step)."""

    def eval_batches(self) -> Any:
        """The eval split once: this process's rows of each eval batch, with a float `mask` (0 = padding).
        Every process yields the same number of batches."""

    def close(self) -> None:
        """Release threads and files."""


class Callback(Protocol):
    """Called by `fit` on every process: `on_step` every `every` steps, with that step's metrics (global-batch
    means, fetched one step late so the host never stalls the devices) and the train state; `on_end` once."""

    every: int

    def on_step(self, step: int, metrics: dict[str, float], state: TrainState) -> None: ...

    def on_end(self, result: FitResult) -> None: ...


@dataclasses.dataclass(frozen=True)
class FitOptions:
    """`fit`'s keyword arguments beyond the required ones, with their defaults."""

    eval_data: Any = None  # like train_data; None = no eval (unless train_data is a Source with an eval split)
    eval_fn: LossFn | None = None  # eval loss function; None = loss_fn
    eval_every: int = 0  # steps between evals; 0 = at the end only
    eval_batch_size: int = 0  # 0 = global_batch_size
    workdir: str | Path | None = None  # checkpoints and metrics here, resumed from; None = nothing written
    seed: int = 0  # orders the data; folded into the model's RNG streams
    backend: str = "shard_map"  # shard_map | pmap | jit
    num_devices: int = 0  # the first N devices; 0 = all
    precision: str = "fp32"  # fp32 | bf16 | fp16 (float32 master parameters)
    keep_fp32: tuple[str, ...] = ()  # floating batch keys never cast under bf16/fp16 (e.g. regression targets)
    grad_accum_steps: int = 1  # micro-batches per step, one all-reduce
    checkpoint_every: int = 0  # steps between checkpoints (0 = at the end and on preemption only)
    keep_checkpoints: int = 3
    log_every: int = 50  # steps between train lines
    callbacks: Sequence[Callback] = ()
    bn_sync: bool = True  # every nnx.BatchNorm averages its statistics across devices
    on_nonfinite: str = "halt"  # halt: save the state from before it and raise | skip the update
    check_replicas_every: int = 500  # compare the replicas' bits every N steps (0 = at the end only)
    shard_optimizer: bool = False  # ZeRO-1 (shard_map; element-wise optimizers only)
    sync_every: int = 1  # local SGD: average parameters every H steps
    allreduce_dtype: str = "fp32"  # fp32 | bf16 gradient all-reduce
    log_grad_norm: bool = False
    loss_scale: float = 2.0**15  # fp16: initial dynamic loss scale
    loss_scale_growth_interval: int = 2000
    schedule: optax.Schedule | None = None  # the optimizer's learning-rate schedule, logged as `lr`
    profile_steps: tuple[int, int] | None = None  # a JAX profiler trace of these steps into WORKDIR/profile
    description: str = ""  # named in the start-up line

    def __post_init__(self) -> None:
        choices = {"backend": BACKENDS, "precision": tuple(COMPUTE_DTYPES), "on_nonfinite": NONFINITE_POLICIES,
                   "allreduce_dtype": ALLREDUCE_DTYPES}
        for key, allowed in choices.items():
            if getattr(self, key) not in allowed:
                raise FitError(f"{key}={getattr(self, key)!r} is unknown; choose one of {', '.join(allowed)}")
        for key in ("grad_accum_steps", "log_every", "keep_checkpoints", "sync_every"):
            if getattr(self, key) < 1:
                raise FitError(f"{key}={getattr(self, key)} must be at least 1")
        for key in ("eval_every", "eval_batch_size", "num_devices", "checkpoint_every", "check_replicas_every", "seed"):
            if getattr(self, key) < 0:
                raise FitError(f"{key}={getattr(self, key)} must not be negative")
        per_device = self.backend in ("shard_map", "pmap")
        if self.allreduce_dtype != "fp32" and not per_device:
            raise FitError("allreduce_dtype=bf16 needs an explicit collective; use backend='shard_map'")
        if self.shard_optimizer and (self.backend != "shard_map" or self.sync_every > 1):
            raise FitError("shard_optimizer=True needs backend='shard_map' and no local SGD (sync_every=1)")
        if self.sync_every > 1:
            if not per_device:
                raise FitError("sync_every > 1 (local SGD) needs a per-device step; use backend='shard_map' or 'pmap'")
            for key in ("eval_every", "checkpoint_every", "check_replicas_every"):
                if getattr(self, key) % self.sync_every:
                    raise FitError(f"{key}={getattr(self, key)} is not a multiple of sync_every={self.sync_every}: "
                                   "with local SGD the replicas agree only at sync points")


@dataclasses.dataclass
class FitResult:
    losses: list[float]  # per-step train loss (weighted mean over the global batch), from the start step on
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


def _options(kwargs: dict[str, Any]) -> FitOptions:
    known = [f.name for f in dataclasses.fields(FitOptions)]
    for key in kwargs:
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else "; see jdp.FitOptions"
            raise FitError(f"fit() got an unknown argument {key!r}{hint}")
    return FitOptions(**kwargs)


def _check_joined() -> None:
    """A multi-process environment must be joined (`jdp.initialize()`) before JAX starts."""
    try:
        job = distributed_lib.resolve()
    except UsageError:
        return  # inconsistent variables: jdp.initialize() reports them
    if job is not None and jax.process_count() == 1:
        raise FitError(f"this looks like process {job.process_id} of {job.num_processes} ({job.origin}) but JAX "
                       "runs alone; call jdp.initialize() before any other JAX work")


def _source(train_data: Any, eval_data: Any, options: FitOptions, global_batch_size: int) -> Source:
    if hasattr(train_data, "train_batch"):  # a jdp Source: already laid out for this run
        if eval_data is not None:
            raise FitError("eval_data goes with train_data given as arrays or a dataset; a Source brings its own "
                           "eval split")
        return train_data
    try:
        return Batcher(train_data, eval_data, seed=options.seed, global_batch_size=global_batch_size,
                       eval_batch_size=options.eval_batch_size, process_index=jax.process_index(),
                       process_count=jax.process_count())
    except ValueError as e:
        raise FitError(str(e)) from None


def _check_sliceable(tx: optax.GradientTransformation, abstract_params: Any, n: int) -> None:
    """ZeRO-1 runs the optimizer on flat slices of each leaf: refuse a transform whose update on slices
    differs from its update on whole leaves (global norms, trust ratios, shape-dependent masks)."""
    if isinstance(tx, optim_lib.Sliceable):
        return
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda x: rng.standard_normal([min(d, 3) for d in x.shape]).astype(np.float32),
                          abstract_params)
    grads = jax.tree.map(lambda x: rng.standard_normal(x.shape).astype(np.float32), params)
    whole, _ = tx.update(grads, tx.init(params), params)
    slices = []
    for i in range(n):
        local = jax.tree.map(lambda x, i=i: np.array_split(zero.shard_layout(x, n), n)[i] if x.ndim else x, params)
        local_grads = jax.tree.map(lambda x, i=i: np.array_split(zero.shard_layout(x, n), n)[i] if x.ndim else x,
                                   grads)
        slices.append(tx.update(local_grads, tx.init(local), local)[0])
    gathered = jax.tree.map(lambda w, *s: np.concatenate([np.ravel(p) for p in s])[: w.size].reshape(w.shape)
                            if w.ndim else s[0], whole, *slices)
    if not all(np.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(jax.tree.leaves(whole),
                                                                       jax.tree.leaves(gathered), strict=True)):
        raise FitError("shard_optimizer=True runs the optimizer on slices of each parameter, and this optimizer "
                       "updates slices differently from whole parameters (global-norm clipping, LAMB, LARS, "
                       "shape-dependent masks); use an element-wise one (sgd, momentum, adam, adamw) or "
                       "shard_optimizer=False")


@dataclasses.dataclass
class Engine:
    """Everything a run compiles, checked before anything compiles: shared by `fit` and by tools that
    drive the step themselves (`jdp.bench`, the tests)."""

    parallel: DataParallel
    source: Source
    model: ModelDef
    init_state: Callable[[], TrainState]  # a fresh logical state, created on the devices
    abstract_state: TrainState  # shapes, dtypes and replicated shardings of the logical state


def prepare(model: nnx.Module | Callable[[], nnx.Module], loss_fn: LossFn, train_data: Any, *,
            optimizer: optax.GradientTransformation, global_batch_size: int,
            options: FitOptions = FitOptions(), all_reduce: bool = True) -> Engine:
    """The compiled steps, the data and the state factory of a run; raises FitError on bad input."""
    o = options
    mesh = make_mesh(o.num_devices)
    n = mesh.size
    if global_batch_size <= 0 or global_batch_size % (n * o.grad_accum_steps):
        raise FitError(f"global_batch_size={global_batch_size} does not split into {o.grad_accum_steps} "
                       f"micro-batch(es) on each of {n} devices; use a positive multiple of {n * o.grad_accum_steps}")
    if o.eval_batch_size % n:
        raise FitError(f"eval_batch_size={o.eval_batch_size} is not divisible by the {n} devices")
    source = _source(train_data, o.eval_data, o, global_batch_size)
    # Under jit the batch is global, so BatchNorm statistics are global without a named axis.
    bn_axis = DATA_AXIS if o.bn_sync and o.backend != "jit" else None
    make = model if callable(model) and not isinstance(model, nnx.Module) else None
    try:
        model_def = ModelDef.of(nnx.eval_shape(make) if make else model, bn_axis)
    except ValueError as e:
        raise FitError(str(e)) from None
    if make is None:  # host copies: the devices' replicated buffers must not alias the caller's
        initial = jax.tree.map(np.asarray, ModelDef.split(model, o.seed))

    def init_state() -> TrainState:
        params, model_state, rng_state = ModelDef.split(make(), o.seed) if make else initial
        zero_ = jnp.zeros((), jnp.int32)
        loss_scale = jnp.array([o.loss_scale if o.precision == "fp16" else 1.0, 0, 0], jnp.float32)
        return TrainState(zero_, params, model_state, rng_state, optimizer.init(params), zero_, loss_scale, zero_)

    abstract = jax.eval_shape(init_state)
    _check_loss(model_def, loss_fn, o.eval_fn or loss_fn, abstract, source, n)
    if o.shard_optimizer:
        _check_sliceable(optimizer, abstract.params, n)
    step_options = StepOptions(
        bn_groups=1 if o.bn_sync else n, on_nonfinite=o.on_nonfinite, precision=o.precision, keep_fp32=o.keep_fp32,
        grad_accum_steps=o.grad_accum_steps, allreduce_dtype=o.allreduce_dtype, all_reduce=all_reduce,
        log_grad_norm=o.log_grad_norm, sync_every=o.sync_every, shard_optimizer=o.shard_optimizer,
        loss_scale_growth_interval=o.loss_scale_growth_interval,
        device_input=getattr(source, "device_input", StepOptions.device_input))
    parallel = DataParallel(o.backend, mesh, model_def, loss_fn, o.eval_fn or loss_fn, optimizer, o.schedule,
                            abstract, step_options)
    sharding = replicated(mesh)
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), abstract)
    return Engine(parallel, source, model_def, lambda: parallel.init_state(init_state), abstract)


def _check_loss(model_def: ModelDef, loss_fn: LossFn, eval_fn: LossFn, abstract: TrainState, source: Source,
                n: int) -> None:
    """The loss contract, checked on shapes alone: a dict with a per-example `"loss"`, every value (and the
    optional `"weight"`) of one shape whose leading axis is the batch."""
    rows = source.train_batch(0)
    local = {k: jax.ShapeDtypeStruct((v.shape[0] // max(1, n // jax.process_count()), *v.shape[1:]), v.dtype)
             for k, v in rows.items()}
    device_input = getattr(source, "device_input", StepOptions.device_input)
    for name, fn, train in (("loss_fn", loss_fn, True), ("eval_fn", eval_fn, False)):
        def call(state, batch, fn=fn, train=train):
            return run_loss(model_def, fn, state.params, state.model_state, state.rng_state, device_input(batch),
                            train=train)[0]
        try:  # vmapped over a `data` axis of one, which synced BatchNorm reduces over
            per_device = jax.vmap(call, in_axes=(None, 0), axis_name=DATA_AXIS)
            outputs = jax.eval_shape(per_device, abstract, jax.tree.map(_one_device, local))
            outputs = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), outputs)
        except Exception as e:  # noqa: BLE001 - the user's code failed on the batch: say where, in one line
            raise FitError(f"{name}(model, batch) failed on a batch with keys {sorted(rows)}: "
                           f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}") from e
        batch_rows = next(iter(local.values())).shape[0]
        if not isinstance(outputs, dict) or "loss" not in outputs:
            raise FitError(f"{name} must return a dict with a 'loss' entry (one value per example); it returned "
                           f"{sorted(outputs) if isinstance(outputs, dict) else type(outputs).__name__}")
        shape = outputs["loss"].shape
        if not shape or shape[0] != batch_rows:
            raise FitError(f"{name}'s 'loss' has shape {shape}; it must hold one value per example (leading axis "
                           f"the batch, {batch_rows} rows here): return the per-example losses, jdp averages them")
        for key, value in outputs.items():
            if value.shape != shape:
                raise FitError(f"{name}'s {key!r} has shape {value.shape}, 'loss' has {shape}; every output needs "
                               "the loss's shape (one value per example, or per example and token)")


def _one_device(x: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct((1, *x.shape), x.dtype)


def fit(model: nnx.Module | Callable[[], nnx.Module], loss_fn: LossFn, train_data: Any, *,
        optimizer: optax.GradientTransformation, steps: int, global_batch_size: int, **options: Any) -> FitResult:
    """Trains `model` data-parallel for `steps` steps of `global_batch_size` examples; see README "Your own model".

    `model`: an `nnx.Module`, or a function returning one (then created directly on the devices). After
    `fit`, a module passed in holds the final state. `loss_fn(model, batch)` returns a dict of per-example
    values (`"loss"` is differentiated, an optional `"weight"` weights each entry, the rest are metrics);
    jdp takes the weighted mean over the whole global batch. `train_data` / `eval_data`: a dict of arrays
    sharing a leading length, a random-access dataset, or a jdp `Source`. Other options: `FitOptions`.
    """
    return run(model, loss_fn, train_data, optimizer=optimizer, steps=steps, global_batch_size=global_batch_size,
               options=_options(options))


def run(model: nnx.Module | Callable[[], nnx.Module], loss_fn: LossFn, train_data: Any, *,
        optimizer: optax.GradientTransformation, steps: int, global_batch_size: int, options: FitOptions
        ) -> FitResult:
    """`fit` with its options already gathered (what `python -m jdp.train` calls)."""
    o = options
    _check_joined()
    if steps <= 0:
        raise FitError(f"steps={steps} must be positive")
    engine = prepare(model, loss_fn, train_data, optimizer=optimizer, global_batch_size=global_batch_size, options=o)
    try:
        result = _Loop(engine, o, steps, global_batch_size).run()
    finally:
        engine.source.close()
    if isinstance(model, nnx.Module):
        engine.model.load_into(model, result.public.params, result.public.model_state, result.rng_state)
    for callback in o.callbacks:
        callback.on_end(result.public)
    return result.public


@dataclasses.dataclass
class _Finished:
    public: FitResult
    rng_state: Any


class _Loop:
    """The training loop of one `fit` call, with its periodic actions."""

    def __init__(self, engine: Engine, options: FitOptions, steps: int, global_batch_size: int) -> None:
        self.e, self.o, self.steps, self.batch_size = engine, options, steps, global_batch_size
        self.parallel = engine.parallel
        self.workdir = Path(options.workdir) if options.workdir is not None else None
        self.is_main = jax.process_index() == 0
        self.checkpointer = (Checkpointer(self.workdir / "checkpoints", keep=options.keep_checkpoints,
                                          every_steps=options.checkpoint_every) if self.workdir else None)
        self.clock, self.losses, self.save_stalls = ThroughputClock(), [], []
        self.window: dict[str, float] = {}  # sums of the metrics since the last train line
        self.window_steps = 0
        self.eval_metrics: dict[str, float] = {}
        self.compile_time = self.first_step_end = math.nan

    def _restore_or_init(self) -> tuple[int, TrainState]:
        echo = self.writer_echo
        if self.checkpointer is not None:
            restored = self.checkpointer.restore_latest(self.e.abstract_state, echo)
            if restored is not None:
                step, state, position = restored
                echo(f"resumed from {self.checkpointer.directory / str(step)} (data position {position})")
                return step, state._replace(halted=state.halted * 0)  # a halted run may go on (e.g. at a lower lr)
        return 0, self.e.init_state()

    def writer_echo(self, line: str) -> None:
        if self.is_main:
            print(line, flush=True)

    def run(self) -> _Finished:
        t_start = time.perf_counter()
        if self.workdir is not None and self.is_main:
            self.workdir.mkdir(parents=True, exist_ok=True)
        start, logical = self._restore_or_init()
        self.start = start
        self.state = self.parallel.to_devices(logical)
        self.writer = MetricsWriter(self.workdir, total_steps=self.steps, start_step=start, enabled=self.is_main)
        self._header()
        try:
            if start < self.steps:
                self._train(start)
                stall = sum(self.save_stalls) / len(self.save_stalls) if self.save_stalls else 0.0
                self.writer.summary(**{f"eval_{k}": v for k, v in self.eval_metrics.items()},
                                    examples_per_sec=self.clock.rate(), compile_time_s=self.compile_time,
                                    total_time_s=time.perf_counter() - t_start, checkpoint_stall_s=stall,
                                    first_step_end_unix=self.first_step_end)
                evaluated = "  ".join(f"eval {k} {v:.4f}" for k, v in self.eval_metrics.items())
                where = f"; metrics in {self.workdir / 'metrics.jsonl'}" if self.workdir else ""
                self.writer.echo(f"done: {evaluated + ', ' if evaluated else ''}{self.clock.rate():,.0f} examples/s, "
                                 f"first step (compile) {self.compile_time:.1f}s, checkpoint stall "
                                 f"{stall * 1e3:.0f} ms/save{where}")
            else:
                self.writer.echo(f"nothing to do: {self.workdir} is at step {start}, steps is {self.steps}")
                self.eval_metrics = evaluate(self.parallel, self.state, self.e.source)
        except NonFiniteLossError:
            # The compiled step froze the state before the bad update: keep it for inspection and resume.
            if self.checkpointer is not None:
                halted = self.parallel.to_logical(self.state)
                halted_step = int(halted.step.addressable_data(0))
                self.checkpointer.save(halted_step, halted, self._position(halted_step))
            raise
        finally:
            if self.checkpointer is not None:
                self.checkpointer.wait()
                self.checkpointer.close()
            self.writer.close()
        final = self.parallel.to_host(self.parallel.to_logical(self.state))
        result = FitResult(self.losses, self.eval_metrics, final.params, final.model_state,
                           int(final.step), self.clock.rate())
        return _Finished(result, final.rng_state)

    def _header(self) -> None:
        mesh, n = self.parallel.mesh, self.parallel.mesh.size
        params = sum(x.size for x in jax.tree.leaves(self.e.abstract_state.params))
        source = self.e.source
        what = f"{self.o.description}: " if self.o.description else ""
        self.writer.echo(
            f"jdp: {n} {mesh.devices.flat[0].platform} devices x {self.batch_size // n} examples = global batch "
            f"{self.batch_size} ({jax.process_count()} process(es)); {what}{params:,} parameters, "
            f"{source.num_train} train examples, {self.steps} steps = {self.steps / source.steps_per_epoch:.1f} "
            f"epochs; backend {self.o.backend}")

    def _position(self, step: int) -> dict[str, int]:  # informative: the source reads any step directly
        return {"step": step, "epoch": step // self.e.source.steps_per_epoch}

    def _record(self, step: int, metrics: dict) -> None:
        """Host side of step `step`, fetched one step late so the device queue stays short."""
        values = self.parallel.fetch(metrics)
        if step == self.start + 1:  # the first step includes compilation: the clock starts after it
            self.compile_time = time.perf_counter() - self.t_first
            self.first_step_end = time.time()
            self.clock.start()
        else:
            self.clock.add(self.batch_size)
        nonfinite, weight = values.pop("nonfinite"), values.pop("weight")
        if nonfinite:
            if self.o.on_nonfinite == "halt":
                raise NonFiniteLossError(
                    f"non-finite loss or gradient at step {step} (loss {values['loss']}); the state from before it "
                    "is saved; rerun to resume, with train.on_nonfinite=skip, or with a lower optim.lr or an "
                    "optim.grad_clip_norm plus checkpoint.allow_config_change=True")
            self.writer.echo(f"warning: step {step} had a non-finite loss or gradient; its update was skipped")
        else:
            self.losses.append(values["loss"])
        averaged = {k: v for k, v in values.items() if k not in _COUNTERS}
        if not nonfinite and weight > 0:
            for key, value in averaged.items():
                self.window[key] = self.window.get(key, 0.0) + value
            self.window_steps += 1
        for callback in self.o.callbacks:
            if step % callback.every == 0:
                callback.on_step(step, values, self.parallel.to_logical(self.state))
        if (step % self.o.log_every == 0 or step == self.steps) and self.window_steps:
            line = {k: v / self.window_steps for k, v in self.window.items()}
            line.update({k: values[k] for k in ("lr",) if k in values})
            line["examples_per_sec"] = self.clock.interval_rate()
            line["skipped_steps"] = int(values["skipped_steps"])
            if self.o.precision == "fp16":  # loss-scale overflows skip an update but are not failures
                line.update(loss_scale=values["loss_scale"], overflow_steps=int(values["overflow_steps"]))
            self.writer.train(step, line)
            self.window, self.window_steps = {}, 0

    def _save(self, step: int) -> None:
        self.clock.pause()
        t = time.perf_counter()
        self.checkpointer.save(step, self.parallel.to_logical(self.state), self._position(step))
        self.save_stalls.append(time.perf_counter() - t)
        self.clock.start()

    def _check_replicas(self, step: int) -> None:
        s = self.state
        leaf = self.parallel.first_differing_leaf({"params": s.params, "model_state": s.model_state,
                                                   "rng_state": s.rng_state})
        if leaf is not None:
            raise ReplicaMismatchError(f"replicas differ at step {step}: first differing parameter {leaf}")

    def _evaluate(self, step: int) -> None:
        self.clock.pause()
        metrics = evaluate(self.parallel, self.state, self.e.source)
        if metrics:
            self.eval_metrics = metrics
            self.writer.eval(step, metrics)
        self.clock.start()

    def _train(self, start: int) -> None:
        o, parallel, source = self.o, self.parallel, self.e.source
        stop = distributed_lib.StopAgreement()  # every process stops at the same step after a signal
        stop_agreed, pending = False, None
        profile = o.profile_steps
        self.t_first = time.perf_counter()
        with PreemptionRequest() as preemption:
            for step in range(start + 1, self.steps + 1):
                # 1. split. Dispatch is asynchronous: this batch is read and put on the devices while the
                # previous step still runs, so the next batch is already there when it ends.
                batch = parallel.shard_batch(source.train_batch(step - 1))
                if profile and step == profile[0] and self.workdir:
                    jax.profiler.start_trace(self.workdir / "profile")
                # 2-4. compute, all-reduce, update.
                self.state, metrics = parallel.train_step(self.state, batch)
                if profile and step == profile[1] and self.workdir:
                    jax.block_until_ready(metrics)
                    jax.profiler.stop_trace()
                    self.writer.echo(f"profile of steps {profile[0]}-{profile[1]} written to "
                                     f"{self.workdir / 'profile'} (open with TensorBoard's profile plugin or Perfetto)")
                kill_if_requested("step", step, before=self.checkpointer.wait if self.checkpointer else lambda: None)
                if pending is not None:
                    self._record(*pending)
                pending = (step, metrics)
                stop_agreed |= stop.should_stop(step, preemption.signal_name is not None)
                # Under local SGD the replicas agree only at sync points: stop at the next one.
                stopping = stop_agreed and step % o.sync_every == 0
                last = step == self.steps
                check_now = last or bool(o.check_replicas_every and step % o.check_replicas_every == 0)
                save_now = self.checkpointer is not None and (last or self.checkpointer.due(step))
                eval_now = last or bool(o.eval_every and step % o.eval_every == 0)
                if stopping or check_now or save_now or eval_now:
                    self._record(*pending)
                    pending = None
                if stopping:
                    if self.checkpointer is None:
                        raise Preempted(f"{preemption.signal_name or 'a signal'} at step {step}; no workdir, so no "
                                        "checkpoint was written")
                    self._save(step)
                    self.checkpointer.wait()
                    cause = preemption.signal_name or "a signal to another process"
                    raise Preempted(f"{cause} at step {step}: checkpoint written to "
                                    f"{self.checkpointer.directory / str(step)}; rerun the same command to resume")
                if check_now:
                    self._check_replicas(step)
                if save_now:
                    self._save(step)
                if eval_now:
                    self._evaluate(step)


_COUNTERS = ("skipped_steps", "lr", "loss_scale", "overflow_steps")  # reported as they are, not averaged


def evaluate(parallel: DataParallel, state: TrainState, source: Source) -> dict[str, float]:
    """Weighted means of the eval function's outputs over the whole eval split ({} without one); padded
    rows weigh nothing."""
    totals: dict[str, float] = {}
    pending = None

    def add(sums: dict) -> None:
        for k, v in parallel.fetch(sums).items():
            totals[k] = totals.get(k, 0.0) + v

    for rows in source.eval_batches():
        sums = parallel.eval_step(state, parallel.shard_batch(rows))
        if pending is not None:  # one batch late, so the host never queues the whole eval
            add(pending)
        pending = sums
    if pending is None:
        return {}
    add(pending)
    weight = totals.pop("weight")
    return {k: v / weight for k, v in totals.items()}

