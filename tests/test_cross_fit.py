"""Cross-fitting the fusion over folds of the training points (``fusion.fit_on``, ``ingest.valid_min``)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import scipy.sparse as sp

from tests.test_pipeline import TINY
from tests.tinydata import tiny_lf_home
from xc_dagster.catalog import Catalog
from xc_dagster.data.splits import cross_fit_folds, validation_split
from xc_dagster.errors import XCConfigError
from xc_dagster.pipeline import StageContext, run_all
from xc_dagster.pipeline.cross_fit import concat_shortlists, cross_fit_shortlists, fold_sources
from xc_dagster.retrieval.ann import LabelIndex
from xc_dagster.retrieval.fusion import load_fusion
from xc_dagster.retrieval.fusion.objective import validation_objective
from xc_dagster.retrieval.shortlist import ShortlistSources, retrieve
from xc_dagster.retrieval.votes import fitted_votes
from xc_dagster.storage import ArtifactStore


def test_folds_partition_the_rows_and_bound_the_scored_points():
    rows = np.arange(3, 1003, 2)  # 500 training rows, not starting at 0
    folds = cross_fit_folds(rows, 5, 200, seed=1)
    assert len(folds) == 5
    np.testing.assert_array_equal(np.sort(np.concatenate([f for f, _ in folds])), rows)  # disjoint cover
    assert [len(f) for f, _ in folds] == [100] * 5
    for fold, scored in folds:
        assert len(scored) == 40 and np.isin(scored, fold).all() and np.all(np.diff(scored) > 0)
    again = cross_fit_folds(rows, 5, 200, seed=1)
    assert all(np.array_equal(a[1], b[1]) for a, b in zip(folds, again))
    assert [len(s) for _, s in cross_fit_folds(rows, 4, 10_000, seed=1)] == [125] * 4  # all scored
    with pytest.raises(XCConfigError, match="fusion.cross_fit_folds"):
        cross_fit_folds(rows, 1, 200, seed=1)
    with pytest.raises(XCConfigError, match="fusion.cross_fit_max_points"):
        cross_fit_folds(rows, 5, 3, seed=1)


def test_validation_split_is_not_carved_below_valid_min():
    assert len(validation_split(1000, 0.05, 5000, 0)) == 50
    assert len(validation_split(1000, 0.05, 5000, 0, min_rows=50)) == 50
    assert len(validation_split(1000, 0.05, 5000, 0, min_rows=51)) == 0


def test_fold_sources_never_use_the_folds_points():
    """A fold's kNN scores are the brute-force scores over the other folds' points only, and its W is the fold's."""
    rng = np.random.default_rng(0)
    n, L, d, K = 60, 12, 8, 3
    emb = rng.normal(size=(n, d)).astype(np.float32)
    emb /= np.linalg.norm(emb, axis=1, keepdims=True)
    Y = sp.random(n, L, density=0.2, random_state=0, format="csr", dtype=np.float32)
    Y.data[:] = 1
    label_emb = rng.normal(size=(L, d)).astype(np.float32)
    m = ShortlistSources(label_emb, label_emb, {"W": LabelIndex("exact", label_emb),
                                                "knn": LabelIndex("exact", emb)}, Y, knn_neighbours=K)
    fold = np.arange(0, n, 4)
    keep = np.setdiff1d(np.arange(n), fold)
    W = rng.normal(size=(L, d)).astype(np.float32)
    src = fold_sources(m, W, emb, label_emb, Y, keep, fold, np.arange(n), {"kind": "exact"}, {})
    sl = retrieve(emb[fold], src, L)
    sims = emb[fold] @ emb[keep].T
    for i in range(len(fold)):
        top = np.argsort(-sims[i])[:K]  # the K nearest among the other folds
        want = (sims[i, top][:, None] * Y[keep[top]].toarray()).sum(0) / K
        ok = sl.ids[i] >= 0
        np.testing.assert_allclose(sl.knn[i][ok], want[sl.ids[i][ok]], atol=1e-5)
        np.testing.assert_allclose(sl.clf[i][ok], W[sl.ids[i][ok]] @ emb[fold[i]], atol=1e-5)
    parts = concat_shortlists([sl, sl])
    assert parts.ids.shape == (2 * len(fold), sl.ids.shape[1]) and parts.lex is None


