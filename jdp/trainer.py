"""`jdp.fit` (docs/api.md): `prepare` checks the input and builds the run before anything compiles."""

from __future__ import annotations

import dataclasses
import difflib
import math
import numbers
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh

from jdp import callbacks, loop, metrics, preemption, storage
from jdp import distributed as distributed_lib
from jdp import record as record_lib
from jdp import sync as sync_lib
from jdp.data.batching import Batcher, Source, optional
from jdp.errors import FitError, UsageError, one_line, warn
from jdp.loop import Engine, FitResult
from jdp.mesh import device_axes, make_mesh, mesh_devices
from jdp.modeldef import LossFn, ModelDef
from jdp.options import FitOptions
from jdp.parallel import DataParallel
from jdp.precision import COMPUTE_DTYPES, cast_floating, jaxpr_matmul_dtypes
from jdp.step import StepOptions, TrainState, run_loss


def _options(kwargs: dict[str, Any]) -> FitOptions:
    known = [f.name for f in dataclasses.fields(FitOptions)]
    for key in kwargs:
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else "; see jdp.FitOptions"
            raise FitError(f"fit() got an unknown argument {key!r}{hint}")
    return FitOptions(**kwargs)


def _check_joined() -> None:
    try:
        job = distributed_lib.resolve()
    except UsageError:
        return  # inconsistent variables: jdp.initialize() reports them
    if job is not None and jax.process_count() == 1:
        raise FitError(f"this looks like process {job.process_id} of {job.num_processes} ({job.origin}) but JAX "
                       "runs alone; call jdp.initialize() before any other JAX work")


def is_factory(data: Any) -> bool:
    """Data given as a zero-argument function returning it (recorded by import path)."""
    return callable(data) and not hasattr(data, "__getitem__") and not hasattr(data, "train_batch")


def _source(train_data: Any, eval_data: Any, options: FitOptions, global_batch_size: int) -> Source:
    train_data, eval_data = (data() if is_factory(data) else data for data in (train_data, eval_data))
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


