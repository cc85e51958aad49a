"""Score fusion: the alpha blend and NGAME's tree fusion (numpy predictor, JSON round trip, formula, errors)."""

from __future__ import annotations

import json
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
import scipy.sparse as sp
from sklearn.tree import DecisionTreeClassifier

from tests.tinydata import label_prior_metrics, write_lf_dataset, write_tiny_encoder
from xc_dagster.catalog import DatasetSpec
from xc_dagster.config import FusionParams
from xc_dagster.data.splits import validation_targets
from xc_dagster.errors import XCConfigError
from xc_dagster.evaluation.metrics import evaluate
from xc_dagster.pipeline import StageContext, run_all
from xc_dagster.pipeline.fusion import run as fusion_stage
from xc_dagster.retrieval.fusion import (
    FUSIONS,
    AlphaFusion,
    TreeFusion,
    check_method,
    fit_alpha,
    fit_fusion,
    fit_tree,
    load_fusion,
    missed_positive_features,
    smooth_grid,
)
from xc_dagster.retrieval.fusion import alpha as alpha_module
from xc_dagster.retrieval.fusion.objective import ObjectiveOnShortlist
from xc_dagster.retrieval.fusion.objective import validation_objective as _objective
from xc_dagster.retrieval.fusion.tree import _tree_from_sklearn
from xc_dagster.retrieval.shortlist import Shortlist, topk_from_scores
from xc_dagster.storage import ArtifactStore


def _roundtrip(f):
    return load_fusion(json.loads(json.dumps(f.to_dict())))


def _synthetic(n: int, L: int = 400, C: int = 20, seed: int = 0, inv_prop: np.ndarray | None = None):
    """Shortlists where relevance depends non-linearly on the scores and on the label's inverse propensity.

    Head labels (low inv_prop) are relevant when the classifier score is high, tail labels when the
    embedding score is high: no single blend a*clf + (1-a)*emb ranks both well, a tree that splits on
    inv_prop does.
    """
    rng = np.random.default_rng(seed)
    if inv_prop is None:
        inv_prop = np.where(rng.random(L) < 0.5, rng.uniform(1.0, 2.0, L), rng.uniform(4.0, 8.0, L))
    ids = np.argsort(rng.random((n, L)), axis=1)[:, :C].astype(np.int64)
    clf = rng.random((n, C)).astype(np.float32)
    emb = rng.random((n, C)).astype(np.float32)
    tail = inv_prop[ids] > 3.0
    signal = np.where(tail, emb, clf)
    p = np.where(signal > 0.85, 0.9, 0.02)
    rel = rng.random((n, C)) < p
    ids[:, -2:] = -1  # padding
    clf[:, -2:] = -np.inf
    emb[:, -2:] = -np.inf
    rel[:, -2:] = False
    r, c = np.nonzero(rel)
    Y = sp.csr_matrix((np.ones(len(r)), (r, ids[r, c])), shape=(n, L))
    return Shortlist(ids, clf, emb), Y, inv_prop


# ----------------------------------------------------------------------------------------- numpy tree

def test_numpy_tree_equals_sklearn_predict_proba():
    rng = np.random.default_rng(1)
    X = rng.normal(size=(3000, 3)).astype(np.float32)
    y = ((X[:, 0] * X[:, 1] > 0.2) ^ (X[:, 2] > 0.5)).astype(int)
    y[rng.random(len(y)) < 0.1] ^= 1
    est = DecisionTreeClassifier(max_depth=7, random_state=0).fit(X, y)
    tree = _tree_from_sklearn(est, None, {})
    Xt = rng.normal(size=(5000, 3)).astype(np.float32)
    # values exactly at and next to the thresholds exercise the <= comparison on float32 features
    inner = tree.children_left >= 0
    thr = tree.threshold[inner].astype(np.float32)
    feat = tree.feature[inner]
    edge = rng.normal(size=(3 * len(thr), 3)).astype(np.float32)
    for j, delta in enumerate((0, 1, -1)):
        vals = np.nextafter(thr, np.float32(np.inf * delta)) if delta else thr
        edge[j * len(thr) + np.arange(len(thr)), feat] = vals
    Xt = np.concatenate([Xt, edge])
    np.testing.assert_array_equal(tree.predict_proba(Xt), est.predict_proba(Xt)[:, 1])
    assert tree.max_depth == 7 and (tree.children_left == -1).sum() == est.get_n_leaves()


def test_constant_and_one_class_trees():
    sl, Y, inv = _synthetic(30, seed=3)
    f = fit_tree(sl, sp.csr_matrix(Y.shape), FusionParams(method="tree"), inv)  # no positives at all
    assert f.info["n_positive"] == 0 and len(f.leaf_prob) == 1 and f.leaf_prob[0] == 0.0
    s = f.score(sl, inv)
    ok = sl.ids >= 0
    np.testing.assert_allclose(s[ok], (sl.clf + sl.emb)[ok], rtol=1e-6)


# --------------------------------------------------------------------------------------- score formula

def test_final_score_hand_example_and_padding():
    # root: inv_prop (feature 2) <= 2.0 -> leaf 1 (P = 0.1), else leaf 2 (P = 0.9)
    tree = TreeFusion([1, -1, -1], [2, -1, -1], [2, -2, -2], [2.0, -2.0, -2.0], [0.5, 0.1, 0.9], 1, 3)
    sl = Shortlist(np.array([[0, 1, -1], [2, -1, -1]]),
                   np.array([[0.5, 0.2, -np.inf], [-0.1, -np.inf, -np.inf]], dtype=np.float32),
                   np.array([[0.3, 0.4, -np.inf], [0.25, -np.inf, -np.inf]], dtype=np.float32))
    inv = np.array([1.5, 3.0, 2.0])
    s = tree.score(sl, inv)
    want = np.array([[0.1 + 0.3 + 0.5, 0.9 + 0.4 + 0.2, -np.inf], [0.1 + 0.25 - 0.1, -np.inf, -np.inf]],
                    dtype=np.float32)
    np.testing.assert_allclose(s, want, rtol=1e-6)
    assert s.dtype == np.float32 and np.isneginf(s[sl.ids < 0]).all()
    # the alpha fusion ignores inv_prop and also pads with -inf
    a = AlphaFusion(0.25).score(sl, inv)
    np.testing.assert_allclose(a[0, :2], [0.25 * 0.5 + 0.75 * 0.3, 0.25 * 0.2 + 0.75 * 0.4], rtol=1e-6)
    assert np.isneginf(a[sl.ids < 0]).all()
    assert tree.alpha is None


