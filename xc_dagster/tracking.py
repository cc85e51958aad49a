"""MLflow tracking: one run per (dataset, stage) materialization, in one experiment per dataset.

Kept free of Dagster so scripts log the same way; the Dagster resource passes the tracking URI and the
run id to tag with. Each run records the process that owns it (host, pid, process start); a run still RUNNING
whose owner is gone (killed: OOM, SIGKILL) is ended as KILLED when the next tracked run starts
(docs/decisions.md#dead-run-sweep).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import re
import socket
import time
import warnings
from pathlib import Path
from typing import Any, Iterator

import mlflow
from mlflow.data.dataset_source_registry import resolve_dataset_source
from mlflow.data.http_dataset_source import HTTPDatasetSource
from mlflow.data.meta_dataset import MetaDataset
from mlflow.entities import InputTag, Metric, Param
from mlflow.tracking import MlflowClient

from xc_dagster.postgres import is_postgres_uri, is_sqlite_uri
from xc_dagster.remote_store import ROOT_ENV

_log = logging.getLogger(__name__)


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
    old_env = os.environ.get("MLFLOW_TRACKING_URI")
    old_uri = mlflow.get_tracking_uri() if mlflow.tracking.is_tracking_uri_set() else None
    old_uri = None if old_uri == old_env else old_uri  # a URI the variable gave: left to the variable again
    mlflow.set_tracking_uri(uri)
    try:
        yield
    finally:
        mlflow.set_tracking_uri(old_uri)  # None unsets the fluent URI (and the variable)
        if old_env is None:
            os.environ.pop("MLFLOW_TRACKING_URI", None)
        else:
            os.environ["MLFLOW_TRACKING_URI"] = old_env


@contextlib.contextmanager
def fluent_run(run_id: str) -> Iterator[None]:
    """Make ``run_id`` MLflow's active fluent run for the block (``log_model`` logs into it), unless it already is
    (the system-metrics sampler of :meth:`Tracker.run` resumes it too)."""
    active = mlflow.active_run()
    if active is not None and active.info.run_id == run_id:
        yield
        return
    with mlflow.start_run(run_id=run_id):
        yield


def prepare_tracking_store(uri: str) -> None:
    """Create a SQLite or PostgreSQL tracking store's tables and run its schema migrations, what MLflow does on a
    store's first use, by opening it through the public client. MLflow checks for its tables then creates them, which
    races: the home runs this once, in a child process (``xc_dagster.home.TRACKING_STORE_CMD``), under its first-use
    lock and, for PostgreSQL (shared by other hosts), under the database's advisory lock. Other stores are left alone:
    a tracking server migrates its own, another database (MySQL, MSSQL) is migrated by its operator."""
    if is_sqlite_uri(uri) or is_postgres_uri(uri):
        MlflowClient(tracking_uri=uri).search_experiments(max_results=1)


def experiment_name(dataset: str) -> str:
    return f"xc-dagster/{dataset}"


PARENT_TAG = "xc.dagster_run_id"  # on the parent run of one Dagster run's stage runs
PARENT_STAGES = ("evaluate",)  # stages whose final numbers the parent run shows too (compare pipelines at a glance)
SYSTEM_METRICS_ENV = "XC_MLFLOW_SYSTEM_METRICS"  # 1: MLflow samples CPU/GPU/memory into each stage run (psutil)
DATA_CONTEXT = "mlflow.data.context"
PARENT_TAGS = ("strategy", "preset")  # a stage run's tags its parent run takes
PARENT_SETTLE_S = 0.5  # a parent's creator looks for racers this long after its create (see Tracker.parent_run)


def _oldest(runs: list) -> Any:
    """The run every racer keeps: the oldest start time, then the smallest id."""
    return min(runs, key=lambda r: (r.info.start_time, r.info.run_id))


def mlflow_dataset(name: str, digest: str, source: str) -> MetaDataset:
    """The dataset as MLflow's Dataset: its catalog name, a digest of its data and where it was read from (a local
    path, an http(s) URL, any URI MLflow resolves; another source is recorded as a URL-like string)."""
    with warnings.catch_warnings():  # "can be interpreted in multiple ways": MLflow picks one, which is fine here
        warnings.simplefilter("ignore", UserWarning)
        try:
            src = resolve_dataset_source(source)
        except mlflow.exceptions.MlflowException:
            src = HTTPDatasetSource(source)
    return MetaDataset(src, name=name, digest=digest[:32])  # MLflow keeps at most 36 characters of a digest


class RunLogger:
    """Handle on an active MLflow run: step metrics, final metrics, artifacts, its dataset."""

    def __init__(self, client: MlflowClient, run_id: str, parent_id: str | None = None, mirror: bool = False):
        self.client = client
        self.run_id = run_id
        self.parent_id = parent_id  # the Dagster run's parent run, if any
        self.mirror = mirror  # final numbers go to the parent run too

    def log_metrics(self, step: int, values: dict[str, float]) -> None:
        ts = int(time.time() * 1000)
        ms = [Metric(k, float(v), ts, int(step)) for k, v in values.items()
              if isinstance(v, (int, float)) and math.isfinite(float(v))]
        if ms:
            self.client.log_batch(self.run_id, metrics=ms)

    def log_final(self, values: dict[str, Any]) -> None:
        numbers = {k: v for k, v in values.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        self.log_metrics(0, numbers)
        if self.mirror and self.parent_id:
            RunLogger(self.client, self.parent_id).log_metrics(0, numbers)

    def log_dataset(self, dataset: MetaDataset, context: str) -> None:
        """Record ``dataset`` as this run's (and its parent's) input, with MLflow's context tag (train, test)."""
        entity = mlflow.data.DatasetEntity(**dataset.to_dict())
        for rid in filter(None, (self.run_id, self.parent_id)):
            self.client.log_inputs(rid, [mlflow.data.DatasetInput(entity, tags=[InputTag(DATA_CONTEXT, context)])])

    def log_artifact(self, path: Path, subdir: str | None = None) -> None:
        self.client.log_artifact(self.run_id, str(path), subdir)

    def log_dict(self, obj: Any, name: str) -> None:
        self.client.log_dict(self.run_id, obj, name)

    def log_figure(self, fig, name: str) -> None:
        self.client.log_figure(self.run_id, fig, name)


