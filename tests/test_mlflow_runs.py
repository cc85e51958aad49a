"""MLflow as its users expect: a parent run per Dagster run with the stage runs nested under it (also when steps
start together in several processes), the switch of system metrics, the fluent URI restored (public API only)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import mlflow
import pytest

from xc_dagster.tracking import (
    PARENT_SETTLE_S,
    PARENT_TAG,
    SYSTEM_METRICS_ENV,
    Tracker,
    experiment_name,
    use_tracking_uri,
)

STAGE_IN_A_PROCESS = """
import sys, time
from xc_dagster.tracking import Tracker
uri, stage, release = sys.argv[1], sys.argv[2], float(sys.argv[3])
tracker = Tracker(uri)
tracker.experiment_id("Tiny")  # created before the release: the race is on the parent run only
time.sleep(max(0.0, release - time.time()))
with tracker.run("Tiny", stage, {"x": 1}, {"dagster_run_id": "run-1", "strategy": "ngame"}) as run:
    run.log_final({"value": 1.0})
"""


def test_stage_runs_started_together_share_one_parent_run(tmp_path):
    """Four stage processes of one Dagster run released together: one parent, every stage nested under it."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    Tracker(uri).experiment_id("Tiny")  # the store's tables, made once
    release = time.time() + 6.0
    procs = [subprocess.Popen([sys.executable, "-c", STAGE_IN_A_PROCESS, uri, f"stage{i}", str(release)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(4)]
    outs = [p.communicate(timeout=180) for p in procs]
    assert [p.returncode for p in procs] == [0] * 4, [e[-800:] for _, e in outs]
    client = mlflow.MlflowClient(uri)
    exp = client.get_experiment_by_name(experiment_name("Tiny")).experiment_id
    parents = client.search_runs([exp], f"tags.`{PARENT_TAG}` = 'run-1'")
    assert len(parents) == 1  # racers converged on the oldest and deleted their own
    parent = parents[0]
    assert parent.info.status == "FINISHED" and parent.data.tags["strategy"] == "ngame"
    stages = client.search_runs([exp], "tags.asset LIKE 'stage%'")
    assert sorted(r.data.tags["asset"] for r in stages) == [f"stage{i}" for i in range(4)]
    assert {r.data.tags["mlflow.parentRunId"] for r in stages} == {parent.info.run_id}


def test_two_creators_of_a_parent_run_converge_on_the_oldest(tmp_path):
    """The creation race, made deterministic: another process's parent run is committed just after this
    process looked (its first search sees none); this process creates its own, looks again, keeps the oldest
    and deletes its own."""
    tracker = Tracker(f"sqlite:///{tmp_path / 'mlflow.db'}")
    exp = tracker.experiment_id("Tiny")
    other = tracker.client.create_run(exp, tags={PARENT_TAG: "run-3"}, start_time=int(time.time() * 1000) - 5)
    real_search = tracker.client.search_runs
    calls = []

    def search_runs(*args, **kwargs):
        calls.append(args)
        return [] if len(calls) == 1 else real_search(*args, **kwargs)

    tracker.client.search_runs = search_runs
    assert tracker.parent_run(exp, "Tiny", "run-3", {}) == other.info.run_id
    tracker.client.search_runs = real_search
    assert [r.info.run_id for r in real_search([exp], f"tags.`{PARENT_TAG}` = 'run-3'")] == [other.info.run_id]


def test_a_stage_that_finds_a_fresh_parent_run_waits_for_its_racers(tmp_path):
    """The joiner's race, made deterministic: a stage finds one parent run just created (a creator's, which is
    deleted once an older racer's lands); an older one becomes visible only later. The stage looks again once the
    run it found is 2 x PARENT_SETTLE_S old and takes the older; a parent run already that old is taken at once."""
    tracker = Tracker(f"sqlite:///{tmp_path / 'mlflow.db'}")
    exp = tracker.experiment_id("Tiny")
    now = int(time.time() * 1000)
    fresh = tracker.client.create_run(exp, tags={PARENT_TAG: "run-4"}, start_time=now)
    real_search = tracker.client.search_runs
    calls = []

    def search_runs(*args, **kwargs):
        calls.append(time.time())
        got = real_search(*args, **kwargs)
        return got if len(calls) > 1 else [r for r in got if r.info.run_id == fresh.info.run_id]

    older = tracker.client.create_run(exp, tags={PARENT_TAG: "run-4"}, start_time=now - 5)
    tracker.client.search_runs = search_runs
    assert tracker.parent_run(exp, "Tiny", "run-4", {}) == older.info.run_id
    assert len(calls) == 2 and calls[1] >= now / 1000 + 2 * PARENT_SETTLE_S - 0.01
    counted = []
    tracker.client.search_runs = lambda *a, **kw: counted.append(1) or real_search(*a, **kw)
    settled = tracker.client.create_run(exp, tags={PARENT_TAG: "run-5"}, start_time=now - 10_000)
    assert tracker.parent_run(exp, "Tiny", "run-5", {}) == settled.info.run_id and len(counted) == 1


def test_a_failed_stage_fails_its_parent_and_a_later_stage_finishes_it(tmp_path):
    tracker = Tracker(f"sqlite:///{tmp_path / 'mlflow.db'}")
    tags = {"dagster_run_id": "run-2"}
    with pytest.raises(RuntimeError):
        with tracker.run("Tiny", "pretrain", {}, tags):
            raise RuntimeError("step failed")
    exp = tracker.experiment_id("Tiny")
    (parent,) = tracker.client.search_runs([exp], f"tags.`{PARENT_TAG}` = 'run-2'")
    assert parent.info.status == "FAILED"
    with tracker.run("Tiny", "pretrain", {}, tags) as run:  # the step retried in the same Dagster run
        assert run.parent_id == parent.info.run_id
    assert tracker.client.get_run(parent.info.run_id).info.status == "FINISHED"
    with tracker.run("Tiny", "ingest", {}, {}) as run:  # no Dagster run (library scripts): not nested
        assert run.parent_id is None
    assert "mlflow.parentRunId" not in tracker.client.get_run(run.run_id).data.tags


@pytest.mark.parametrize("switch", ["1", ""])
def test_system_metrics_are_switchable(tmp_path, monkeypatch, switch):
    pytest.importorskip("psutil")
    monkeypatch.setenv(SYSTEM_METRICS_ENV, switch)
    monkeypatch.setenv("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL", "0.2")
    monkeypatch.setenv("MLFLOW_SYSTEM_METRICS_SAMPLES_BEFORE_LOGGING", "1")
    tracker = Tracker(f"sqlite:///{tmp_path / 'mlflow.db'}")
    with tracker.run("Tiny", "pretrain", {}, {}) as run:
        time.sleep(1.5)
        run.log_final({"loss": 0.5})
    got = tracker.client.get_run(run.run_id)
    system = {k for k in got.data.metrics if k.startswith("system/")}
    assert ("system/cpu_utilization_percentage" in system) == (switch == "1")
    assert got.data.metrics["loss"] == 0.5 and got.info.status == "FINISHED"
    assert mlflow.active_run() is None


def test_use_tracking_uri_restores_the_uri_and_the_variable(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    mlflow.set_tracking_uri(None)
    with use_tracking_uri(f"sqlite:///{tmp_path / 'a.db'}"):
        assert mlflow.get_tracking_uri().endswith("a.db")
    assert not mlflow.tracking.is_tracking_uri_set() and "MLFLOW_TRACKING_URI" not in os.environ
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'env.db'}")
    with use_tracking_uri(f"sqlite:///{tmp_path / 'b.db'}"):
        assert mlflow.get_tracking_uri().endswith("b.db")
    assert os.environ["MLFLOW_TRACKING_URI"].endswith("env.db") and mlflow.get_tracking_uri().endswith("env.db")
