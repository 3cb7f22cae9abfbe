"""Every training option, once: its `jdp.fit` keyword, config key, default(s), valid values and help.
`jdp.FitOptions`, configs/base.py's sections, `--config.X` and the checks of both (`check`) come from this table."""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from jdp.errors import FitError

BACKENDS = ("shard_map", "pmap", "jit")
PRECISIONS = ("fp32", "bf16", "fp16")
NONFINITE_POLICIES = ("halt", "skip")
ALLREDUCE_DTYPES = ("fp32", "bf16", "int8", "int4")
OUTER_OPTIMIZERS = ("none", "sgd", "nesterov")


@dataclasses.dataclass(frozen=True)
class Range:
    """The valid values of a numeric field: [low, high], either end open; NaN is never in it."""

    low: float
    high: float = math.inf
    low_open: bool = False
    high_open: bool = True

    def __contains__(self, value: float) -> bool:
        above = value > self.low if self.low_open else value >= self.low
        below = value < self.high if self.high_open else value <= self.high
        return bool(above and below)

    def condition(self) -> str:
        """`> 0`, `>= 1`, `in [0, 1)`: what a value must satisfy."""
        low, high = _number(self.low), _number(self.high)
        if self.high == math.inf:
            return f"{'>' if self.low_open else '>='} {low}"
        return f"in {'(' if self.low_open else '['}{low}, {high}{')' if self.high_open else ']'}"

    def phrase(self, value: float | None = None) -> str:
        """Why a value is refused: `must be positive`; `must be finite and > 0` for an inf or a NaN `value`."""
        if hasattr(value, "__float__") and not math.isfinite(value):
            return f"must be finite and {self.condition()}"
        return _PHRASES.get(self, f"must be {self.condition()}")