class Tracker:
    """Creates runs in ``experiment_name(dataset)`` on the given tracking store."""

    def __init__(self, tracking_uri: str, artifact_root: Path | None = None, remote_root: str | None = None):
        """``artifact_root``: the local folder of new experiments' artifacts (a folder per dataset).
        ``remote_root``: the artifact root that replaces it, default ``XC_ARTIFACT_ROOT``
        (:data:`xc_dagster.remote_store.ROOT_ENV`; '' or unset: none), any URI MLflow writes (s3://, gs://, a path);
        new experiments then keep their artifacts under ``<remote_root>/mlflow/<dataset>``."""
        self.tracking_uri = tracking_uri
        self.artifact_root = Path(artifact_root) if artifact_root else None
        remote = os.environ.get(ROOT_ENV, "") if remote_root is None else remote_root
        self.remote_root = remote.strip().rstrip("/") or None
        self.client = MlflowClient(tracking_uri=tracking_uri)

    def experiment_id(self, dataset: str) -> str:
        """The dataset's experiment, created on first use with its artifact location under the remote root, else
        the local artifact root, else the tracking store's default (an existing experiment keeps its own)."""
        name = experiment_name(dataset)
        exp = self.client.get_experiment_by_name(name)
        if exp is not None:
            return exp.experiment_id
        location = None
        if self.remote_root is not None:
            location = (f"{self.remote_root}/mlflow/{dataset}" if "://" in self.remote_root
                        else (Path(self.remote_root) / "mlflow" / dataset).resolve().as_uri())
        elif self.artifact_root is not None and "://" not in str(self.artifact_root):
            location = (self.artifact_root / dataset).resolve().as_uri()
        try:
            return self.client.create_experiment(name, artifact_location=location)
        except mlflow.exceptions.MlflowException:  # created concurrently
            return self.client.get_experiment_by_name(name).experiment_id

    def _log_params(self, run_id: str, params: dict[str, Any]) -> None:
        items = [Param(k, _param_str(v)) for k, v in params.items()]
        for i in range(0, len(items), 100):
            self.client.log_batch(run_id, params=items[i:i + 100])

    def parent_run(self, experiment_id: str, dataset: str, dagster_run_id: str, tags: dict[str, str]) -> str:
        """The parent run of one Dagster run (tag :data:`PARENT_TAG`), created by its first stage with ``tags``
        (no params: a stage's run config changes its own section only, so the stage runs hold the params). Steps
        of a run may start together in several processes: each creator then looks again, all keep the oldest, and
        a creator whose run is not it deletes its own. It looks again PARENT_SETTLE_S after its create, not at once:
        a racer's start time is taken before its insert, which can wait on the store's write lock (SQLite), so an
        older run could land after a creator had looked, each then keeping its own (seen once in a suite run). A
        stage that finds a parent run younger than twice that looks again once it is that old, after its creator
        has looked (``_settled``): taken at once, it could be a creator's run about to be deleted (seen once)."""
        flt = f"tags.`{PARENT_TAG}` = '{dagster_run_id}'"
        found = self.client.search_runs([experiment_id], flt, max_results=50)
        if not found:
            mine = self.client.create_run(experiment_id, tags={
                **tags, PARENT_TAG: dagster_run_id, "dagster_run_id": dagster_run_id, "dataset": dataset,
                "xc.kind": "pipeline", "mlflow.runName": f"dagster-{dagster_run_id[:8]}"})
            time.sleep(PARENT_SETTLE_S)
            found = self.client.search_runs([experiment_id], flt, max_results=50)
            keep = _oldest(found)
            if keep.info.run_id != mine.info.run_id:
                self.client.delete_run(mine.info.run_id)
            return keep.info.run_id
        return self._settled(experiment_id, flt, found).info.run_id

    def _settled(self, experiment_id: str, flt: str, found: list) -> Any:
        """The oldest of ``found``, searched again once it is 2 x PARENT_SETTLE_S old (its creator has looked for
        racers by then unless its insert waited longer than PARENT_SETTLE_S); at once when it is older."""
        wait = _oldest(found).info.start_time / 1000 + 2 * PARENT_SETTLE_S - time.time()
        if wait > 0:
            time.sleep(wait)
            found = self.client.search_runs([experiment_id], flt, max_results=50) or found
        return _oldest(found)

    @contextlib.contextmanager
    def run(self, dataset: str, stage: str, params: dict[str, Any], tags: dict[str, str]) -> Iterator[RunLogger]:
        """Open a run tagged with dataset, stage and its owner process; FAILED status if the body raises. First ends
        the runs of this host whose owner process died (:func:`end_dead_runs`).

        With a ``dagster_run_id`` tag the run is nested (``mlflow.parentRunId``) under that Dagster run's parent
        run, which is RUNNING while a stage runs and ends with the last stage's status. With
        ``$XC_MLFLOW_SYSTEM_METRICS=1`` MLflow samples the system's metrics into the run while it is open."""
        try:
            end_dead_runs(self.client)
        except mlflow.exceptions.MlflowException as exc:  # a courtesy to killed runs: never fails this one
            _log.warning("could not end the runs of dead processes: %s", exc)
        exp = self.experiment_id(dataset)
        parent = (self.parent_run(exp, dataset, tags["dagster_run_id"], {k: tags[k] for k in PARENT_TAGS if k in tags})
                  if tags.get("dagster_run_id") else None)
        all_tags = {"dataset": dataset, "asset": stage, "mlflow.runName": f"{stage}", **tags, **owner_tags(),
                    **({"mlflow.parentRunId": parent} if parent else {})}
        rid = self.client.create_run(exp, tags=all_tags).info.run_id
        self._log_params(rid, params)
        if parent:
            self.client.update_run(parent, status="RUNNING")
        status = "FAILED"
        try:
            with self._system_metrics(rid):
                yield RunLogger(self.client, rid, parent, mirror=stage in PARENT_STAGES)
            status = "FINISHED"
        finally:
            self.client.set_terminated(rid, status)
            if parent:
                self.client.set_terminated(parent, status)

    @contextlib.contextmanager
    def _system_metrics(self, run_id: str) -> Iterator[None]:
        """MLflow's system-metrics sampler on the run while the block runs, when switched on (public API: the
        fluent run, resumed for the block)."""
        if os.environ.get(SYSTEM_METRICS_ENV, "").strip().lower() not in ("1", "true", "yes", "on"):
            yield
            return
        with use_tracking_uri(self.tracking_uri), mlflow.start_run(run_id=run_id, log_system_metrics=True):
            yield


