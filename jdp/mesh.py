"""Devices -> the mesh (the 1-D `data` mesh, or a sync strategy's groups x `data`) and its shardings."""

from __future__ import annotations

import numbers
import os

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jdp.environment import MAX_CPU_DEVICES, add_xla_flags
from jdp.errors import UsageError

DATA_AXIS = "data"
GROUPS_AXIS = "groups"  # hybrid sharding's outer axis (`jdp.sync.hybrid`): the state is replicated across it


ONE_THREAD_PER_DEVICE = "--xla_cpu_multi_thread_eigen=false"


def simulate_cpu_devices(count: int) -> None:
    """Ask XLA:CPU for `count` devices (0: leave JAX alone) before JAX touches one. When they fill the usable cores,
    each device's ops run on one thread: XLA's shared pool made all-reduces wait (docs/benchmarks.md)."""
    if count <= 0:
        return
    if count > MAX_CPU_DEVICES:  # XLA would set them all up in C++, for minutes and gigabytes, deaf to signals
        raise UsageError(f"{count} simulated CPU devices asked for; jdp simulates at most {MAX_CPU_DEVICES}")
    jax.config.update("jax_num_cpu_devices", count)
    if count >= len(os.sched_getaffinity(0)):
        add_xla_flags(dict([ONE_THREAD_PER_DEVICE.split("=")]))


def mesh_devices(num_devices: int = 0) -> list[jax.Device]:
    """The first `num_devices` devices (0 = all), each process's contiguous (as is its block of a global batch)."""
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    if not isinstance(num_devices, numbers.Integral) or num_devices < 0:  # -1 took all devices but the last
        raise UsageError(f"num_devices={num_devices!r} must be a whole number of devices, or 0 for all of them")
    if num_devices > len(devices):
        raise UsageError(f"{num_devices} devices asked for (num_devices / parallel.num_devices) but only "
                         f"{len(devices)} exist; lower it, or simulate more on a CPU (--cpu_devices N, or "
                         "jax.config.update('jax_num_cpu_devices', N) before JAX starts)")
    return devices[:num_devices] if num_devices else devices


def make_mesh(num_devices: int = 0, shape: dict[str, int] | None = None) -> Mesh:
    """The 1-D `data` mesh over `mesh_devices(num_devices)`, or those devices in a strategy's `mesh_shape`."""
    devices = np.array(mesh_devices(num_devices))
    shape = shape or {DATA_AXIS: devices.size}
    return Mesh(devices.reshape(tuple(shape.values())), tuple(shape))  # axes of type Auto


def device_axes(mesh: Mesh) -> str | tuple[str, ...]:
    """The axis name of all the mesh's devices: `data` on the 1-D mesh, else the tuple of every axis."""
    return DATA_AXIS if mesh.axis_names == (DATA_AXIS,) else tuple(mesh.axis_names)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def data_sharded(mesh: Mesh) -> NamedSharding:
    """Leading axis split across all the devices: step 1 of data parallelism."""
    return NamedSharding(mesh, P(device_axes(mesh)))


def to_numpy(x: jax.Array | np.ndarray) -> np.ndarray:
    """An array whole on the host (a split one in several processes: all call this together)."""
    if not isinstance(x, jax.Array):
        return np.asarray(x)
    if x.sharding.is_fully_replicated:
        return np.asarray(x.addressable_data(0))
    return np.asarray(x) if x.is_fully_addressable else multihost_utils.process_allgather(x, tiled=True)


def split_whole(mesh: Mesh, shape: tuple[int, ...]) -> NamedSharding:
    """A whole array split across the devices on an axis that divides by their count (the first, else the longest),
    else as far as its axes share factors with it (docs/performance.md, "Checkpoints and callbacks")."""
    if mesh.size == 1:
        return replicated(mesh)
    axes = sorted((i for i, size in enumerate(shape) if size % mesh.size == 0), key=lambda i: (i != 0, -shape[i]))
    if axes:
        return NamedSharding(mesh, P(*[DATA_AXIS if i == axes[0] else None for i in range(len(shape))]))
    factors = _prime_factors(mesh.size)
    view = Mesh(mesh.devices.reshape(factors), tuple(f"{DATA_AXIS}{k}" for k in range(len(factors))))
    left, names = list(shape), [[] for _ in shape]
    for name, factor in zip(view.axis_names, factors, strict=True):
        fits = [i for i, size in enumerate(left) if size % factor == 0]
        if fits:
            i = max(fits, key=lambda i: left[i])
            left[i] //= factor
            names[i].append(name)
    if not any(names):
        return replicated(mesh)
    return NamedSharding(view, P(*[tuple(n) if n else None for n in names]))


def _prime_factors(n: int) -> list[int]:
    factors, p = [], 2
    while n > 1:
        while n % p == 0:
            factors.append(p)
            n //= p
        p += 1
    return factors
