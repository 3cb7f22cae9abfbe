"""The sync-strategy interface (step 3), run per device (`axis_name` "data", or a wider mesh's tuple of axes) or on
the global batch under jit (`axis_name` None). Writing a strategy: docs/communication.md, 'A strategy of your own'.
"""

from __future__ import annotations

import functools
import json
import math
import numbers
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jdp import hlo
from jdp.errors import FitError
from jdp.layers import LayerView
from jdp.mesh import DATA_AXIS, GROUPS_AXIS

Tree = Any

# How a leaf of the logical train state lives on the devices (`Sync.layouts`). REPLICATED: the same copy on every
# device. PER_DEVICE: a leading device axis, a row per device; restores on the same device count only. SHARDED:
# split on one axis (`shard_axis`), zero-padded to a multiple of N inside the step; restores on any device count.
REPLICATED, PER_DEVICE, SHARDED = "replicated", "per_device", "sharded"
ALLREDUCE_DTYPES = {"fp32": jnp.float32, "bf16": jnp.bfloat16}  # what a gradient collective sends


def is_sharded(leaf: Any) -> bool:
    """Whether a sharding strategy splits `leaf`: scalars and empty arrays stay whole."""
    return len(leaf.shape) > 0 and math.prod(leaf.shape) > 0


def shard_axis(shape: tuple[int, ...], n: int, first: int = 0) -> int:
    """The axis a leaf of `shape` splits on: the longest (from `first`) that `n` devices divide, else the longest."""
    axes = range(first, len(shape))
    return max([a for a in axes if shape[a] % n == 0] or axes, key=lambda a: (shape[a], -a))


def padded(x: jax.Array, n: int, axis: int) -> jax.Array:
    pad = (-x.shape[axis]) % n
    return x if not pad else jnp.pad(x, [(0, pad if a == axis else 0) for a in range(x.ndim)])


def unpadded(x: jax.Array, like: Any) -> jax.Array:
    """`x` cut back to the shape of `like` (a padded sharded leaf -> its logical self)."""
    return x if x.shape == like.shape else x[tuple(slice(0, size) for size in like.shape)]


def path_keys(path: tuple) -> tuple:
    """A jax key path as the plain keys of the pure parameter dict (`("blocks", 0, "kernel")`)."""
    return tuple(getattr(k, "key", getattr(k, "idx", k)) for k in path)


def spec_on(axis: int | None, ndim: int) -> P:
    return P() if axis is None else P(*[DATA_AXIS if a == axis else None for a in range(ndim)])


def whole_number(name: str, value: Any, least: int, unit: str = "") -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < least:
        raise ValueError(f"{name}={value!r} must be an int of at least {least}{unit}")
    return int(value)


def real_number(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name}={value!r} must be a number")
    return float(value)


def checked_group_size(group_size: Any) -> int | None:
    return None if group_size is None else whole_number("group_size", group_size, 1, " (devices in a group), or None "
                                                                                     "for one process's devices")


