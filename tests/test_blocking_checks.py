"""The ingest asset's ERROR checks are blocking: a failed one fails the step and the partition's downstream stages
do not run; a failed WARN check is reported and blocks nothing. Real runs of the real asset definitions."""

from __future__ import annotations

import gzip
import json

import dagster as dg
import pytest

from assets import build_assets
from assets import ingest as ingest_module
from resources.home import dataset_partitions
from tests.tinydata import dagster_instance, ready_home, write_lf_dataset
from xc_dagster.artifacts import CHECKS as CHECKS_FILE
from xc_dagster.catalog import Catalog, DatasetSpec
from xc_dagster.data.checks import CHECKS, ERROR
from xc_dagster.definitions import pipeline_resources
from xc_dagster.home import Home
from xc_dagster.storage import ArtifactStore

# a known public dataset's name on tiny data, its published counts not enforced at ingest (verify_counts off):
# ingest succeeds and its ERROR check counts_match fails (n_train, n_test, n_labels differ), nothing else
MISCOUNTED = "LF-AmazonTitles-131K"
DUPLICATED = "TinyDuplicates"  # one training title repeated: the WARN check duplicate_point_texts fails
BLOCKING = {"label_ids_in_range", "counts_match", "filter_pairs_in_range"}


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("XC_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    home = ready_home(tmp_path / "home")
    cat = Catalog(home.catalog)
    cat.add(DatasetSpec(MISCOUNTED, str(write_lf_dataset(tmp_path / "src" / MISCOUNTED)), text="title",
                        overrides={"ingest.verify_counts": False}))
    dup = write_lf_dataset(tmp_path / "src" / DUPLICATED)
    with gzip.open(dup / "trn.json.gz", "rt") as fh:
        rows = [json.loads(line) for line in fh]
    rows[1]["title"] = rows[0]["title"]
    with gzip.open(dup / "trn.json.gz", "wt") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in rows)
    cat.add(DatasetSpec(DUPLICATED, str(dup), text="title"))
    return home


def materialize(home: Home, partition: str) -> dg.ExecuteInProcessResult:
    """``dataset`` and the stage after it (``tokens``) of one partition, the real asset definitions."""
    return dg.materialize(build_assets(dataset_partitions()), selection=["dataset", "tokens"], partition_key=partition,
                          resources=pipeline_resources(home), instance=dagster_instance(partition),
                          raise_on_error=False)


def materialized(result: dg.ExecuteInProcessResult) -> set[str]:
    return {e.asset_key.to_user_string() for e in result.get_asset_materialization_events()}


def test_exactly_the_error_checks_are_blocking():
    specs = {s.name: s for s in ingest_module.build(dataset_partitions()).check_specs}
    assert {n for n, s in specs.items() if s.blocking} == BLOCKING == {n for n, (sev, _) in CHECKS.items()
                                                                        if sev == ERROR}
    assert set(specs) - BLOCKING == {"points_without_labels", "duplicate_point_texts", "train_test_overlap"}


def test_a_failed_error_check_fails_ingest_and_skips_the_next_stage(home):
    result = materialize(home, MISCOUNTED)
    assert not result.success
    # Dagster records the materialization and every check result, then fails the step: tokens never starts
    assert materialized(result) == {"dataset"}
    evs = {e.check_name: e for e in result.get_asset_check_evaluations()}
    assert {n for n, e in evs.items() if not e.passed} == {"counts_match"}
    cm = evs["counts_match"]
    assert cm.severity == dg.AssetCheckSeverity.ERROR and cm.blocking
    assert cm.metadata["n_mismatches"].value == 3 and cm.metadata["registry"].value == MISCOUNTED
    assert result.get_failed_step_keys() == {"dataset"}
    err = result.get_step_failure_events()[0].event_specific_data.error
    assert err.cls_name == "DagsterAssetCheckFailedError"
    assert "1 blocking asset check failed with ERROR severity:\ndataset: counts_match" in err.message
    assert [e.step_key for e in result.get_step_success_events()] == []
    store = ArtifactStore(home.artifacts)
    assert json.loads((store.stage_dir(MISCOUNTED, "ingest") / CHECKS_FILE).read_text())["failed"] == ["counts_match"]
    assert not store.stage_dir(MISCOUNTED, "tokenize").exists()


def test_a_failed_warn_check_blocks_nothing(home):
    result = materialize(home, DUPLICATED)
    assert result.success
    assert materialized(result) == {"dataset", "tokens"}
    evs = {e.check_name: e for e in result.get_asset_check_evaluations()}
    assert {n for n, e in evs.items() if not e.passed} == {"duplicate_point_texts"}
    dup = evs["duplicate_point_texts"]
    assert dup.severity == dg.AssetCheckSeverity.WARN and not dup.blocking
    assert dup.metadata["duplicate_train_texts"].value == 1
    assert (ArtifactStore(home.artifacts).stage_dir(DUPLICATED, "tokenize") / "train_ids.npy").is_file()
