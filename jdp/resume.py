"""What a workdir holds: resuming its latest checkpoint (or starting from `init_from`), refusing a
config that no longer fits it, and restoring it for evaluation or export."""

from __future__ import annotations

from pathlib import Path

import jax
import ml_collections

from jdp import config as config_lib
from jdp.checkpoint import Checkpointer, CheckpointError
from jdp.export import load_into
from jdp.mesh import replicated
from jdp.step import TrainState
from jdp.wiring import Built, build


def abstract_state(b: Built) -> TrainState:
    """Shapes, dtypes and (replicated) shardings of the logical state, as a restore needs them."""
    sharding = replicated(b.parallel.mesh)
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), b.abstract_state)


def restore_or_init(b: Built, checkpointer: Checkpointer, echo) -> tuple[int, TrainState]:
    """The latest usable checkpoint, else the `init_from` file, else a fresh state; logical layout."""
    abstract = abstract_state(b)
    restored = checkpointer.restore_latest(abstract, echo)
    if restored is not None:
        step, state, position = restored
        echo(f"resumed from {checkpointer.directory / str(step)} (data position {position})")
        return step, state._replace(halted=state.halted * 0)  # a halted run may go on (e.g. at a lower lr)
    if not b.cfg.init_from:
        return 0, b.parallel.init_state(b.init_state)
    try:
        params, model_state = load_into(b.cfg.init_from, abstract.params, abstract.model_state)
    except (OSError, ValueError) as e:
        raise config_lib.ConfigError(f"init_from={b.cfg.init_from}: {e}") from None
    echo(f"initialised from {b.cfg.init_from}")
    return 0, b.parallel.init_state(b.init_state, params, model_state)


def check_workdir_config(cfg: ml_collections.ConfigDict, workdir: Path, echo) -> None:
    saved = workdir / "config.json"
    if not saved.exists():
        return
    old = config_lib.load_saved_config(saved)
    changes = config_lib.state_changes(old, cfg)
    if changes and not cfg.checkpoint.allow_config_change:
        raise config_lib.ConfigError(
            f"{workdir} holds a run whose model or optimizer differs ({'; '.join(changes)}); use a new --workdir, "
            "or pass --config.checkpoint.allow_config_change=True")
    if cfg.train.steps != old.train.steps:
        echo(f"warning: train.steps changed from {old.train.steps} to {cfg.train.steps}: the learning-rate "
             "schedule changes from here on")


def restore_for_inference(workdir: Path) -> tuple[int, Built, TrainState]:
    """A finished or interrupted run's latest checkpoint, with its config, on this machine's devices."""
    saved = workdir / "config.json"
    if not saved.exists():
        raise config_lib.ConfigError(f"{saved} not found; pass the --workdir of a jdp.train run")
    b = build(config_lib.load_saved_config(saved))
    checkpointer = Checkpointer(workdir / "checkpoints", keep=b.cfg.checkpoint.keep, every_steps=0)
    try:
        restored = checkpointer.restore_latest(abstract_state(b), print)
    finally:
        checkpointer.close()
    if restored is None:
        raise CheckpointError(f"no checkpoint in {checkpointer.directory}; train first with python -m jdp.train")
    step, state, _ = restored
    return step, b, state