def prepare(model: nnx.Module | Callable[[], nnx.Module], loss_fn: LossFn, train_data: Any, *,
            optimizer: optax.GradientTransformation, global_batch_size: int,
            options: FitOptions | None = None, all_reduce: bool = True) -> Engine:
    """The compiled steps, the data and the state factory of a run; raises FitError on bad input."""
    o = options or FitOptions()
    _check_model_and_optimizer(model, optimizer)
    sync, what = sync_lib.strategy(o)
    try:  # the strategy lays out the mesh: the 1-D `data` mesh, or hybrid sharding's groups x `data`
        mesh = make_mesh(o.num_devices, sync.mesh_shape(len(mesh_devices(o.num_devices))))
    except UsageError as e:
        raise FitError(str(e)) from None
    n = mesh.size
    if global_batch_size <= 0 or global_batch_size % (n * o.grad_accum_steps):
        raise FitError(f"global_batch_size={global_batch_size} does not split into {o.grad_accum_steps} "
                       f"micro-batch(es) on each of {n} devices; use a positive multiple of {n * o.grad_accum_steps}")
    if o.log_noise_scale and n == 1 and o.grad_accum_steps == 1:
        raise FitError("log_noise_scale (train.log_noise_scale) needs small batches to compare with the global "
                       "one: several devices, or on one device grad_accum_steps > 1 (its micro-batches)")
    if o.eval_batch_size % n:
        raise FitError(f"eval_batch_size={o.eval_batch_size} is not divisible by the {n} devices")
    source = _source(train_data, o.eval_data, o, global_batch_size)
    largest = eval_batch_limit(optional(source, "num_eval"), n)
    if o.eval_batch_size > largest:
        raise FitError(f"eval_batch_size={o.eval_batch_size} is larger than the eval data needs ({source.num_eval} "
                       f"examples on {n} device(s)); use at most {largest}, or 0 (= global_batch_size)")
    if not optional(source, "num_eval") and (o.eval_every or o.eval_fn) and jax.process_index() == 0:
        warn(f"{'eval_every' if o.eval_every else 'eval_fn'} is set, but there is no eval data: no eval runs; "
             "give eval_data")
    # Synced BatchNorm reduces over the devices' axes, but jit without accumulation sees the global batch whole.
    bn_axis = device_axes(mesh) if o.bn_sync and (o.backend != "jit" or o.grad_accum_steps > 1) else None
    make = model if callable(model) and not isinstance(model, nnx.Module) else None
    module = _abstract_model(make) if make else model
    model_def = ModelDef.of(module, bn_axis, o.seed)
    sync = sync.bind(module, o.seed)
    # A module's state goes in as host copies (an argument, not constants), never aliased by the devices' buffers.
    initial = () if make else (jax.tree.map(np.asarray, ModelDef.split(model, o.seed)),)

    def init_state(*given: Any) -> TrainState:
        params, model_state, rng_state = ModelDef.split(make(), o.seed) if make else given[0]
        zero_ = jnp.zeros((), jnp.int32)
        loss_scale = jnp.array([o.loss_scale if o.precision == "fp16" else 1.0, 0, 0], jnp.float32)
        return TrainState(zero_, params, model_state, rng_state, sync.init_opt_state(optimizer.init(params), n),
                          zero_, loss_scale, zero_, sync.init_state(params, n))

    abstract = jax.eval_shape(init_state, *initial)
    _check_loss(model_def, loss_fn, o.eval_fn or loss_fn, abstract, source, mesh, global_batch_size, o)
    sync.check_optimizer(optimizer, abstract.params, n, o.backend, what)
    step_options = StepOptions(
        o, bn_groups=1 if o.bn_sync else n, all_reduce=all_reduce, device_input=optional(source, "device_input"),
        noise_small_batches=("micro_batches" if n == 1 else "devices") if o.log_noise_scale else "")
    parallel = DataParallel(mesh, model_def, loss_fn, optimizer, abstract, step_options, sync)
    init_on_devices = jax.jit(init_state, out_shardings=parallel.logical_shardings)  # laid out as it lives there
    return Engine(parallel, source, model_def, lambda: init_on_devices(*initial),
                  jax.eval_shape(init_on_devices, *initial))  # with those shardings


def _check_model_and_optimizer(model: Any, optimizer: Any) -> None:
    if not isinstance(model, nnx.Module) and not callable(model):
        raise FitError(f"model is of type {type(model).__name__}; give an nnx.Module, or a function of no "
                       "arguments that returns one (e.g. lambda: MyNet(nnx.Rngs(0)))")
    if callable(getattr(optimizer, "init", None)) and callable(getattr(optimizer, "update", None)):
        return  # an optax.GradientTransformation, or anything with its two functions
    hint = "build one, e.g. optax.adamw(1e-3)"
    if isinstance(optimizer, str) and callable(getattr(optax, optimizer, None)):
        hint = f"build it, e.g. optax.{optimizer}(1e-3)"
    elif isinstance(optimizer, tuple) and optimizer and all(isinstance(f, optax.GradientTransformation)
                                                            for f in optimizer):
        hint = "its items are transforms; chain them: " + (
            "optax.chain(...)" if type(optimizer) is tuple else f"{type(optimizer).__name__}(*optax.chain(...))")
    elif callable(optimizer):  # optax.adam itself, uncalled
        hint = f"call {getattr(optimizer, '__name__', 'it')} with its settings, e.g. optax.adamw(1e-3)"
    shown = (repr(optimizer) if optimizer is None or isinstance(optimizer, (str, int, float))
             else getattr(optimizer, "__name__", type(optimizer).__name__))  # a literal, else a name or the type
    raise FitError(f"optimizer={shown if len(shown) <= 60 else shown[:57] + '...'} is of type "
                   f"{type(optimizer).__name__}, not an optax.GradientTransformation; {hint}")