# ------------------------------------------------------------------------------------ fit and compare

def test_tree_beats_alpha_where_relevance_depends_on_propensity():
    sl, Y, inv = _synthetic(800, seed=0)
    params = FusionParams(method="tree", grid_step=0.05, tree_min_samples_leaf=5)
    tree = fit_fusion(sl, Y, params, inv, None)
    # against the two-score blend (no propensity term: the tree must find the dependence on 1/p itself)
    alpha = fit_fusion(sl, Y, replace(params, method="alpha", propensity_grid=(0.0,)), inv, None)
    assert isinstance(tree, TreeFusion) and isinstance(alpha, AlphaFusion)
    best_alpha = max(o for _, o in alpha.grid)
    # cross-fitted (out-of-sample) tree objective vs the alpha grid's best, on the validation points
    assert tree.info["objective_value"] > best_alpha + 0.05
    assert tree.summary()["method"] == "tree" and tree.summary()["n_candidates"] == 800 * 18
    # and on fresh points from the same distribution
    sl2, Y2, _ = _synthetic(800, seed=1, inv_prop=inv)
    p_tree = _objective(sl2.ids, tree.score(sl2, inv), Y2, "precision_at_1", inv, None, 10)
    p_alpha = _objective(sl2.ids, alpha.score(sl2, inv), Y2, "precision_at_1", inv, None, 10)
    assert p_tree > p_alpha + 0.05


def test_subsampling_seeded_and_filter_pairs_dropped():
    sl, Y, inv = _synthetic(200, seed=4)
    params = FusionParams(method="tree", tree_max_samples=1000, seed=7)
    a, b = fit_tree(sl, Y, params, inv), fit_tree(sl, Y, params, inv)
    assert a.info["n_train"] == 1000 and a.info["n_candidates"] == 200 * 18
    np.testing.assert_array_equal(a.threshold, b.threshold)
    fp = np.stack([np.arange(10), sl.ids[:10, 0]], axis=1)
    c = fit_tree(sl, Y, replace(params, tree_max_samples=0), inv, filter_pairs=fp)
    assert c.info["n_candidates"] == 200 * 18 - 10 and c.info["n_train"] == 200 * 18 - 10


def test_missed_positives_scored_exactly_and_added():
    rng = np.random.default_rng(5)
    q, W, E = (rng.normal(size=s).astype(np.float32) for s in ((3, 4), (6, 4), (6, 4)))
    ids = np.array([[0, 1, -1], [2, 3, 4], [5, -1, -1]])
    sl = Shortlist(ids, np.where(ids >= 0, 0.0, -np.inf).astype(np.float32),
                   np.where(ids >= 0, 0.0, -np.inf).astype(np.float32))
    Y = sp.csr_matrix(np.array([[1, 0, 0, 1, 0, 1], [0, 0, 1, 0, 0, 0], [1, 0, 0, 0, 0, 1]], dtype=np.float32))
    inv = np.arange(6, dtype=np.float64) + 1
    rows, X = missed_positive_features(sl, Y, q, W, E, inv)
    pairs = sorted(zip(rows.tolist(), (X[:, 2] - 1).astype(int).tolist()))
    assert pairs == [(0, 3), (0, 5), (2, 0)]
    for r, (row, lab) in enumerate(zip(rows, (X[:, 2] - 1).astype(int))):
        np.testing.assert_allclose(X[r, :2], [q[row] @ E[lab], q[row] @ W[lab]], rtol=1e-5)
    f = fit_tree(sl, Y, FusionParams(method="tree"), inv, extra=(rows, X))
    assert f.info["n_missed_positives"] == 3 and f.info["n_candidates"] == 6 + 3
    assert f.info["n_positive"] == 3 + 3


# ----------------------------------------------------------------------------------------- save / load

def test_round_trip_gives_identical_scores():
    sl, Y, inv = _synthetic(300, seed=2)
    tree = fit_tree(sl, Y, FusionParams(method="tree"), inv)
    d = json.loads(json.dumps(tree.to_dict()))
    assert d["method"] == "tree" and d["features"] == ["embedding_score", "classifier_score", "inv_propensity"]
    loaded = load_fusion(d)
    assert isinstance(loaded, TreeFusion)
    np.testing.assert_array_equal(loaded.score(sl, inv), tree.score(sl, inv))
    assert loaded.info["objective_value"] == tree.info["objective_value"]
    alpha = fit_alpha(sl, Y, FusionParams(grid_step=0.25), inv, None)
    np.testing.assert_array_equal(_roundtrip(alpha).score(sl, inv), alpha.score(sl, inv))
    assert _roundtrip(alpha).alpha == alpha.alpha and len(alpha.grid) == 5