def test_small_dataset_is_cross_fitted_end_to_end(tmp_path, monkeypatch):
    """ingest.valid_min above the split's size: every training point trains the models, the fusion is fitted on
    all 120 points out of fold; scoring the same points in-sample (their own kNN row, the deployed W) reads far
    higher on the fusion's objective, which is what fitting on them would overfit to."""
    home = tiny_lf_home(tmp_path, monkeypatch, {**TINY, "pretrain.epochs": 1, "classifier.epochs": 2,
                                                "index.sources": "W,label,knn,lexical", "ingest.valid_min": 100,
                                                "fusion.cross_fit_folds": 4})
    spec = Catalog(home.catalog).get("TinyTitles")
    ctx = StageContext(ArtifactStore(home.artifacts), spec, spec.config(), home.cache)
    out = run_all(ctx)
    assert out["ingest"]["n_valid"] == 0 and out["index"]["knn_points"] == 120
    fus = out["fusion"]
    assert fus["fit_on"] == "cross_fit" and fus["cross_fit_folds"] == 4 and fus["cross_fit_points"] == 120
    fusion_file = json.loads((ctx.dir("fusion") / "fusion.json").read_text())
    fitted = load_fusion(fusion_file)
    assert fitted.method == "alpha" and "vote_grid" not in fus  # ngame: the index's own votes
    # it was fitted on the out-of-fold shortlists; in-sample (the deployed sources, each point its own nearest
    # neighbour) the positives' kNN scores are far higher: what a fit on them would overrate
    ds = ctx.read.labels()
    inv_prop = ctx.inv_prop(ds.Y_train)
    # with the votes it chose, and with the index stage's (10 neighbours, squared: the in-sample comparison below)
    cf, cf_index = cross_fit_shortlists(ctx, inv_prop, None, [fitted_votes(fusion_file), None])
    assert cf.points == 120 and cf.Y.shape == (120, 20)
    value = validation_objective(cf.shortlist.ids, fitted.score(cf.shortlist, inv_prop), cf.Y,
                                 ctx.cfg.fusion.objective, inv_prop, cf.filter_pairs, 10)
    assert value == pytest.approx(fus["objective_value"], abs=1e-9)
    m = ctx.read.shortlist_sources(ctx.cfg.index.hnsw_ef_search)
    insample = retrieve(ctx.read.embeddings("train"), m, 8, lexical_queries=ctx.read.lexical_queries(m, "train"))

    def positive_knn(sl, Y):
        hit = np.take_along_axis(Y.toarray(), np.maximum(sl.ids, 0), axis=1) * (sl.ids >= 0)
        return float(sl.knn[hit > 0].mean())

    rows = np.concatenate([s for _, s in cross_fit_folds(np.arange(120), 4, 20_000, 0)])
    assert positive_knn(insample, ds.Y_train) > positive_knn(cf_index.shortlist, ds.Y_train[rows]) + 0.05
    # "validation" without a split keeps the old default blend; a bad choice is refused
    spec2 = spec.config({"fusion.fit_on": "validation"})
    assert run_all(StageContext(ctx.store, spec, spec2, home.cache), ("fusion",))["fusion"]["fit_on"] == "none"
    with pytest.raises(XCConfigError, match="fusion.fit_on"):
        run_all(StageContext(ctx.store, spec, spec.config({"fusion.fit_on": "folds"}), home.cache), ("fusion",))


def test_cross_fitting_a_fusion_needs_an_index_built_for_it(tmp_path, monkeypatch):
    """The co-occurrence source (and the lexical classifiers) of an index built for a validation fit count every
    training point: a cross-fitted fusion over it is refused, naming fusion.fit_on; the index stage run again
    with it leaves them out, and the fusion is then cross-fitted."""
    home = tiny_lf_home(tmp_path, monkeypatch, {**TINY, "pretrain.epochs": 1, "classifier.epochs": 2,
                                                "fusion.cross_fit_folds": 3})
    spec = Catalog(home.catalog).get("TinyTitles")
    ctx = StageContext(ArtifactStore(home.artifacts), spec, spec.config(), home.cache)
    out = run_all(ctx)
    assert "cooccurrence" in out["index"]["sources"] and out["fusion"]["fit_on"] == "validation"
    cross = StageContext(ctx.store, spec, spec.config({"fusion.fit_on": "cross_fit"}), home.cache)
    with pytest.raises(XCConfigError, match="index stage was built for a fusion fitted on validation"):
        run_all(cross, ("fusion",))
    again = run_all(cross, ("index", "fusion"))
    assert "cooccurrence" not in again["index"]["sources"] and "left_out" in again["index"]["cooccurrence"]
    assert again["index"]["lexical"]["classifier_weights"] == 0 and again["fusion"]["fit_on"] == "cross_fit"
