"""Per-device memory of a train step: the state's bytes and the compiled step's peak, argument + output + temporary -
aliased bytes (XLA's own `peak_memory_in_bytes` reads below the temporaries on XLA:CPU)."""

from __future__ import annotations

import math

import jax

MB = 2**20


def per_device_bytes(tree) -> int:
    """Bytes of one device's part of every leaf (arrays, or shapes with their sharding)."""
    return sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(tree))


def state_memory(state) -> dict[str, int]:
    """Per-device bytes of the step's state: parameters, one gradient per parameter as held, optimizer state."""
    return {"params_bytes": per_device_bytes(state.params), "grads_bytes": per_device_bytes(state.params),
            "opt_state_bytes": per_device_bytes(state.opt_state)}


def memory_analysis(compiled) -> dict[str, int]:
    """XLA's accounting of a compiled program's bytes per device and the `peak_bytes` they make; {} where none."""
    memory = compiled.memory_analysis()
    if memory is None:
        return {}
    out = {f"{x}_bytes": int(getattr(memory, f"{x}_size_in_bytes")) for x in ("argument", "output", "temp", "alias")}
    out["peak_bytes"] = out["argument_bytes"] + out["output_bytes"] + out["temp_bytes"] - out["alias_bytes"]
    return out


def summary_fields(memory: dict[str, int]) -> dict[str, int]:
    """The memory figures as metrics.jsonl's summary line names them: `params_bytes_per_device`, ..."""
    return {f"{name}_per_device": value for name, value in memory.items()}


def mb(n: int) -> str:
    """`n` bytes in MB: two decimals, four below 1 MB (a small model's 0.0103)."""
    return f"{n / MB:,.2f}" if n >= MB else f"{n / MB:.4f}"


def describe(memory: dict[str, int]) -> str:
    """The start-up line of the state's and compiled step's figures, in MB (2**20 bytes)."""
    state = (f"memory per device: params {mb(memory['params_bytes'])} MB, grads {mb(memory['grads_bytes'])} MB, "
             f"optimizer state {mb(memory['opt_state_bytes'])} MB")
    if "peak_bytes" not in memory:
        return f"{state}; compiled step peak unknown (XLA gives no memory analysis for these devices)"
    return (f"{state}; compiled step peak {mb(memory['peak_bytes'])} MB (arguments {mb(memory['argument_bytes'])} "
            f"+ outputs {mb(memory['output_bytes'])} + temporaries {mb(memory['temp_bytes'])} - aliased "
            f"{mb(memory['alias_bytes'])}; XLA's figures for these devices)")
