"""The one step of `jdp.step` under a backend: shard_map and pmap once per device, jit once on the global batch;
outside the step the state is logical, every leaf at its own shape (docs/performance.md, 'Backends')."""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Callable, Iterable
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jdp import digest, hlo
from jdp import memory as memory_lib
from jdp import step as step_lib
from jdp.errors import FitError, one_line
from jdp.mesh import DATA_AXIS, data_sharded, device_axes, replicated, split_whole, to_numpy
from jdp.modeldef import LossFn, ModelDef
from jdp.split import shard_batch
from jdp.sync import Sync
from jdp.sync.base import PER_DEVICE, REPLICATED, SHARDED, spec_on

Tree = step_lib.Tree


def _logical_shardings(mesh: Mesh, layouts: Tree, abstract_state: Tree, shard_axes: Tree) -> Tree:
    """Where each leaf of the logical state lives. A sharded leaf is split on the step's own axis when that needs
    no padding, else as evenly as its axes allow (`jdp.mesh.split_whole`)."""
    shards = mesh.shape[DATA_AXIS]

    def logical(layout: str, x: Any, axis: int | None) -> NamedSharding:
        if layout != SHARDED:
            return {REPLICATED: replicated(mesh), PER_DEVICE: data_sharded(mesh)}[layout]
        if axis is not None and x.shape[axis] % shards == 0:
            return NamedSharding(mesh, spec_on(axis, x.ndim))
        return split_whole(mesh, x.shape)

    return jax.tree.map(logical, layouts, abstract_state, shard_axes)


def _without_device_axis(train: Callable, per_device: Tree) -> Callable:
    """shard_map's train step: a per-device leaf goes in without its device axis of one, and comes out with it."""
    def step(state: Tree, batch: Tree) -> tuple[Tree, Tree]:
        state = jax.tree.map(lambda x, p: x[0] if p else x, state, per_device)
        new_state, metrics = train(state, batch)
        return jax.tree.map(lambda x, p: x[None] if p else x, new_state, per_device), metrics

    return step


