"""MLflow tracking: one run per (dataset, stage) materialization, in one experiment per dataset.

Kept free of Dagster so scripts log the same way; the Dagster resource passes the tracking URI and the
run id to tag with.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import time
from pathlib import Path
from typing import Any, Iterator

import mlflow
from mlflow.entities import Metric, Param
from mlflow.tracking import MlflowClient
from mlflow.tracking._tracking_service import utils as tracking_utils


def model_name(dataset: str) -> str:
    """The registered model name of a dataset: ``xc-<dataset>``, characters other than [A-Za-z0-9._-]
    replaced by '-' (names go into ``models:/<name>@<alias>`` URIs)."""
    return "xc-" + re.sub(r"[^A-Za-z0-9._-]+", "-", dataset).strip("-")


@contextlib.contextmanager
def use_tracking_uri(uri: str) -> Iterator[None]:
    """Point MLflow's fluent API (start_run, log_model, load_model of ``models:/``) at ``uri`` for a while.

    ``mlflow.set_tracking_uri`` also exports ``MLFLOW_TRACKING_URI`` (MLflow 3), which would outlive the
    call and redirect every later tracker of the process (``Home.mlflow_uri`` reads it): both are restored.
    """
    old_uri = getattr(tracking_utils, "_tracking_uri", None)
    old_env = os.environ.get("MLFLOW_TRACKING_URI")
    mlflow.set_tracking_uri(uri)
    try:
        yield
    finally:
        tracking_utils.set_tracking_uri(old_uri)  # None unsets the fluent URI (and the variable)
        if old_env is None:
            os.environ.pop("MLFLOW_TRACKING_URI", None)
        else:
            os.environ["MLFLOW_TRACKING_URI"] = old_env


def experiment_name(dataset: str) -> str:
    return f"xc-dagster/{dataset}"


class RunLogger:
    """Handle on an active MLflow run: step metrics, final metrics, artifacts."""

    def __init__(self, client: MlflowClient, run_id: str):
        self.client = client
        self.run_id = run_id

    def log_metrics(self, step: int, values: dict[str, float]) -> None:
        ts = int(time.time() * 1000)
        ms = [Metric(k, float(v), ts, int(step)) for k, v in values.items()
              if isinstance(v, (int, float)) and math.isfinite(float(v))]
        if ms:
            self.client.log_batch(self.run_id, metrics=ms)

    def log_final(self, values: dict[str, Any]) -> None:
        self.log_metrics(0, {k: v for k, v in values.items() if isinstance(v, (int, float))
                             and not isinstance(v, bool)})

    def log_artifact(self, path: Path, subdir: str | None = None) -> None:
        self.client.log_artifact(self.run_id, str(path), subdir)

    def log_dict(self, obj: Any, name: str) -> None:
        self.client.log_dict(self.run_id, obj, name)

    def log_figure(self, fig, name: str) -> None:
        self.client.log_figure(self.run_id, fig, name)


class Tracker:
    """Creates runs in ``experiment_name(dataset)`` on the given tracking store."""

    def __init__(self, tracking_uri: str, artifact_root: Path | None = None):
        self.tracking_uri = tracking_uri
        self.artifact_root = Path(artifact_root) if artifact_root else None
        self.client = MlflowClient(tracking_uri=tracking_uri)

    def experiment_id(self, dataset: str) -> str:
        name = experiment_name(dataset)
        exp = self.client.get_experiment_by_name(name)
        if exp is not None:
            return exp.experiment_id
        location = None
        if self.artifact_root is not None and "://" not in str(self.artifact_root):
            location = (self.artifact_root / dataset).resolve().as_uri()
        try:
            return self.client.create_experiment(name, artifact_location=location)
        except mlflow.exceptions.MlflowException:  # created concurrently
            return self.client.get_experiment_by_name(name).experiment_id

    @contextlib.contextmanager
    def run(self, dataset: str, stage: str, params: dict[str, Any], tags: dict[str, str]) -> Iterator[RunLogger]:
        """Open a run tagged with dataset and stage; FAILED status if the body raises."""
        exp = self.experiment_id(dataset)
        all_tags = {"dataset": dataset, "asset": stage, "mlflow.runName": f"{stage}", **tags}
        run = self.client.create_run(exp, tags=all_tags)
        rid = run.info.run_id
        items = [Param(k, _param_str(v)) for k, v in params.items()]
        for i in range(0, len(items), 100):
            self.client.log_batch(rid, params=items[i:i + 100])
        try:
            yield RunLogger(self.client, rid)
        except BaseException:
            self.client.set_terminated(rid, "FAILED")
            raise
        self.client.set_terminated(rid, "FINISHED")


def _param_str(v: Any) -> str:
    s = ",".join(map(str, v)) if isinstance(v, (tuple, list)) else str(v)
    return s[:6000]

