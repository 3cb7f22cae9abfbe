"""Config -> everything a run needs (data source, compiled data-parallel steps, state factory),
checked before anything compiles."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx

from jdp import config as config_lib
from jdp import data as data_lib
from jdp import models
from jdp.mesh import DATA_AXIS, make_mesh
from jdp.optim import build_optimizer
from jdp.parallel import DataParallel
from jdp.step import StepOptions, TrainState


@dataclasses.dataclass
class Built:
    cfg: ml_collections.ConfigDict
    source: data_lib.Source
    parallel: DataParallel
    init_state: Callable[..., TrainState]  # (params=None, model_state=None) -> a fresh TrainState
    abstract_state: TrainState  # shapes and dtypes of the logical state (jax.ShapeDtypeStruct leaves)


def build(cfg: ml_collections.ConfigDict) -> Built:
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
    axis_name = DATA_AXIS if cfg.model.bn_sync and cfg.parallel.backend != "jit" else None

    def make_model() -> nnx.Module:
        return models.build_model(cfg.model, source.input_shape, num_classes, axis_name=axis_name, seed=cfg.seed)

    graphdef, abstract_params, _ = nnx.split(nnx.eval_shape(make_model), nnx.Param, ...)
    tx, schedule = build_optimizer(cfg.optim, cfg.train.global_batch_size, cfg.train.steps,
                                   nnx.to_pure_dict(abstract_params),
                                   sharded_axis=DATA_AXIS if cfg.parallel.shard_optimizer else None)

    def init_state(params=None, model_state=None) -> TrainState:
        if params is None:
            _, params, model_state = nnx.split(make_model(), nnx.Param, ...)
            params, model_state = nnx.to_pure_dict(params), nnx.to_pure_dict(model_state)
        zero = jnp.zeros((), jnp.int32)
        loss_scale = jnp.array([cfg.loss_scale.initial if cfg.precision == "fp16" else 1.0, 0, 0], jnp.float32)
        return TrainState(zero, params, model_state, tx.init(params), zero, loss_scale, zero)

    options = StepOptions(bn_groups=1 if cfg.model.bn_sync else mesh.size, on_nonfinite=cfg.train.on_nonfinite,
                          precision=cfg.precision, grad_accum_steps=cfg.train.grad_accum_steps,
                          allreduce_dtype=cfg.parallel.allreduce_dtype, sync_every=cfg.parallel.sync_every,
                          loss_scale_growth_interval=cfg.loss_scale.growth_interval,
                          shard_optimizer=cfg.parallel.shard_optimizer, log_grad_norm=cfg.train.log_grad_norm,
                          prepare_input=source.device_input)
    abstract_state = jax.eval_shape(init_state)
    parallel = DataParallel(cfg.parallel.backend, mesh, graphdef, tx, schedule, abstract_state, options)
    return Built(cfg, source, parallel, init_state, abstract_state)
