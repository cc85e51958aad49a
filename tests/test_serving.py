"""Serving and promotion: the registered MLflow pyfunc (text in, top-k labels out), the champion/challenger
gate (library, Dagster asset + blocking check) and ``mlflow models serve`` answering a real HTTP request.

One tiny pipeline (tiny random encoder, generated dataset) is built once for the module."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import mlflow
import numpy as np
import pandas as pd
import pytest

from tests.test_pipeline import TINY
from tests.tinydata import dagster_instance, free_port, stop_process_group, write_lf_dataset, write_tiny_encoder
from xc_dagster import tracking
from xc_dagster.catalog import Catalog, DatasetSpec
from xc_dagster.data import load_dataset
from xc_dagster.errors import XCConfigError
from xc_dagster.evaluation.metrics import remove_filtered
from xc_dagster.home import Home
from xc_dagster.pipeline import StageContext, run_all
from xc_dagster.retrieval.ann import saved_kind
from xc_dagster.serving import bundle as serving_bundle
from xc_dagster.serving import registry
from xc_dagster.storage import ArtifactStore, load_json, save_json
from xc_dagster.tracking import Tracker, experiment_name

DATASET = "TinyTitles"
NAME = "xc-TinyTitles"


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """The whole library pipeline on the tiny dataset, in a temporary XC_HOME (module-wide)."""
    root = tmp_path_factory.mktemp("serving")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XC_HOME", str(root / "home"))
        mp.delenv("MLFLOW_TRACKING_URI", raising=False)
        home = Home.from_env().ensure()
        enc = write_tiny_encoder(root / "enc")
        src = write_lf_dataset(root / "src" / DATASET)
        Catalog(home.catalog).add(DatasetSpec(DATASET, str(src), overrides={**TINY, "tokenize.encoder": str(enc)}))
        spec = Catalog(home.catalog).get(DATASET)
        ctx = StageContext(ArtifactStore(home.artifacts), spec, spec.config(), home.cache)
        run_all(ctx)
        ds = load_dataset(ctx.dir("ingest") / "dataset", features=False)
        yield SimpleNamespace(home=home, ctx=ctx, root=root, ds=ds,
                              metrics=load_json(ctx.dir("evaluate") / "metrics.json"),
                              predictions=np.load(ctx.dir("evaluate") / "predictions.npz")["ids"])


def _with_metrics(ctx: StageContext, folder: Path, **changes: float) -> StageContext:
    """A copy of the dataset's artifacts whose evaluation metrics.json has ``changes`` applied."""
    store = ArtifactStore(folder)
    shutil.copytree(ctx.store.root / ctx.name, store.root / ctx.name)
    path = store.stage_dir(ctx.name, "evaluate") / "metrics.json"
    save_json(path, {**load_json(path), **changes})
    return dataclasses.replace(ctx, store=store)


# ------------------------------------------------------------------------------------ promotion decision

CHAMP = {"precision_at_1": 0.31, "psprecision_at_1": 0.20}


@pytest.mark.parametrize("challenger, tolerance, promote, worse", [
    ({"precision_at_1": 0.31, "psprecision_at_1": 0.20}, 0.0, True, []),          # equal
    ({"precision_at_1": 0.35, "psprecision_at_1": 0.25}, 0.0, True, []),          # better
    ({"precision_at_1": 0.3099, "psprecision_at_1": 0.20}, 0.0, False, ["precision_at_1"]),
    ({"precision_at_1": 0.30, "psprecision_at_1": 0.20}, 1.0, True, []),          # exactly 1 pp lower: within
    ({"precision_at_1": 0.2999, "psprecision_at_1": 0.20}, 1.0, False, ["precision_at_1"]),  # 1.01 pp lower
    ({"precision_at_1": 0.40, "psprecision_at_1": 0.19}, 0.5, False, ["psprecision_at_1"]),  # P@1 up, PSP down
    ({"precision_at_1": 0.30, "psprecision_at_1": 0.19}, 0.5, False, ["precision_at_1", "psprecision_at_1"]),
    ({"precision_at_1": 0.30, "psprecision_at_1": 0.19}, 1.0, True, []),
    ({"precision_at_1": float("nan"), "psprecision_at_1": 0.5}, 5.0, False, ["precision_at_1"]),
    ({"psprecision_at_1": 0.5}, 5.0, False, ["precision_at_1"]),                  # missing number
])
def test_promotion_decision(challenger, tolerance, promote, worse):
    d = registry.promotion_decision(challenger, CHAMP, tolerance)
    assert d["promote"] is promote and d["worse"] == worse and d["first"] is False
    assert d["champion"] == CHAMP and d["tolerance_pp"] == tolerance and len(d["reasons"]) == 2
    assert set(d["challenger"]) == set(registry.GATE_METRICS)


