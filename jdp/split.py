"""Step 1 of data parallelism, split: each global batch is cut along the device axis `data`, across processes
(`process_block`: what every source hands `fit`), then across a process's devices (`shard_batch`)."""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh

from jdp.mesh import data_sharded


def process_block(global_size: int, process_index: int, process_count: int, what: str) -> slice:
    """Process p's contiguous block [p*B/P, (p+1)*B/P) of a global batch of size B."""
    if global_size <= 0 or global_size % process_count:
        raise ValueError(f"{what} {global_size} must be a positive multiple of the process count {process_count}")
    local = global_size // process_count
    return slice(process_index * local, (process_index + 1) * local)


def shard_batch(local_rows: dict[str, np.ndarray], backend: str, mesh: Mesh) -> dict[str, jax.Array | np.ndarray]:
    """This process's rows of the global batch -> what the compiled step takes: in one process the host rows (split
    by the step's input sharding, cheaper than `jax.device_put`: docs/benchmarks.md), in several a global array."""
    if backend == "pmap":
        local_devices = sum(d.process_index == jax.process_index() for d in mesh.devices.flat)
        local_rows = {k: v.reshape(local_devices, -1, *v.shape[1:]) for k, v in local_rows.items()}
    if jax.process_count() == 1:
        return local_rows
    return {k: jax.make_array_from_process_local_data(data_sharded(mesh), v) for k, v in local_rows.items()}