def _param_str(v: Any) -> str:
    s = ",".join(map(str, v)) if isinstance(v, (tuple, list)) else str(v)
    return s[:6000]


OWNER_HOST, OWNER_PID, OWNER_PROCESS = "xc.owner.host", "xc.owner.pid", "xc.owner.process"
ENDED_BY = "xc.ended_by"  # why a run was ended by another process than its owner
HAS_PROC = Path("/proc/self/stat").exists()  # Linux: process start times and pid namespaces are readable


def _read(path: str) -> str:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return ""


def _scope() -> str:
    """``<boot id>/<pid namespace>``: where pids of this host are comparable ('' without /proc)."""
    if not HAS_PROC:
        return ""
    try:
        ns = os.readlink("/proc/self/ns/pid")
    except OSError:
        ns = ""
    return f"{_read('/proc/sys/kernel/random/boot_id')}/{ns}"


def _start_ticks(pid: int) -> str | None:
    """The process's start time (clock ticks since boot, /proc/<pid>/stat field 22); None when it is gone or a
    zombie (dead, not yet reaped by its parent)."""
    stat = _read(f"/proc/{pid}/stat")
    if not stat:
        return None
    fields = stat[stat.rindex(")") + 2:].split()  # after the command name, which may hold spaces
    return None if fields[0] in ("Z", "X") else fields[19]