def group_mesh(strategy: Any, num_devices: int) -> dict[str, int]:
    """The groups x `data` mesh, a group `strategy.group_size` consecutive devices (None: one process's)."""
    k = strategy.group_size
    if k is None:
        if jax.process_count() == 1:
            raise FitError(f"{strategy!r} groups one process's devices by default, and this run is one process: "
                           "give the group's size (group_size=k, parallel.shard_group=k)")
        k = jax.local_device_count()
    if num_devices % k:
        raise FitError(f"{strategy!r}: a group of {k} devices does not divide the {num_devices} devices; give a "
                       f"group size (group_size, parallel.shard_group) that divides {num_devices}")
    return {GROUPS_AXIS: num_devices // k, DATA_AXIS: k}


class DDPTwin(NamedTuple):
    """How PyTorch DDP computes what a strategy computes (`Sync.ddp_twin`), for `jdp.compare`'s twin."""

    hook: str  # "allreduce" (DDP's own mean) or a hook of torch's ddp_comm_hooks, e.g. "powerSGD_hook"
    settings: dict[str, Any]  # the hook's state, as torch's keywords (PowerSGDState's)


class Local(NamedTuple):
    """One device's step-2 result (`jdp.gradients`)."""

    grads: Tree  # d(weighted sum of the loss)/rows, float32, loss scale removed
    sums: dict[str, jax.Array]  # weighted sums of every loss output
    weight: jax.Array  # the weight total
    model_state: Tree  # after the forward (BatchNorm statistics)
    counts: Tree  # the RNG counters after it
    rows: int  # static rows of one micro-batch, by which `grads` is divided
    small_sq: jax.Array | None  # for the noise scale: the small batches' mean |gradient of the weighted mean|^2


class Reduced(NamedTuple):
    """What the update needs after the sync."""

    grads: Tree  # the update's input: the gradient of the weighted mean (a strategy may hold a slice of it)
    sums: dict[str, jax.Array]  # the global weighted sums
    weight: jax.Array  # the global weight total
    model_state: Tree  # floating leaves averaged across replicas
    small_sq: jax.Array | None
    sync_state: Tree = None  # the strategy's own state after the step (None: unchanged)


def all_reduce_mean(tree: Tree, axis_name: str | None) -> Tree:
    """The mean over `axis_name`, one collective (None, under jit: a no-op)."""
    return tree if axis_name is None else jax.lax.pmean(tree, axis_name)


def sum_of_squares(tree: Tree) -> jax.Array:
    """The squared L2 norm of all leaves, in float32."""
    return sum((jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(tree)), jnp.float32(0))


def floating(tree: Tree) -> Tree:
    """The floating leaves of `tree` (others None): what may be averaged across replicas."""
    return jax.tree.map(lambda x: x if jnp.issubdtype(x.dtype, jnp.floating) else None, tree)


def merge_floating(averaged: Tree, tree: Tree) -> Tree:
    return jax.tree.map(lambda a, x: x if a is None else a, averaged, tree, is_leaf=lambda x: x is None)


def averaged_sums(local: Local, axis_name: str | None, **extra: Tree) -> dict[str, Any]:
    """The mean over `axis_name`, in one collective, of `extra` and what rides beside a gradient: the floating model
    state, the loss sums, the weight total and, where measured, `small_sq`."""
    payload = {"model_state": floating(local.model_state), "sums": local.sums, "weight": local.weight, **extra}
    return all_reduce_mean(payload if local.small_sq is None else {**payload, "small_sq": local.small_sq}, axis_name)


def _plain(value: Any) -> Any:
    """A strategy parameter JSON has no type for, as its record holds it (`str` unless that holds an address)."""
    if isinstance(value, type):  # a class's `str` names it alike in every process (np.float32 has a `tolist`)
        return str(value)
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, functools.partial):
        return {"partial": value.func, "args": value.args, "keywords": value.keywords}
    if hasattr(value, "__qualname__"):
        return f"{value.__module__}:{value.__qualname__}"
    if type(value).__str__ is object.__str__ and type(value).__repr__ is object.__repr__:
        raise FitError(f"a strategy parameter, {value}, has no record a resume could compare (its str holds an "
                       "address); give numbers, strings, arrays, functions or classes")
    return str(value)