def test_promotion_decision_first_version_and_bad_tolerance():
    d = registry.promotion_decision({"precision_at_1": 0.0, "psprecision_at_1": 0.0}, None)
    assert d["promote"] and d["first"] and d["champion"] is None
    for bad in (-0.1, float("nan"), float("inf")):
        with pytest.raises(XCConfigError, match="tolerance"):
            registry.promotion_decision(CHAMP, CHAMP, bad)


def test_model_name_is_sanitized():
    assert tracking.model_name("LF-AmazonTitles-131K") == "xc-LF-AmazonTitles-131K"
    assert tracking.model_name("a b/c@d") == "xc-a-b-c-d"


def test_use_tracking_uri_restores_the_environment(monkeypatch, tmp_path):
    """mlflow.set_tracking_uri exports MLFLOW_TRACKING_URI; the helper must not leak it to later trackers."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    uri = f"sqlite:///{tmp_path / 'x.db'}"
    with tracking.use_tracking_uri(uri):
        assert mlflow.get_tracking_uri() == uri
    assert "MLFLOW_TRACKING_URI" not in os.environ and mlflow.get_tracking_uri() != uri
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:///elsewhere.db")
    with tracking.use_tracking_uri(uri):
        pass
    assert os.environ["MLFLOW_TRACKING_URI"] == "sqlite:///elsewhere.db"


# ------------------------------------------------------------------------------------------- the bundle

def test_bundle_reproduces_the_evaluation(built, tmp_path):
    """predict_topk on the raw test texts = the evaluation stage's predictions (pre-tokenized ids); the
    bundle loads from files only and re-evaluates to the same metrics."""
    info = serving_bundle.write_bundle(built.ctx, tmp_path / "bundle", default_k=7)
    assert info["max_len"] == 32 and info["index_kind"] == "auto" and info["default_k"] == 7
    files = {p.relative_to(tmp_path / "bundle").as_posix() for p in (tmp_path / "bundle").rglob("*") if p.is_file()}
    assert {"W.npy", "label_emb.npy", "W.index", "label_emb.index", "fusion.json", "inv_prop.npy", "labels.parquet",
            "serving.json", "encoder/config.json", "encoder/model.safetensors", "encoder/tokenizer.json"} <= files
    assert not any(f.endswith((".pkl", ".pickle", ".bin")) for f in files)
    manifest = load_json(tmp_path / "bundle" / "manifest.json")["files"]  # every other file, its size and hash
    assert info["manifest"] == "manifest.json" and set(manifest) == files - {"manifest.json"}
    w = (tmp_path / "bundle" / "W.npy").read_bytes()
    assert manifest["W.npy"] == {"size": len(w), "sha256": hashlib.sha256(w).hexdigest()}
    bundle = serving_bundle.load_bundle(tmp_path / "bundle", "cpu")
    ids, scores = serving_bundle.predict_topk(built.ds.test_texts, bundle, 10)
    assert ids.shape == (40, 10) and all(np.all(np.diff(s[i >= 0]) <= 0) for i, s in zip(ids, scores))
    filtered, _ = remove_filtered(ids, scores, built.ds.filter_test)
    np.testing.assert_array_equal(filtered, built.predictions)
    ids3, scores3 = serving_bundle.predict_topk(built.ds.test_texts, bundle, 3)
    np.testing.assert_array_equal(ids3, ids[:, :3])
    m = registry.evaluate_bundle(bundle, built.ctx)
    for k in registry.GATE_METRICS:
        assert m[k] == pytest.approx(built.metrics[k], abs=1e-12)
    frame = serving_bundle.predictions_frame(ids3[:2], scores3[:2], bundle)
    assert list(frame.columns) == ["label_ids", "labels", "scores"]
    assert frame["labels"][0] == [built.ds.label_texts[i] for i in ids3[0]]
    # a faster serving setting than the evaluated one is recorded as such
    fast = serving_bundle.write_bundle(built.ctx, tmp_path / "fast", shortlist_size=3, ef_search=16)
    assert fast["shortlist_size"] == 3 and fast["ef_search"] == 16 and fast["as_evaluated"] is False
    assert info["as_evaluated"] is True
    fast_bundle = serving_bundle.load_bundle(tmp_path / "fast", "cpu")
    ids_fast, _ = serving_bundle.predict_topk(built.ds.test_texts, fast_bundle, 10)
    width = 3 * len(fast["sources"])  # at most 3 candidates from each source (ngame: W, label, knn)
    assert ((ids_fast >= 0).sum(1) <= width).all() and ((ids_fast >= 0).sum(1) >= 3).all()


def test_large_exact_indexes_are_served_from_graphs(built, tmp_path):
    """``graph_above``: each exact index of more vectors is written as an HNSW graph (the rest linked as they
    are), recorded in serving.json and as not as evaluated; its answers equal the exact bundle's on this small set
    (HNSW with efSearch above the vectors finds every neighbour)."""
    exact = serving_bundle.write_bundle(built.ctx, tmp_path / "exact")
    sizes = {name: len(np.load(tmp_path / "exact" / name)) for name in ("W.index", "label_emb.index", "knn.index")}
    above = min(sizes.values())  # the smaller indexes stay exact, the larger become graphs
    info = serving_bundle.write_bundle(built.ctx, tmp_path / "graph", graph_above=above)
    want = sorted(name for name, n in sizes.items() if n > above)
    assert want and info["graph_indexes"] == sorted(info["graph_indexes"]) == want
    assert info["as_evaluated"] is False and exact["as_evaluated"] is True and exact["graph_indexes"] == []
    for name, n in sizes.items():
        assert saved_kind(tmp_path / "graph" / name) == ("hnsw" if n > above else "exact")
    graph = serving_bundle.load_bundle(tmp_path / "graph", "cpu")
    ids, scores = serving_bundle.predict_topk(built.ds.test_texts, graph, 10)
    want_ids, want_scores = serving_bundle.predict_topk(
        built.ds.test_texts, serving_bundle.load_bundle(tmp_path / "exact", "cpu"), 10)
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_allclose(scores, want_scores, rtol=1e-5, atol=1e-6)
    with pytest.raises(XCConfigError, match="graph_above"):
        serving_bundle.write_bundle(built.ctx, tmp_path / "bad", graph_above=-1)


def test_a_bundle_is_written_whole_or_not_at_all(built, tmp_path, monkeypatch):
    """write_bundle assembles beside its folder and renames: a failure part-way leaves nothing (no folder, no
    temporary one), and a folder holding files (another bundle's) is refused, never mixed into."""
    real, writes = serving_bundle.save_json, []

    def failing(path, obj):  # serving.json: the last part before the manifest
        writes.append(Path(path).name)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(serving_bundle, "save_json", failing)
    with pytest.raises(OSError, match="No space left"):
        serving_bundle.write_bundle(built.ctx, tmp_path / "bundle")
    assert writes == ["serving.json"] and list(tmp_path.iterdir()) == []
    monkeypatch.setattr(serving_bundle, "save_json", real)
    (tmp_path / "empty").mkdir()  # an empty folder may be the target
    assert serving_bundle.write_bundle(built.ctx, tmp_path / "empty")["format"] == serving_bundle.BUNDLE_FORMAT
    assert serving_bundle.load_bundle(tmp_path / "empty", "cpu").num_labels == built.ds.num_labels
    with pytest.raises(XCConfigError, match=r"serving bundle folder .*empty: exists and is not empty"):
        serving_bundle.write_bundle(built.ctx, tmp_path / "empty")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty"]


# ---------------------------------------------------------------------------- registry and promotion

def test_register_pyfunc_and_champion_challenger(built, tmp_path):
    ctx = built.ctx
    tracker = Tracker(f"sqlite:///{tmp_path / 'mlflow.db'}", tmp_path / "mlartifacts")
    client = tracker.client

    # first version: champion, the gate passes as "first"
    r1 = registry.register_model(ctx, tracker, {"dagster_run_id": "test"}, default_k=10)
    assert (r1["name"], r1["version"], r1["alias"]) == (NAME, "1", "champion")
    d1 = registry.champion_gate(ctx, tracker, r1, tolerance=0.0)
    assert d1["promote"] and d1["first"] and d1["aliases"] == {"champion": "1"}
    run = client.get_run(r1["run_id"])
    assert run.data.tags["asset"] == "registered_model" and run.data.tags["dataset"] == DATASET
    assert client.get_experiment(run.info.experiment_id).name == experiment_name(DATASET)
    assert run.data.metrics["precision_at_1"] == pytest.approx(built.metrics["precision_at_1"])
    # MLflow 3: the metrics belong to the LoggedModel too (the Models view), measured on the test split's dataset
    model = client.get_logged_model(r1["model_id"])
    by_key = {m.key: m for m in model.metrics}
    assert by_key["precision_at_1"].value == pytest.approx(built.metrics["precision_at_1"])
    assert (by_key["precision_at_1"].dataset_name, by_key["precision_at_1"].dataset_digest) == \
        (DATASET, r1["test_split"][:32])
    (inp,) = run.inputs.dataset_inputs
    assert inp.dataset.digest == r1["test_split"][:32] and {t.value for t in inp.tags} == {"test"}
    mv = client.get_model_version(NAME, "1")
    assert float(mv.tags["precision_at_1"]) == built.metrics["precision_at_1"]
    assert float(mv.tags["psprecision_at_1"]) == built.metrics["psprecision_at_1"]

    # the pyfunc, loaded by alias: same top-k as the evaluation's predictions; k honoured
    with tracking.use_tracking_uri(tracker.tracking_uri):
        model = mlflow.pyfunc.load_model(f"models:/{NAME}@champion")
    sig = model.metadata.signature
    assert sig.inputs.input_names() == ["text"]
    assert [p.name for p in sig.params.params] == ["k"] and sig.params.params[0].default == 10
    assert set(sig.outputs.input_names()) == {"label_ids", "labels", "scores"}
    assert model.metadata.saved_input_example_info is not None
    out = model.predict(pd.DataFrame({"text": built.ds.test_texts}), params={"k": 10})
    assert len(out) == 40 and all(len(x) <= 10 for x in out["label_ids"])
    ids = np.array([x + [-1] * (10 - len(x)) for x in out["label_ids"]])
    np.testing.assert_array_equal(remove_filtered(ids, None, built.ds.filter_test)[0], built.predictions)
    out3 = model.predict(pd.DataFrame({"text": built.ds.test_texts}), params={"k": 3})
    assert [x[:3] for x in out["label_ids"]] == list(out3["label_ids"])
    assert all(len(x) == 3 for x in out3["label_ids"]) and all(len(x) == 3 for x in out3["scores"])
    assert out3["labels"][0] == [built.ds.label_texts[i] for i in out3["label_ids"][0]]
    assert len(model.predict(pd.DataFrame({"text": ["apple river"]}))["label_ids"][0]) <= 10  # default k

    # a later, worse version: challenger, refused (P@1 2 pp lower, tolerance 1 pp); champion stays
    worse = _with_metrics(ctx, tmp_path / "worse", precision_at_1=built.metrics["precision_at_1"] - 0.02)
    r2 = registry.register_model(worse, tracker)
    assert (r2["version"], r2["alias"]) == ("2", "challenger")
    d2 = registry.champion_gate(worse, tracker, r2, tolerance=1.0)
    assert not d2["promote"] and d2["worse"] == ["precision_at_1"]
    assert d2["champion_metrics_source"].startswith("version tags")
    assert d2["champion"] == pytest.approx({m: built.metrics[m] for m in registry.GATE_METRICS})
    assert d2["delta_pp"]["precision_at_1"] == pytest.approx(-2.0)
    assert d2["aliases"] == {"champion": "1", "challenger": "2"}
    assert client.get_model_version(NAME, "2").tags["promotion"] == "refused"

    # equal numbers, champion measured on "another split": it is re-evaluated on this one (same model,
    # so the same numbers through the serving path), and the challenger is promoted; the alias moves
    client.set_model_version_tag(NAME, "1", "test_split", "another-split")
    r3 = registry.register_model(ctx, tracker)
    assert (r3["version"], r3["alias"]) == ("3", "challenger")
    d3 = registry.champion_gate(ctx, tracker, r3, tolerance=0.0)
    assert d3["champion_metrics_source"].startswith("re-evaluated")
    assert d3["champion"] == pytest.approx({m: built.metrics[m] for m in registry.GATE_METRICS}, abs=1e-12)
    assert d3["promote"] and d3["aliases"] == {"champion": "3"}
    assert client.get_model_version(NAME, "1").tags["superseded_by"] == "3"
    assert str(client.get_model_version_by_alias(NAME, "champion").version) == "3"


# ------------------------------------------------------------------------------------- Dagster asset

def test_registered_model_asset_and_blocking_gate_through_dagster(built):
    import dagster as dg

    from assets import build_lifecycle_assets
    from resources.home import dataset_partitions
    from xc_dagster.definitions import PIPELINE_JOB, build_definitions, pipeline_resources

    home = built.home
    defs = build_definitions(home)
    assert "registered_model" in {k.to_user_string() for k in defs.resolve_all_asset_keys()}
    assert "registered_model" in {k.to_user_string() for k in defs.resolve_job_def(PIPELINE_JOB).asset_layer
                                  .selected_asset_keys}
    assets = build_lifecycle_assets(dataset_partitions())
    (spec,) = assets[0].check_specs
    assert spec.name == "champion_gate" and spec.blocking

    def materialize(tolerance: float):
        return dg.materialize(assets, partition_key=DATASET, resources=pipeline_resources(home),
                              instance=dagster_instance(DATASET), raise_on_error=False,
                              run_config={"ops": {"registered_model": {"config": {"tolerance": tolerance}}}})

    res = materialize(0.0)
    assert res.success
    (mat,) = res.get_asset_materialization_events()
    meta = {k: v.value for k, v in mat.materialization.metadata.items()}
    assert meta["model_name"] == NAME and meta["alias"] == "champion"
    assert meta["model_uri"] == f"models:/{NAME}/{meta['version']}"
    (check,) = res.get_asset_check_evaluations()
    assert check.check_name == "champion_gate" and check.passed
    first_version = meta["version"]

    # worse numbers: the check fails with ERROR (blocking: the step fails), champion unchanged
    mpath = built.ctx.dir("evaluate") / "metrics.json"
    original = mpath.read_text()
    try:
        save_json(mpath, {**json.loads(original), "psprecision_at_1": built.metrics["psprecision_at_1"] - 0.05})
        res2 = materialize(1.0)
    finally:
        mpath.write_text(original)
    assert not res2.success
    (check2,) = res2.get_asset_check_evaluations()
    assert not check2.passed and check2.severity == dg.AssetCheckSeverity.ERROR
    m2 = {k: v.value for k, v in check2.metadata.items()}
    assert m2["decision"] == "refused: stays challenger" and m2["promoted"] is False
    assert m2["champion_version"] == first_version and m2["tolerance_pp"] == 1.0
    assert m2["champion PSP@1"] == pytest.approx(100 * built.metrics["psprecision_at_1"], abs=1e-3)
    assert m2["challenger PSP@1"] == pytest.approx(100 * built.metrics["psprecision_at_1"] - 5, abs=1e-3)
    assert {"challenger P@1", "champion P@1", "reasons", "challenger_metrics", "champion_metrics"} <= set(m2)
    client = mlflow.MlflowClient(home.mlflow_uri)
    assert str(client.get_model_version_by_alias(NAME, "champion").version) == first_version
    runs = client.search_runs([client.get_experiment_by_name(experiment_name(DATASET)).experiment_id],
                              "tags.asset = 'registered_model'")
    assert len(runs) == 2 and {r.data.tags["dagster_run_id"] for r in runs} == {res.run_id, res2.run_id}


def test_gate_tolerance_from_the_catalog_when_the_run_has_no_config(built):
    """Runs of the click-log sensor and the retrain schedule carry no run config: the gate then takes the
    dataset's catalog ``gate_tolerance``; a tolerance given in run config still wins over it."""
    import dagster as dg

    from assets import build_lifecycle_assets
    from resources.home import dataset_partitions
    from xc_dagster.definitions import pipeline_resources

    home = built.home
    assets = build_lifecycle_assets(dataset_partitions())
    cat = Catalog(home.catalog)
    entry = cat.get(DATASET)
    mpath = built.ctx.dir("evaluate") / "metrics.json"
    original = mpath.read_text()
    psp = built.metrics["psprecision_at_1"]

    def materialize(psp_drop_pp: float, run_config: dict | None = None):
        save_json(mpath, {**json.loads(original), "psprecision_at_1": psp - psp_drop_pp / 100})
        res = dg.materialize(assets, partition_key=DATASET, resources=pipeline_resources(home),
                             instance=dagster_instance(DATASET), raise_on_error=False, run_config=run_config)
        (check,) = res.get_asset_check_evaluations()
        return res, {k: v.value for k, v in check.metadata.items()}

    try:
        cat.add(dataclasses.replace(entry, gate_tolerance=1.0), replace=True)
        res, m = materialize(0.0)  # a champion with the measured numbers (first version or a tie)
        assert res.success and m["promoted"] is True and m["tolerance_pp"] == 1.0
        champion = m["challenger_version"]
        # PSP@1 0.5 pp below the champion, no run config: within the catalog's 1 pp -> promoted
        res, m = materialize(0.5)
        assert res.success and m["promoted"] is True and m["decision"] == "promoted to champion"
        assert m["champion_version"] == champion
        assert m["tolerance_pp"] == 1.0 and m["tolerance_source"] == "catalog gate_tolerance"
        assert m["delta_pp"]["psprecision_at_1"] == pytest.approx(-0.5, abs=1e-6)
        champion = m["challenger_version"]
        # again 0.5 pp below the (new) champion, with tolerance 0 in run config: the run config wins, refused
        res, m = materialize(1.0, {"ops": {"registered_model": {"config": {"tolerance": 0.0}}}})
        assert not res.success and m["promoted"] is False and m["decision"] == "refused: stays challenger"
        assert m["tolerance_pp"] == 0.0 and m["tolerance_source"] == "run config"
        assert m["delta_pp"]["psprecision_at_1"] == pytest.approx(-0.5, abs=1e-6)
        # the same numbers without the catalog value and without run config: the default 0, refused
        cat.add(dataclasses.replace(entry, gate_tolerance=None), replace=True)
        res, m = materialize(1.0)
        assert not res.success and m["promoted"] is False
        assert m["tolerance_pp"] == 0.0 and m["tolerance_source"] == "default"
        client = mlflow.MlflowClient(home.mlflow_uri)
        assert str(client.get_model_version_by_alias(NAME, "champion").version) == champion
    finally:
        mpath.write_text(original)
        cat.add(entry, replace=True)


# ------------------------------------------------------------------------------------- HTTP serving

def _get(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status
    except (urllib.error.URLError, ConnectionError, OSError):
        return 0


def test_mlflow_models_serve_answers_scoring_requests(built, tmp_path):
    home, ctx = built.home, built.ctx
    bin_dir = Path(sys.executable).parent
    exe = bin_dir / "mlflow" if (bin_dir / "mlflow").exists() else shutil.which("mlflow")
    if exe is None:
        pytest.skip("the mlflow command is not installed")
    tracker = Tracker(home.mlflow_uri, home.mlflow_artifacts)
    if not (_registered(tracker) and registry.CHAMPION in registry._aliases(tracker.client, NAME)):
        registry.champion_gate(ctx, tracker, registry.register_model(ctx, tracker))
    champion = tracker.client.get_model_version_by_alias(NAME, "champion").version
    bundle = registry.load_served_bundle(f"models:/{NAME}/{champion}", home.mlflow_uri, "cpu")
    texts = built.ds.test_texts[:2]
    expected, _ = serving_bundle.predict_topk(texts, bundle, 3)

    port = free_port()
    env = {**os.environ, "MLFLOW_TRACKING_URI": home.mlflow_uri, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    log = open(tmp_path / "serve.log", "wb")
    proc = subprocess.Popen([str(exe), "models", "serve", "-m", f"models:/{NAME}@champion", "--env-manager",
                             "local", "-p", str(port), "-h", "127.0.0.1"], env=env, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while _get(f"http://127.0.0.1:{port}/ping") != 200:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "scoring server not up in 120 s\n" + \
                (tmp_path / "serve.log").read_text()[-3000:]
            time.sleep(0.5)
        body = {"dataframe_split": {"columns": ["text"], "data": [[t] for t in texts]}, "params": {"k": 3}}
        req = urllib.request.Request(f"http://127.0.0.1:{port}/invocations", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
        with urllib.request.urlopen(req, timeout=60) as r:
            answer = json.loads(r.read())
    finally:
        stop_process_group(proc, 20)  # the server and its uvicorn worker (their own process group)
        log.close()
    preds = answer["predictions"]
    assert [p["label_ids"] for p in preds] == expected.tolist()
    assert preds[0]["labels"] == [built.ds.label_texts[i] for i in expected[0]]
    assert all(len(p["scores"]) == 3 for p in preds)


def _registered(tracker: Tracker) -> bool:
    try:
        tracker.client.get_registered_model(NAME)
        return True
    except mlflow.exceptions.MlflowException:
        return False