class DataParallel:
    """The train and eval steps compiled for one backend, plus the layout of state and batches."""

    # Read from the train step compiled by `compile_train`: its per-device bytes of memory (`jdp.memory`) and of
    # collectives per step (`jdp.hlo`; of those, what crosses a hybrid mesh's groups), the strategy's warning.
    memory: dict[str, int] | None = None
    comm_bytes_per_step: float | None = None
    comm_cross_group_bytes_per_step: float | None = None
    compiled_warning: str | None = None
    _compiled_train: jax.stages.Compiled | None = None  # what `train_step` runs once `compile_train` made it

    def __init__(self, mesh: Mesh, model: ModelDef, loss_fn: LossFn, tx: optax.GradientTransformation,
                 abstract_state: step_lib.TrainState, options: step_lib.StepOptions, sync: Sync):
        """The backend, eval function and schedule are `options.fit`'s; `options.bn_groups` applies to jit only."""
        backend, eval_fn, schedule = options.fit.backend, options.fit.eval_fn or loss_fn, options.fit.schedule
        self.backend, self.mesh, self.sync = backend, mesh, sync
        self._eval_derived = options.fit.eval_derived  # more eval metrics from the eval means
        shards = mesh.shape[DATA_AXIS]  # the devices a sharded leaf is split over: all, or one group's
        self._layouts = layouts = _checked_layouts(sync, abstract_state, mesh, backend)
        self._state_specs = sync.state_specs(abstract_state, shards, device_axes(mesh))
        self.per_device = jax.tree.map(lambda layout: layout == PER_DEVICE, layouts)
        self.logical_shardings = _logical_shardings(mesh, layouts, abstract_state,
                                                    sync.shard_axes(abstract_state, shards))
        jit = backend == "jit"  # one call on the global batch (`axis_name=None`), else one per device
        axis_name, whole_mesh = (None, mesh) if jit else (device_axes(mesh), None)
        step = partial(step_lib.train_step, model=model, loss_fn=loss_fn, tx=tx, sync=sync, schedule=schedule,
                       options=dataclasses.replace(
                           options, axis_name=axis_name, mesh=whole_mesh,
                           bn_groups=options.bn_groups if jit else 1,  # per-device rows need no grouping
                           accum_lanes=mesh.size if jit and options.fit.grad_accum_steps > 1 else 0))

        # The scalar metrics as one float32 vector, fetched in one transfer (~75 us a step less of host work); their
        # names are read while it is traced.
        def train(state: Tree, batch: Tree) -> tuple[Tree, jax.Array]:
            new_state, metrics = step(state, batch)
            self._metric_names = tuple(metrics)
            return new_state, jnp.stack([jnp.reshape(v, ()).astype(jnp.float32) for v in metrics.values()])

        evaluate = partial(step_lib.eval_step, model=model, loss_fn=eval_fn, axis_name=axis_name,
                           device_input=options.device_input,
                           params_view=lambda params: sync.params_view(params, axis_name),
                           layer_view=sync.layer_view(axis_name, whole_mesh))
        step_shardings = jax.tree.map(lambda spec: NamedSharding(mesh, spec), self._state_specs)
        # The layout conversions at the step's boundary: the strategy's padded slices (pmap's stacked copy below).
        self._to_step_layout = jax.jit(lambda t: sync.to_step_layout(t, shards), out_shardings=step_shardings)
        self._to_logical = jax.jit(lambda t: sync.to_logical(t, abstract_state), out_shardings=self.logical_shardings)
        if jit:  # XLA partitions the one call and inserts the all-reduce (and a sharded state's gathers)
            inputs = (step_shardings, data_sharded(mesh))
            self._train = jax.jit(train, in_shardings=inputs, out_shardings=(step_shardings, replicated(mesh)),
                                  donate_argnums=0)
            self.eval_step = jax.jit(evaluate, in_shardings=inputs, out_shardings=replicated(mesh))
        elif backend == "shard_map":  # check_vma=False: with it, a replicated parameter's gradient arrives summed
            # over devices, and the step's pmean would leave it N times too large.
            on_each_device = partial(jax.shard_map, mesh=mesh, in_specs=(self._state_specs, P(axis_name)),
                                     check_vma=False)
            inputs = (None, data_sharded(mesh))  # host rows are split as the step is called (`jdp.split`)
            self._train = jax.jit(on_each_device(_without_device_axis(train, self.per_device),
                                                 out_specs=(self._state_specs, P())), in_shardings=inputs,
                                  donate_argnums=0)
            self.eval_step = jax.jit(on_each_device(evaluate, out_specs=P()), in_shardings=inputs)
        else:  # the classic pmap over the mesh's devices, the state stacked along a leading device axis
            devices = list(mesh.devices.flat)
            self._train = jax.pmap(train, axis_name=DATA_AXIS, devices=devices, donate_argnums=0)
            self.eval_step = jax.pmap(evaluate, axis_name=DATA_AXIS, devices=devices)
            self._to_step_layout = jax.jit(lambda t: jax.tree.map(
                lambda x, p: x if p else jnp.broadcast_to(x, (mesh.size, *x.shape)), t, self.per_device),
                out_shardings=data_sharded(mesh))
            self._to_logical = jax.jit(lambda t: jax.tree.map(lambda x, p: x if p else x[0], t, self.per_device),
                                       out_shardings=self.logical_shardings)
        self._relayout = backend == "pmap" or any(spec != P() for spec in jax.tree.leaves(self._state_specs))
        # Each device checksums the bits of its own copy; pmax != pmin flags a leaf that differs.
        state_spec = P(DATA_AXIS) if backend == "pmap" else P()
        self._differing_leaves = jax.jit(jax.shard_map(partial(_differing_leaves, axis_name=device_axes(mesh)),
                                                       mesh=mesh, in_specs=(state_spec,), out_specs=P(),
                                                       check_vma=False))

    def to_devices(self, state: Tree) -> Tree:
        """Logical state -> the compiled step's layout (pmap's stacked copy; sharded leaves padded and split)."""
        return self._to_step_layout(state) if self._relayout else state

    def step_shapes(self, abstract_state: step_lib.TrainState) -> step_lib.TrainState:
        """The shapes and shardings of the state the compiled step takes (shard_map and jit)."""
        return jax.eval_shape(self._to_step_layout, abstract_state)

    def _global(self, tree: Tree) -> Tree:
        """pmap's process-local outputs (in a multi-process run) as the global arrays, split on `data`."""
        if self.backend != "pmap" or jax.process_count() == 1:
            return tree
        sharding = data_sharded(self.mesh)
        return jax.tree.map(lambda x: jax.make_array_from_single_device_arrays(
            (self.mesh.size, *x.shape[1:]), sharding, [s.data for s in x.addressable_shards]), tree)

    def to_logical(self, state: Tree) -> Tree:
        """The compiled step's layout -> the logical state."""
        return self._to_logical(self._global(state)) if self._relayout else state

    def shard_batch(self, local_rows: dict[str, np.ndarray]) -> dict[str, jax.Array | np.ndarray]:
        """Step 1, split (`jdp.split`): this process's rows of the global batch -> what the compiled steps take."""
        return shard_batch(local_rows, self.backend, self.mesh)

    def train_step(self, state: step_lib.TrainState, batch: dict[str, jax.Array]
                   ) -> tuple[step_lib.TrainState, jax.Array]:
        """Steps 2-4 on the devices: the new state, and the step's metrics packed for `fetch`."""
        return (self._compiled_train or self._train)(state, batch)

    def evaluate(self, state: step_lib.TrainState, batches: Iterable[dict[str, np.ndarray]]) -> dict[str, float]:
        """Weighted means of the eval function's outputs over `batches` (this process's rows, with a `mask`; {}
        when there are none)."""
        totals, pending = collections.Counter(), []
        for rows in batches:
            pending.append(self.eval_step(state, self.shard_batch(rows)))
            if len(pending) > 1:  # fetched one batch late, so the host never queues the whole eval
                totals.update(self.fetch(pending.pop(0)))
        if not pending:
            return {}
        totals.update(self.fetch(pending.pop()))
        weight = totals.pop("weight")
        means = {k: v / weight if weight else math.nan for k, v in totals.items()}
        return means | self._eval_derived(means) if self._eval_derived else means

    def lower_train(self, state: step_lib.TrainState, batch: dict[str, jax.Array]) -> jax.stages.Lowered:
        """The train step's program as jdp asks for it (`.as_text()`), before XLA's own passes (`.compile()`)."""
        return self._train.lower(state, batch)

    def compile_train(self, state: step_lib.TrainState, batch: dict[str, jax.Array],
                      lowered: jax.stages.Lowered | None = None) -> jax.stages.Compiled:
        """Compiles the train step (or `lowered`, `lower_train` of it) once: `train_step` runs it from then on, and
        `comm_bytes_per_step` and `memory` are read from it."""
        compiled = (lowered if lowered is not None else self.lower_train(state, batch)).compile()
        self._compiled_train, text = compiled, compiled.as_text()
        hybrid = device_axes(self.mesh) != DATA_AXIS  # a group is consecutive devices along `data`
        sent = hlo.collectives(text, self.mesh.size, self.sync.every, self.mesh.shape[DATA_AXIS] if hybrid else None)
        self.comm_bytes_per_step = sent.total
        self.comm_cross_group_bytes_per_step = sent.cross_group if hybrid else None
        self.compiled_warning = self.sync.compiled_warning(text, self.mesh.size)
        self.memory = {**memory_lib.state_memory(state), **memory_lib.memory_analysis(compiled)}
        return compiled

    def to_host(self, tree: Tree) -> Tree:
        """A logical tree as numpy (`jdp.mesh.to_numpy`; all processes call it together); of a train state's
        per-device leaf, the rows of this process's devices."""
        def host(x: jax.Array, layout: str) -> np.ndarray:
            if layout == PER_DEVICE and not x.sharding.is_fully_replicated:
                return np.concatenate([np.asarray(s.data) for s in x.addressable_shards])
            return to_numpy(x)
        whole = isinstance(tree, step_lib.TrainState)
        return jax.tree.map(host, tree, self._layouts if whole else jax.tree.map(lambda _: SHARDED, tree))

    def fetch(self, outputs: jax.Array | dict[str, jax.Array]) -> dict[str, float]:
        """A train step's packed metrics, or an eval step's sums, as floats; blocks until the step is done."""
        if isinstance(outputs, dict):
            values = jax.device_get([v.addressable_data(0) for v in outputs.values()])
            return {k: float(np.reshape(v, -1)[0]) for k, v in zip(outputs, values, strict=True)}
        row = np.reshape(np.asarray(outputs.addressable_data(0)), (-1, len(self._metric_names)))[0]
        return dict(zip(self._metric_names, row.tolist(), strict=True))

    def replicated(self, state: step_lib.TrainState) -> dict[str, Tree]:
        """What replicas compare: `state`'s params, model state, RNG state and sync state, replicated leaves only."""
        kept = jax.tree.map(lambda x, layout: x if layout == REPLICATED else None, state, self._layouts)
        return {name: getattr(kept, name) for name in ("params", "model_state", "rng_state", "sync")}

    def first_differing_leaf(self, tree: Tree) -> str | None:
        """The path of the first leaf whose copies differ across devices (bit checksums), or None."""
        if not jax.tree.leaves(tree):
            return None
        differs = np.asarray(self._differing_leaves(self._global(tree)).addressable_data(0))
        paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(tree)]
        return next((path for path, d in zip(paths, differs, strict=True) if d), None)