class Sync:
    """The strategy interface, behaving as data parallelism's mean all-reduce (one collective carries the gradient in
    `dtype`, the loss sums, the weight total and the floating model state); a strategy overrides what it changes."""

    per_device_update = False  # True: each device updates from its own gradient (the guard then decides alike)
    every = 1  # steps between two runs of a periodic sync's collectives (local SGD, DiLoCo)
    agrees_every = property(lambda self: self.every)  # steps between states a checkpoint can hold whole
    dtype_name, dtype = "fp32", jnp.float32  # what the gradient's collective sends (`__init__` sets them)
    noise_scale = False  # True: `reduce` returns the small batches' `small_sq` (`log_noise_scale`), via `averaged_sums`
    shards_optimizer = False  # the optimizer updates slices, its state sharded (`layouts`; the CLI refuses LAMB, LARS)
    shards_params = False  # the parameters are sharded too (ZeRO-3)
    per_device_state: tuple[str, ...] = ()  # keys of the strategy's own state (a dict) kept a row per device

    def __init__(self, dtype: str = "fp32") -> None:
        if dtype not in ALLREDUCE_DTYPES:
            raise ValueError(f"dtype={dtype!r} is not one of {', '.join(ALLREDUCE_DTYPES)}")
        self.dtype_name, self.dtype = dtype, ALLREDUCE_DTYPES[dtype]

    def params(self) -> dict[str, Any]:
        """The scalar parameters that define the strategy's numerics, by keyword (its record, its start-up line)."""
        return {"dtype": self.dtype_name}

    def record(self) -> dict[str, Any]:
        """What the resume guard compares: the class's import path and its parameters, as JSON (`_plain`)."""
        plain = json.loads(json.dumps(self.params(), default=_plain))
        return {"class": f"{type(self).__module__}:{type(self).__qualname__}", **plain}

    def __repr__(self) -> str:  # an array parameter by its dtype and shape
        shown = {k: f"{v.dtype}{list(v.shape)}" if isinstance(v, np.ndarray | jax.Array) and v.ndim else repr(v)
                 for k, v in self.params().items()}
        return f"{type(self).__name__}({', '.join(f'{k}={v}' for k, v in shown.items())})"

    def bind(self, model: Any, seed: int) -> Sync:
        """The strategy for this model (maybe abstract) and seed: itself, or a copy holding what it derives."""
        return self

    def check(self, options: dict[str, Any], view: Any, what: str, require: Callable[[bool, str], None]) -> None:
        """Refuses, with `require(condition, one line)`, the options (`fit` keyword -> value; `view` names them,
        `jdp.options.View`) it cannot run with; `what` is how the run named the strategy."""
        if self.dtype_name == "bf16":
            require(options["backend"] in ("shard_map", "pmap"),
                    f"{what} needs an explicit collective; use {view.use('backend', 'shard_map')}")

    def optimizer_sees_slices(self, backend: str) -> bool:
        """Whether each device's optimizer updates slices of the leaves (global-norm clipping must sum across them)."""
        return False

    def compiled_warning(self, hlo_text: str, num_devices: int) -> str | None:
        """What to say of the compiled step (`hlo_text`, after XLA's passes) before it runs, or None."""
        if self.dtype == jnp.bfloat16 and num_devices > 1 and not hlo.sends_dtype(hlo_text, "bf16"):
            return (f"{self!r} saves nothing here: the compiled program all-reduces in float32 on these devices "
                    "(XLA:CPU widens bfloat16); fp32 sends as many bytes, without the casts")
        return None

    def ddp_twin(self) -> DDPTwin | None:
        """How DDP computes the same, for `jdp.compare` (None: no such hook; ValueError: settings torch refuses)."""
        return None

    def mesh_shape(self, num_devices: int) -> dict[str, int]:
        """The step's mesh, axis -> size, `data` last (sharded leaves split on it); FitError for unusable counts."""
        return {DATA_AXIS: num_devices}

    def check_optimizer(self, tx: optax.GradientTransformation, abstract_params: Tree, num_devices: int,
                        backend: str, what: str) -> None:
        """Refuses (FitError) an optimizer the strategy cannot run."""

    def init_state(self, params: Tree, num_devices: int) -> Tree:
        """The strategy's own state (`TrainState.sync`) in the logical layout, from the initial parameters."""
        return {}

    def init_opt_state(self, opt_state: Any, num_devices: int) -> Any:
        """The optimizer's initial state as the strategy keeps it (DiLoCo: a copy per device)."""
        return opt_state

    def layouts(self, abstract_state: Any) -> Any:
        """REPLICATED, PER_DEVICE or SHARDED for each leaf of the logical train state."""
        layouts = jax.tree.map(lambda _: REPLICATED, abstract_state)
        sharded = [f for f, on in (("opt_state", self.shards_optimizer), ("params", self.shards_params)) if on]
        layouts = layouts._replace(**{f: jax.tree.map(lambda x: SHARDED if is_sharded(x) else REPLICATED,
                                                      getattr(abstract_state, f)) for f in sharded})
        own = {k: jax.tree.map(lambda _: PER_DEVICE, abstract_state.sync[k]) for k in self.per_device_state
               if k in abstract_state.sync}
        return layouts._replace(sync={**layouts.sync, **own}) if own else layouts

    def shard_axes(self, abstract_state: Any, num_devices: int) -> Any:
        """The axis each sharded leaf splits on inside the step (`shard_axis`); None for the other leaves."""
        return jax.tree.map(lambda layout, x: shard_axis(x.shape, num_devices) if layout == SHARDED else None,
                            self.layouts(abstract_state), abstract_state)

    def state_specs(self, abstract_state: Any, num_devices: int, devices: Any = DATA_AXIS) -> Any:
        """Each leaf's PartitionSpec in the step: per-device rows over `devices`, a sharded leaf's axis over `data`."""
        # The tree of axes, whose None leaves would not match a tree, goes last.
        return jax.tree.map(lambda layout, x, axis: P(devices) if layout == PER_DEVICE else spec_on(axis, x.ndim),
                            self.layouts(abstract_state), abstract_state, self.shard_axes(abstract_state, num_devices))

    def to_step_layout(self, state: Any, num_devices: int) -> Any:
        return jax.tree.map(lambda x, axis: x if axis is None else padded(x, num_devices, axis),
                            state, self.shard_axes(state, num_devices))

    def to_logical(self, state: Any, abstract_state: Any) -> Any:
        return jax.tree.map(unpadded, state, abstract_state)  # only a padded sharded leaf differs in shape

    def params_view(self, params: Tree, axis_name: str | None) -> Tree:
        """The parameters the forward sees (a sharding strategy gathers them here)."""
        return params

    def layer_view(self, axis_name: str | None, mesh: Mesh | None = None) -> LayerView | None:
        """How a scanned model's layer computes (`jdp.layers.LayerView`; `mesh`: under jit; None: as held)."""
        return None

    def reduce(self, local: Local, state: Any, axis_name: str | None, collective: bool = True) -> Reduced:
        """Local gradient -> the update's input (`state`: the train state the step began with; its `sync`'s successor
        goes in `Reduced.sync_state`); `collective` False (`jdp.bench`) leaves out the collectives, not the layout."""
        grads = optax.tree.cast(local.grads, self.dtype)
        averaged = averaged_sums(local, axis_name if collective else None, grads=grads)
        return self._reduced(optax.tree.cast(averaged["grads"], jnp.float32), local, averaged)

    @staticmethod
    def _of_mean(grads: Tree, rows: int, weight: jax.Array) -> Tree:
        """d(weighted sum)/rows (averaged over devices) -> d(weighted mean), by the weight total."""
        return jax.tree.map(lambda g: g * (rows / jnp.where(weight > 0, weight, 1.0)), grads)

    def _reduced(self, grads: Tree, local: Local, averaged: dict[str, Any], sync_state: Tree = None) -> Reduced:
        """The update's input from `grads` (d(weighted sum)/rows, averaged over devices) and `averaged_sums`' result."""
        weight = averaged["weight"]
        return Reduced(self._of_mean(grads, local.rows, weight), averaged["sums"], weight,
                       merge_floating(averaged["model_state"], local.model_state), averaged.get("small_sq"),
                       sync_state)

    def update(self, tx: optax.GradientTransformation, grads: Tree, state: Any, axis_name: str | None
               ) -> tuple[Tree, Any]:
        """Step 4: the same optax update on every replica keeps the parameters in sync."""
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        return optax.apply_updates(state.params, updates), opt_state

    def for_inference(self) -> Sync:
        """The strategy that restores this one's checkpoints to evaluate or export them on any device count."""
        return self

    def restart(self, restored: Any, fresh: Any) -> Any:
        """`restored` with its per-device leaves saved on another device count (None) afresh from `fresh`."""
        return jax.tree.map(lambda x, new: new if x is None else x, restored, fresh, is_leaf=lambda x: x is None)

    def forward_state(self, state: Any) -> Any:
        """The train state the step computes on, from the stored one (which `after_update` hands back)."""
        return state

    def after_update(self, state: Any, previous: Any, axis_name: str | None) -> Any:
        """After the guard has chosen the state every replica keeps (`previous`: the state the step began with)."""
        return state

    def grad_norm(self, grads: Tree, axis_name: str | None, collective: bool = True) -> jax.Array:
        """The norm the update sees, before clipping."""
        return jnp.sqrt(sum_of_squares(grads))


class AllReduce(Sync):
    """Data parallelism's mean all-reduce, the default; `dtype="bf16"` sends bfloat16, as DDP's `bf16_compress_hook`."""

    noise_scale = True  # each device holds its whole gradient and the all-reduced one

    def ddp_twin(self) -> DDPTwin | None:
        return DDPTwin("allreduce", {}) if self.dtype_name == "fp32" else None
