"""The whole model lifecycle, chained as the daemon runs it, on a tiny click-log feed: click-log files dropped
into the watched folder -> ``click_log_sensor`` (``build_sensor_context``) -> its run request executed
in-process as requested (partition, tags, run config, asset selection) -> a warm retrain from the champion,
evaluation, a new registered version and the blocking ``champion_gate`` check -> the MLflow aliases.

Three drops, each one tick and one run, with the gate's default tolerance (0 pp):
1. the first model becomes champion;
2. clicks on labels new to this drop, which the champion cannot predict: the retrain is promoted;
3. the same feed with a harmful ``pretrain.lr`` set on the catalog entry (it collapses the encoder): the
   retrain is refused, stays challenger, and the champion does not move."""

from __future__ import annotations

import time
from pathlib import Path

import dagster as dg
import mlflow
import numpy as np
import pandas as pd
import pytest

from resources.clicklogs import ClickLogFeedResource
from resources.home import XCHomeResource
from tests.test_pipeline import TINY
from tests.tinydata import ready_home, write_tiny_encoder
from xc_dagster.catalog import Catalog, DatasetSpec
from xc_dagster.home import Home
from xc_dagster.serving import retraining
from xc_dagster.storage import load_json

DATASET = "shop"
MODEL = f"xc-{DATASET}"
OLD = ["apple", "river", "stone", "cloud", "music", "paper", "glass", "horse", "light", "metal"]
NEW = ["ocean", "plant", "sugar", "tiger", "water", "wheel"]  # labels first clicked in the second drop
BAD_LR = 0.5  # pretrain.lr that collapses the tiny encoder (final loss = the 0.3 margin, every score ties)


