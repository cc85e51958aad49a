"""Retraining automation: the click-log sensor over successive drops (build_sensor_context), the retrain
schedule (build_schedule_context), and the UI path -- `dagster dev` (webserver + daemon) launching a
partitioned materialization through the GraphQL API, as the UI does."""

from __future__ import annotations

import gzip
import json
import os
import sys
import time
from pathlib import Path

import dagster as dg
import mlflow
import pandas as pd
import pytest

from resources.clicklogs import ClickLogFeedResource
from resources.home import XCHomeResource
from tests.tinydata import (
    free_port,
    graphql,
    ready_home,
    start_server,
    stop_process_group,
    wait_for,
    write_lf_dataset,
)
from xc_dagster.catalog import Catalog, DatasetSpec
from xc_dagster.cli import main as cli_main
from xc_dagster.errors import XCError
from xc_dagster.home import Home
from xc_dagster.pipeline import StageContext, run_all
from xc_dagster.serving import retraining, source_changes
from xc_dagster.storage import ArtifactStore

REPO = Path(__file__).resolve().parent.parent
WORDS = ["apple", "river", "stone", "cloud", "music", "paper", "glass", "horse"]


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("XC_HOME", str(tmp_path / "home"))
    for var in ("MLFLOW_TRACKING_URI", retraining.ENV_ROOT, "XC_RETRAIN_CRON", "XC_RETRAIN_TIMEZONE"):
        monkeypatch.delenv(var, raising=False)
    return ready_home(tmp_path / "home")