def test_scores_rank_like_evaluate_expects():
    """The fused scores rank as ``evaluate`` ranks (score descending, ties to the smaller label id, padding
    never predicted); a hand example where the tree reorders the plain sum; and the fitted tree ranks fresh
    points far better than the plain score sum or noise."""
    # hand example: inv_prop <= 2.0 -> P = 0.1, else P = 0.9; label 1 (inv 3.0) overtakes label 0 on row 0,
    # row 1 ties labels 0 and 2 (0.1 + 0.4 + 0.4 both): the smaller id first
    tree = TreeFusion([1, -1, -1], [2, -1, -1], [2, -2, -2], [2.0, -2.0, -2.0], [0.5, 0.1, 0.9], 1, 3)
    inv = np.array([1.5, 3.0, 2.0])
    sl = Shortlist(np.array([[0, 1, 2, -1], [2, 0, -1, -1]]),
                   np.array([[0.5, 0.2, 0.3, -np.inf], [0.4, 0.4, -np.inf, -np.inf]], dtype=np.float32),
                   np.array([[0.3, 0.4, 0.1, -np.inf], [0.4, 0.4, -np.inf, -np.inf]], dtype=np.float32))
    top, _ = topk_from_scores(sl.ids, tree.score(sl, inv), 4)
    np.testing.assert_array_equal(top, [[1, 0, 2, -1], [0, 2, -1, -1]])
    by_sum, _ = topk_from_scores(sl.ids, sl.clf + sl.emb, 4)
    np.testing.assert_array_equal(by_sum[0], [0, 1, 2, -1])
    Yh = sp.csr_matrix(np.array([[0, 1, 0], [1, 0, 0]], dtype=np.float32))
    assert evaluate(top, Yh, ks=(1,))["precision_at_1"] == 1.0
    assert evaluate(by_sum, Yh, ks=(1,))["precision_at_1"] == 0.5
    assert evaluate(sl.ids, Yh, ks=(1, 2), scores=tree.score(sl, inv)) == evaluate(top, Yh, ks=(1, 2))

    # fitted: topk_from_scores ranks each row as a plain sort does (score descending, then smaller id), and
    # evaluate given (ids, scores) ranks them the same way
    sl, Y, inv = _synthetic(100, seed=6)
    tree = fit_tree(sl, Y, FusionParams(method="tree"), inv)
    s = tree.score(sl, inv)
    top, _ = topk_from_scores(sl.ids, s, 5)
    for i in range(len(top)):
        want = sorted((l for l in sl.ids[i] if l >= 0), key=lambda l: (-s[i][sl.ids[i] == l][0], l))[:5]
        assert top[i].tolist() == want
    ks = (1, 3, 5)
    assert evaluate(sl.ids, Y, ks=ks, scores=s) == evaluate(top, Y, ks=ks)
    # and on fresh points from the same distribution it beats the plain sum and noise by wide margins
    # (measured over 10 seeds: tree >= 0.78, sum <= 0.64, noise <= 0.17)
    sl2, Y2, _ = _synthetic(300, seed=106, inv_prop=inv)
    noise = np.where(sl2.ids >= 0, np.random.default_rng(0).random(sl2.ids.shape), -np.inf)

    def p1(scores):
        return evaluate(topk_from_scores(sl2.ids, scores, 5)[0], Y2, ks=(1,))["precision_at_1"]

    p_tree, p_sum, p_noise = p1(tree.score(sl2, inv)), p1(sl2.clf + sl2.emb), p1(noise)
    assert p_tree > 0.7 and p_tree > p_sum + 0.15 and p_tree > p_noise + 0.5, (p_tree, p_sum, p_noise)


# --------------------------------------------------------------------------------------------- errors

def test_errors_unknown_method_and_bad_inputs():
    with pytest.raises(XCConfigError, match="fusion.method"):
        check_method("forest")
    sl, Y, inv = _synthetic(20, seed=8)
    with pytest.raises(XCConfigError, match="fusion.method"):
        fit_fusion(sl, Y, FusionParams(method="forest"), inv, None)
    with pytest.raises(XCConfigError, match="unknown method 'forest'"):
        load_fusion({"method": "forest"})
    with pytest.raises(XCConfigError, match="unknown method None"):
        load_fusion({})
    tree = fit_tree(sl, Y, FusionParams(method="tree"), inv)
    with pytest.raises(XCConfigError, match="inv_prop"):
        tree.score(sl)
    with pytest.raises(XCConfigError, match="labels"):
        tree.score(sl, inv[:-1])
    with pytest.raises(XCConfigError, match="fusion.tree_depth"):
        fit_tree(sl, Y, FusionParams(method="tree", tree_depth=0), inv)
    d = tree.to_dict()
    with pytest.raises(XCConfigError, match="lacks 'threshold'"):
        load_fusion({k: v for k, v in d.items() if k != "threshold"})
    with pytest.raises(XCConfigError, match="different lengths"):
        load_fusion({**d, "leaf_prob": d["leaf_prob"][:-1]})
    with pytest.raises(XCConfigError, match="child indices"):
        load_fusion({**d, "children_left": [len(d["children_left"])] + d["children_left"][1:]})


def test_pipeline_stage_rejects_bad_method_before_work():
    ctx = SimpleNamespace(cfg=SimpleNamespace(fusion=FusionParams(method="forest")))
    with pytest.raises(XCConfigError, match="fusion.method"):
        fusion_stage(ctx)


def test_validation_targets_leave_out_labels_the_models_never_saw():
    """Label 2's only point (row 1) is a validation row: its pair leaves the truth and joins the filter pairs;
    label 1 (also on training row 3) stays; the dataset's own filter pairs are kept first."""
    # rows 0..4; labels 0..3; validation rows 1 and 4
    Y = sp.csr_matrix(np.array([[1, 0, 0, 0],
                                [0, 1, 1, 0],
                                [1, 0, 0, 0],
                                [0, 1, 0, 0],
                                [1, 0, 0, 1]], dtype=np.float32))
    valid, train = np.array([1, 4]), np.array([0, 2, 3])
    Yv, pairs, dropped = validation_targets(Y, valid, train, np.array([[0, 0]]))
    assert dropped == 2  # (valid row 0, label 2) and (valid row 1, label 3)
    np.testing.assert_array_equal(Yv.toarray(), [[0, 1, 0, 0], [1, 0, 0, 0]])
    np.testing.assert_array_equal(pairs, [[0, 0], [0, 2], [1, 3]])
    # nothing to drop: the same matrix and filter pairs back
    Yv, pairs, dropped = validation_targets(Y, np.array([2]), np.array([0, 1, 3, 4]), np.zeros((0, 2), np.int64))
    assert dropped == 0 and pairs.shape == (0, 2) and (Yv != Y[[2]]).nnz == 0
    # the objective no longer counts a prediction of the unseen label as right or wrong: ranking label 2 first
    # on validation row 0 scores like ranking nothing there, and label 1 first scores P@1 = 1
    ids = np.array([[2, 1], [0, 3]])
    Yv, pairs, _ = validation_targets(Y, valid, train, np.zeros((0, 2), np.int64))
    first = evaluate(ids[:, :1], Yv, ks=(1,), filter_pairs=pairs)["precision_at_1"]
    assert first == pytest.approx(0.5)  # row 0: label 2 filtered, nothing left at rank 1; row 1: label 0 right
    assert evaluate(ids, Yv, ks=(1,), filter_pairs=pairs)["precision_at_1"] == pytest.approx(1.0)


