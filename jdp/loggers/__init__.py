"""Experiment trackers: `jdp.loggers.WandB` and `jdp.loggers.MLflow`, callbacks for `fit(callbacks=...)`, or
`metrics.loggers = "wandb,mlflow"` in a config (docs/trackers.md)."""

from __future__ import annotations

from jdp.loggers.base import Tracker
from jdp.loggers.mlflow_logger import MLflow
from jdp.loggers.wandb_logger import WandB

# metrics.loggers's names; each logger is one module and one line here.
LOGGERS: dict[str, type[Tracker]] = {"wandb": WandB, "mlflow": MLflow}

__all__ = ["LOGGERS", "MLflow", "Tracker", "WandB"]
