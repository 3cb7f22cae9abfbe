"""`python -m jdp.train`: the command line, and `run(config)`, which wires the pieces and runs the loop.

The four steps of data parallelism live in their own places: split in `jdp.mesh` /
`DataParallel.shard_batch`, compute, all-reduce and update in `jdp.step.train_step`.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import time
from pathlib import Path

import jax
import ml_collections
from flax import nnx

from jdp import config as config_lib
from jdp import data as data_lib
from jdp import models
from jdp.mesh import make_mesh, simulate_cpu_devices
from jdp.metrics import MetricsWriter, ThroughputClock
from jdp.optim import build_optimizer
from jdp.parallel import DataParallel
from jdp.runinfo import write_run_metadata
from jdp.step import TrainState

EXIT_OK, EXIT_USAGE, EXIT_NONFINITE, EXIT_REPLICAS_DIFFER = 0, 2, 3, 4


class NonFiniteLossError(RuntimeError):
    pass


class ReplicaMismatchError(RuntimeError):
    pass


@dataclasses.dataclass
class RunResult:
    losses: list[float]  # per-step train loss (mean over the global batch)
    eval_loss: float
    eval_accuracy: float
    params: dict  # final parameters of one replica, as numpy
    model_state: dict
    examples_per_sec: float


def build(cfg: ml_collections.ConfigDict):
    """Everything a run needs, checked before anything compiles."""
    mesh = make_mesh(cfg.parallel.num_devices)
    config_lib.validate(cfg, model_names=models.MODEL_NAMES, dataset_names=data_lib.DATASET_NAMES,
                        num_devices=mesh.size)
    eval_batch_size = cfg.train.eval_batch_size or cfg.train.global_batch_size
    try:
        source = data_lib.build_source(cfg.data, seed=cfg.seed, global_batch_size=cfg.train.global_batch_size,
                                       eval_batch_size=eval_batch_size, process_index=jax.process_index(),
                                       process_count=jax.process_count())
    except ValueError as e:  # the sources' own checks of the data section
        raise config_lib.ConfigError(str(e)) from None
    num_classes = cfg.data.num_classes or source.num_classes
    # Under jit the batch is global, so BatchNorm statistics are global without a named axis.
    axis_name = "data" if cfg.model.bn_sync and cfg.parallel.backend != "jit" else None

    def make_model() -> nnx.Module:
        return models.build_model(cfg.model, source.input_shape, num_classes, axis_name=axis_name, seed=cfg.seed)

    tx, schedule = build_optimizer(cfg.optim, cfg.train.global_batch_size, cfg.train.steps)

    def init_state() -> TrainState:
        _, params, model_state = nnx.split(make_model(), nnx.Param, ...)
        params, model_state = nnx.to_pure_dict(params), nnx.to_pure_dict(model_state)
        return TrainState(jax.numpy.zeros((), jax.numpy.int32), params, model_state, tx.init(params))

    graphdef = nnx.graphdef(nnx.eval_shape(make_model))
    parallel = DataParallel(cfg.parallel.backend, mesh, graphdef, tx, schedule, bn_sync=cfg.model.bn_sync)
    return mesh, source, parallel, init_state


def _fetch(parallel: DataParallel, metrics: dict) -> dict[str, float]:
    return {k: float(v) for k, v in parallel.to_host(metrics).items()}


def evaluate(parallel: DataParallel, state: TrainState, source: data_lib.Batcher) -> tuple[float, float]:
    """Mean loss and accuracy over the whole eval split; padded rows are masked out."""
    totals = {"loss_sum": 0.0, "correct": 0.0, "count": 0.0}
    pending = None
    for rows in source.eval_batches():
        sums = parallel.eval_step(state, parallel.shard_batch(rows))
        if pending is not None:  # one batch late, so the host never queues the whole eval
            totals = {k: totals[k] + v for k, v in _fetch(parallel, pending).items()}
        pending = sums
    totals = {k: totals[k] + v for k, v in _fetch(parallel, pending).items()}
    return totals["loss_sum"] / totals["count"], totals["correct"] / totals["count"]


def run(cfg: ml_collections.ConfigDict, workdir: str | Path) -> RunResult:
    """Trains `cfg` into `workdir`. Raises ConfigError before compiling anything if the config is bad."""
    t_start = time.perf_counter()
    mesh, source, parallel, init_state = build(cfg)
    workdir = Path(workdir)
    is_main = jax.process_index() == 0
    if is_main:
        workdir.mkdir(parents=True, exist_ok=True)
        config_lib.save_config(cfg, workdir / "config.json")
        write_run_metadata(workdir, mesh)

    state = parallel.init_state(init_state)
    batch_size, steps = cfg.train.global_batch_size, cfg.train.steps
    writer = MetricsWriter(workdir, total_steps=steps, enabled=is_main)
    n_params = models.count_params(parallel.to_host(state.params))
    writer.echo(f"jdp: {mesh.size} {mesh.devices.flat[0].platform} devices x {batch_size // mesh.size} examples "
                f"= global batch {batch_size} ({jax.process_count()} process(es)); {cfg.model.name}: "
                f"{n_params:,} parameters; {cfg.data.name}: {source.num_train} train / {source.num_eval} eval, "
                f"{steps} steps = {steps / source.steps_per_epoch:.1f} epochs; backend {cfg.parallel.backend}")

    clock, losses = ThroughputClock(), []
    window = {"loss": 0.0, "accuracy": 0.0, "n": 0}  # means over the steps since the last train line
    compile_time = eval_loss = eval_accuracy = math.nan

    def record(step: int, metrics: dict) -> None:
        """Host side of step `step`, fetched one step late so the device queue stays short."""
        nonlocal compile_time
        values = _fetch(parallel, metrics)
        if not math.isfinite(values["loss"]):
            raise NonFiniteLossError(f"loss became {values['loss']} at step {step}; lower optim.lr or set "
                                     "optim.grad_clip_norm")
        losses.append(values["loss"])
        if step == 1:  # the first step includes compilation: the steady-state clock starts after it
            compile_time = time.perf_counter() - t_first
            clock.start()
        else:
            clock.add(batch_size)
        window["loss"] += values["loss"]
        window["accuracy"] += values["accuracy"]
        window["n"] += 1
        if step % cfg.train.log_every == 0 or step == steps:
            writer.train(step, loss=window["loss"] / window["n"], accuracy=window["accuracy"] / window["n"],
                         lr=values["lr"], examples_per_sec=clock.interval_rate())
            window.update(loss=0.0, accuracy=0.0, n=0)

    pending = None
    t_first = time.perf_counter()
    for step in range(1, steps + 1):
        batch = parallel.shard_batch(source.train_batch(step - 1))
        state, metrics = parallel.train_step(state, batch)
        if pending is not None:
            record(*pending)
        pending = (step, metrics)
        if step % cfg.train.eval_every == 0 or step == steps:
            record(*pending)
            pending = None
            clock.pause()
            eval_loss, eval_accuracy = evaluate(parallel, state, source)
            writer.eval(step, loss=eval_loss, accuracy=eval_accuracy)
            clock.start()

    mismatch = parallel.replicas_identical(state.params)
    if mismatch is not None:
        raise ReplicaMismatchError(f"replicas differ after step {steps}: first differing parameter {mismatch}")
    writer.summary(eval_accuracy=eval_accuracy, examples_per_sec=clock.rate(), compile_time_s=compile_time,
                   total_time_s=time.perf_counter() - t_start)
    writer.echo(f"done: eval accuracy {eval_accuracy:.4f}, {clock.rate():,.0f} examples/s, "
                f"first step (compile) {compile_time:.1f}s; metrics in {workdir / 'metrics.jsonl'}")
    writer.close()
    return RunResult(losses, eval_loss, eval_accuracy, parallel.to_host(state.params),
                     parallel.to_host(state.model_state), clock.rate())


class _ArgumentParser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line and exit 2, like every other usage error
        raise config_lib.ConfigError(f"{message}; see python -m jdp.train --help")


def parse_command_line(argv: list[str]) -> tuple[ml_collections.ConfigDict, Path]:
    parser = _ArgumentParser(prog="python -m jdp.train", allow_abbrev=False,
                             description="Data-parallel training. Override any config field with "
                                         "--config.SECTION.KEY=VALUE, e.g. --config.train.steps=500.")
    parser.add_argument("--config", help=f"config file (default: {config_lib.DEFAULT_CONFIG})")
    parser.add_argument("--workdir", help="output directory (default: runs/CONFIG_NAME)")
    parser.add_argument("--cpu_devices", type=int, help="simulate N CPU devices (sets parallel.cpu_devices)")
    args, rest = parser.parse_known_args(argv)
    overrides = {}
    while rest:
        arg = rest.pop(0)
        if not arg.startswith("--config."):
            raise config_lib.ConfigError(f"unrecognised argument {arg}; overrides look like --config.train.steps=500")
        key, sep, value = arg[len("--config."):].partition("=")
        if not sep:
            if not rest:
                raise config_lib.ConfigError(f"{arg} needs a value, e.g. {arg}=VALUE")
            value = rest.pop(0)
        overrides[key] = value
    config_path = Path(args.config) if args.config else config_lib.DEFAULT_CONFIG
    cfg = config_lib.apply_overrides(config_lib.load_config_file(config_path), overrides)
    if args.cpu_devices is not None:
        cfg.parallel.cpu_devices = args.cpu_devices
    return cfg, Path(args.workdir or Path("runs") / config_path.stem)


def _enable_compilation_cache(cache_dir: str) -> None:
    """Persistent XLA cache, unless disabled or already set through JAX's own JAX_COMPILATION_CACHE_DIR."""
    if cache_dir and not jax.config.jax_compilation_cache_dir:
        jax.config.update("jax_compilation_cache_dir", os.path.expanduser(cache_dir))


def main(argv: list[str] | None = None) -> int:
    try:
        cfg, workdir = parse_command_line(sys.argv[1:] if argv is None else argv)
        simulate_cpu_devices(cfg.parallel.cpu_devices)
        _enable_compilation_cache(cfg.compile_cache_dir)
        run(cfg, workdir)
    except config_lib.ConfigError as e:
        print(f"jdp: config error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except NonFiniteLossError as e:
        print(f"jdp: halted: {e}", file=sys.stderr)
        return EXIT_NONFINITE
    except ReplicaMismatchError as e:
        print(f"jdp: halted: {e}", file=sys.stderr)
        return EXIT_REPLICAS_DIFFER
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
