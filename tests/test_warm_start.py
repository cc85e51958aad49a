"""Warm starts from a previous model: W initialisation by label text, bundle resolution and errors, and the
pretrain + classifier stages starting from a bundle's encoder and classifiers."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.test_pipeline import TINY
from tests.tinydata import ready_home, write_lf_dataset, write_tiny_encoder
from xc_dagster.catalog import Catalog, DatasetSpec
from xc_dagster.errors import XCConfigError
from xc_dagster.pipeline import StageContext, run_all
from xc_dagster.serving import bundle as serving_bundle
from xc_dagster.serving.warm_start import classifier_init, resolve_warm_start
from xc_dagster.storage import ArtifactStore, load_json


def _fake_bundle(folder, W, texts):
    (folder / "encoder").mkdir(parents=True)
    (folder / "serving.json").write_text("{}")
    np.save(folder / "W.npy", np.asarray(W, dtype=np.float32))
    pq.write_table(pa.table({"text": pa.array(texts, type=pa.string())}), folder / "labels.parquet")
    return folder


def test_classifier_init_takes_known_labels_by_text_and_new_ones_from_text_embeddings(tmp_path):
    W_prev = np.array([[1, 0], [0, 1], [0.6, 0.8], [-1, 0]], dtype=np.float32)
    b = _fake_bundle(tmp_path / "b", W_prev, ["oak", "pine", "elm", "oak"])
    E = np.array([[0.1, 0.2], [0.3, 0.4], [0.5, 0.6]], dtype=np.float32)
    W0, n = classifier_init(b, ["pine", "maple", "oak"], E)
    assert n == 2
    np.testing.assert_array_equal(W0, np.array([[0, 1], [0.3, 0.4], [1, 0]], dtype=np.float32))  # "oak": its first occurrence
    with pytest.raises(XCConfigError, match="dimension 2"):
        classifier_init(b, ["pine"], np.zeros((1, 3), dtype=np.float32))


def test_resolve_warm_start_values_and_errors(tmp_path, monkeypatch):
    assert resolve_warm_start("", "X", None, tmp_path / "w") is None
    with pytest.raises(XCConfigError, match="pretrain.warm_start='/nope'.*serving bundle"):
        resolve_warm_start("/nope", "X", None, tmp_path / "w")
    monkeypatch.setenv("XC_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert resolve_warm_start("champion", "X", None, tmp_path / "w") is None  # the home's store, no champion
    b = _fake_bundle(tmp_path / "b", np.eye(2), ["a", "b"])
    assert resolve_warm_start(str(b), "X", None, tmp_path / "w") == b
    # a tracking store without a registered model for the dataset: cold start
    assert resolve_warm_start("champion", "X", f"sqlite:///{tmp_path / 'm.db'}", tmp_path / "w") is None


def test_pretrain_and_classifiers_start_from_a_bundle(tmp_path, monkeypatch):
    monkeypatch.setenv("XC_HOME", str(tmp_path / "home"))
    home = ready_home(tmp_path / "home")
    enc = write_tiny_encoder(tmp_path / "enc")
    src = write_lf_dataset(tmp_path / "src" / "TinyTitles")
    cat = Catalog(home.catalog)
    cat.add(DatasetSpec("TinyTitles", str(src), overrides={**TINY, "tokenize.encoder": str(enc)}))
    spec = cat.get("TinyTitles")
    first = StageContext(ArtifactStore(home.artifacts), spec, spec.config(), home.cache)
    run_all(first)
    serving_bundle.write_bundle(first, tmp_path / "bundle")
    W_prev = np.load(tmp_path / "bundle" / "W.npy")
    # retrain on the same data in another partition, warm, without further pretraining steps
    cat.add(DatasetSpec("TinyTitles2", str(src), overrides={**TINY, "tokenize.encoder": str(enc),
                                                            "pretrain.epochs": 0,
                                                            "pretrain.warm_start": str(tmp_path / "bundle")}))
    spec2 = cat.get("TinyTitles2")
    second = StageContext(ArtifactStore(home.artifacts), spec2, spec2.config(), home.cache)
    run_all(second, ("ingest", "tokenize", "pretrain"))
    s = load_json(second.dir("pretrain") / "summary.json")
    assert s["warm_start"] == str(tmp_path / "bundle") and s["warm_start_labels"] == 20 and s["steps"] == 0
    # the first model's encoder: the same label embeddings; its classifiers: the initial W
    np.testing.assert_allclose(np.load(second.dir("pretrain") / "label_emb.npy"),
                               np.load(tmp_path / "bundle" / "label_emb.npy"), atol=1e-5)
    np.testing.assert_array_equal(np.load(second.dir("pretrain") / "classifier_init.npy"), W_prev)
    # a cold start writes no classifier_init and starts W from the label embeddings
    assert not (first.dir("pretrain") / "classifier_init.npy").exists()
    # the classifier stage then trains from W_prev: with 0 epochs W stays the previous model's W
    ctx = StageContext(second.store, spec2, spec2.config({"classifier.epochs": 0}), home.cache)
    run_all(ctx, ("mining", "classifier"))
    np.testing.assert_allclose(np.load(ctx.dir("classifier") / "W.npy"), W_prev, atol=1e-6)


def test_warm_start_rejects_an_encoder_with_another_vocabulary(tmp_path, monkeypatch):
    monkeypatch.setenv("XC_HOME", str(tmp_path / "home"))
    home = ready_home(tmp_path / "home")
    enc = write_tiny_encoder(tmp_path / "enc")
    src = write_lf_dataset(tmp_path / "src" / "TinyTitles")
    b = _fake_bundle(tmp_path / "b", np.eye(2), ["a", "b"])
    shutil.rmtree(b / "encoder")
    shutil.copytree(enc, b / "encoder")
    vocab = b / "encoder" / "vocab.txt"
    if vocab.exists():
        vocab.write_text(vocab.read_text() + "zzzextra\n")
    tok = b / "encoder" / "tokenizer.json"
    if tok.exists():
        d = json.loads(tok.read_text())
        d["model"]["vocab"]["zzzextra"] = len(d["model"]["vocab"])
        tok.write_text(json.dumps(d))
    Catalog(home.catalog).add(DatasetSpec("TinyTitles", str(src), overrides={
        **TINY, "tokenize.encoder": str(enc), "pretrain.warm_start": str(b)}))
    spec = Catalog(home.catalog).get("TinyTitles")
    ctx = StageContext(ArtifactStore(home.artifacts), spec, spec.config(), home.cache)
    run_all(ctx, ("ingest", "tokenize"))
    with pytest.raises(XCConfigError, match="another vocabulary"):
        run_all(ctx, ("pretrain",))
    assert not ctx.store.stage_dir("TinyTitles", "pretrain").exists()  # nothing half-written
