"""Step 1 of data parallelism, split: each global batch is cut along the device axis `data`.

- Across processes: process p reads only its contiguous block of every global batch (`process_block`), which
  every source (jdp's own and a `jdp.Source`) hands `fit`.
- Across a process's devices: those rows become the compiled step's input, split on `data` (`data_sharded`,
  the input sharding of the jit and shard_map steps; `shard_batch` for what the step is called with).
"""

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
    """This process's rows of the global batch -> what the compiled step takes: in one process the host rows, which
    the step's input sharding splits as it is called, at a fraction of `jax.device_put`'s cost (docs/benchmarks.md,
    "Fixed per-step costs"); in several, one global array on `data`; for pmap, a leading axis of local devices."""
    if backend == "pmap":
        local_devices = sum(d.process_index == jax.process_index() for d in mesh.devices.flat)
        local_rows = {k: v.reshape(local_devices, -1, *v.shape[1:]) for k, v in local_rows.items()}
    if jax.process_count() == 1:
        return local_rows
    return {k: jax.make_array_from_process_local_data(data_sharded(mesh), v) for k, v in local_rows.items()}