def queries(words: list[str], n: int, hours: tuple[int, int], seed: int) -> list[tuple[list[str], int]]:
    """``n`` queries clicking 1-2 of ``words`` each, spread evenly over ``hours`` of the day (seeded)."""
    rng = np.random.default_rng(seed)
    return [([str(w) for w in rng.choice(words, size=int(rng.integers(1, 3)), replace=False)],
             hours[0] + i * (hours[1] - hours[0]) // n) for i in range(n)]


def write_clicks(path: Path, day: int, qs: list[tuple[list[str], int]], seed: int) -> Path:
    """A Parquet click log: each query names the words of its clicked labels plus a unique token."""
    rng = np.random.default_rng(seed)
    rows = [{"query": " ".join(words) + f" item{day}x{n}", "label": w, "clicks": int(rng.integers(1, 4)),
             "timestamp": f"2024-02-{day:02d}T{hour:02d}:{n % 60:02d}:00Z"}
            for n, (words, hour) in enumerate(qs) for w in words]
    path.parent.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(rows).to_parquet(path, index=False)
    return path


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("XC_HOME", str(tmp_path / "home"))
    for var in ("MLFLOW_TRACKING_URI", retraining.ENV_ROOT, "XC_CLICKLOG_INTERVAL"):
        monkeypatch.delenv(var, raising=False)
    return ready_home(tmp_path / "home")


class Daemon:
    """What the daemon does for the sensor: evaluate a tick, launch its run requests (here in-process)."""

    def __init__(self, home: Home) -> None:
        from xc_dagster.definitions import build_definitions

        self.home = home
        self.defs = build_definitions(home)
        self.instance = dg.DagsterInstance.local_temp()
        self.cursor: str | None = None

    def tick(self) -> dg.SensorResult:
        resources = {"home": XCHomeResource(root=str(self.home.root)),
                     "clicklogs": ClickLogFeedResource(settle_seconds=0)}
        with dg.build_sensor_context(instance=self.instance, instance_ref=self.instance.get_ref(),
                                     cursor=self.cursor, definitions=self.defs, resources=resources) as ctx:
            result = self.defs.resolve_sensor_def("click_log_sensor").evaluate_tick(ctx)
        self.cursor = result.cursor
        for req in result.dynamic_partitions_requests or []:  # as the daemon does, before the run requests
            self.instance.add_dynamic_partitions(req.partitions_def_name, list(req.partition_keys))
        return result

    def launch(self, req: dg.RunRequest) -> dg.ExecuteInProcessResult:
        """Exactly the requested run: same partition, tags, run config and asset selection."""
        job = self.defs.resolve_job_def("xc_pipeline")
        return job.execute_in_process(run_config=req.run_config, instance=self.instance,
                                      partition_key=req.partition_key, tags=req.tags,
                                      asset_selection=req.asset_selection, raise_on_error=False)

    def drop_and_run(self, n_files: int = 1) -> tuple[dg.RunRequest, dg.ExecuteInProcessResult]:
        result = self.tick()
        (req,) = result.run_requests
        assert req.partition_key == DATASET and req.tags["xc/trigger"] == "click_log_sensor"
        assert req.tags["xc/new_files"] == str(n_files)
        # the request runs the whole job: every stage, the registered model and its gate
        assert req.asset_selection is None and not req.asset_check_keys
        run = self.launch(req)
        tags = self.instance.get_run_by_id(run.run_id).tags
        assert tags["dagster/partition"] == DATASET and tags["xc/drop"] == req.tags["xc/drop"]
        return req, run


def gate(run: dg.ExecuteInProcessResult) -> dict:
    """The champion_gate check's metadata in a run (exactly one evaluation)."""
    (check,) = [c for c in run.get_asset_check_evaluations() if c.check_name == "champion_gate"]
    assert check.asset_key == dg.AssetKey("registered_model")
    return {"passed": check.passed, "severity": check.severity,
            **{k: v.value for k, v in check.metadata.items()}}


def materialized(run: dg.ExecuteInProcessResult) -> set[str]:
    return {e.asset_key.to_user_string() for e in run.get_asset_materialization_events()}


def test_click_log_drops_retrain_and_the_gate_promotes_or_refuses(home, tmp_path):
    t0 = time.perf_counter()
    enc = write_tiny_encoder(tmp_path / "enc")
    inbox = home.root / retraining.INBOX / DATASET
    # the entry is made before the first drop (feed folder as placeholder source) to give it the tiny config
    # without the lexical channel, whose TF-IDF kNN would carry the broken encoder of drop 3 (the gate is tested)
    Catalog(home.catalog).add(DatasetSpec(DATASET, str(inbox), text="title", overrides={
        **TINY, "tokenize.encoder": str(enc), "index.sources": "W,label,knn"}))
    write_clicks(inbox / "2024-02-01.parquet", 1, queries(OLD, 60, (0, 24), seed=1), seed=1)
    daemon = Daemon(home)
    client = mlflow.MlflowClient(home.mlflow_uri)
    stages = {"dataset", "tokens", "siamese_encoder", "negative_shortlist", "classifiers", "ann_index", "fusion",
              "evaluation", "registered_model"}

    # ---- drop 1: cold start (no champion yet), the first version becomes champion
    req1, run1 = daemon.drop_and_run()
    assert run1.success and materialized(run1) == stages
    spec = Catalog(home.catalog).get(DATASET)
    assert spec.source == req1.tags["xc/clicklog_folder"] and spec.overrides["pretrain.warm_start"] == "champion"
    assert load_json(home.artifacts / DATASET / "pretrain" / "summary.json")["warm_start"] == ""
    g1 = gate(run1)
    assert g1["passed"] and g1["decision"] == "first version: champion" and g1["challenger_version"] == "1"
    assert g1["champion_metrics"] is None and g1["aliases"] == {"champion": "1"}
    assert g1["challenger P@1"] > 50.0  # the query names its labels: learnable even by the tiny encoder
    assert {a: str(v) for a, v in client.get_registered_model(MODEL).aliases.items()} == {"champion": "1"}
    assert daemon.tick().run_requests == []  # consumed: nothing more to do

    # ---- drop 2: six new labels, which dominate the latest queries (the test split); warm start from v1
    write_clicks(inbox / "2024-02-02.parquet", 2,
                 queries(OLD, 30, (0, 12), seed=2) + queries(NEW, 40, (4, 24), seed=3), seed=2)
    req2, run2 = daemon.drop_and_run()
    assert run2.success and materialized(run2) == stages
    warm2 = load_json(home.artifacts / DATASET / "pretrain" / "summary.json")
    assert warm2["warm_start"] and warm2["warm_start_labels"] == len(OLD)  # v1's labels, matched by text
    assert load_json(home.artifacts / DATASET / "ingest" / "summary.json")["n_labels"] == len(OLD + NEW)
    g2 = gate(run2)
    assert g2["passed"] and g2["decision"] == "promoted to champion" and g2["promoted"] is True
    assert (g2["challenger_version"], g2["champion_version"]) == ("2", "1") and g2["tolerance_pp"] == 0.0
    assert g2["champion_metrics_source"].startswith("re-evaluated on this test split")
    # v1 knows none of the new labels: it scores 0 on this split; v2 learned them
    assert g2["champion_metrics"] == {"precision_at_1": 0.0, "psprecision_at_1": 0.0}
    assert g2["challenger_metrics"]["precision_at_1"] > 0.3 and g2["challenger_metrics"]["psprecision_at_1"] > 0.3
    assert g2["champion P@1"] == 0.0 and g2["challenger P@1"] == pytest.approx(
        100 * g2["challenger_metrics"]["precision_at_1"], abs=1e-3)
    for m in ("precision_at_1", "psprecision_at_1"):
        assert g2["delta_pp"][m] == pytest.approx(100 * g2["challenger_metrics"][m])
    assert g2["aliases"] == {"champion": "2"}
    assert {a: str(v) for a, v in client.get_registered_model(MODEL).aliases.items()} == {"champion": "2"}
    assert client.get_model_version(MODEL, "1").tags["superseded_by"] == "2"
    assert client.get_model_version(MODEL, "2").tags["promotion"] == "promoted"

    # ---- drop 3: a harmful learning rate on the entry; the retrain evaluates, registers, and is refused
    spec = Catalog(home.catalog).get(DATASET)
    spec.overrides = {**spec.overrides, "pretrain.lr": BAD_LR}
    Catalog(home.catalog).add(spec, replace=True)
    write_clicks(inbox / "2024-02-03.parquet", 3, queries(OLD + NEW, 60, (0, 24), seed=4), seed=4)
    req3, run3 = daemon.drop_and_run()
    assert Catalog(home.catalog).get(DATASET).overrides["pretrain.lr"] == BAD_LR  # kept by the sensor
    warm3 = load_json(home.artifacts / DATASET / "pretrain" / "summary.json")
    assert warm3["warm_start_labels"] == len(OLD + NEW)  # from the promoted champion v2
    assert not run3.success  # the blocking check failed with ERROR: the run fails at registered_model
    assert run3.get_failed_step_keys() == {"registered_model"}
    assert materialized(run3) == stages  # evaluated and registered all the same (the version exists)
    g3 = gate(run3)
    assert not g3["passed"] and g3["severity"] == dg.AssetCheckSeverity.ERROR
    assert g3["decision"] == "refused: stays challenger" and g3["promoted"] is False
    assert (g3["challenger_version"], g3["champion_version"]) == ("3", "2")
    champ, chal = g3["champion_metrics"], g3["challenger_metrics"]
    assert champ["precision_at_1"] > 0.5 and champ["psprecision_at_1"] > 0.5  # v2 on drop 3's test split
    for m in ("precision_at_1", "psprecision_at_1"):
        assert chal[m] < champ[m] - 0.3  # clearly worse, far beyond the 0 pp tolerance
        assert g3["delta_pp"][m] == pytest.approx(100 * (chal[m] - champ[m]))
    assert g3["champion P@1"] == pytest.approx(100 * champ["precision_at_1"], abs=1e-3)
    assert g3["challenger PSP@1"] == pytest.approx(100 * chal["psprecision_at_1"], abs=1e-3)
    assert "worse by more than the tolerance 0 pp" in g3["reasons"]
    assert g3["aliases"] == {"champion": "2", "challenger": "3"}
    assert {a: str(v) for a, v in client.get_registered_model(MODEL).aliases.items()} == \
        {"champion": "2", "challenger": "3"}
    assert client.get_model_version(MODEL, "3").tags["promotion"] == "refused"
    # the failed run is over: the next tick is not held back by it, and finds nothing new
    nothing = daemon.tick()
    assert nothing.run_requests == [] and "no new click-log files" in nothing.skip_message
    assert len({req1.run_key, req2.run_key, req3.run_key}) == 3
    assert time.perf_counter() - t0 < 120  # about 30 s on 2 CPU cores