# ------------------------------------------------------------------------------------ pipeline stages

def test_pipeline_fits_saves_and_evaluates_tree_fusion(tmp_path):
    """The tiny pipeline with ``fusion.method=tree``: JSON artifact, summary numbers, evaluation scores it."""
    enc = write_tiny_encoder(tmp_path / "tiny-bert")
    src = write_lf_dataset(tmp_path / "src" / "TinyTitles")
    tiny = {"pretrain.epochs": 1, "pretrain.batch_size": 16, "pretrain.chunk_size": 8, "pretrain.warmup_steps": 2,
            "mining.shortlist_size": 8, "classifier.epochs": 1, "classifier.batch_size": 32,
            "classifier.num_negatives": 5, "index.shortlist_size": 8, "index.kind": "exact", "evaluate.top_k": 10,
            "ingest.valid_fraction": 0.25, "tokenize.encoder": str(enc), "fusion.method": "tree"}
    spec = DatasetSpec("TinyTitles", str(src), overrides=tiny)
    store = ArtifactStore(tmp_path / "artifacts")
    ctx = StageContext(store, spec, spec.config(), tmp_path / "cache")
    out = run_all(ctx)
    s = out["fusion"]
    assert s["method"] == "tree" and s["n_candidates"] >= s["n_train"] > 0 and 0 <= s["objective_value"] <= 4
    # validation pairs of labels without a non-validation training point are counted out of the fit
    ds = ctx.read.labels()
    valid = np.load(store.stage_dir("TinyTitles", "ingest") / "valid_rows.npy")
    seen = np.zeros(ds.Y_train.shape[1], bool)
    seen[ds.Y_train[ctx.read.train_rows(ds.num_train)].indices] = True
    assert s["valid_pairs_unseen_dropped"] == int((~seen[ds.Y_train[valid].indices]).sum())
    text = (store.stage_dir("TinyTitles", "fusion") / "fusion.json").read_text()
    fz = load_fusion(json.loads(text))
    assert isinstance(fz, TreeFusion) and fz.num_labels == 20 and fz.info["params"]["tree_add_positives"]
    # the tree-fused ranking is far above the label prior (P@1 0.10, P@5 0.095 here; measured 0.525 / 0.305;
    # over data seeds 0-4 P@1 0.33-0.75, always above the prior, yet below the embedding score alone in 4 of 5:
    # the tree fuses only the classifier and embedding scores, on 30 validation points)
    m = out["evaluate"]["metrics"]
    base = label_prior_metrics(ds.Y_train, ds.Y_test, ds.filter_test)
    assert m["precision_at_1"] >= base["precision_at_1"] + 0.25, (m["precision_at_1"], base)
    assert m["precision_at_5"] >= base["precision_at_5"] + 0.1, (m["precision_at_5"], base)


def test_alpha_fits_a_knn_weight_jointly_when_the_shortlist_has_knn_scores():
    """Relevance follows the kNN score on half the candidates: the joint (a, c) grid finds c > 0 and beats the
    best two-score blend; without kNN scores, or with knn_grid (0,), it is the plain blend; c round-trips."""
    rng = np.random.default_rng(3)
    n, C, L = 400, 20, 300
    ids = np.argsort(rng.random((n, L)), axis=1)[:, :C].astype(np.int64)
    clf, emb, knn = (rng.random((n, C)).astype(np.float32) for _ in range(3))
    rel = (0.5 * clf + knn) > 1.2
    r, c = np.nonzero(rel)
    Y = sp.csr_matrix((np.ones(len(r)), (r, ids[r, c])), shape=(n, L))
    sl = Shortlist(ids, clf, emb, knn)
    p = FusionParams(grid_step=0.25, knn_grid=(0.0, 0.5, 1.0, 2.0), objective="precision_at_1")
    fit = fit_alpha(sl, Y, p, None, None)
    plain = fit_alpha(Shortlist(ids, clf, emb), Y, p, None, None)
    assert fit.knn_weight > 0 and plain.knn_weight == 0.0 and plain.knn_grid == []
    assert [c for c, _ in fit.knn_grid][:4] == [0.0, 0.5, 1.0, 2.0]
    assert dict(fit.knn_grid)[0.0] == pytest.approx(max(o for _, o in plain.grid))  # c = 0: the plain blend
    assert max(o for _, o in fit.grid) > max(o for _, o in plain.grid) + 0.05
    want = fit.alpha * clf + (1 - fit.alpha) * emb + fit.knn_weight * knn
    np.testing.assert_allclose(fit.score(sl), want, rtol=1e-6)
    back = _roundtrip(fit)
    assert back.knn_weight == fit.knn_weight
    np.testing.assert_array_equal(back.score(sl), fit.score(sl))
    assert fit_alpha(sl, Y, replace(p, knn_grid=(0.0,)), None, None).knn_weight == 0.0
    with pytest.raises(XCConfigError, match="shortlist has none"):
        fit.score(Shortlist(ids, clf, emb))
    with pytest.raises(XCConfigError, match="fusion.knn_grid"):
        fit_alpha(sl, Y, replace(p, knn_grid=(-1.0,)), None, None)