def _abstract_model(make: Callable[[], Any]) -> nnx.Module:
    """`make()` with shapes for arrays (FitError if it fails)."""
    name = getattr(make, "__name__", None) or getattr(getattr(make, "func", None), "__name__", type(make).__name__)

    def checked() -> nnx.Module:  # what it returned, seen before eval_shape turns it into shapes
        module = make()
        if not isinstance(module, nnx.Module):
            raise FitError(f"model: {name}() returned an object of type {type(module).__name__}, not an nnx.Module")
        return module

    try:
        return nnx.eval_shape(checked)
    except FitError:
        raise
    except Exception as e:  # noqa: BLE001 - the user's function failed: say so, in one line
        raise FitError(f"model: calling {name}() failed ({one_line(e)}); give an nnx.Module, or a function of no "
                       "arguments that returns one") from e


def eval_batch_limit(num_eval: int, num_devices: int) -> float:
    """The eval split in one batch, rounded up to a multiple of the devices; any size goes without eval data."""
    return -(-num_eval // num_devices) * num_devices if num_eval else math.inf


def _check_loss(model_def: ModelDef, loss_fn: LossFn, eval_fn: LossFn, abstract: TrainState, source: Source,
                mesh: Mesh, global_batch_size: int, options: FitOptions) -> None:
    """The loss contract (`jdp.loss`), checked on shapes alone, the train trace cast as the step casts."""
    rows = source.train_batch(0)
    read = len(next(iter(rows.values()))) * jax.process_count()
    if read != global_batch_size:
        raise FitError(f"the Source reads global batches of {read} rows, fit was given global_batch_size="
                       f"{global_batch_size}; make the Source for the same global batch size")
    if unknown := sorted(set(options.keep_fp32) - set(rows)):
        raise FitError(f"keep_fp32 names {unknown}, which the batches do not hold (their keys: {sorted(rows)}); name "
                       "batch keys")
    # The eval data's own first batch: its rows may have other shapes (larger images, longer windows).
    first_eval = next(iter(source.eval_batches()), None) if optional(source, "num_eval") else None
    eval_rows = {k: v for k, v in first_eval.items() if k != "mask"} if first_eval else rows
    compute_dtype = COMPUTE_DTYPES[options.precision]
    n, device_input = mesh.size, optional(source, "device_input")
    axis_env = [(axis, 1) for axis in mesh.axis_names]  # each of one device here, for synced BatchNorm's reductions
    for name, fn, train, batch in (("loss_fn", loss_fn, True, rows), ("eval_fn", eval_fn, False, eval_rows)):
        batch_rows = len(next(iter(batch.values()))) // max(1, n // jax.process_count())  # one device's
        one_device = {k: jax.ShapeDtypeStruct((batch_rows, *v.shape[1:]), v.dtype) for k, v in batch.items()}
        def call(state, batch, fn=fn, train=train):
            params, batch = state.params, device_input(batch)
            if train:  # as the step casts them (eval runs in float32)
                params = cast_floating(params, compute_dtype)
                batch = {k: v if k in options.keep_fp32 else cast_floating(v, compute_dtype) for k, v in batch.items()}
            return run_loss(model_def, fn, params, state.model_state, state.rng_state, batch, train=train)[0]
        try:
            jaxpr, outputs = jax.make_jaxpr(call, axis_env=axis_env, return_shape=True)(abstract, one_device)
        except Exception as e:  # noqa: BLE001 - the user's code failed on the batch: say where, in one line
            shapes = ", ".join(f"{k!r}: {v.shape[1:]}" for k, v in sorted(batch.items()))
            raise FitError(f"{name}(model, batch) failed on {'a train' if train else 'an eval'} batch of rows "
                           f"{{{shapes}}}: {one_line(e)}") from e
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
        # Layers built with `dtype=jnp.float32` promote the cast parameters back: the step runs at float32 speed.
        matmuls = jaxpr_matmul_dtypes(jaxpr) if train and compute_dtype != jnp.float32 else None
        if matmuls and set(matmuls) == {"float32"} and jax.process_index() == 0:
            warn(f"precision={options.precision}, but all {sum(matmuls.values())} dots/convolutions of the model's "
                 "forward compute in float32: build its layers with dtype=None (Flax's default, which follows the "
                 "inputs and parameters jdp casts) rather than dtype=jnp.float32")
        if not train and options.eval_derived is not None:  # called with the eval means' keys, at 1.0 each
            try:
                options.eval_derived({k: 1.0 for k in outputs if k != "weight"})
            except Exception as e:  # noqa: BLE001 - the user's function: one line, before anything trains
                raise FitError(f"eval_derived failed on eval means of {sorted(outputs)}: {one_line(e)}") from e


def fit(model: nnx.Module | Callable[[], nnx.Module], loss_fn: LossFn, train_data: Any, *,
        optimizer: optax.GradientTransformation, steps: int, global_batch_size: int, **options: Any) -> FitResult:
    """Trains `model` data-parallel for `steps` steps of `global_batch_size` examples; reference: docs/api.md.
    `model`: an `nnx.Module`, left holding the final state, or a function returning one (then created on the
    devices). `loss_fn(model, batch)` returns a dict of per-example values (`"loss"` is differentiated, an
    optional `"weight"` weights each entry, the rest are metrics), averaged (weighted) over the whole global batch.
    `train_data` / `eval_data`: a dict of arrays sharing a leading length, a random-access dataset, or a jdp
    `Source`. Other options: `FitOptions`. Bad input raises `jdp.FitError` in one line, before anything compiles."""
    preemption.install_excepthook()  # left uncaught in a script, a FitError is one line and exit 2, as in the CLI
    return run(model, loss_fn, train_data, optimizer=optimizer, steps=steps, global_batch_size=global_batch_size,
               options=_options(options))


@preemption.during_fit()  # a signal in a script ends it with exit 75, as in the CLI
@metrics.console_may_close()
def run(model: nnx.Module | Callable[[], nnx.Module], loss_fn: LossFn, train_data: Any, *,
        optimizer: optax.GradientTransformation, steps: int, global_batch_size: int, options: FitOptions,
        on_start: Callable[[int], None] = lambda start: None, settings: dict[str, Any] | None = None) -> FitResult:
    """`fit` with its options gathered (`python -m jdp.train`'s). `on_start(step)`: before anything is written to
    the workdir; `settings`: the caller's that define the run, recorded in run.json and guarded like fit's own."""
    _check_joined()
    strategy, what = sync_lib.strategy(options)  # a periodic strategy's replicas agree only at sync points
    for name, count in (("steps", steps), ("global_batch_size", global_batch_size)):
        if not isinstance(count, numbers.Integral) or isinstance(count, bool):  # 2.0 steps, a batch of 64.0 rows
            raise FitError(f"{name}={count!r} must be an int")
    if not 0 < steps < 2**31:  # the state counts steps in int32
        raise FitError(f"steps={steps} must be positive and below 2**31")
    if steps % strategy.every:
        raise FitError(f"steps={steps} is not a multiple of the sync period {strategy.every} ({what}); use a multiple")
    if options.workdir is not None:
        if not str(options.workdir).strip():  # Path("") is the current directory
            raise FitError(f"workdir={options.workdir!r} names no folder; give a path, or None to write nothing")
        try:
            storage.check_writable(options.workdir, "workdir")
        except UsageError as e:
            raise FitError(str(e)) from None
    engine = prepare(model, loss_fn, train_data, optimizer=optimizer, global_batch_size=global_batch_size,
                     options=options)
    try:
        fit_record = None if options.workdir is None else record_lib.fit_record(
            model=model, loss_fn=loss_fn, optimizer=optimizer, source=engine.source,
            abstract_params=engine.abstract_state.params, steps=steps, global_batch_size=global_batch_size,
            options=options,
            data_factories=tuple(d if is_factory(d) else None for d in (train_data, options.eval_data)),
            settings=settings)
        result, final = loop.train(engine, options, steps, global_batch_size, fit_record, on_start)
    finally:
        engine.source.close()
    if isinstance(model, nnx.Module):
        engine.model.load_into(model, final.params, final.model_state, final.rng_state)
    for callback in options.callbacks:
        callbacks.as_callback(callback).on_end(result)
    return result
