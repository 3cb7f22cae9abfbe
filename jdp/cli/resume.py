"""A train workdir: its config.json and config_history.jsonl, its checkpoint restored for eval or export, init_from."""

from __future__ import annotations

import contextlib
import json
import tempfile
import time
import zipfile
from pathlib import Path

import jax
import ml_collections
from flax import nnx

from jdp.checkpoint import Checkpointer, CheckpointError
from jdp.cli import config as config_lib
from jdp.cli.build import build
from jdp.data.text import TEXT_PREFIX, VOCAB_FILE, Vocabulary
from jdp.distributed import differences
from jdp.errors import warn
from jdp.files import committed_steps
from jdp.modeldef import replace_state, state_groups
from jdp.params_file import load_into
from jdp.step import TrainState
from jdp.trainer import Engine


def initialised_from(path: str, model: nnx.Module) -> nnx.Module:
    """`model` with the parameters and BatchNorm statistics of a `python -m jdp.export` file."""
    try:
        params, model_state = load_into(path, *state_groups(model))
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as e:
        raise config_lib.ConfigError(f"init_from={path} cannot be read ({type(e).__name__}: {e}); give a file "
                                     "written by python -m jdp.export") from None
    replace_state(model, params, model_state)
    print(f"initialised from {path}")
    return model


def record_config(cfg: ml_collections.ConfigDict, workdir: Path) -> None:
    """Writes config.json (what `--workdir W` alone continues with) and appends it to config_history.jsonl."""
    config_lib.save_config(cfg, workdir / "config.json")
    line = {"time_unix": round(time.time(), 3), "latest_checkpoint_step": max(committed_steps(workdir), default=0),
            "config": cfg.to_dict()}
    with open(workdir / "config_history.jsonl", "a") as f:
        f.write(json.dumps(line, sort_keys=True, default=list) + "\n")


def report_finished_run(cfg: ml_collections.ConfigDict, workdir: Path, step: int) -> None:
    """A finished run met with other settings: say which differ and what to do (nothing is written)."""
    saved = workdir / "config.json"
    if not saved.exists():
        return
    # Unreadable, it is no fault of --config's: its fix is not "pass --config".
    saved = config_lib.load_saved_config(saved, fix="it records the settings of the run this workdir holds, which a "
                                         "finished run's rerun is compared with: restore it (config_history.jsonl "
                                         "holds each run segment's config), or move it away")
    changed = [f"{key}: {old!r} -> {new!r}" for key, old, new in differences(saved.to_dict(), cfg.to_dict())
               if key != "train.steps"]
    if changed:
        warn(f"{workdir} holds a run finished at step {step} with other settings ({'; '.join(changed)}); "
             "nothing was trained or written: to train with these settings pass a new --workdir, or raise "
             "--config.train.steps to extend this run")


def inference_devices(cfg: ml_collections.ConfigDict) -> int:
    """Devices to evaluate or export on: the run's count, or fewer on a smaller machine, so the batches still split."""
    available, eval_batch_size = len(jax.devices()), cfg.train.eval_batch_size or cfg.train.global_batch_size
    return next(n for n in range(min(cfg.parallel.num_devices or available, available), 0, -1)
                if not cfg.train.global_batch_size % (n * cfg.train.grad_accum_steps) and not eval_batch_size % n)


def _built_on_its_vocabulary(cfg: ml_collections.ConfigDict, workdir: Path) -> Engine:
    """The language model's engine on a stand-in text of its vocabulary's symbols: the model without its own text."""
    symbols = "".join(Vocabulary.load(workdir / VOCAB_FILE).symbols) or "\n"  # bytes: any byte is a symbol
    windows = 2 * max(cfg.train.global_batch_size, cfg.train.eval_batch_size) + 2
    with tempfile.TemporaryDirectory() as folder:
        stand_in = Path(folder) / "text.txt"
        stand_in.write_text(symbols * (10 * windows * (cfg.data.block_size + 1) // len(symbols) + 1))
        cfg.data.name = f"{TEXT_PREFIX}{stand_in}"  # `cfg`: restore_for_inference's own copy
        return build(cfg, workdir=workdir, inference=True)


def restore_for_inference(workdir: Path, *, reads_data: bool = True) -> tuple[int, Engine, TrainState]:
    """A run's latest checkpoint, with its config, on this machine's devices. Without `reads_data` (a sample, an
    export), a language model whose text has moved or changed is rebuilt from the workdir's vocabulary alone."""
    cfg = config_lib.load_saved_config(workdir / "config.json", fix="restore it (config_history.jsonl holds each "
                                       "run segment's config): the run is rebuilt from it")
    cfg.parallel.num_devices = inference_devices(cfg)  # the state is replicated: any count restores it
    try:
        engine = build(cfg, workdir=workdir, inference=True)
    except config_lib.ConfigError as e:
        if reads_data or not cfg.data.name.startswith(TEXT_PREFIX) or not (workdir / VOCAB_FILE).is_file():
            raise
        warn(f"{e}; the model is rebuilt from {workdir / VOCAB_FILE} and the run's config, which is all it needs")
        engine = _built_on_its_vocabulary(cfg, workdir)
    with contextlib.closing(Checkpointer(workdir / "checkpoints", keep=cfg.checkpoint.keep, every_steps=0)) as ckpt:
        restored = ckpt.restore_latest(engine.abstract_state, reject_damaged=False,
                                       per_device=engine.parallel.per_device)
    if restored is None:
        raise CheckpointError(f"no checkpoint in {ckpt.directory}; train first with python -m jdp.train")
    step, state, _ = restored
    # Per-device state saved on more devices comes back as None; inference reads only the parameters: left fresh.
    if any(x is None for x in jax.tree.leaves(state, is_leaf=lambda x: x is None)):
        state = engine.parallel.sync.restart(state, engine.init_state())
    return step, engine, state