def owner_tags(pid: int | None = None) -> dict[str, str]:
    """The tags that name a run's owning process: host, pid and ``<scope>/<start ticks>`` (a reused pid has
    another start time)."""
    pid = os.getpid() if pid is None else pid
    ticks = _start_ticks(pid) if HAS_PROC else ""
    return {OWNER_HOST: socket.gethostname(), OWNER_PID: str(pid), OWNER_PROCESS: f"{_scope()}/{ticks or ''}"}


def owner_alive(tags: dict[str, str]) -> bool | None:
    """Whether a run's owner process still runs; None when this process cannot tell (another host or pid
    namespace, or a run without owner tags)."""
    host, pid, process = tags.get(OWNER_HOST), tags.get(OWNER_PID, ""), tags.get(OWNER_PROCESS, "")
    if host != socket.gethostname() or not pid.isdigit():
        return None
    scope, _, ticks = process.rpartition("/")
    if scope != _scope():
        boot, here = scope.split("/")[0], _scope().split("/")[0]
        return False if boot and here and boot != here else None  # rebooted since: every process of then is gone
    if HAS_PROC:
        return _start_ticks(int(pid)) == ticks
    try:
        os.kill(int(pid), 0)  # signal 0: only checks that the pid exists
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, another user's
        return True
    return True


def _running_runs(client: MlflowClient) -> Iterator[Any]:
    """Every RUNNING run of this host's owners, in every active experiment."""
    ids, token = [], None
    while True:
        page = client.search_experiments(max_results=1000, page_token=token)
        ids += [e.experiment_id for e in page]
        token = page.token
        if not token:
            break
    host = socket.gethostname().replace("'", "")
    query = f"attributes.status = 'RUNNING' AND tags.`{OWNER_HOST}` = '{host}'"
    for i in range(0, len(ids), 100):
        token = None
        while True:
            page = client.search_runs(ids[i:i + 100], query, max_results=1000, page_token=token)
            yield from page
            token = page.token
            if not token:
                break


def end_dead_runs(client: MlflowClient) -> list[str]:
    """End as KILLED each RUNNING run whose owner process is gone (a killed step never ends its run); runs of
    live processes, and of processes this one cannot see, are left alone. Returns the ended run ids."""
    ended = []
    for run in _running_runs(client):
        tags = run.data.tags
        if owner_alive(tags) is False:
            rid = run.info.run_id
            # read again now that the owner is gone: a run it ended between the search and its exit stays as it
            # ended it (an owner that is gone writes nothing more, so this read is its last word)
            if client.get_run(rid).info.status != "RUNNING":
                continue
            client.set_tag(rid, ENDED_BY, f"owner process {tags[OWNER_PID]} on {tags[OWNER_HOST]} was gone "
                                          f"(ended by process {os.getpid()})")
            client.set_terminated(rid, "KILLED")
            ended.append(rid)
    return ended
