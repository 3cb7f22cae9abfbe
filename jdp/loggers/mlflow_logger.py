"""`jdp.loggers.MLflow`: metrics.jsonl's lines into an MLflow run (`pip install "jdp[mlflow]"`, the mlflow-skinny
client: a local `file:` store or a tracking server; `sqlite:` stores need the full `mlflow` package)."""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from typing import Any

from jdp.errors import UsageError
from jdp.loggers.base import CLOSE_TIMEOUT_S, Tracker, flatten, numbers

MAX_KEY, MAX_VALUE = 250, 6000  # MLflow's limits on a param's key and value


def tracking_uri_problem(uri: str) -> str | None:
    """Why `uri` is no tracking URI (neither `SCHEME://...`, `file:...` nor a path without a colon), or None."""
    if "://" in uri or uri.startswith("file:") or ":" not in uri:
        return None
    return ("is neither a URI (SCHEME://..., e.g. http://HOST:5000) nor a path; give a tracking server's URI, "
            "file:./mlruns, or a directory")


class MLflow(Tracker):
    """metrics.jsonl's lines into an MLflow run, continued by a rerun (docs/trackers.md). `tracking_uri`: None =
    `MLFLOW_TRACKING_URI`, else `file:./mlruns`; `experiment`: None = `MLFLOW_EXPERIMENT_NAME`, else `Default`."""

    name = package = "mlflow"

    def __init__(self, tracking_uri: str | None = None, experiment: str | None = None, *,
                 close_timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        super().__init__(close_timeout_s=close_timeout_s)
        for name, value in (("tracking_uri", tracking_uri), ("experiment", experiment)):
            if value is not None and not isinstance(value, str):
                raise UsageError(f"MLflow({name}={value!r}) must be a string, or None")
        if tracking_uri and tracking_uri_problem(tracking_uri):
            raise UsageError(f"MLflow(tracking_uri={tracking_uri!r}) {tracking_uri_problem(tracking_uri)}")
        self.tracking_uri, self.experiment = tracking_uri, experiment

    def on_start(self, start: int, workdir: Path | None, record: dict[str, Any] | None) -> None:
        self.close()  # a first fit's run ends on its own store, before this one's is chosen
        uri = self.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or (Path.cwd() / "mlruns").as_uri()
        if "://" not in uri and not uri.startswith("file:"):
            uri = Path(uri).absolute().as_uri()  # a plain path is a file store
        if uri.startswith("file:"):  # MLflow >= 3.13 refuses file stores unless told they are wanted
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.uri = uri
        super().on_start(start, workdir, record)

    def _stored_run(self, run_id: str | None) -> Any:
        """The MLflow run `run_id` (a new client on the store), or None where the store has none by that id."""
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(self.uri)
        try:
            return None if run_id is None else self.client.get_run(run_id)
        except MlflowException:
            return None

    def _logged(self) -> dict[str, int]:
        # As MLflow answers (a kill may have come between a mark and its send), over every key of a split.
        run_id = self.state.get("run_id")
        if (stored := self._stored_run(run_id)) is None:
            return {}
        marks, keys = super()._logged(), list(stored.data.metrics)
        for split, ours in (("train", lambda k: not k.startswith(("eval_", "summary/"))),
                            ("eval", lambda k: k.startswith("eval_"))):
            marks[split] = max((m.step for key in filter(ours, keys)
                                for m in self.client.get_metric_history(run_id, key)), default=-1)
        return marks

    def _open(self, run_id: str | None) -> str:
        from mlflow.entities import Param
        from mlflow.exceptions import MlflowException

        params = {key[:MAX_KEY]: str(value)[:MAX_VALUE] for key, value in flatten(self.params()).items()}
        stored = self._stored_run(run_id)
        if stored is None:
            name = self.experiment or os.environ.get("MLFLOW_EXPERIMENT_NAME")
            if name and self.client.get_experiment_by_name(name) is None:
                with contextlib.suppress(MlflowException):  # created meanwhile by another run: found below
                    self.client.create_experiment(name)
            experiment_id = self.client.get_experiment_by_name(name).experiment_id if name else "0"
            tags = {"jdp.workdir": str(self.workdir)} if self.workdir is not None else {}
            run_id = self.client.create_run(experiment_id, run_name=self.workdir.name if self.workdir else None,
                                            tags=tags).info.run_id
            logged, prefix = {}, ""
        else:
            logged = stored.data.params
            self.client.update_run(run_id, status="RUNNING")
            # Params cannot change: a second resume from the same step gets a prefix of its own.
            prefix, n = f"resume_{self.start}", 1
            while any(key.startswith(f"{prefix}.") for key in logged):
                n += 1
                prefix = f"resume_{self.start}_{n}"
        self.run_id = run_id
        self.client.log_batch(run_id, params=[Param(f"{prefix}.{key}"[:MAX_KEY] if key in logged else key, value)
                                              for key, value in params.items() if logged.get(key) != value])
        return run_id

    def _log(self, split: str, step: int, line: dict[str, Any]) -> None:
        from mlflow.entities import Metric

        prefix = {"train": "", "eval": "eval_", "summary": "summary/"}[split]
        stamp = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(key, value, stamp, step)
                                                    for key, value in numbers(line, prefix).items()])

    def _close(self, ok: bool) -> None:
        self.client.set_terminated(self.run_id, "FINISHED" if ok else "KILLED")