def test_alpha_extends_the_knn_grid_when_its_optimum_is_on_the_edge():
    """Relevance is 3 * kNN + emb: a grid that stops at c = 0.125 has its best weight on its edge, so the fit
    keeps doubling c while validation improves (and stops after the first weight that does not);
    knn_grid_extend = 0 keeps the grid as given."""
    rng = np.random.default_rng(5)
    n, C, L = 600, 20, 400
    ids = np.argsort(rng.random((n, L)), axis=1)[:, :C].astype(np.int64)
    clf, emb, knn = (rng.random((n, C)).astype(np.float32) for _ in range(3))
    top = np.argmax(3.0 * knn + emb, axis=1)  # one relevant label per row: the best under 3 kNN + emb
    Y = sp.csr_matrix((np.ones(n), (np.arange(n), ids[np.arange(n), top])), shape=(n, L))
    sl = Shortlist(ids, clf, emb, knn)
    p = FusionParams(grid_step=0.25, knn_grid=(0.0, 0.125), objective="precision_at_1")
    edge = fit_alpha(sl, Y, replace(p, knn_grid_extend=0), None, None)
    assert edge.knn_weight == 0.125 and [c for c, _ in edge.knn_grid] == [0.0, 0.125]
    fit = fit_alpha(sl, Y, p, None, None)
    tried = [c for c, _ in fit.knn_grid]
    assert tried[:3] == [0.0, 0.125, 0.25] and all(b == 2 * a for a, b in zip(tried[1:], tried[2:]))
    assert fit.knn_weight >= 1.0 and fit.knn_weight == tried[-2]  # the last weight tried did not improve
    values = dict(fit.knn_grid)
    assert values[fit.knn_weight] > values[0.125] + 0.1
    with pytest.raises(XCConfigError, match="fusion.knn_grid_extend"):
        fit_alpha(sl, Y, replace(p, knn_grid_extend=-1), None, None)


def test_coordinate_search_finds_the_grids_choice_with_a_tenth_of_the_evaluations(monkeypatch):
    """fusion.search: relevance mixes every score (and the propensity); moving one weight at a time (alpha's whole
    grid with each value) ends at the whole grid's choice, the same objective, ~10x fewer evaluations; its records
    per weight hold the chosen point's value; a bad search names the field."""
    rng = np.random.default_rng(11)
    n, C, L = 500, 20, 400
    ids = np.argsort(rng.random((n, C * 20)), axis=1)[:, :C].astype(np.int64)
    clf, emb, knn, lex, cooc = (rng.random((n, C)).astype(np.float32) for _ in range(5))
    inv = 1.0 + 3.0 * rng.random(L)
    truth = 0.6 * clf + 0.4 * emb + 0.5 * knn + 0.25 * lex + 1.0 * cooc + 0.04 * np.log(inv)[ids]
    top = np.argsort(-truth, axis=1)[:, :2]
    Y = sp.csr_matrix((np.ones(2 * n), (np.repeat(np.arange(n), 2), ids[np.arange(n)[:, None], top].ravel())),
                      shape=(n, L))
    sl = Shortlist(ids, clf, emb, knn, lex, cooc)
    calls = [0]
    value = ObjectiveOnShortlist.value

    def counted(self, scores):
        calls[0] += 1
        return value(self, scores)

    monkeypatch.setattr(ObjectiveOnShortlist, "value", counted)
    p = FusionParams(grid_step=0.1, objective="precision_at_1+psprecision_at_1")
    grid = fit_alpha(sl, Y, replace(p, search="grid"), inv, None)
    grid_calls, calls[0] = calls[0], 0
    coord = fit_alpha(sl, Y, p, inv, None)
    assert p.search == "coordinate"  # the default
    weights = ("alpha", "knn_weight", "lexical_weight", "cooccurrence_weight", "propensity_weight")
    assert [getattr(coord, w) for w in weights] == [getattr(grid, w) for w in weights]
    assert coord.objective_value == grid.objective_value and coord.knn_weight > 0 and coord.cooccurrence_weight > 0
    assert grid_calls >= 11 * 5 * 5 * 4 * 5 and calls[0] * 8 <= grid_calls, (calls[0], grid_calls)
    for record, w in ((coord.knn_grid, coord.knn_weight), (coord.lexical_grid, coord.lexical_weight),
                      (coord.cooccurrence_grid, coord.cooccurrence_weight),
                      (coord.propensity_grid, coord.propensity_weight)):
        assert dict(record)[w] == coord.objective_value == max(v for _, v in record)
    assert dict(coord.knn_grid) == dict(grid.knn_grid)  # the same sweep through the chosen point
    with pytest.raises(XCConfigError, match="fusion.search"):
        fit_alpha(sl, Y, replace(p, search="random"), inv, None)


def test_coordinate_search_climbs_a_ridge_by_steps_along_two_weights():
    """An objective that grows only where c and d grow together (c + d - 10 (c - d)^2): one weight at a time
    never leaves (0, 0); the steps along two at once climb the ridge to the grid's corner (3, 3)."""
    def cells(points):
        return [np.full(3, c + d - 10.0 * (c - d) ** 2) for c, d, *_ in points]

    axes = [[0.0, 1.0, 2.0, 3.0], [0.0, 1.0, 2.0, 3.0], [0.0], [0.0], [0.0]]
    assert alpha_module._sweeps(cells, axes, [0] * 5, 1, [0] * 5)[0] == [0] * 5
    at, j, value = alpha_module._coordinate_search(cells, axes, [0] * 5, 1)
    assert at == [3, 3, 0, 0, 0] and j == 2 and value == 6.0  # ties over alpha: the most classifier weight


