"""Runs the one step of `jdp.step` under the chosen backend: shard_map, pmap or jit.

shard_map and pmap call the step once per device with `axis_name="data"`, so the explicit
`lax.pmean` in the step is the all-reduce. jit calls it once on the global batch with
`axis_name=None`, and XLA partitions it and inserts the all-reduce itself.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jdp import step as step_lib
from jdp.mesh import DATA_AXIS, data_sharded, global_batch, replicated

Tree = step_lib.Tree


class DataParallel:
    """The train and eval steps compiled for one backend, plus the layout of state and batches."""

    def __init__(self, backend: str, mesh: Mesh, graphdef: nnx.GraphDef, tx: optax.GradientTransformation,
                 schedule: optax.Schedule, *, bn_sync: bool = True):
        self.backend, self.mesh = backend, mesh
        train = partial(step_lib.train_step, graphdef=graphdef, tx=tx, schedule=schedule)
        evaluate = partial(step_lib.eval_step, graphdef=graphdef)
        if backend == "jit":
            repl, split = replicated(mesh), data_sharded(mesh)
            # Per-device BatchNorm: the global batch is normalised in groups of each device's rows.
            bn_groups = 1 if bn_sync else mesh.size
            self._train = jax.jit(partial(train, axis_name=None, bn_groups=bn_groups),
                                  in_shardings=(repl, split), out_shardings=(repl, repl), donate_argnums=0)
            self._eval = jax.jit(partial(evaluate, axis_name=None), in_shardings=(repl, split), out_shardings=repl)
        elif backend == "shard_map":
            # check_vma=False: with it on, the gradient of a replicated parameter is already summed
            # over devices, and the classic pmean of the step would leave it N times too large.
            def per_device(fn: Callable, out_specs: object) -> Callable:
                return jax.shard_map(partial(fn, axis_name=DATA_AXIS), mesh=mesh, in_specs=(P(), P(DATA_AXIS)),
                                     out_specs=out_specs, check_vma=False)

            self._train = jax.jit(per_device(train, (P(), P())), donate_argnums=0)
            self._eval = jax.jit(per_device(evaluate, P()))
        elif backend == "pmap":
            devices = list(mesh.devices.flat)
            self._train = jax.pmap(partial(train, axis_name=DATA_AXIS), axis_name=DATA_AXIS, devices=devices,
                                   donate_argnums=0)
            self._eval = jax.pmap(partial(evaluate, axis_name=DATA_AXIS), axis_name=DATA_AXIS, devices=devices)
        else:
            raise ValueError(f"unknown backend {backend!r}")
        self._local_devices = sum(d.process_index == jax.process_index() for d in mesh.devices.flat)

    def init_state(self, init_fn: Callable[[], step_lib.TrainState]) -> step_lib.TrainState:
        """Creates the state directly on the devices, already replicated (no host copy, no broadcast)."""
        if self.backend != "pmap":
            return jax.jit(init_fn, out_shardings=replicated(self.mesh))()
        n = self.mesh.size  # pmap wants one stacked copy per device along a leading axis
        stacked = lambda: jax.tree.map(lambda x: jnp.broadcast_to(x, (n, *x.shape)), init_fn())  # noqa: E731
        return jax.jit(stacked, out_shardings=data_sharded(self.mesh))()

    def shard_batch(self, local_rows: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        """Step 1, split: this process's rows of the global batch -> a global array on `data`."""
        if self.backend == "pmap":
            local_rows = {k: v.reshape(self._local_devices, -1, *v.shape[1:]) for k, v in local_rows.items()}
        return global_batch(local_rows, data_sharded(self.mesh))

    def train_step(self, state: step_lib.TrainState, batch: dict[str, jax.Array]
                   ) -> tuple[step_lib.TrainState, dict[str, jax.Array]]:
        return self._train(state, batch)

    def eval_step(self, state: step_lib.TrainState, batch: dict[str, jax.Array]) -> dict[str, jax.Array]:
        return self._eval(state, batch)

    def to_host(self, tree: Tree) -> Tree:
        """One replica's copy as numpy (the copies are identical; see `replicas_identical`)."""
        def first_copy(x: jax.Array) -> np.ndarray:
            local = np.asarray(x.addressable_data(0))
            return local[0] if self.backend == "pmap" else local  # pmap shards are (1, ...)

        return jax.tree.map(first_copy, tree)

    def replicas_identical(self, tree: Tree) -> str | None:
        """None if every local device holds a bitwise-identical copy, else the first differing leaf's path."""
        for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
            copies = [np.asarray(shard.data) for shard in leaf.addressable_shards]
            if any(c.tobytes() != copies[0].tobytes() for c in copies[1:]):
                return jax.tree_util.keystr(path)
        return None
