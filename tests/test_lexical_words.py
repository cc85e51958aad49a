"""The lexical source of a BoW dataset with its feature words: ingest keeps the vocabulary, a point's rebuilt text
and its feature row have the same TF-IDF row (whatever the feature values and however odd the vocabulary), the
words are saved without pickle, and without them the model serves feature vectors instead of text."""

from __future__ import annotations

import json

import numpy as np
import pytest
import scipy.sparse as sp

from tests.test_lexical import _write_bow, bow_context
from xc_dagster.data import load_dataset, read_dataset, save_dataset
from xc_dagster.data.canonical import FEATURE_WORDS_FILE, load_feature_words
from xc_dagster.data.companions import _texts_from_vocab
from xc_dagster.errors import XCConfigError, XCError
from xc_dagster.pipeline import run_all
from xc_dagster.retrieval.lexical import FEATURE_WORDS_FILE as LEXICAL_WORDS_FILE
from xc_dagster.retrieval.lexical import LexicalIndex
from xc_dagster.retrieval.sparse_rows import sparse_topk
from xc_dagster.serving import bundle as serving_bundle

PLAIN = [f"w{i}" for i in range(12)]
# repeated, empty and two-piece words: columns 0 and 2 share a term, "c d" is the terms c and d, "" has none
ODD = ["a", "b", "a", "c d", "", "e", "f", "g h", "h", "i", "j", "k"]


def _features(seed: int = 1) -> tuple[sp.csr_matrix, sp.csr_matrix]:
    X = sp.random(60, 12, density=0.3, random_state=seed, format="csr", dtype=np.float32)
    X.data = 0.25 + 2 * X.data  # real values: a rebuilt text keeps their order, not them
    Y = sp.random(60, 5, density=0.3, random_state=seed + 1, format="csr", dtype=np.float32)
    return X, Y


@pytest.mark.parametrize("words", [PLAIN, ODD], ids=["plain", "odd"])
def test_rebuilt_text_and_feature_row_have_the_same_tfidf_row(words):
    """transform(rebuilt text) == transform(feature row), exactly, for every point; the text's words are matched
    case-sensitively on single spaces, unknown words ignored; an explicit 0 entry counts as its word."""
    X, Y = _features()
    lex = LexicalIndex.fit(X, None, Y, neighbours=3, fit_on=np.arange(50), feature_words=words)
    texts = _texts_from_vocab(X, np.array(words, dtype=object))
    A, B = lex.transform(texts), lex.transform(X)
    assert A.dtype == B.dtype == np.float32 and A.shape == B.shape == (60, lex.points.shape[1])
    np.testing.assert_array_equal(A.toarray(), B.toarray())
    np.testing.assert_array_equal(lex.scores(A).toarray(), lex.scores(B).toarray())
    np.testing.assert_array_equal(lex.points.toarray(), lex.transform(X).toarray())  # indexed as it serves
    assert lex.num_features == 12 and lex.points.shape[1] == (12 if words is PLAIN else 11)
    noisy = [f"{t}  UNKNOWN {t.upper()}" for t in texts[:5]]  # double spaces, an unknown and upper-cased words
    np.testing.assert_array_equal(lex.transform(noisy).toarray(), B[:5].toarray())
    Z = sp.csr_matrix((np.zeros(2, np.float32), ([0, 1], [3, 5])), shape=(2, 12))
    np.testing.assert_array_equal(lex.transform(Z).toarray(), lex.transform([words[3], words[5]]).toarray())
    assert lex.transform([]).shape == (0, lex.points.shape[1]) and lex.transform(X[:0]).shape[0] == 0
    assert lex.transform([""]).nnz == 0
    with pytest.raises(XCError, match="columns"):
        lex.transform(X[:, :5])


def test_feature_words_round_trip_without_pickle(tmp_path):
    """The index saves its words as a JSON list and loads them back, serving the same rows; one fitted without
    words keeps refusing raw text with the index.sources error."""
    X, Y = _features(3)
    lex = LexicalIndex.fit(X, None, Y, neighbours=3, feature_words=ODD)
    lex.save(tmp_path / "lex")
    assert json.loads((tmp_path / "lex" / LEXICAL_WORDS_FILE).read_text()) == ODD
    assert json.loads((tmp_path / "lex" / "lexical.json").read_text())["feature_words"] is True
    back = LexicalIndex.load(tmp_path / "lex")
    texts = _texts_from_vocab(X, np.array(ODD, dtype=object))
    np.testing.assert_array_equal(back.transform(texts).toarray(), lex.transform(X).toarray())
    bare = LexicalIndex.fit(X, None, Y, neighbours=3)
    bare.save(tmp_path / "bare")
    assert not (tmp_path / "bare" / LEXICAL_WORDS_FILE).exists()
    with pytest.raises(XCConfigError, match="index.sources.*feature words"):
        LexicalIndex.load(tmp_path / "bare").transform(texts)
    with pytest.raises(ValueError, match="feature words"):
        LexicalIndex.fit(X, None, Y, neighbours=3, feature_words=ODD[:5])
    with pytest.raises(ValueError, match="feature_words"):
        LexicalIndex.fit(texts, None, Y, neighbours=3, feature_words=ODD)