def test_alpha_fits_a_knn_discount_where_a_head_labels_crowd_outvotes_the_tail():
    """Odd rows: the relevant label is a head label (100 points in the kNN index) voted 0.5 against another's 0.1
    (1 point); even rows: a tail label (1 point) voted 0.3 trails a head decoy's 0.5 (100 points); the classifier
    and embedding scores level. c * kNN gets the odd rows right (P@1 0.5); dividing the votes by n_l ** f gets the
    even rows too for 5/3 < 100 ** f < 5 (f 0.25 of the grid: 0.1 and 0.5 fall either side). The fit picks it, scores
    as c * kNN / n_l ** f by hand, round-trips, and without counts the discount is never tried or used."""
    rng = np.random.default_rng(3)
    n, C, L = 200, 6, 400
    ids = np.stack([rng.permutation(L)[:C] for _ in range(n)]).astype(np.int64)
    knn, count = np.zeros((n, C), np.float32), np.full((n, C), 20.0, np.float32)
    knn[0::2, 0], count[0::2, 0], knn[0::2, 1], count[0::2, 1] = 0.5, 100.0, 0.3, 1.0  # decoy, relevant tail
    knn[1::2, 0], count[1::2, 0], knn[1::2, 1], count[1::2, 1] = 0.1, 1.0, 0.5, 100.0  # other, relevant head
    level = np.full((n, C), 0.2, np.float32)
    Y = sp.csr_matrix((np.ones(n), (np.arange(n), ids[:, 1])), shape=(n, L))
    sl = Shortlist(ids, level.copy(), level.copy(), knn, None, None, count)
    p = FusionParams(grid_step=0.5, objective="precision_at_1", knn_grid=(0.0, 1.0), knn_grid_extend=0,
                     propensity_grid=(0.0,))
    off = fit_alpha(sl, Y, p, None, None)
    assert (off.knn_weight, off.knn_discount, off.knn_discount_grid, off.objective_value) == (1.0, 0.0, [], 0.5)
    fit = fit_alpha(sl, Y, replace(p, knn_discount_grid=(0.1, 0.25, 0.5)), None, None)
    assert (fit.knn_weight, fit.knn_discount, fit.objective_value) == (1.0, 0.25, 1.0)
    assert dict(fit.knn_discount_grid) == {0.0: 0.5, 0.1: 0.5, 0.25: 1.0, 0.5: 0.5}
    want = fit.alpha * level + (1 - fit.alpha) * level + knn / count ** 0.25
    np.testing.assert_allclose(fit.score(sl), want, rtol=1e-6)
    back = _roundtrip(fit)
    assert back.knn_discount == 0.25 and back.summary()["knn_discount"] == 0.25
    np.testing.assert_array_equal(back.score(sl), fit.score(sl))
    bare = replace(sl, knn_count=None)
    assert fit_alpha(bare, Y, replace(p, knn_discount_grid=(0.1, 0.25)), None, None).knn_discount == 0.0
    with pytest.raises(XCConfigError, match="knn_count"):
        fit.score(bare)
    with pytest.raises(XCConfigError, match="fusion.knn_discount_grid"):
        fit_alpha(sl, Y, replace(p, knn_discount_grid=(0.0, -0.5)), None, None)


def test_objective_sums_metrics_joined_by_plus():
    """``a+b`` is the sum of the two metrics on the same ranking (the default weighs P@1 and PSP@1 equally);
    a bad name among them is an error naming it."""
    ids = np.array([[0, 1, 2], [2, 1, 0]])
    scores = np.array([[0.9, 0.5, 0.1], [0.8, 0.7, 0.1]], dtype=np.float32)
    Y = sp.csr_matrix(np.array([[1, 0, 0], [0, 1, 0]], dtype=np.float32))
    inv = np.array([1.0, 4.0, 2.0])
    # top-1: row 0 -> label 0 (relevant, 1/p = 1), row 1 -> label 2 (not): P@1 = 0.5; PSP@1 = (1 + 0) / (1 + 4)
    p1 = _objective(ids, scores, Y, "precision_at_1", inv, None, 3)
    ps1 = _objective(ids, scores, Y, "psprecision_at_1", inv, None, 3)
    assert p1 == pytest.approx(0.5) and ps1 == pytest.approx(0.2)
    assert _objective(ids, scores, Y, "precision_at_1+psprecision_at_1", inv, None, 3) == pytest.approx(0.7)
    assert FusionParams().objective == "precision_at_1+precision_at_5+psprecision_at_1+psprecision_at_5"
    with pytest.raises(XCConfigError, match="'psprecision_at_0'"):
        _objective(ids, scores, Y, "precision_at_1+psprecision_at_0", inv, None, 3)


def test_alpha_fits_a_propensity_weight_that_trades_head_for_tail():
    """Each row has one relevant tail label ranked just below a head decoy by both scores: only + b log(1/p)
    puts it first. With the grid (0,) there is no propensity term; with (0, 0.05, 0.1) the fit picks
    b > 0, raises the P@1 + PSP@1 objective, scores as a c + b log(1/p) by hand, and round-trips."""
    rng = np.random.default_rng(7)
    n, C, L = 300, 10, 200
    inv = np.where(np.arange(L) < 100, 1.0, 3.0)  # labels 0..99 head (1/p = 1), 100..199 tail (1/p = 3)
    ids = np.stack([rng.permutation(L)[:C] for _ in range(n)]).astype(np.int64)
    base = rng.uniform(0.0, 0.5, (n, C)).astype(np.float32)
    head_col = np.argmax(np.where(inv[ids] == 1.0, 1, 0) + rng.random((n, C)), axis=1)  # a head label per row
    tail_col = np.argmax(np.where(inv[ids] == 3.0, 1, 0) + rng.random((n, C)), axis=1)
    ok = (inv[ids[np.arange(n), head_col]] == 1.0) & (inv[ids[np.arange(n), tail_col]] == 3.0)
    r = np.arange(n)[ok]
    base[r, head_col[ok]] = 0.9  # the decoy
    base[r, tail_col[ok]] = 0.85  # the relevant label: 0.05 below, log(3) * b above when b > 0.046
    Y = sp.csr_matrix((np.ones(len(r)), (r, ids[r, tail_col[ok]])), shape=(n, L))
    sl = Shortlist(ids, base.copy(), base.copy())
    p = FusionParams(grid_step=0.5, objective="precision_at_1+psprecision_at_1")
    off = fit_alpha(sl, Y, replace(p, propensity_grid=(0.0,)), inv, None)
    assert off.propensity_weight == 0.0 and off.propensity_grid == []
    fit = fit_alpha(sl, Y, replace(p, propensity_grid=(0.0, 0.05, 0.1)), inv, None)
    assert fit.propensity_weight == 0.05  # ties: the smaller weight
    # smoothed over 3 grid points, b = 0.05 sits next to the cliff at b = 0 (mean 4/3) and 0.1 inside the plateau
    # (mean 2, as is its doubled neighbour 0.2 tried on the edge: ties take the smaller)
    assert fit_alpha(sl, Y, replace(p, propensity_grid=(0.0, 0.05, 0.1), smoothing=3), inv, None).propensity_weight == 0.1
    grid = dict(fit.propensity_grid)
    assert grid[0.0] == pytest.approx(max(o for _, o in off.grid)) and grid[0.05] > grid[0.0] + 1.0
    want = np.where(ids < 0, -np.inf, fit.alpha * base + (1 - fit.alpha) * base + 0.05 * np.log(inv[ids]))
    np.testing.assert_allclose(fit.score(sl, inv), want, rtol=1e-6)
    top, _ = topk_from_scores(ids, fit.score(sl, inv), 1)
    assert np.array_equal(top[r, 0], ids[r, tail_col[ok]])
    back = _roundtrip(fit)
    assert back.propensity_weight == 0.05 and back.summary()["propensity_weight"] == 0.05
    np.testing.assert_array_equal(back.score(sl, inv), fit.score(sl, inv))
    with pytest.raises(XCConfigError, match="propensit"):
        fit.score(sl)  # the propensity term needs inv_prop
    with pytest.raises(XCConfigError, match="fusion.propensity_grid"):
        fit_alpha(sl, Y, replace(p, propensity_grid=(0.0, -0.1)), inv, None)
    # without propensities (a P@1 objective needs none) the term is not fitted, as c without kNN scores
    blind = fit_alpha(sl, Y, replace(p, objective="precision_at_1"), None, None)
    assert blind.propensity_weight == 0.0 and blind.propensity_grid == []
    assert FusionParams().propensity_grid[0] == 0.0 and max(FusionParams().propensity_grid) > 0  # on by default
    # gaps spread over (0, 0.1): a grid that stops at 0.01 has its best on its edge, so the weight keeps
    # doubling while validation improves
    spread = base.copy()
    spread[r, tail_col[ok]] = 0.9 - rng.uniform(0.001, 0.1, len(r))
    edge = fit_alpha(Shortlist(ids, spread, spread), Y, replace(p, propensity_grid=(0.0, 0.01)), inv, None)
    tried = [b for b, _ in edge.propensity_grid]
    assert tried[:3] == [0.0, 0.01, 0.02] and all(y == 2 * x for x, y in zip(tried[1:], tried[2:]))
    assert edge.propensity_weight >= 0.04


