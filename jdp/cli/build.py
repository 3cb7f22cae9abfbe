"""Config -> the task `jdp.fit` trains (model, loss, data, optimizer, options), checked before anything compiles."""

from __future__ import annotations

import dataclasses
import functools
import sysconfig
import traceback
from collections.abc import Callable
from pathlib import Path

import jax
import ml_collections
import optax
from flax import nnx

from jdp import data as data_lib
from jdp import models, trainer
from jdp.cli import config as config_lib
from jdp.cli.optim import OPTIMIZERS, build_optimizer
from jdp.errors import UsageError, one_line
from jdp.mesh import DATA_AXIS, mesh_devices
from jdp.modeldef import LossFn
from jdp.sync import for_inference
from jdp.task import DERIVED_EVAL_METRICS, LOSSES


@dataclasses.dataclass
class Task:
    make_model: Callable[[], nnx.Module]
    loss_fn: LossFn
    source: trainer.Source
    optimizer: optax.GradientTransformation
    options: trainer.FitOptions  # steps and global_batch_size: the config's train section's


def check_names(cfg: ml_collections.ConfigDict) -> None:
    """Every name the config gives is registered, or an import path that imports (ConfigError otherwise)."""
    registries = {"model.name": models.MODELS, "optim.name": OPTIMIZERS, "task.loss": LOSSES}
    if not (cfg.data.name.startswith(data_lib.TFDS_PREFIX) or data_lib.is_text(cfg.data.name)):
        registries["data.name"] = data_lib.DATASETS
    for key, registry in registries.items():
        try:
            registry.get(cfg[key])
        except UsageError as e:
            raise config_lib.ConfigError(str(e)) from None


def model_maker(cfg: ml_collections.ConfigDict, input_shape: tuple[int, ...],
                num_classes: int) -> Callable[[], nnx.Module]:
    """The model's constructor, by keyword: the run's record names it as importable code; no dtype (the step casts)."""
    return functools.partial(models.build_model, name=cfg.model.name, kwargs=cfg.model.kwargs.to_dict(),
                             input_shape=tuple(input_shape), num_classes=num_classes, seed=cfg.seed)


_JDP_MODELS = str(Path(models.__file__).parent)
# Frames skipped in naming where the constructor failed: installed libraries', the stdlib's, the calls to it.
_LIBRARIES = tuple(sorted({sysconfig.get_paths()[key] for key in ("purelib", "platlib", "stdlib")}))
_CALL_PATH = (__file__, models.__file__)


def abstract_model(make_model: Callable[[], nnx.Module]) -> nnx.Module:
    """The model with shapes and dtypes for arrays, nothing allocated (ConfigError for a bad model setting)."""
    try:
        return nnx.eval_shape(make_model)
    except Exception as e:  # noqa: BLE001 - a model (maybe the user's) that cannot be built: one line
        frames = traceback.extract_tb(e.__traceback__)
        if isinstance(e, ValueError) and frames[-1].filename.startswith(_JDP_MODELS):  # jdp's checks name the fix
            raise config_lib.ConfigError(one_line(e, typed=False)) from None
        frames = [f for f in frames if not f.filename.startswith(_LIBRARIES) and f.filename not in _CALL_PATH]
        where = f" at {Path(frames[-1].filename).name} line {frames[-1].lineno}" if frames else ""
        traced = isinstance(e, jax.errors.JAXTypeError | jax.errors.NonConcreteBooleanIndexError)
        hint = ("; jdp builds the model with nnx.eval_shape, where arrays have no values: compute no Python value "
                "from an array in the constructor" if traced else "")
        raise config_lib.ConfigError(f"the model cannot be built: {one_line(e)} (raised{where} in its constructor)"
                                     f"{hint}; fix the model's code or its settings (model.kwargs)") from None


def build_task(cfg: ml_collections.ConfigDict, workdir: str | Path | None = None) -> Task:
    """`cfg`'s task, checked before anything compiles (ConfigError); a text source keeps its vocabulary in `workdir`."""
    num_devices = len(mesh_devices(cfg.parallel.num_devices))  # the mesh itself is fit's
    values, strategy = config_lib.validate(cfg, num_devices=num_devices)  # `values`: the config's view of fit's options
    check_names(cfg)
    batch_size = cfg.train.global_batch_size
    try:
        source = data_lib.build_source(cfg.data, seed=cfg.seed, global_batch_size=batch_size,
                                       eval_batch_size=cfg.train.eval_batch_size or batch_size,
                                       process_index=jax.process_index(), process_count=jax.process_count(),
                                       workdir=None if workdir is None else Path(workdir))
    except ValueError as e:  # the sources' own checks of the data section
        raise config_lib.ConfigError(str(e)) from None
    largest = trainer.eval_batch_limit(source.num_eval, num_devices)
    if cfg.train.eval_batch_size > largest:
        source.close()
        raise config_lib.ConfigError(
            f"train.eval_batch_size={cfg.train.eval_batch_size} is larger than the eval split needs "
            f"({source.num_eval} examples on {num_devices} device(s)); set --config.train.eval_batch_size to at most "
            f"{largest}, or 0 (= train.global_batch_size)")
    if 0 < cfg.data.num_classes < (own := getattr(source, "num_classes", 0)):  # labels past the logits: nan loss
        source.close()
        raise config_lib.ConfigError(f"data.num_classes={cfg.data.num_classes} is fewer than the data's {own} "
                                     f"classes (or symbols); set --config.data.num_classes to at least {own}, or 0 "
                                     "for the data's own")
    make_model = model_maker(cfg, source.input_shape, cfg.data.num_classes or source.num_classes)
    model = abstract_model(make_model)
    params = nnx.state(model, nnx.Param)
    tx, schedule = build_optimizer(cfg.optim, batch_size, cfg.train.steps, nnx.to_pure_dict(params),
                                   sharded_axis=DATA_AXIS if strategy.optimizer_sees_slices(cfg.parallel.backend)
                                   else None)
    options = trainer.FitOptions(
        **values,
        schedule=schedule, profile_steps=config_lib.profile_steps(cfg.profile.steps),
        eval_derived=DERIVED_EVAL_METRICS.get(cfg.task.loss),
        description=f"{cfg.model.name} on {cfg.data.name} ({source.num_eval} eval examples)"
                    + (f"; {model.describe()}" if hasattr(model, "describe") else ""))
    return Task(make_model, LOSSES.get(cfg.task.loss), source, tx, options)


def build(cfg: ml_collections.ConfigDict, *, all_reduce: bool = True, workdir: str | Path | None = None,
          inference: bool = False) -> trainer.Engine:
    """`cfg`'s run prepared by `jdp.trainer.prepare`; `inference`: its strategy restores on any device count."""
    task = build_task(cfg, workdir)
    options = for_inference(task.options) if inference else task.options
    return trainer.prepare(task.make_model, task.loss_fn, task.source, optimizer=task.optimizer,
                           global_batch_size=cfg.train.global_batch_size, options=options, all_reduce=all_reduce)