def write_drop(path: Path, day: int, n: int = 12, offset: int = 0) -> Path:
    """A click-log file of ``n`` queries on 2024-01-<day>; label texts from WORDS (a learnable toy)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = [{"query": f"{WORDS[i % 8]} {WORDS[(i + 3) % 8]} q{offset + i}", "label": WORDS[(i + k) % 8],
             "clicks": 1 + k, "timestamp": f"2024-01-{day:02d}T{i % 24:02d}:00:00Z"}
            for i in range(n) for k in range(2)]
    if path.name.endswith(".parquet"):
        pd.DataFrame(rows).to_parquet(path, index=False)
    else:
        data = "".join(json.dumps(r) + "\n" for r in rows).encode()
        path.write_bytes(gzip.compress(data) if path.name.endswith(".gz") else data)
    return path


def _tick(defs: dg.Definitions, home: Home, cursor: str | None, instance: dg.DagsterInstance, **feed):
    """One sensor evaluation, as the daemon runs it (run requests resolved against the job's partitions)."""
    # with the instance's ref, as the daemon builds it: run requests may name partitions the tick adds
    with dg.build_sensor_context(instance=instance, instance_ref=instance.get_ref(), cursor=cursor, definitions=defs,
                                 resources={"home": XCHomeResource(root=str(home.root)),
                                            "clicklogs": ClickLogFeedResource(**{"settle_seconds": 0, **feed})}) as ctx:
        res = defs.resolve_sensor_def("click_log_sensor").evaluate_tick(ctx)
    for req in res.dynamic_partitions_requests or []:  # as the daemon does, before the run requests
        instance.add_dynamic_partitions(req.partitions_def_name, list(req.partition_keys))
    return res


# ------------------------------------------------------------------------------------------- sensor

def test_click_log_sensor_over_two_drops(home):
    from xc_dagster.definitions import build_definitions

    inbox = home.root / retraining.INBOX
    write_drop(inbox / "shop" / "2024-01-01.parquet", day=1)
    write_drop(inbox / "shop" / "more" / "2024-01-02.jsonl.gz", day=2, offset=100)
    (inbox / "shop" / "_SUCCESS").write_text("")  # upload markers and other files are not click logs
    (inbox / "shop" / ".2024-01-03.jsonl.part").write_text("half written")
    (inbox / "bad name!").mkdir()
    defs = build_definitions(home)
    assert defs.resolve_job_def("xc_pipeline").partitions_def.name == "datasets"  # dynamic: keys in the instance
    sensor = defs.resolve_sensor_def("click_log_sensor")
    assert sensor.default_status == dg.DefaultSensorStatus.STOPPED
    instance = dg.DagsterInstance.local_temp()

    # first drop: two files -> one dataset folder, a catalog entry, one run request for the partition
    first = _tick(defs, home, None, instance)
    assert len(first.run_requests) == 1
    # a feed not yet a partition: its partition is added with the run request (no reload of the definitions)
    assert [(r.partitions_def_name, list(r.partition_keys)) for r in first.dynamic_partitions_requests] == \
        [("datasets", ["shop"])]
    assert instance.get_dynamic_partitions("datasets") == ["shop"]
    req = first.run_requests[0]
    assert req.partition_key == "shop" and req.tags["dagster/partition"] == "shop"
    assert req.tags["xc/trigger"] == "click_log_sensor" and req.tags["xc/new_files"] == "2"
    folder1 = Path(req.tags["xc/clicklog_folder"])
    assert folder1.parent == home.root / "clicklogs" / "shop" and (folder1 / "label_map.json").is_file()
    spec = Catalog(home.catalog).get("shop")
    assert spec.source == str(folder1) and spec.layout == "lf-raw" and spec.text == "title"
    seen = json.loads(first.cursor)["seen"]["shop"]
    assert sorted(seen) == ["2024-01-01.parquet", "more/2024-01-02.jsonl.gz"]
    summary1 = json.loads((folder1 / "clicklog.json").read_text())
    assert summary1["n_queries"] == 24 and summary1["rows_read"] == 48
    assert spec.overrides == {"pretrain.warm_start": "champion"}  # a new entry: retrains warm-start

    # the same files again: nothing to do, cursor unchanged
    again = _tick(defs, home, first.cursor, instance)
    assert again.run_requests == [] and again.cursor == first.cursor
    assert "no new click-log files" in again.skip_message

    # keep a custom option on the entry: a later drop updates the source and keeps it
    spec.overrides = {"pretrain.epochs": 2}
    Catalog(home.catalog).add(spec, replace=True)

    # second drop (arriving with an older mtime than the first: out of order) -> a new run request
    f3 = write_drop(inbox / "shop" / "2024-01-03.jsonl", day=3, offset=200)
    os.utime(f3, (1_000_000_000, 1_000_000_000))
    second = _tick(defs, home, first.cursor, instance)
    assert len(second.run_requests) == 1 and not second.dynamic_partitions_requests  # known now
    req2 = second.run_requests[0]
    assert req2.run_key != req.run_key and req2.tags["xc/new_files"] == "1"
    folder2 = Path(req2.tags["xc/clicklog_folder"])
    assert folder2 != folder1 and folder1.is_dir()  # earlier windows are kept
    spec2 = Catalog(home.catalog).get("shop")
    # the entry keeps its options; retrains warm-start from the champion unless the entry says otherwise
    assert spec2.source == str(folder2)
    assert spec2.overrides == {"pretrain.epochs": 2, "pretrain.warm_start": "champion"}
    labels1 = json.loads((folder1 / "label_map.json").read_text())["labels"]
    labels2 = json.loads((folder2 / "label_map.json").read_text())["labels"]
    assert {k: labels2[k] for k in labels1} == labels1  # label ids continue across drops
    assert json.loads((folder2 / "clicklog.json").read_text())["rows_read"] == 24  # only the new file
    assert "2024-01-03.jsonl" in json.loads(second.cursor)["seen"]["shop"]

    # a bad file: the tick fails naming file and line; nothing consumed; fixed, it is taken
    bad = inbox / "shop" / "2024-01-04.csv"
    bad.write_text("query,label,clicks,timestamp\nred shoes,shoe,1,2024-01-04\nblue,hat,1,yesterday\n")
    with pytest.raises(Exception, match=r"2024-01-04\.csv:3: expected 'timestamp' as ISO-8601") as e:
        _tick(defs, home, second.cursor, instance)
    assert "click-log sensor" in str(e.value)
    assert Catalog(home.catalog).get("shop").source == str(folder2)
    bad.write_text("query,label,clicks,timestamp\nred shoes,shoe,1,2024-01-04\nblue,hat,1,2024-01-05\n")
    fixed = _tick(defs, home, second.cursor, instance)
    assert [r.partition_key for r in fixed.run_requests] == ["shop"]
    assert json.loads(fixed.cursor)["seen"]["shop"]["2024-01-04.csv"][0] == bad.stat().st_size


def test_sensor_waits_for_new_folders_running_partitions_and_settling(home, monkeypatch):
    from xc_dagster.definitions import build_definitions

    inbox = home.root / retraining.INBOX
    write_drop(inbox / "shop" / "a.jsonl", day=1)
    defs = build_definitions(home)
    instance = dg.DagsterInstance.local_temp()
    # a feed folder created after the definitions loaded: taken at once, its partition added by the tick
    write_drop(inbox / "late" / "a.jsonl", day=1)
    # a queued or running run of a partition holds its drops back
    instance.add_run(dg.DagsterRun(job_name="xc_pipeline", run_id="r1", status=dg.DagsterRunStatus.STARTED,
                                   tags={"dagster/partition": "shop"}))
    res = _tick(defs, home, None, instance)
    assert [r.partition_key for r in res.run_requests] == ["late"]
    assert [list(r.partition_keys) for r in res.dynamic_partitions_requests] == [["late"]]
    assert "late" in Catalog(home.catalog).load() and "shop" not in json.loads(res.cursor)["seen"]
    # after the run's end, the held drop is taken
    instance.delete_run("r1")
    res = _tick(defs, home, res.cursor, instance)
    assert [r.partition_key for r in res.run_requests] == ["shop"]
    # files still being written (modified within settle_seconds) wait
    write_drop(inbox / "shop" / "b.jsonl", day=2)
    res2 = _tick(defs, home, res.cursor, instance)  # settle 0: taken
    assert len(res2.run_requests) == 1
    write_drop(inbox / "shop" / "c.jsonl", day=3)
    res3 = _tick(defs, home, res2.cursor, instance, settle_seconds=3600)
    assert res3.run_requests == [] and "waiting for them to settle" in res3.skip_message


def test_sensor_reads_an_fsspec_feed_root(home, monkeypatch):
    """A remote root ($XC_CLICKLOG_ROOT; here fsspec's in-memory filesystem): files are listed with fsspec
    and copied locally; its dataset folders are partitions."""
    import fsspec

    from xc_dagster.definitions import build_definitions

    fs = fsspec.filesystem("memory")
    local = write_drop(home.root / "tmp" / "d1.jsonl", day=1)
    fs.pipe("/xc-feed/remote/2024/d1.jsonl", local.read_bytes())
    fs.pipe("/xc-feed/remote/notes.txt", b"ignored")
    try:
        root = "memory://xc-feed"
        monkeypatch.setenv(retraining.ENV_ROOT, root)
        listing = retraining.list_feeds(root)
        assert list(listing.feeds) == ["remote"] and list(listing.feeds["remote"]) == ["2024/d1.jsonl"]
        defs = build_definitions(home)
        res = _tick(defs, home, None, dg.DagsterInstance.local_temp())
        assert [r.partition_key for r in res.run_requests] == ["remote"]
        folder = Path(res.run_requests[0].tags["xc/clicklog_folder"])
        assert json.loads((folder / "clicklog.json").read_text())["n_queries"] == 12
        assert not (home.cache / "clicklog-feeds" / "remote").exists() or \
            not any((home.cache / "clicklog-feeds" / "remote").iterdir())
    finally:
        fs.rm("/xc-feed", recursive=True)


def test_a_feed_whose_build_raises_leaves_the_other_feeds_running(home, monkeypatch):
    """Any exception from one feed's build (not only an XCError) is that feed's: logged and not consumed, while
    the feeds built before and after it in the same tick are requested and consumed."""
    import assets.automation as automation
    from xc_dagster.definitions import build_definitions

    inbox = home.root / retraining.INBOX
    for name in ("alpha", "beta", "shop"):
        write_drop(inbox / name / "a.jsonl", day=1)
    real = automation.build_drop

    def build_drop(h, root, drop, **kw):
        if drop.name == "beta":
            raise RuntimeError("disk on fire")
        return real(h, root, drop, **kw)

    monkeypatch.setattr(automation, "build_drop", build_drop)
    defs = build_definitions(home)
    instance = dg.DagsterInstance.local_temp()
    res = _tick(defs, home, None, instance)
    assert [r.partition_key for r in res.run_requests] == ["alpha", "shop"]
    assert sorted(json.loads(res.cursor)["seen"]) == ["alpha", "shop"]  # beta's file is retried
    with pytest.raises(Exception, match=r"click-log sensor.*beta: RuntimeError: disk on fire"):
        _tick(defs, home, res.cursor, instance)  # alone, it fails the tick with the feed and the error


def test_pending_drops_and_cursor_unit():
    sig = retraining.FileSig
    listing = retraining.FeedListing("/r", feeds={"a": {"x.csv": sig(10, "1", 1.0), "y.csv": sig(5, "2", 2.0)}})
    drops, waiting = retraining.pending_drops(listing, {"a": {"x.csv": [10, "1"]}}, now=100.0)
    assert [list(d.new) for d in drops] == [["y.csv"]] and not waiting
    assert list(drops[0].files) == ["y.csv"] and drops[0].run_key.startswith("clicklogs:a:")
    (all_,), _ = retraining.pending_drops(listing, {"a": {"x.csv": [10, "1"]}}, now=100.0, history="all")
    assert sorted(all_.files) == ["x.csv", "y.csv"] and all_.digest == drops[0].digest
    # a changed file (same name, new size) is new again
    (d,), _ = retraining.pending_drops(listing, {"a": {"x.csv": [9, "1"], "y.csv": [5, "2"]}}, now=100.0)
    assert list(d.new) == ["x.csv"]
    with pytest.raises(XCError, match="cursor"):
        retraining.decode_cursor("{not json")
    with pytest.raises(XCError, match="history"):
        retraining.pending_drops(listing, {}, now=0.0, history="weekly")


# ----------------------------------------------------------------------------------------- schedule

def _ingest(home: Home, name: str) -> None:
    spec = Catalog(home.catalog).get(name)
    run_all(StageContext(ArtifactStore(home.artifacts), spec, spec.config(), home.cache), ("ingest",))


def test_retrain_schedule_requests_only_changed_partitions(home, tmp_path):
    from xc_dagster.definitions import build_definitions

    cat = Catalog(home.catalog)
    for name in ("Alpha", "Beta", "Gamma"):
        cat.add(DatasetSpec(name, str(write_lf_dataset(tmp_path / "src" / name, n_train=30, n_test=10)),
                            text="title"))
    cat.add(DatasetSpec("Packaged", "builtin:LF-WordNetNouns", text="title"))
    now = time.time()
    for f in (tmp_path / "src").rglob("*"):
        os.utime(f, (now - 200, now - 200))  # the sources were written ...
    for name in ("Alpha", "Beta", "Gamma"):
        _ingest(home, name)
        summary = home.artifacts / name / "ingest" / "summary.json"
        os.utime(summary, (now - 100, now - 100))  # ... then ingested
    (home.artifacts / "Packaged" / "ingest").mkdir(parents=True)  # as if ingested (builtin never changes)
    (home.artifacts / "Packaged" / "ingest" / "summary.json").write_text("{}")
    os.utime(tmp_path / "src" / "Alpha" / "trn.json.gz", (now, now))  # ... then Alpha's data changed in place
    moved = write_lf_dataset(tmp_path / "src" / "Gamma-v2", n_train=30, n_test=10)  # Gamma re-pointed
    cat.add(DatasetSpec("Gamma", str(moved), text="title"), replace=True)
    cat.add(DatasetSpec("Delta", str(tmp_path / "src" / "Beta"), text="title"))  # never ingested

    changes = {c.name: c for c in source_changes.changed_datasets(home)}
    assert {n for n, c in changes.items() if c.changed} == {"Alpha", "Gamma", "Delta"}
    # ingest records the source's fingerprint: an in-place edit and a moved source both change it
    assert "fingerprint differs" in changes["Alpha"].reason and "fingerprint differs" in changes["Gamma"].reason
    assert "unchanged (same fingerprint" in changes["Beta"].reason
    assert changes["Delta"].reason == "never ingested" and "unchanged" in changes["Beta"].reason

    defs = build_definitions(home)
    schedule = defs.resolve_schedule_def("retrain_schedule")
    assert schedule.cron_schedule == "0 3 * * *" and schedule.default_status == dg.DefaultScheduleStatus.STOPPED
    resources, repo = {"home": XCHomeResource(root=str(home.root))}, defs.get_repository_def()
    with dg.instance_for_test() as instance:  # schedules need a persistent instance
        with dg.build_schedule_context(instance=instance, resources=resources, repository_def=repo) as ctx:
            data = schedule.evaluate_tick(ctx)
        reqs = {r.partition_key: r for r in data.run_requests}
        assert set(reqs) == {"Alpha", "Gamma", "Delta"}
        assert reqs["Alpha"].tags["xc/trigger"] == "retrain_schedule"
        assert reqs["Alpha"].tags["dagster/partition"] == "Alpha" and reqs["Alpha"].run_key != reqs["Gamma"].run_key
        # a partition with a run in progress is not requested again; once re-ingested it is unchanged
        instance.add_run(dg.DagsterRun(job_name="xc_pipeline", run_id="r2", status=dg.DagsterRunStatus.STARTING,
                                       tags={"dagster/partition": "Delta"}))
        _ingest(home, "Alpha")
        _ingest(home, "Gamma")
        with dg.build_schedule_context(instance=instance, resources=resources, repository_def=repo) as ctx:
            data = schedule.evaluate_tick(ctx)
    assert data.run_requests == [] and "Delta: changed, but run r2" in data.skip_message
    # an ingest summary that records the source's fingerprint is compared exactly
    summary_path = home.artifacts / "Beta" / "ingest" / "summary.json"
    fp = source_changes.source_fingerprint(str(tmp_path / "src" / "Beta"))
    summary_path.write_text(json.dumps({**json.loads(summary_path.read_text()), "source_fingerprint": fp.digest}))
    assert not source_changes.data_changed(home, cat.get("Beta")).changed
    (tmp_path / "src" / "Beta" / "filter_labels_test.txt").write_text("0 1\n")  # same mtime second, new size
    assert source_changes.data_changed(home, cat.get("Beta")).changed

    assert cli_main(["retrain", "check"]) == 0


def test_schedule_cron_from_the_environment(home, monkeypatch):
    from xc_dagster.definitions import build_definitions

    monkeypatch.setenv("XC_RETRAIN_CRON", "*/15 * * * *")
    monkeypatch.setenv("XC_RETRAIN_TIMEZONE", "Europe/Berlin")
    schedule = build_definitions(home).resolve_schedule_def("retrain_schedule")
    assert schedule.cron_schedule == "*/15 * * * *" and schedule.execution_timezone == "Europe/Berlin"


# ------------------------------------------------------------------------------------------- the UI

LOCATIONS = """{ workspaceOrError { __typename ... on Workspace { locationEntries { name
  locationOrLoadError { __typename ... on RepositoryLocation { name repositories { name
    sensors { name sensorState { status } } schedules { name cronSchedule scheduleState { status } } } }
  ... on PythonError { message } } } } } }"""
LAUNCH = """mutation($p: ExecutionParams!) { launchPipelineExecution(executionParams: $p) { __typename
  ... on LaunchRunSuccess { run { runId } } ... on PythonError { message }
  ... on RunConfigValidationInvalid { errors { message } } ... on InvalidSubsetError { message }
  ... on PipelineNotFoundError { message } } }"""
RUN = """query($id: ID!) { runOrError(runId: $id) { __typename ... on Run { status tags { key value } } } }"""


def test_ui_launches_a_partitioned_materialization(home, tmp_path):
    """`dagster dev` (webserver + daemon) on a free local port, against a temporary DAGSTER_HOME and XC_HOME:
    the sensor and the schedule are listed STOPPED; the `dataset` asset of one partition is materialized
    through the GraphQL API (launchPipelineExecution with the partition tag, as the UI's Materialize
    button does) and the run ends SUCCESS."""
    Catalog(home.catalog).add(DatasetSpec("TinyUI", str(write_lf_dataset(tmp_path / "src", 30, 10)), text="title"))
    port = free_port()
    env = {**os.environ, "XC_HOME": str(home.root), "DAGSTER_HOME": str(home.dagster_home)}
    env.pop("MLFLOW_TRACKING_URI", None)
    exe = Path(sys.executable).parent / "dagster"
    log_path = tmp_path / "dagster-dev.log"
    proc = start_server([str(exe), "dev", "-m", "xc_dagster.definitions", "-h", "127.0.0.1", "-p", str(port)],
                        log_path, cwd=REPO, env=env)
    try:
        # meanwhile create the MLflow store's tables (seconds of migrations the run would otherwise spend)
        mlflow.MlflowClient(home.mlflow_uri).search_experiments()

        def loaded():
            entries = graphql(port, LOCATIONS)["workspaceOrError"]["locationEntries"]
            loc = entries[0]["locationOrLoadError"] if entries else None
            if loc and loc["__typename"] == "PythonError":
                raise AssertionError(loc["message"])
            return loc if loc and loc["__typename"] == "RepositoryLocation" else None

        loc = wait_for("code location loaded", loaded, 180, log_path, proc)
        repo = loc["repositories"][0]
        assert {s["name"]: s["sensorState"]["status"] for s in repo["sensors"]} == {"click_log_sensor": "STOPPED"}
        assert [(s["name"], s["cronSchedule"], s["scheduleState"]["status"]) for s in repo["schedules"]] == [
            ("retrain_schedule", "0 3 * * *", "STOPPED")]
        params = {"selector": {"repositoryLocationName": loc["name"], "repositoryName": repo["name"],
                               "jobName": "__ASSET_JOB", "assetSelection": [{"path": ["dataset"]}]},
                  "executionMetadata": {"tags": [{"key": "dagster/partition", "value": "TinyUI"}]},
                  "runConfigData": {"execution": {"config": {"in_process": {}}}}}  # one process: faster
        launched = graphql(port, LAUNCH, {"p": params})["launchPipelineExecution"]
        assert launched["__typename"] == "LaunchRunSuccess", launched
        run_id = launched["run"]["runId"]

        def finished():
            run = graphql(port, RUN, {"id": run_id})["runOrError"]
            return run if run["status"] in ("SUCCESS", "FAILURE", "CANCELED") else None

        run = wait_for("run finished", finished, 240, log_path, proc)
        assert run["status"] == "SUCCESS", log_path.read_text()[-4000:]
        assert {"key": "dagster/partition", "value": "TinyUI"} in run["tags"]
    finally:
        stop_process_group(proc, 30)  # dagster dev and its webserver, daemon and code server
    summary = json.loads((home.artifacts / "TinyUI" / "ingest" / "summary.json").read_text())
    assert summary["n_train"] == 30 and summary["n_test"] == 10