def test_smooth_grid_averages_neighbours_along_each_axis_with_repeated_edges():
    v = np.array([0.0, 3.0, 0.0, 2.0, 2.0, 2.0])
    np.testing.assert_allclose(smooth_grid(v, 3), [1.0, 1.0, 5 / 3, 4 / 3, 2.0, 2.0])
    np.testing.assert_array_equal(smooth_grid(v, 1), v)
    # (c, a, b) with one c and one b: only the alpha axis is averaged (a length-1 axis is left alone)
    np.testing.assert_allclose(smooth_grid(v[None, :, None], 3)[0, :, 0], smooth_grid(v, 3))
    g = np.zeros((3, 3))
    g[1, 1] = 9.0
    np.testing.assert_allclose(smooth_grid(g, 3), np.ones((3, 3)))  # 3 x 3 box: 9 / 9 everywhere


def test_alpha_fit_takes_the_middle_of_a_plateau_over_a_lone_spike(monkeypatch):
    """The objective over alpha (read back from the fused scores: clf = 1, emb = 0 gives s = a) has a spike of
    1.0 at a = 0.2 between 0.5s and a plateau of 0.9 over a = 0.6..0.8: the raw argmax (smoothing 1) takes the
    spike, the 3-point average the plateau's middle; smoothing must be an odd int >= 1."""
    table = {0.2: 1.0, 0.6: 0.9, 0.7: 0.9, 0.8: 0.9}
    monkeypatch.setattr("xc_dagster.retrieval.fusion.alpha.ObjectiveOnShortlist",
                        lambda *a: SimpleNamespace(value=lambda s: table.get(round(float(s[0, 0]), 2), 0.5)))
    n, C = 4, 3
    sl = Shortlist(np.arange(n * C, dtype=np.int64).reshape(n, C), np.ones((n, C), np.float32),
                   np.zeros((n, C), np.float32))
    Y = sp.csr_matrix((n, n * C))
    p = FusionParams(grid_step=0.1, propensity_grid=(0.0,), smoothing=3)
    raw = fit_alpha(sl, Y, replace(p, smoothing=1), None, None)
    assert raw.alpha == 0.2 and raw.objective_value == 1.0 and raw.objective_smoothed == 1.0
    assert FusionParams().smoothing == 1  # the raw argmax by default
    fit = fit_alpha(sl, Y, p, None, None)
    assert fit.alpha == 0.7
    assert fit.objective_value == 0.9 and fit.objective_smoothed == pytest.approx(0.9)
    assert [a for a, _ in fit.grid] == pytest.approx(np.arange(11) / 10) and dict(fit.grid)[0.2] == 1.0
    back = _roundtrip(fit)
    assert back.summary()["objective_value"] == 0.9 and back.summary()["objective_smoothed"] == pytest.approx(0.9)
    for bad in (0, 2, 1.0):
        with pytest.raises(XCConfigError, match="fusion.smoothing"):
            fit_alpha(sl, Y, replace(p, smoothing=bad), None, None)


# ------------------------------------------------------------------------------------------------ registry

