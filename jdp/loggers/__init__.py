"""Experiment trackers beside metrics.jsonl and TensorBoard: `jdp.loggers.WandB` and `jdp.loggers.MLflow`, callbacks
for `fit(callbacks=...)`, or `metrics.loggers = "wandb,mlflow"` in a config (docs/trackers.md)."""

from __future__ import annotations

import ml_collections

from jdp.errors import UsageError
from jdp.loggers.base import Tracker, installed
from jdp.loggers.mlflow_logger import MLflow
from jdp.loggers.wandb_logger import WandB

# metrics.loggers's names; each logger is one module and one line here.
LOGGERS: dict[str, type[Tracker]] = {"wandb": WandB, "mlflow": MLflow}

__all__ = ["LOGGERS", "MLflow", "Tracker", "WandB", "from_config", "names"]


def names(spec: str) -> list[str]:
    """`metrics.loggers` ("wandb,mlflow") -> its names, each known and installed (UsageError otherwise)."""
    given = [name.strip() for name in spec.split(",") if name.strip()]
    for name in given:
        if name not in LOGGERS:
            raise UsageError(f"metrics.loggers={spec!r} names an unknown logger {name!r}; choose from "
                             f"{', '.join(LOGGERS)}, comma-separated (e.g. \"wandb,mlflow\")")
        if given.count(name) > 1:
            raise UsageError(f"metrics.loggers={spec!r} names {name} twice; name each logger once")
        package = LOGGERS[name].package
        if not installed(package):
            raise UsageError(f"metrics.loggers={spec!r}: the {name} logger needs the {package} package, which is not "
                             f"installed: pip install \"jdp[{name}]\"")
    return given


def from_config(metrics: ml_collections.ConfigDict) -> list[Tracker]:
    """The loggers a config's `metrics` section names."""
    return [LOGGERS[name].from_config(metrics) for name in names(metrics.loggers)]
