"""Known-dataset registry (defaults, published counts verified at ingest) and the ingest validation checks
(library numbers in checks.json, Dagster asset checks, label-frequency plot in metadata and MLflow)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import dagster as dg
import mlflow
import numpy as np
import pytest
import scipy.sparse as sp

from assets import ingest as ingest_module
from resources.home import dataset_partitions
from tests.test_data import DATA
from tests.tinydata import dagster_instance, ready_home
from xc_dagster.catalog import Catalog, DatasetSpec
from xc_dagster.cli import main as cli_main
from xc_dagster.data import read_dataset
from xc_dagster.data.canonical import XCDataset
from xc_dagster.data.checks import compute_checks, label_frequencies
from xc_dagster.data.registry import KNOWN_DATASETS, XCCountMismatch, lookup, verify_counts
from xc_dagster.definitions import pipeline_resources
from xc_dagster.home import Home
from xc_dagster.pipeline import StageContext, ingest
from xc_dagster.storage import ArtifactStore
from xc_dagster.tracking import experiment_name

WORDNET = DATA / "LF-WordNetNouns"

# planted: train dups 2 ("red apple" x3), 2 empty train texts, 1 train point without labels;
# test: "night owl" twice (1 dup), 2 test texts in train ("green pear", "red apple"), 2 without labels, 1 empty
TRAIN = [("red apple", [0]), ("green pear", [1]), ("red apple", [0, 1]), ("blue sky", []), ("red apple", [2]),
         ("", [3]), ("", [3]), ("yellow sun", [0])]
TEST = [("green pear", [1]), ("red apple", []), ("night owl", [2]), ("night owl", []), ("", [0])]
LABELS = ["fruit", "green", "bird", "nothing"]


def _write_planted(folder: Path) -> Path:
    folder.mkdir(parents=True)
    for name, rows in (("trn.json.gz", TRAIN), ("tst.json.gz", TEST), ("lbl.json.gz", [(t, []) for t in LABELS])):
        with gzip.open(folder / name, "wt") as fh:
            for i, (title, tgt) in enumerate(rows):
                fh.write(json.dumps({"uid": str(i), "title": title, "content": "", "target_ind": tgt}) + "\n")
    (folder / "filter_labels_test.txt").write_text("0 1\n2 3\n")
    (folder / "filter_labels_train.txt").write_text("1 1\n")
    return folder


@pytest.fixture
def home(tmp_path, monkeypatch) -> Home:
    monkeypatch.setenv("XC_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    return ready_home(tmp_path / "home")


def _ingest(home: Home, spec: DatasetSpec, **overrides) -> dict:
    cfg = spec.config({f"ingest.{k}": v for k, v in overrides.items()})
    return ingest.run(StageContext(ArtifactStore(home.artifacts), spec, cfg, home.cache, stage="ingest"))


# ------------------------------------------------------------------------------------------ registry

def test_registry_entries():
    assert {"LF-AmazonTitles-131K", "LF-Amazon-131K", "LF-WikiSeeAlsoTitles-320K", "LF-WikiSeeAlso-320K",
            "LF-AmazonTitles-1.3M", "LF-Wikipedia-500K", "Amazon-670K", "AmazonCat-13K", "EURLex-4K",
            "Wiki10-31K", "Bibtex", "Delicious", "LF-WordNetNouns", "LF-WordNetNounsTitles"} <= set(KNOWN_DATASETS)
    a = lookup("lf-amazontitles-131k")
    assert (a.n_train, a.n_test, a.n_labels, a.text, a.max_len) == (294_805, 134_835, 131_073, "title", 32)
    assert (a.propensity_a, a.propensity_b, a.layout) == (0.6, 2.6, "lf-raw")
    w = lookup("LF-Wikipedia-500K")
    assert (w.text, w.max_len, w.propensity_a, w.propensity_b) == ("title+content", 256, 0.5, 0.4)
    assert lookup("LF-WikiSeeAlso-320K").max_len == 128
    assert (lookup("Bibtex").n_features, lookup("Delicious").n_labels) == (1_836, 983)
    assert (lookup("EURLex-4K").propensity_a, lookup("Wiki10-31K").propensity_b) == (0.55, 0.4)
    assert lookup("LF-WordNetNounsTitles").counts() == {"n_train": 57_480, "n_test": 24_599,
                                                          "n_labels": 21_523, "n_features": None}
    assert lookup("TinyTitles") is None


def test_datasets_add_takes_registry_defaults(home, tmp_path, capsys):
    assert cli_main(["datasets", "add", "LF-AmazonTitles-131K", "--source", str(tmp_path)]) == 0
    assert "known public dataset LF-AmazonTitles-131K: 294,805 train" in capsys.readouterr().out
    assert cli_main(["datasets", "add", "LF-Wikipedia-500K", "--source", str(tmp_path)]) == 0
    # explicit options win over the registry
    (tmp_path / "a.zip").write_bytes(b"")  # a local source must exist
    assert cli_main(["datasets", "add", "LF-Amazon-131K", "--source", str(tmp_path / "a.zip"), "--max-len", "64",
                     "--propensity", "0.5", "1.0", "--sha256", "AB" * 32]) == 0
    cat = Catalog(home.catalog)
    cfg = cat.get("LF-AmazonTitles-131K").config()
    assert (cfg.ingest.text, cfg.tokenize.max_len, cfg.evaluate.propensity_a, cfg.evaluate.propensity_b) == \
        ("title", 32, 0.6, 2.6)
    cfg = cat.get("LF-Wikipedia-500K").config()
    assert (cfg.ingest.text, cfg.tokenize.max_len, cfg.evaluate.propensity_a) == ("title+content", 256, 0.5)
    spec = cat.get("LF-Amazon-131K")
    cfg = spec.config()
    assert (cfg.ingest.text, cfg.tokenize.max_len, cfg.evaluate.propensity_a, cfg.evaluate.propensity_b) == \
        ("title+content", 64, 0.5, 1.0)
    assert spec.sha256 == "ab" * 32
    assert cli_main(["datasets", "add", "X", "--source", str(tmp_path), "--sha256", "xyz"]) == 2
    assert "64 hexadecimal" in capsys.readouterr().err


# --------------------------------------------------------------------------------- count verification

@pytest.mark.skipif(not WORDNET.is_dir(), reason="shared LF-WordNetNouns not present")
def test_counts_verified_on_real_wordnet(home):
    out = _ingest(home, DatasetSpec("LF-WordNetNounsTitles", str(WORDNET)))
    assert out["registry"] == "LF-WordNetNounsTitles" and out["counts_verified"]
    assert (out["n_train"], out["n_test"], out["n_labels"]) == (57_480, 24_599, 21_523)
    assert out["label_names"]  # its labels are named: ngame's pretraining may use them as points
    checks = json.loads((home.artifacts / "LF-WordNetNounsTitles" / "ingest" / "checks.json").read_text())
    assert checks["checks"]["counts_match"]["passed"] and checks["checks"]["label_ids_in_range"]["passed"]


@pytest.mark.parametrize("name", ["Bibtex", "Delicious"])
def test_published_counts_of_real_bow_sets(name):
    folder = WORDNET.parent / name / "xc_format"
    if not folder.is_dir():
        pytest.skip(f"shared {name} not present")
    ds = read_dataset(folder)
    verify_counts(name, ds.stats(), lookup(name))  # n_features included (BoW)
    assert ds.stats()["n_features"] == lookup(name).n_features


def test_count_mismatch_fails_clearly_and_writes_nothing(home, tmp_path):
    src = _write_planted(tmp_path / "planted")
    spec = DatasetSpec("EURLex-4K", str(src), text="title")  # a known name on the wrong download
    with pytest.raises(XCCountMismatch) as ei:
        _ingest(home, spec)
    e = ei.value
    assert (e.dataset, e.field, e.expected, e.got) == ("EURLex-4K", "n_train", 15_539, 8)
    msg = str(e)
    assert "'EURLex-4K'" in msg and "n_test: expected 3809, got 5" in msg and "verify_counts" in msg
    assert not (home.artifacts / "EURLex-4K" / "ingest").exists()
    out = _ingest(home, spec, verify_counts=False)  # the option skips it; the check then records it
    assert not out["counts_verified"] and out["check_counts"]["count_mismatches"] == 3
    assert out["label_names"]  # lbl.json.gz titles
    checks = json.loads((home.artifacts / "EURLex-4K" / "ingest" / "checks.json").read_text())
    mism = checks["checks"]["counts_match"]["metadata"]["mismatches"]
    assert {"field": "n_labels (published)", "expected": 3993, "got": 4} in mism


def test_ingest_records_placeholder_label_names(home, tmp_path):
    """A layout without Y.txt gets placeholder names ("label 0" ...): ingest records it, so that the pretraining
    leaves them out as points and the planner does not count them."""
    from tests.test_data import make_bow

    named = _ingest(home, DatasetSpec("Toy", str(make_bow(tmp_path / "named"))))
    bare = _ingest(home, DatasetSpec("ToyBare", str(make_bow(tmp_path / "bare", y=None))))
    assert named["label_names"] and not bare["label_names"]


# -------------------------------------------------------------------------------------------- checks

def test_checks_json_on_planted_dataset(home, tmp_path):
    src = _write_planted(tmp_path / "planted")
    out = _ingest(home, DatasetSpec("Planted", str(src), text="title"))
    d = home.artifacts / "Planted" / "ingest"
    res = json.loads((d / "checks.json").read_text())
    c = {k: v["metadata"] for k, v in res["checks"].items()}
    assert c["duplicate_point_texts"] == {"duplicate_train_texts": 2, "duplicate_test_texts": 1,
                                          "empty_train_texts": 2, "empty_test_texts": 1}
    assert c["train_test_overlap"]["test_texts_in_train"] == 2 and c["train_test_overlap"]["test_points_compared"] == 4
    assert c["points_without_labels"] == {"train_without_labels": 1, "test_without_labels": 2}
    assert c["filter_pairs_in_range"]["filter_test_pairs"] == 2 and c["filter_pairs_in_range"]["filter_test_out_of_range"] == 0
    assert c["counts_match"]["n_mismatches"] == 0 and c["counts_match"]["registry"] is None
    assert c["label_ids_in_range"]["max_label_id"] == 3
    assert res["failed"] == ["duplicate_point_texts", "points_without_labels", "train_test_overlap"]
    assert {k: v["severity"] for k, v in res["checks"].items() if not v["passed"]} == \
        {"duplicate_point_texts": "WARN", "points_without_labels": "WARN", "train_test_overlap": "WARN"}
    assert res["label_frequency"]["positives"] == 8 and res["label_frequency"]["max_frequency"] == 3
    assert np.load(d / "label_freq.npy").tolist() == [3, 2, 1, 2]
    assert (d / "label_freq.png").read_bytes()[:4] == b"\x89PNG"
    assert out["check_counts"]["test_texts_in_train"] == 2 and out["registry"] is None


def test_checks_flag_out_of_range_filters_and_label_ids():
    """Inputs the parsers already refuse, built in memory: the checks still catch them (ERROR)."""
    Y_tr = sp.csr_matrix((np.ones(3, np.float32), np.array([0, 1, 4]), np.array([0, 1, 3])), shape=(2, 5))
    Y_te = sp.csr_matrix(np.array([[1, 0, 0, 0]], dtype=np.float32))
    ds = XCDataset(train_texts=["a", "b"], test_texts=["c"], label_texts=["l0", "l1", "l2", "l3"],
                   Y_train=Y_tr, Y_test=Y_te,
                   filter_train=np.array([[0, 1], [2, 0], [1, 4]]), filter_test=np.array([[0, -1]]))
    res = compute_checks(ds)
    f = res["checks"]["filter_pairs_in_range"]
    assert not f["passed"] and f["severity"] == "ERROR"
    assert (f["metadata"]["filter_train_out_of_range"], f["metadata"]["filter_train_bad_rows"],
            f["metadata"]["filter_train_bad_labels"], f["metadata"]["filter_test_out_of_range"]) == (2, 1, 1, 1)
    lab = res["checks"]["label_ids_in_range"]
    assert not lab["passed"] and lab["metadata"]["out_of_range_train"] == 1 and lab["metadata"]["max_label_id"] == 4
    cm = res["checks"]["counts_match"]
    assert not cm["passed"] and {"field": "label texts vs Y_train columns", "expected": 4, "got": 5} in \
        cm["metadata"]["mismatches"]
    assert label_frequencies(Y_tr, 4).tolist() == [1, 1, 0, 0]


# ---------------------------------------------------------------------------------------- Dagster

def test_asset_checks_through_dagster(home, tmp_path):
    src = _write_planted(tmp_path / "planted")
    cat = Catalog(home.catalog)
    cat.add(DatasetSpec("Planted", str(src), text="title"))
    cat.add(DatasetSpec("Bibtex", str(src), text="title"))  # known name, wrong data: count mismatch
    asset = ingest_module.build(dataset_partitions())
    check_names = {k.name for k in asset.check_keys}
    assert check_names == {"label_ids_in_range", "counts_match", "points_without_labels", "duplicate_point_texts",
                           "train_test_overlap", "filter_pairs_in_range"}

    def run(partition: str, **cfg):
        return dg.materialize([asset], partition_key=partition, resources=pipeline_resources(home),
                              instance=dagster_instance(partition), raise_on_error=False,
                              run_config={"ops": {"dataset": {"config": cfg}}} if cfg else None)

    result = run("Planted")
    assert result.success
    evs = {e.check_name: e for e in result.get_asset_check_evaluations()}
    assert set(evs) == check_names
    assert {n for n, e in evs.items() if e.passed} == {"label_ids_in_range", "counts_match", "filter_pairs_in_range"}
    assert all(evs[n].severity == dg.AssetCheckSeverity.WARN for n in
               ("points_without_labels", "duplicate_point_texts", "train_test_overlap"))
    assert evs["train_test_overlap"].metadata["test_texts_in_train"].value == 2
    assert evs["duplicate_point_texts"].metadata["duplicate_train_texts"].value == 2
    assert evs["points_without_labels"].metadata["test_without_labels"].value == 2
    meta = result.get_asset_materialization_events()[0].materialization.metadata
    assert meta["label_frequency_plot"].value.startswith("![label frequency")
    assert "base64," in meta["label_frequency_plot"].value
    client = mlflow.MlflowClient(home.mlflow_uri)
    runs = client.search_runs([client.get_experiment_by_name(experiment_name("Planted")).experiment_id])
    arts = {a.path for a in client.list_artifacts(runs[0].info.run_id)}
    assert {"label_freq.png", "checks.json"} <= arts

    bad = run("Bibtex")  # verify_counts (default on): the materialization fails, naming the mismatch
    assert not bad.success
    assert "n_train: expected 4880, got 8" in str(bad.get_step_failure_events()[0].event_specific_data.error)
    skipped = run("Bibtex", verify_counts=False)  # ingested; the blocking ERROR check fails the step
    assert not skipped.success and skipped.get_failed_step_keys() == {"dataset"}
    evs = {e.check_name: e for e in skipped.get_asset_check_evaluations()}
    assert not evs["counts_match"].passed and evs["counts_match"].severity == dg.AssetCheckSeverity.ERROR
    assert evs["counts_match"].metadata["n_mismatches"].value == 3  # n_features: the LF data has none
    assert evs["counts_match"].metadata["registry"].value == "Bibtex"