def _number(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


POSITIVE, NON_NEGATIVE, AT_LEAST_1 = Range(0, low_open=True), Range(0), Range(1)
_PHRASES = {POSITIVE: "must be positive", NON_NEGATIVE: "must not be negative", AT_LEAST_1: "must be at least 1"}


@dataclasses.dataclass(frozen=True)
class Option:
    name: str  # the `fit` keyword
    key: str | None  # the config key; None: `fit` only (Python objects)
    type: Any
    default: Any
    help: str
    valid: Range | tuple[str, ...] | None = None
    config_default: Any = None  # configs/base.py's default, where it differs from fit's (never None)

    @property
    def config_value(self) -> Any:
        return self.default if self.config_default is None else self.config_default


OPTIONS: tuple[Option, ...] = (
    Option("eval_data", None, Any, None, "like train_data; None = no eval (unless train_data is a Source with one)"),
    Option("eval_fn", None, Callable | None, None, "eval loss function; None = loss_fn"),
    Option("eval_derived", None, Callable | None, None, "more eval metrics from the eval means (e.g. perplexity)"),
    Option("eval_every", "train.eval_every", int, 0, "steps between evals; 0 = at the end only", NON_NEGATIVE, 500),
    Option("eval_batch_size", "train.eval_batch_size", int, 0, "0 = global_batch_size", NON_NEGATIVE),
    Option("workdir", None, str | Path | None, None, "checkpoints and metrics here, resumed from; None = nothing "
           "written"),
    Option("seed", "seed", int, 0, "orders the data; folded into the model's RNG streams (uint32 keys)",
           Range(0, 2**32 - 1, high_open=False)),
    Option("backend", "parallel.backend", str, "shard_map", "how the one step runs on the devices", BACKENDS),
    Option("num_devices", "parallel.num_devices", int, 0, "the first N devices; 0 = all", NON_NEGATIVE),
    Option("precision", "precision", str, "fp32", "float32 master parameters; fp16 adds dynamic loss scaling",
           PRECISIONS),
    Option("keep_fp32", None, tuple, (), "floating batch keys never cast under bf16/fp16 (e.g. regression targets)"),
    Option("grad_accum_steps", "train.grad_accum_steps", int, 1, "micro-batches per step, all-reduced once (like "
           "DDP's no_sync)", AT_LEAST_1),
    Option("checkpoint_every", "checkpoint.every_steps", int, 0, "steps between checkpoints; 0 = at the end and on "
           "preemption only", NON_NEGATIVE, 1000),
    Option("keep_checkpoints", "checkpoint.keep", int, 3, "checkpoints kept", AT_LEAST_1),
    Option("log_every", "train.log_every", int, 50, "steps between train lines", AT_LEAST_1),
    Option("callbacks", None, Sequence, (), "jdp.Callback objects, or any with `every`, `on_step` and `on_end`"),
    Option("bn_sync", "model.bn_sync", bool, True, "every nnx.BatchNorm averages its statistics across devices"),
    Option("on_nonfinite", "train.on_nonfinite", str, "halt", "halt: save the state from before the bad step and "
           "stop (exit 3) | skip the update", NONFINITE_POLICIES),
    Option("max_skipped_fraction", "train.max_skipped_fraction", float, 0.1, "skip: halt once more of the last 100 "
           "steps were skipped", Range(0, 1, high_open=False)),
    Option("check_replicas_every", "parallel.check_replicas_every", int, 500, "compare the replicas' bits every N "
           "steps (0 = at the end only; the default, under local SGD or DiLoCo, rounds up to a multiple of "
           "sync_every)", NON_NEGATIVE),
    Option("shard_optimizer", "parallel.shard_optimizer", bool, False, "ZeRO-1: each device keeps and updates 1/N "
           "of the optimizer state (shard_map; element-wise optimizers only)"),
    Option("shard_params", "parallel.shard_params", bool, False, "ZeRO-3 (FSDP): parameters, gradients and "
           "optimizer state live as 1/N slices, the parameters gathered for each step (shard_map or jit; "
           "element-wise optimizers only)"),
    Option("shard_group", "parallel.shard_group", int, 0, "hybrid sharding (HSDP, jdp.sync.HybridShard): ZeRO-3 "
           "(ZeRO-1 with shard_optimizer) inside groups of this many devices, which must divide the device count, "
           "the mean all-reduce of each device's 1/k gradient slice across the groups (shard_map only); with "
           "DiLoCo, a learner a group of this many devices; 0 = not hybrid", NON_NEGATIVE),
    Option("sync_every", "parallel.sync_every", int, 1, "local SGD: > 1 averages parameters every H steps instead "
           "of gradients every step", AT_LEAST_1),
    Option("allreduce_dtype", "parallel.allreduce_dtype", str, "fp32", "what the gradient all-reduce sends "
           "(int8, int4: block-quantized through an all-to-all, jdp.sync.QuantizedAllReduce)", ALLREDUCE_DTYPES),
    Option("sync", "parallel.sync", str, "allreduce", "the gradient sync strategy: a jdp.sync.Sync object (fit), "
           "an import path `pkg.module:Class` built with parallel.sync_kwargs (config), or a name: allreduce (the "
           "mean all-reduce, or ZeRO-1 / ZeRO-3 / local SGD / DiLoCo as shard_optimizer, shard_params, sync_every "
           "and outer_optimizer say), zero1, zero3, local_sgd, diloco or powersgd (low-rank, Vogels et al. 2019)"),
    Option("powersgd_rank", "parallel.powersgd_rank", int, 4, "PowerSGD: the rank of each compressed gradient "
           "matrix", AT_LEAST_1),
    Option("powersgd_start_step", "parallel.powersgd_start_step", int, 10, "PowerSGD: steps before it, the "
           "gradient is all-reduced whole", NON_NEGATIVE),
    Option("outer_optimizer", "parallel.outer_optimizer", str, "none", "with sync_every = H > 1: none averages the "
           "parameters (local SGD); sgd or nesterov apply the averaged change as an outer gradient (DiLoCo, "
           "Douillard et al. 2023)", OUTER_OPTIMIZERS),
    Option("outer_lr", "parallel.outer_lr", float, 0.7, "DiLoCo: the outer learning rate", POSITIVE),
    Option("outer_momentum", "parallel.outer_momentum", float, 0.9, "DiLoCo: the outer momentum",
           Range(0, 1)),
    Option("log_grad_norm", "train.log_grad_norm", bool, False, "add grad_norm to the train lines (a pass over the "
           "gradients)"),
    Option("log_noise_scale", "train.log_noise_scale", bool, False, "add grad_noise_scale (the critical-batch "
           "estimate) to the train lines"),
    Option("loss_scale", "loss_scale.initial", float, 2.0**15, "fp16: the initial dynamic loss scale", POSITIVE),
    Option("loss_scale_growth_interval", "loss_scale.growth_interval", int, 2000, "fp16: finite steps before the "
           "scale doubles", AT_LEAST_1),
    Option("schedule", None, Callable | None, None, "the optimizer's learning-rate schedule, logged as `lr`"),
    Option("profile_steps", None, tuple | None, None, "(A, B): a JAX profiler trace of steps A..B into "
           "WORKDIR/profile (config: profile.steps = \"A:B\")"),
    Option("description", None, str, "", "named in the start-up line"),
    Option("allow_config_change", "checkpoint.allow_config_change", bool, False, "resume a workdir whose run had "
           "other numerics or data (jdp.record)"),
)
BY_NAME = {option.name: option for option in OPTIONS}
DEFAULTS = {option.name: option.default for option in OPTIONS}
CONFIG_KEYS = {option.key: option for option in OPTIONS if option.key}


@dataclasses.dataclass(frozen=True)
class View:
    """How a check names an option and its fix: by `fit` keyword (`backend='jit'`), or by config key
    (`--config.parallel.backend=jit`)."""

    config: bool = False

    def __call__(self, name: str) -> str:
        return BY_NAME[name].key if self.config else name

    def use(self, name: str, value: Any) -> str:
        return f"--config.{BY_NAME[name].key}={value}" if self.config else f"{name}={value!r}"

    @staticmethod
    def default(name: str) -> Any:
        """The option's default (jdp.sync.flags, which jdp.options imports in `check`, does not import it back)."""
        return DEFAULTS[name]


FIT_NAMES, CONFIG_NAMES = View(), View(config=True)
_KINDS = {int: (numbers.Integral, "an int"), float: (numbers.Real, "a number"), bool: (bool, "True or False"),
          tuple: ((tuple, list), "a tuple")}  # a str where keys go matched them as substrings


def check(values: dict[str, Any], view: View = FIT_NAMES, error: type[Exception] = FitError) -> tuple[Any, str]:
    """Checks every option in `values` (by `fit` keyword) and the rules between them, raising `error` in one line;
    returns (the strategy they choose, how `view` names it)."""
    def require(condition: bool, message: str) -> None:
        if not condition:
            raise error(message)

    n, use = view, view.use
    for name, value in values.items():
        valid, kind = BY_NAME[name].valid, _KINDS.get(BY_NAME[name].type)
        if kind is not None:  # a string or a float where a count goes compared, or counted, as one
            require(isinstance(value, kind[0]) and (kind[0] is bool or not isinstance(value, bool)),
                    f"{n(name)}={value!r} must be {kind[1]}")
        if isinstance(valid, tuple):
            require(value in valid, f"{n(name)}={value!r} is unknown; choose one of {', '.join(valid)}")
        elif isinstance(valid, Range):  # a config's values are first held to their ranges by `check_ranges`
            require(value in valid, f"{n(name)}={value} {valid.phrase(value)}")
    o = dict(DEFAULTS, **values)
    from jdp.sync.flags import chosen  # the strategy's own rules: jdp.sync (JAX) only once a run is checked

    strategy, what = chosen(o, view, require)
    for period in ("every", "agrees_every"):  # what the loop and the checkpoints count in
        steps = getattr(strategy, period)
        require(type(steps) is int and steps >= 1, f"{what}.{period}={steps!r} must be an int of at least 1 (steps)")
    # A default passes: 0, or the replica check's, rounded up to a multiple of the period where it runs (jdp.callbacks).
    for name in ("checkpoint_every", "eval_every", "check_replicas_every"):
        require(o[name] % strategy.agrees_every == 0 or o[name] == DEFAULTS[name], f"{n(name)}={o[name]} is not a "
                f"multiple of the sync period {strategy.agrees_every} ({what}): a checkpoint, an eval or a replica "
                "check needs a state where the replicas agree; use a multiple")
    strategy.check(o, view, what, require)
    noise = f"{n('log_noise_scale')} compares each device's gradient with the all-reduced one, which"
    require(not o["log_noise_scale"] or o["backend"] != "jit", f"{noise} jit does not have (no per-device "
            f"gradients); use {use('backend', 'shard_map')} or pmap")
    require(not o["log_noise_scale"] or strategy.noise_scale, f"{noise} {what} does not hold on each device; use "
            "the mean all-reduce")
    return strategy, what


def _post_init(self: Any) -> None:
    check({field.name: getattr(self, field.name) for field in dataclasses.fields(self)})
    if isinstance(self.callbacks, (str, bytes)) or not isinstance(self.callbacks, Sequence):
        raise FitError(f"callbacks={self.callbacks!r} is not a list of callbacks; give a list, e.g. "
                       "callbacks=[MyCallback()]")
    for callback in self.callbacks:  # a jdp.Callback may be due on a condition of its own instead
        every = getattr(callback, "every", 0)
        if not isinstance(every, numbers.Integral) or every < 0:
            raise FitError(f"callback {callback!r} has every={every!r}; give an int: the steps between calls, or 0 "
                           "for none")
        if not (every >= 1 or callable(getattr(callback, "due", None))):
            raise FitError(f"callback {callback!r} needs an `every` of at least 1 (steps between calls), or a `due` "
                           "method")


FitOptions = dataclasses.make_dataclass(
    "FitOptions", [(o.name, o.type, dataclasses.field(default=o.default, metadata={"help": o.help, "key": o.key}))
                   for o in OPTIONS],
    frozen=True, namespace={"__post_init__": _post_init, "__module__": __name__,
                            "__doc__": "`fit`'s keyword arguments beyond the required ones, with their defaults "
                                       "(`jdp.options.OPTIONS` holds each one's config key, range and help)."})
