"""A config's data-parallel step, compiled once and timed: what `python -m jdp.bench` (and `--predict`) measures."""

from __future__ import annotations

import itertools
import statistics
import time

import jax

from jdp import precision
from jdp.cli.build import build
from jdp.cli.config import with_default_sync
from jdp.memory import memory_analysis, state_memory

# The state's sharding on the devices, as `python -m jdp.bench --compile_only` compares them: sync strategy names.
SHARDINGS = {"plain": "allreduce", "zero1": "zero1", "zero3": "zero3"}


def compiled_memory(cfg, num_devices: int, sharding: str, remat: str = "") -> dict:
    """Per-device memory and compile time of the config's step on `num_devices`, state sharded as `sharding` (a
    SHARDINGS name), with `remat` if given: compiled from shapes, never run, for models too big to run here."""
    cfg = with_default_sync(cfg)  # the strategy named alone, whatever the config's flags chose
    cfg.parallel.num_devices = num_devices
    cfg.parallel.sync = SHARDINGS[sharding]
    if remat:
        cfg.model.kwargs.remat = remat
    b = build(cfg)
    state = b.parallel.step_shapes(b.abstract_state)
    batch = b.parallel.shard_batch(b.source.train_batch(0))
    b.source.close()
    t0 = time.perf_counter()
    compiled = b.parallel.lower_train(state, batch).compile()
    return {"sharding": sharding, "devices": num_devices, "compile_s": time.perf_counter() - t0,
            "params_n": sum(x.size for x in jax.tree.leaves(b.abstract_state.params)),
            **state_memory(state), **memory_analysis(compiled)}


class Variant:
    """A config's step (device count, with or without its collective), compiled once and timed as often as asked."""

    def __init__(self, cfg, num_devices: int, collective: bool = True) -> None:
        cfg = cfg.copy_and_resolve_references()
        # No eval runs here: a device count below the run's must not find its eval batch too large.
        cfg.parallel.num_devices, cfg.train.eval_batch_size = num_devices, 0
        self.num_devices, self.batch_size = num_devices, cfg.train.global_batch_size
        b = build(cfg, all_reduce=collective)
        self.parallel, source = b.parallel, b.source
        self.tokens_per_example = getattr(source, "tokens_per_example", 0)  # language models
        self.abstract_params = b.abstract_state.params
        t0 = time.perf_counter()
        self.batches = [self.parallel.shard_batch(source.train_batch(i)) for i in range(4)]
        jax.block_until_ready(self.batches)
        self.input_s = (time.perf_counter() - t0) / len(self.batches)
        source.close()
        self.state = self.parallel.to_devices(b.init_state())
        t0 = time.perf_counter()
        # Compiled once, as the trainer does: the step runs this executable; collectives and XLA's figures read it.
        self._lowered = self.parallel.lower_train(self.state, self.batches[0])
        self._step = self.parallel.compile_train(self.state, self.batches[0], self._lowered)
        self.state, metrics = self._step(self.state, self.batches[0])
        self.parallel.fetch(metrics)
        self.first_step_s = time.perf_counter() - t0  # compilation (or a persistent-cache hit) and one step

    def time(self, steps: int) -> float:
        """Median seconds per step over `steps` steps, fetching metrics one step late as the trainer does."""
        stamps, pending = [time.perf_counter()], None
        for i in range(steps + 1):
            self.state, metrics = self._step(self.state, self.batches[(i + 1) % len(self.batches)])
            if pending is not None:
                self.parallel.fetch(pending)
                stamps.append(time.perf_counter())
            pending = metrics
        self.parallel.fetch(pending)
        return statistics.median(b - a for a, b in itertools.pairwise(stamps))

    def stats(self) -> dict:
        """XLA's own accounting of the compiled step: memory (bytes per device) and FLOPs, and how many of its
        dots and convolutions produce each dtype (`matmul_dtypes`, in the program as lowered)."""
        out = {"matmul_dtypes": dict(precision.hlo_matmul_dtypes(self._lowered.as_text(dialect="hlo"))),
               **memory_analysis(self._step)}
        cost = self._step.cost_analysis()
        if cost and "flops" in cost:
            out["flops"] = float(cost["flops"])
        return out

    def row(self, step_s: float) -> dict:
        return {"devices": self.num_devices, "first_step_s": self.first_step_s, "step_s": step_s,
                "input_s": self.input_s, "examples_per_sec": self.batch_size / step_s,
                "comm_bytes_per_step": self.parallel.comm_bytes_per_step, **state_memory(self.state)}


def one_device_step_s(cfg, steps: int, repeats: int) -> float:
    """Median over `repeats` of the config's single-device step time at its global batch (compiled once)."""
    variant = Variant(cfg, 1)
    return statistics.median(variant.time(steps) for _ in range(repeats))