def test_ingest_keeps_the_feature_words(tmp_path):
    """The BoW reader keeps X_vocab.txt's words, the canonical folder stores them (Parquet), and a dataset
    without a vocabulary has none."""
    ds = read_dataset(_write_bow(tmp_path / "with"))
    assert ds.feature_words == [f"word{i}" for i in range(30)]
    save_dataset(ds, tmp_path / "saved")
    assert (tmp_path / "saved" / FEATURE_WORDS_FILE).is_file()
    assert load_feature_words(tmp_path / "saved") == load_dataset(tmp_path / "saved").feature_words == ds.feature_words
    assert load_dataset(tmp_path / "saved", features=False).feature_words is None
    bare = read_dataset(_write_bow(tmp_path / "without", vocab=False))
    assert bare.feature_words is None and bare.X_train is not None
    save_dataset(bare, tmp_path / "bare")
    assert load_feature_words(tmp_path / "bare") is None and load_dataset(tmp_path / "bare").feature_words is None


def test_a_bow_dataset_without_vocabulary_trains_no_encoder_and_serves_feature_vectors(tmp_path, monkeypatch):
    """Without X_vocab.txt no point has text: ingest counts none, pretraining trains nothing (its epochs set or not:
    every point would be the same empty input), the lexical index reads the feature values (no words), and the
    model serves feature vectors: the bundle (``input: features``) gives the test rows the evaluation's predictions,
    refuses text, and the registered_model asset registers it, its pyfunc reading a ``features`` column."""
    import dagster as dg
    import mlflow
    import pandas as pd

    from assets import build_lifecycle_assets
    from resources.home import dataset_partitions
    from tests.tinydata import dagster_instance
    from xc_dagster.definitions import pipeline_resources
    from xc_dagster.evaluation.metrics import remove_filtered
    from xc_dagster.home import Home
    from xc_dagster.serving.requests import feature_lines
    from xc_dagster.tracking import use_tracking_uri

    ctx = bow_context(tmp_path, monkeypatch, vocab=False)
    assert ctx.cfg.pretrain.epochs == 1 and "pretrain.epochs" in ctx.cfg.explicit
    out = run_all(ctx)
    assert out["ingest"]["train_texts"] == 0 and out["pretrain"]["steps"] == 0
    assert out["pretrain"]["budget"]["planned_epochs"] == 0
    assert out["index"]["lexical"]["input"] == "features" and out["index"]["lexical"]["feature_words"] is False
    info = serving_bundle.write_bundle(ctx, tmp_path / "bundle")
    assert info["input"] == "features" and info["num_features"] == 30
    bundle = serving_bundle.load_bundle(tmp_path / "bundle", "cpu")
    X_test = ctx.read.features("test")
    ids, scores = serving_bundle.predict_features(X_test, bundle, 10)
    filtered, _ = remove_filtered(ids, scores, ctx.read.dataset(features=False).filter_test)
    np.testing.assert_array_equal(filtered, np.load(ctx.dir("evaluate") / "predictions.npz")["ids"])
    with pytest.raises(XCError, match="feature vectors.*'features'.*30 features"):
        serving_bundle.predict_topk(["word1 word2"], bundle, 10)
    empty, _ = serving_bundle.predict_features(sp.csr_matrix((2, 30), dtype=np.float32), bundle, 10)
    assert (empty == -1).all()  # no feature, no labels
    # mixed: an encoder that reads text beside a lexical source that reads wordless features cannot be served
    monkeypatch.setattr(type(ctx), "points_have_text", lambda self: True)
    with pytest.raises(XCConfigError, match="feature words.*encoder reads the points' texts"):
        serving_bundle.write_bundle(ctx, tmp_path / "mixed")
    monkeypatch.undo()
    monkeypatch.setenv("XC_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    home = Home.from_env()
    res = dg.materialize(build_lifecycle_assets(dataset_partitions()), partition_key="TinyBow",
                         resources=pipeline_resources(home), instance=dagster_instance("TinyBow"),
                         raise_on_error=False)
    assert res.success
    (mat,) = res.get_asset_materialization_events()
    meta = {k: v.value for k, v in mat.materialization.metadata.items()}
    assert meta["model_name"] == "xc-TinyBow" and meta["alias"] == "champion"
    (check,) = res.get_asset_check_evaluations()
    assert check.passed
    with use_tracking_uri(home.mlflow_uri):
        model = mlflow.pyfunc.load_model("models:/xc-TinyBow@champion")
    assert model.metadata.get_input_schema().input_names() == ["features"]
    got = model.predict(pd.DataFrame({"features": feature_lines(X_test[:5])}), params={"k": 10})
    assert [row[:3] for row in got["label_ids"]] == [[int(i) for i in r[r >= 0][:3]] for r in ids[:5]]


@pytest.mark.parametrize("vocab", [False, True])
def test_without_text_the_model_is_the_lexical_source_alone(tmp_path, monkeypatch, vocab):
    """The strategy's sources over the points' embeddings: without any point text every embedding is the same, so
    the kNN source is left out (the lexical source keeps its own sparse kNN), and W and the label embeddings would
    only give each label a constant: the classifier stage trains nothing, the index serves the lexical source
    alone, with 25 kNN votes, and every candidate's classifier and embedding scores are 0, so the evaluation ranks by
    the fitted d * lexical + b * log(1 / p_l) exactly. With text, every source stays and W trains."""
    ctx = bow_context(tmp_path, monkeypatch, vocab=vocab, sources=None)
    assert {"W", "label", "knn", "lexical"} <= set(ctx.cfg.index.sources) and "index.sources" not in ctx.cfg.explicit
    out = run_all(ctx)
    assert ctx.lexical_only() is not vocab
    sources = out["index"]["sources"]
    assert {"W", "label", "knn", "lexical"} <= set(sources) if vocab else sources == ["lexical"]
    assert out["index"].get("dense", True) is vocab and (out["index"]["knn_points"] > 0) is vocab
    # its kNN the one part proposing labels by content: 25 neighbours vote (LEXICAL_ONLY_NEIGHBOURS), else the 10 set
    assert out["index"]["lexical"]["neighbours"] == (10 if vocab else 25) and ctx.cfg.index.lexical_neighbours == 10
    assert (out["classifier"]["steps"] > 0) is vocab and ("untrained" in out["classifier"]) is not vocab
    src = ctx.read.shortlist_sources(ctx.cfg.index.hnsw_ef_search)
    assert ("knn" in src.indexes) is vocab and src.dense is vocab
    # one weight of the lexical classifiers by default: it is theirs, nothing is chosen (test_lexical.py sets several)
    lex = out["index"]["lexical"]
    assert lex["classifier_weights"] > 0 and lex["classifier_weight_grid"] == []
    assert lex["classifier_weight"] == src.lexical.classifier.settings.weight == 1.0
    mined = ctx.read.shortlist()  # without text one point's shortlist, every point's
    assert (mined == mined[:1]).all() is not vocab and set(out["mining"]["kinds"].values()) == {"exact"}
    if vocab:
        return
    f = json.loads((ctx.dir("fusion") / "fusion.json").read_text())
    assert f["lexical_weight"] > 0
    Q = ctx.read.lexical_queries(src, "test")
    lex = sparse_topk(sp.csr_matrix(src.lexical.scores(Q)), ctx.cfg.index.shortlist_size)
    ds = ctx.read.labels()
    boost = np.log(ctx.inv_prop(ds.Y_train))
    want = np.where(lex[0] < 0, -np.inf, f["lexical_weight"] * lex[1]
                    + f["propensity_weight"] * boost[np.maximum(lex[0], 0)])
    want, lex = np.pad(want, ((0, 0), (0, 10)), constant_values=-np.inf), np.pad(lex[0], ((0, 0), (0, 10)),
                                                                                  constant_values=-1)
    top = np.argsort(-want, axis=1, kind="stable")[:, :10]
    got = np.load(ctx.dir("evaluate") / "predictions.npz")
    assert ds.filter_test.size == 0  # nothing removed: the predictions are the fused top 10 as ranked
    np.testing.assert_allclose(got["scores"], np.take_along_axis(want, top, 1).astype(np.float32), rtol=1e-5)
    ranked = np.where(np.isfinite(np.take_along_axis(want, top, 1)), np.take_along_axis(lex, top, 1), -1)
    assert (got["ids"] == ranked).mean() > 0.95  # ids agree up to ties of equal score
    info = serving_bundle.write_bundle(ctx, tmp_path / "bundle")  # served as evaluated: feature rows, no dense score
    assert info["dense"] is False and info["sources"] == ["lexical"]
    ids, scores = serving_bundle.predict_features(ctx.read.features("test"), serving_bundle.load_bundle(
        tmp_path / "bundle", "cpu"), 10)
    w = ids.shape[1]  # served without the evaluation's padding columns
    assert (got["ids"][:, w:] == -1).all()
    np.testing.assert_array_equal(ids, got["ids"][:, :w])
    np.testing.assert_allclose(scores, got["scores"][:, :w], rtol=1e-6)


def test_a_bow_dataset_with_its_vocabulary_has_text_to_train_on(tmp_path, monkeypatch):
    """The same files with X_vocab.txt: every point's text is rebuilt, and pretraining takes its steps."""
    out = run_all(bow_context(tmp_path, monkeypatch), stages=("ingest", "tokenize", "pretrain"))
    assert out["ingest"]["train_texts"] == out["ingest"]["n_train"] == 120 and out["pretrain"]["steps"] > 0