def _differing_leaves(tree: Tree, axis_name: str | tuple[str, ...] = DATA_AXIS) -> jax.Array:
    sums = jnp.stack([digest.sums_on_device(x) for x in jax.tree.leaves(tree)])  # the checkpoints' word sums
    return (jax.lax.pmax(sums, axis_name) != jax.lax.pmin(sums, axis_name)).any(-1)


def _checked_layouts(sync: Sync, abstract_state: Any, mesh: Mesh, backend: str) -> Any:
    """`sync.layouts(abstract_state)`, checked (FitError): a known layout a leaf, a row per device if per-device,
    and a backend that can run them on `mesh`."""
    if device_axes(mesh) != DATA_AXIS and backend != "shard_map":
        raise ValueError(f"a mesh of axes {mesh.axis_names} needs shard_map, not {backend}")
    layouts = sync.layouts(abstract_state)
    try:
        kinds = jax.tree.structure(abstract_state).flatten_up_to(layouts)
    except (TypeError, ValueError) as e:
        raise FitError(f"{sync!r}.layouts returned a tree unlike the train state's ({one_line(e)}); return one of "
                       f"{REPLICATED!r}, {PER_DEVICE!r}, {SHARDED!r} for each of its leaves") from None
    for (path, x), layout in zip(jax.tree_util.tree_leaves_with_path(abstract_state), kinds, strict=True):
        where = f"{sync!r}.layouts gives the train state's {jax.tree_util.keystr(path)}"
        if layout not in (REPLICATED, PER_DEVICE, SHARDED):
            raise FitError(f"{where} the layout {layout!r}; give {REPLICATED!r}, {PER_DEVICE!r} or {SHARDED!r}")
        if layout == PER_DEVICE and x.shape[:1] != (mesh.size,):
            raise FitError(f"{where} a row per device, but its init_state made it of shape {x.shape}: a "
                           f"per-device leaf's first axis is the {mesh.size} devices")
    if backend == "jit" and PER_DEVICE in kinds:
        raise FitError(f"{sync!r} keeps per-device state, which needs a per-device step; use backend 'shard_map' or "
                       "'pmap', not jit")
    if backend == "pmap" and SHARDED in kinds:
        raise FitError(f"{sync!r} keeps sharded state, which needs backend 'shard_map' or 'jit', not pmap")
    return layouts