def test_registry_names_are_the_methods_and_every_fusion_round_trips():
    """``FUSIONS`` names exactly what ``fusion.method`` accepts (each class writes its name as ``method``); a bad
    name's error lists the registry's names; every registered fusion, fitted on a hand-made shortlist, goes
    through ``to_dict`` -> JSON -> ``load_fusion`` to the same class, the same dict and identical scores."""
    assert sorted(FUSIONS) == ["alpha", "tree"]
    for name, cls in FUSIONS.items():
        assert check_method(name) == name and cls.method == name
        assert all(callable(getattr(cls, m)) for m in ("fit", "from_dict", "score", "to_dict", "summary"))
    for bad in ("forest", "Alpha", "", None):
        with pytest.raises(XCConfigError, match="fusion.method") as err:
            check_method(bad)
        assert all(repr(name) in str(err.value) for name in FUSIONS)
    with pytest.raises(XCConfigError, match="unknown method 'forest'") as err:
        load_fusion({"method": "forest"})
    assert all(repr(name) in str(err.value) for name in FUSIONS)
    # 4 points, labels 0..5, one padded cell per row; label 1 (1/p 4) relevant where the embedding says so
    ids = np.array([[0, 1, 2, -1], [1, 3, 4, -1], [5, 0, 1, -1], [2, 1, 4, -1]])
    pad = ids < 0
    clf = np.where(pad, -np.inf, [[0.9, 0.2, 0.1, 0], [0.3, 0.8, 0.1, 0], [0.7, 0.6, 0.2, 0], [0.4, 0.1, 0.5, 0]])
    emb = np.where(pad, -np.inf, [[0.1, 0.8, 0.2, 0], [0.9, 0.3, 0.1, 0], [0.2, 0.1, 0.7, 0], [0.3, 0.9, 0.4, 0]])
    sl = Shortlist(ids, clf.astype(np.float32), emb.astype(np.float32))
    Y = sp.csr_matrix((np.ones(5), ([0, 1, 1, 2, 3], [1, 1, 3, 5, 1])), shape=(4, 6))
    inv = np.array([1.0, 4.0, 1.5, 2.0, 3.0, 1.2])
    for name, cls in FUSIONS.items():
        fitted = fit_fusion(sl, Y, FusionParams(method=name, grid_step=0.25), inv, None)
        assert type(fitted) is cls
        back = _roundtrip(fitted)
        assert type(back) is cls and json.dumps(back.to_dict()) == json.dumps(fitted.to_dict())
        assert back.summary() == fitted.summary()
        np.testing.assert_array_equal(back.score(sl, inv), fitted.score(sl, inv))
        assert np.isneginf(back.score(sl, inv)[pad]).all()


@pytest.mark.parametrize("objective", ["precision_at_1+psprecision_at_1",
                                       "precision_at_1+precision_at_5+psprecision_at_1+psprecision_at_5",
                                       "ndcg_at_5+psrecall_at_3", "coverage_at_5"])
def test_objective_from_the_named_families_equals_the_full_evaluation(objective):
    """The fusion grid computes only the objective's metric families from the scored shortlist; on shortlists with
    padding, tied scores and filter pairs (fewer than the top_k margin per row) it equals the full evaluation of
    the top-k ranking."""
    rng = np.random.default_rng(3)
    n, C, L = 300, 40, 120
    ids = np.stack([rng.choice(L, C, replace=False) for _ in range(n)]).astype(np.int64)
    ids[:, -5:] = -1
    scores = np.round(rng.random((n, C)), 1).astype(np.float32)  # many ties, broken by the smaller label id
    scores[ids < 0] = -np.inf
    Y = sp.random(n, L, density=0.05, random_state=4, format="csr", dtype=np.float32)
    Y.data[:] = 1.0
    inv = 1.0 + rng.random(L) * 4
    pairs = np.stack([np.arange(0, n, 3), ids[np.arange(0, n, 3), 0]], axis=1)  # each third row's first candidate
    top, _ = topk_from_scores(ids, scores, 10)
    m = evaluate(top, Y, ks=(1, 3, 5), inv_prop=inv, filter_pairs=pairs)
    expected = sum(m[name] for name in objective.split("+"))
    assert _objective(ids, scores, Y, objective, inv, pairs, 10) == pytest.approx(expected, abs=1e-12)


def test_alpha_halves_the_propensity_weight_where_its_grid_swamps_small_scores():
    """Lexical scores alone, small (a lexical-only model whose classifiers count little): in 3 rows of 10 a tail
    label is relevant and trails its row's head label by 0.001 in raw score, in the others the head label leads by
    0.03; at the lexical weight d = 0.125 a propensity weight b ranks both right for 0.000125 < b < 0.00375, so the
    grid's 0.01 loses to b = 0 (P@1 0.3 against 0.7), and b = 0 chosen over it halves it until one wins: 0.0025,
    P@1 1.0. Without the halving budget (propensity_grid_extend = 0) b stays 0. (The whole grid, fusion.search
    grid, finds d = 0.5 with b = 0.01 instead.)"""
    n = 200
    ids = np.stack([np.arange(0, 2 * n, 2), np.arange(1, 2 * n, 2)], axis=1).astype(np.int64)  # tail, head
    tail = np.arange(n) % 10 < 3  # rows where the tail label is relevant
    lex = np.where(tail[:, None], [0.019, 0.020], [0.010, 0.040]).astype(np.float32)
    zeros = np.zeros_like(lex)
    sl = Shortlist(ids, zeros, zeros.copy(), lex=lex)
    Y = sp.csr_matrix((np.ones(n), (np.arange(n), ids[np.arange(n), np.where(tail, 0, 1)])), shape=(n, 2 * n))
    inv = np.exp(np.tile([1.1, 0.1], n))  # log(1 / p): 1.1 for the tail labels (even ids), 0.1 for the head ones
    p = FusionParams(grid_step=0.5, knn_grid=(0.0,), objective="precision_at_1")
    fit = fit_alpha(sl, Y, p, inv, None)
    values = dict(fit.propensity_grid)
    assert [b for b, _ in fit.propensity_grid] == [0.0, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08]
    assert values[0.0] == 0.7 and values[0.01] == values[0.005] == 0.3
    assert fit.lexical_weight == 0.125 and fit.propensity_weight == 0.0025 and fit.objective_value == 1.0
    kept = fit_alpha(sl, Y, replace(p, propensity_grid_extend=0), inv, None)
    assert kept.propensity_weight == 0.0 and [b for b, _ in kept.propensity_grid] == [0.0, 0.01, 0.02, 0.04, 0.08]
    whole = fit_alpha(sl, Y, replace(p, search="grid"), inv, None)
    assert (whole.lexical_weight, whole.propensity_weight, whole.objective_value) == (0.5, 0.01, 1.0)
