"""What a workdir holds: refusing a config that no longer fits it, restoring its latest checkpoint for
evaluation or export, and starting a new run from an exported parameter file (`init_from`)."""

from __future__ import annotations

from pathlib import Path

import ml_collections
from flax import nnx

from jdp import config as config_lib
from jdp.checkpoint import Checkpointer, CheckpointError
from jdp.modeldef import replace_state, state_groups
from jdp.params_file import load_into
from jdp.step import TrainState
from jdp.task import build
from jdp.trainer import Engine


def initialised_from(path: str, model: nnx.Module) -> nnx.Module:
    """`model` with the parameters and BatchNorm statistics of a `python -m jdp.export` file."""
    try:
        params, model_state = load_into(path, *state_groups(model))
    except (OSError, ValueError, EOFError) as e:
        raise config_lib.ConfigError(f"init_from={path}: {e}") from None
    replace_state(model, params, model_state)
    print(f"initialised from {path}")
    return model


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


def restore_for_inference(workdir: Path) -> tuple[int, Engine, TrainState]:
    """A finished or interrupted run's latest checkpoint, with its config, on this machine's devices."""
    saved = workdir / "config.json"
    if not saved.exists():
        raise config_lib.ConfigError(f"{saved} not found; pass the --workdir of a jdp.train run")
    cfg = config_lib.load_saved_config(saved)
    engine = build(cfg, workdir=workdir)
    checkpointer = Checkpointer(workdir / "checkpoints", keep=cfg.checkpoint.keep, every_steps=0)
    try:
        restored = checkpointer.restore_latest(engine.abstract_state, print)
    finally:
        checkpointer.close()
    if restored is None:
        raise CheckpointError(f"no checkpoint in {checkpointer.directory}; train first with python -m jdp.train")
    step, state, _ = restored
    return step, engine, state
