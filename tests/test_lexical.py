"""The lexical (TF-IDF) shortlist source: hand-computed scores, exactness against brute force, held-out
exclusion, files without pickle, its weight in the alpha fusion, and the pipeline path through the bundle."""

from __future__ import annotations

import json
import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import numpy as np
import pytest
import scipy.sparse as sp
import torch

from tests.test_pipeline import TINY
from tests.tinydata import ready_home, tiny_lf_home, write_tiny_encoder
from xc_dagster import device as device_module
from xc_dagster.catalog import Catalog, DatasetSpec
from xc_dagster.config import FusionParams
from xc_dagster.data import load_dataset
from xc_dagster.errors import XCConfigError
from xc_dagster.evaluation.metrics import remove_filtered
from xc_dagster.pipeline import StageContext, run_all
from xc_dagster.retrieval import lexical as lexical_module
from xc_dagster.retrieval.fusion import AlphaFusion, fit_alpha, fit_tree, load_fusion
from xc_dagster.retrieval.lexical import LexicalIndex
from xc_dagster.retrieval.lexical_classifier import ClassifierSettings
from xc_dagster.retrieval.lexical_exact import SCALES, SCALES_EXTEND
from xc_dagster.retrieval.shortlist import (
    ANN_SOURCES,
    Shortlist,
    ShortlistSources,
    build_sources,
    check_sources,
    retrieve,
)
from xc_dagster.retrieval.source_files import load_sources, save_sources
from xc_dagster.retrieval.sparse_rows import sparse_lookup, sparse_topk
from xc_dagster.serving import bundle as serving_bundle
from xc_dagster.storage import ArtifactStore

WORDS = [f"w{i:03d}" for i in range(150)]


def _hand_index(neighbours: int = 2, power: float = 1.0) -> LexicalIndex:
    """Four unit TF-IDF rows over three terms, their labels, and one label-text row per label (no model)."""
    points = sp.csr_matrix(np.array([[1, 0, 0], [0.6, 0.8, 0], [0, 0, 1], [0, 1, 0]], dtype=np.float32))
    Y = sp.csr_matrix(np.array([[1, 0, 0], [1, 1, 0], [0, 0, 1], [0, 1, 0]], dtype=np.float32))
    return LexicalIndex(None, points, Y, sp.identity(3, dtype=np.float32, format="csr"), neighbours, power=power)


def test_lexical_score_hand_computed():
    """q = (0.8, 0.6, 0): sims to the points 0.8, 0.96, 0, 0.6; K = 2 nearest: points 1 and 0.
    kNN part: label 0 = (0.96 + 0.8) / 2, label 1 = 0.96 / 2; label-text part: cos = 0.8, 0.6, 0."""
    lex = _hand_index()
    q = sp.csr_matrix(np.array([[0.8, 0.6, 0.0]], dtype=np.float32))
    assert lex.scores(q).toarray()[0] == pytest.approx([0.88 + 0.8, 0.48 + 0.6, 0.0])
    assert lex.scores(q).nnz == 2  # label 2 shares no term: not stored, never proposed
    # point 1 excluded (a validation point): neighbours 0 (0.8) and 3 (0.6)
    assert lex.scores(q, excluded=np.array([1])).toarray()[0] == pytest.approx([0.4 + 0.8, 0.3 + 0.6, 0.0])
    # the query's own point 0 excluded: neighbours 1 (0.96) and 3 (0.6)
    assert lex.scores(q, own=np.array([0])).toarray()[0] == pytest.approx([0.48 + 0.8, 0.78 + 0.6, 0.0])
    # K = 3: point 3 (0.6) joins; the mean is over K
    assert _hand_index(3).scores(q).toarray()[0] == pytest.approx([1.76 / 3 + 0.8, 1.56 / 3 + 0.6, 0.0])
    # index.lexical_power 2: votes 0.96^2 = 0.9216 (point 1) and 0.8^2 = 0.64 (point 0); the label-text part as is
    assert _hand_index(power=2).scores(q).toarray()[0] == pytest.approx([1.5616 / 2 + 0.8, 0.9216 / 2 + 0.6, 0.0])
    for bad in (0, -1.0, float("nan"), float("inf"), True, "2"):
        with pytest.raises(XCConfigError, match="index.lexical_power"):
            _hand_index(power=bad)
    ids, vals = sparse_topk(lex.scores(q), 3)
    assert ids[0].tolist() == [0, 1, -1] and vals[0] == pytest.approx([1.68, 1.08, 0.0])
    assert sparse_lookup(lex.scores(q), np.array([[2, 1, -1, 0]]))[0] == pytest.approx([0.0, 1.08, 0.0, 1.68])


def test_tfidf_on_texts_is_sublinear_word_bigrams_with_min_df():
    """A text equal to a label's text has cosine 1 to it, a text sharing no term 0; terms (1-2 grams) of one
    document are dropped by min_df 2; idf is sklearn's smoothed ln((1 + n) / (1 + df)) + 1; tf is 1 + ln(tf)."""
    points = ["red apple pie", "red apple tart", "blue river bank", "blue river delta", "green stone"]
    labels = ["red apple", "blue river", "green stone wall"]
    Y = sp.csr_matrix(np.array([[1, 0, 0], [1, 0, 0], [0, 1, 0], [0, 1, 0], [0, 0, 1]], dtype=np.float32))
    lex = LexicalIndex.fit(points, labels, Y, neighbours=2, min_df=2)
    vocab = lex.model.vocabulary_
    assert "red apple" in vocab and "pie" not in vocab and "wall" not in vocab  # df 1: dropped
    n = len(points) + len(labels)
    assert lex.model.idf_[vocab["red"]] == pytest.approx(math.log((1 + n) / (1 + 3)) + 1)
    q = lex.transform(["Red apple", "purple cloud", "apple apple"])
    s = lex.scores(q).toarray()
    cos_red = (q[0] @ lex.labels.T).toarray()[0]
    assert cos_red[0] == pytest.approx(1.0) and cos_red[1] == 0 and s[0, 0] > 1.0  # + the neighbours' votes
    assert q[1].nnz == 0 and not s[1].any()  # no known term: no score
    assert lex.transform([]).shape == (0, len(vocab)) and lex.scores(lex.transform([])).shape == (0, 3)
    # "red red red apple": red 1 + ln 3, apple 1, "red apple" 1 ("red red" is no term), times idf, normalised
    row = lex.transform(["red red red apple"]).toarray()[0]
    idf = lex.model.idf_
    raw = np.array([(1 + math.log(3)) * idf[vocab["red"]], idf[vocab["apple"]], idf[vocab["red apple"]]])
    assert np.count_nonzero(row) == 3
    assert row[[vocab["red"], vocab["apple"], vocab["red apple"]]] == pytest.approx(raw / np.linalg.norm(raw))
    only = LexicalIndex.fit(["alpha beta", "gamma delta"], None, Y[:2], neighbours=1, min_df=2)
    assert only.model.min_df == 1 and len(only.model.vocabulary_) == 6  # nothing twice: min_df falls back to 1
    with pytest.raises(XCConfigError, match="index.sources"):
        LexicalIndex.fit(["", " ", "a"], ["", "", "b"], Y[:3], neighbours=1)  # no term anywhere
    with pytest.raises(XCConfigError, match="index.sources"):
        LexicalIndex.fit(["", "", ""], labels, Y[:3], neighbours=1)  # label texts, but points without text
    with pytest.raises(XCConfigError, match="index.lexical_min_df"):
        LexicalIndex.fit(points, labels, Y, neighbours=1, min_df=0)
    with pytest.raises(XCConfigError, match="index.lexical_neighbours"):
        LexicalIndex.fit(points, labels, Y, neighbours=0)


def test_char_ngrams_beside_the_words_match_inflections_in_the_classifiers_and_round_trip(tmp_path):
    """index.lexical_char_weight w > 0: the word block and the char 3-5 gram block, each L2-normalised, the chars
    times w, the row normalised again -- so the char block holds w^2 / (1 + w^2) of a row's squared norm. The
    label-text and kNN parts read the word block alone, rescaled to the word rows' cosines (their scores those of a
    words-only index); the classifiers read both, so a query word the words never saw ("chestnuts", "infections")
    still meets the label sharing its stem there. Saved and loaded back (terms "w "/"c " prefixed) the rows and
    scores are the same; an index written before the setting loads as words only."""
    points = ["european chestnut tree", "sweet chestnut", "bone cell", "protozoal infection", "infection of bone"] * 2
    labels = ["chestnut", "cell", "infection"]
    Y = sp.csr_matrix(np.array([[1, 0, 0], [1, 0, 0], [0, 1, 0], [0, 0, 1], [0, 1, 1]] * 2, dtype=np.float32))
    queries = ["chestnuts", "protozoan infections", "sweet chestnut", "bone infection", ""]
    words = LexicalIndex.fit(points, labels, Y, neighbours=2, min_df=1)
    assert words.transform(queries[:2]).nnz == 0  # no word of either query is a term
    plain = words.scores(words.transform(queries)).toarray()
    assert plain[:2].max() == 0 and plain[2, 0] > 0 and plain[3, [1, 2]].min() > 0
    settings = ClassifierSettings(solver="liblinear", seed=0)
    for w in (1.0, 0.5):
        lex = LexicalIndex.fit(points, labels, Y, neighbours=2, min_df=1, char_weight=w)
        Q = lex.transform(queries)
        n = len(lex.model.words.vocabulary_)
        assert Q.shape == (5, n + len(lex.model.chars.vocabulary_)) and Q[4].nnz == 0
        both = Q[2].toarray()[0]  # "sweet chestnut": terms in both blocks
        assert both @ both == pytest.approx(1.0)
        assert both[n:] @ both[n:] == pytest.approx(w * w / (1 + w * w))
        assert both[:n] == pytest.approx(words.transform(queries[2:3]).toarray()[0] / math.sqrt(1 + w * w))
        assert Q[:2].nnz and Q[:2, :n].nnz == 0  # the inflected queries: chars only
        np.testing.assert_allclose(lex.scores(Q).toarray(), plain, rtol=1e-5, atol=1e-7)  # parts read the words
        # the label rows hold their word block alone (read by the label-text part only); the points keep their
        # chars (the classifiers train on them); label rows with chars (an index saved before) score the same
        assert lex.labels[:, n:].nnz == 0 and lex.labels.nnz == words.labels.nnz and lex.points[:, n:].nnz
        with_chars = LexicalIndex(lex.model, lex.points, lex.point_labels, lex.model.transform(labels), 2)
        assert with_chars.labels[:, n:].nnz
        np.testing.assert_array_equal(with_chars.scores(Q).toarray(), lex.scores(Q).toarray())
        lex.classifier = lex.fit_classifier(np.arange(len(points)), settings)
        ranked = lex.scores(Q).toarray()
        assert ranked[0].argmax() == 0 and ranked[1].argmax() == 2  # through the classifiers' char weights
        lex.save(tmp_path / str(w))
        config = json.loads((tmp_path / str(w) / "lexical.json").read_text())
        assert config["char_weight"] == w and config["char_vectorizer"]["analyzer"] == "char_wb"
        vocab = json.loads((tmp_path / str(w) / "vocabulary.json").read_text())
        assert vocab[0].startswith("w ") and vocab[-1].startswith("c ") and len(vocab) == Q.shape[1]
        back = LexicalIndex.load(tmp_path / str(w))
        assert (back.transform(queries) != Q).nnz == 0 and (back.labels != lex.labels).nnz == 0
        np.testing.assert_array_equal(back.scores(Q).toarray(), ranked)
    words.classifier = words.fit_classifier(np.arange(len(points)), settings)
    unseen = words.scores(words.transform(queries[:2])).toarray()
    np.testing.assert_array_equal(unseen[0], unseen[1])  # words only: both get the classifiers' prior alone
    words.save(tmp_path / "words")
    assert "char_weight" not in json.loads((tmp_path / "words" / "lexical.json").read_text())
    assert (LexicalIndex.load(tmp_path / "words").transform(queries) != words.transform(queries)).nnz == 0
    for bad in (-1.0, float("nan"), float("inf"), True, "1"):
        with pytest.raises(XCConfigError, match="index.lexical_char_weight"):
            LexicalIndex.fit(points, labels, Y, neighbours=2, char_weight=bad)


def test_a_stored_zero_in_the_point_labels_is_no_label():
    """A label matrix may store explicit zeros (scipy keeps them through slicing and sums): the index binarises
    its entries after dropping them, so a 0 never becomes a neighbour's label."""
    points = ["red apple", "red apple pie", "blue river"]
    Y = sp.csr_matrix((np.array([1.0, 0.0, 1.0, 1.0], dtype=np.float32), np.array([0, 1, 0, 1]),
                       np.array([0, 2, 3, 4])), shape=(3, 2))  # point 0: label 0, and a stored 0 for label 1
    lex = LexicalIndex.fit(points, None, Y, neighbours=2, min_df=1)
    assert lex.point_labels.toarray().tolist() == [[1, 0], [1, 0], [0, 1]]
    s = lex.scores(lex.transform(["red apple"])).toarray()[0]
    assert s[0] > 0 and s[1] == 0  # its neighbours (points 0 and 1) carry label 0 only


def _corpus(seed: int, n: int, L: int):
    rng = np.random.default_rng(seed)

    def text() -> str:
        return " ".join(rng.choice(WORDS, size=int(rng.integers(3, 9))))

    points = [text() for _ in range(n)]
    labels = [text() for _ in range(L)]
    Y = sp.random(n, L, density=0.02, random_state=seed, format="csr", dtype=np.float32)
    Y.data[:] = 1
    return points, labels, Y, [text() for _ in range(60)]


def _brute(lex: LexicalIndex, Q: sp.csr_matrix, excluded: np.ndarray | None = None) -> np.ndarray:
    """Dense (queries, L) lexical scores: every point's cosine, top K by (cosine desc, row), their mean vote."""
    S = Q.toarray().astype(np.float64) @ lex.points.toarray().T
    if excluded is not None:
        S[:, excluded] = 0
    Yd, T = lex.point_labels.toarray(), lex.labels.toarray()
    out = Q.toarray() @ T.T
    for i in range(len(S)):
        order = np.lexsort((np.arange(S.shape[1]), -S[i]))[:lex.neighbours]
        order = order[S[i, order] > 0]
        out[i] += S[i, order] @ Yd[order] / lex.neighbours
    return out


@pytest.mark.parametrize("budget", [1 << 24, 300])
def test_lexical_retrieve_is_exact_against_brute_force(monkeypatch, budget):
    """The lexical source's top-k equals the brute-force top-k of the dense scores (ties aside), in any row
    blocks; every candidate, whichever source proposed it, carries its exact lexical score."""
    monkeypatch.setattr(lexical_module, "PRODUCT_BUDGET", budget)  # 300: one query per block
    points, labels, Y, queries = _corpus(0, 400, 80)
    lex = LexicalIndex.fit(points, labels, Y, neighbours=5)
    Q = lex.transform(queries)
    want = _brute(lex, Q)
    rng = np.random.default_rng(1)
    E = rng.standard_normal((80, 8)).astype(np.float32)
    E /= np.linalg.norm(E, axis=1, keepdims=True)
    k = 10
    src = build_sources(("label", "lexical"), E, E, None, None, None, "text", "exact", 8, 40, 40, lexical=lex)
    q_emb = rng.standard_normal((len(queries), 8)).astype(np.float32)
    sl = retrieve(q_emb, src, k, lexical_queries=Q, block=7)
    alone = retrieve(q_emb, ShortlistSources(E, E, {}, lexical=lex), k, lexical_queries=Q)
    hits = total = 0
    for i in range(len(queries)):
        ok = sl.ids[i] >= 0
        np.testing.assert_allclose(sl.lex[i][ok], want[i][sl.ids[i][ok]], atol=1e-5)  # every candidate
        got = alone.ids[i][alone.ids[i] >= 0]
        top = np.lexsort((np.arange(80), -want[i]))[:k]
        top = top[want[i][top] > 0]
        np.testing.assert_allclose(np.sort(want[i][got]), np.sort(want[i][top]), atol=1e-5)
        hits += len(set(got) & set(top))
        total += len(top)
        assert set(got) <= set(sl.ids[i][ok])  # the union holds the lexical proposals
    assert total > 0 and hits == total  # recall 1 of the exact top-k (no ties in this corpus)


def test_validation_points_are_excluded_from_the_lexical_knn():
    """Excluding rows (knn_excluded) gives the scores of an index over the other points only; ``exclude_knn``
    keeps a query point from voting for itself."""
    points, labels, Y, queries = _corpus(2, 300, 50)
    held = np.arange(0, 300, 7)
    keep = np.setdiff1d(np.arange(300), held)
    lex = LexicalIndex.fit(points, labels, Y, neighbours=4, fit_on=keep)
    only = LexicalIndex(lex.model, lex.points[keep], lex.point_labels[keep], lex.labels, 4)
    Q = lex.transform(queries + [points[i] for i in held])
    np.testing.assert_array_equal(lex.scores(Q, excluded=held).toarray(), only.scores(Q).toarray())
    np.testing.assert_allclose(lex.scores(Q, excluded=held).toarray(), _brute(lex, Q, held), atol=1e-5)
    nbrs, _ = lex.nearest(Q, drop=np.isin(np.arange(300), held))
    assert not np.isin(nbrs, held).any()
    E = np.eye(50, 4, dtype=np.float32)
    src = ShortlistSources(E, E, {}, knn_excluded=held, lexical=lex)
    sl = retrieve(np.zeros((Q.shape[0], 4), np.float32), src, 50, lexical_queries=Q)
    dense = lex.scores(Q, excluded=held).toarray()
    for i in range(Q.shape[0]):
        ok = sl.ids[i] >= 0
        np.testing.assert_allclose(sl.lex[i][ok], dense[i][sl.ids[i][ok]])
    own = lex.transform(points[:20])
    self_free, _ = lex.nearest(own, own=np.arange(20))
    assert not (self_free == np.arange(20)[:, None]).any()
    with_self, _ = lex.nearest(own)
    assert (with_self[:, 0] == np.arange(20)).all()  # a point is its own nearest neighbour (cosine 1)
    with pytest.raises(ValueError, match="lexical_queries"):
        retrieve(np.zeros((2, 4), np.float32), src, 5)


def test_lexical_index_round_trips_without_pickle(tmp_path):
    """Saved as JSON + .npy + .npz and loaded back, the index maps the same texts to the same rows and scores;
    the same for the shipped-features form, which has no label-text part without label features and cannot
    read raw text."""
    points, labels, Y, queries = _corpus(3, 200, 40)
    lex = LexicalIndex.fit(points, labels, Y, neighbours=3, power=2.5)
    E = np.eye(40, 4, dtype=np.float32)
    save_sources(ShortlistSources(E, E, {}, lexical=lex), tmp_path / "idx", None)
    files = sorted(p.name for p in (tmp_path / "idx" / "lexical").iterdir())
    assert files == ["idf.npy", "labels.npz", "lexical.json", "point_labels.npz", "points.npz", "vocabulary.json"]
    back = load_sources(tmp_path / "idx", ("lexical",), "text", "exact", 40, E, E).lexical
    assert back.power == 2.5  # the vote power is part of the index
    Q, Q2 = lex.transform(queries), back.transform(queries)
    assert (Q != Q2).nnz == 0
    np.testing.assert_array_equal(lex.scores(Q).toarray(), back.scores(Q2).toarray())
    X = sp.random(200, 30, density=0.1, random_state=4, format="csr", dtype=np.float32)
    feat = LexicalIndex.fit(X, None, Y, neighbours=3)
    assert feat.input == "features" and feat.labels is None
    feat.save(tmp_path / "feat")
    again = LexicalIndex.load(tmp_path / "feat")
    Xq = sp.random(10, 30, density=0.2, random_state=5, format="csr", dtype=np.float32)
    np.testing.assert_array_equal(feat.scores(feat.transform(Xq)).toarray(),
                                  again.scores(again.transform(Xq)).toarray())
    assert not (tmp_path / "feat" / "labels.npz").exists() and not (tmp_path / "feat" / "vocabulary.json").exists()
    with pytest.raises(XCConfigError, match="index.sources"):
        again.transform(["raw text"])


def test_lexical_is_an_inference_source_only():
    check_sources(("W", "label", "lexical"), "index.sources")
    with pytest.raises(XCConfigError, match="mining.sources"):
        check_sources(("label", "lexical"), "mining.sources", ANN_SOURCES)
    with pytest.raises(ValueError, match="LexicalIndex"):
        build_sources(("lexical",), np.eye(2, dtype=np.float32), np.eye(2, dtype=np.float32), None, None, None,
                      "text", "exact", 8, 40, 40)


def test_shipped_features_counts_get_tfidf_and_real_values_are_only_normalised(tmp_path):
    """Count rows (every stored value a positive integer) get sklearn's sublinear TF-IDF; real-valued rows (already
    weighted, or dense descriptors under 1, with explicit zeros and negatives) are L2-normalised as they are, never
    1 + log(v) (negative below 1, -inf at an explicit 0), at fit, at query time and after a save and load."""
    from sklearn.feature_extraction.text import TfidfTransformer

    Y = sp.csr_matrix(np.eye(4, 3, dtype=np.float32))
    counts = sp.csr_matrix(np.array([[1, 0, 3], [2, 1, 0], [0, 0, 1], [1, 1, 1]], dtype=np.float32))
    lex = LexicalIndex.fit(counts, None, Y, neighbours=2)
    want = TfidfTransformer(sublinear_tf=True).fit(counts).transform(counts).toarray()
    np.testing.assert_allclose(lex.points.toarray(), want, rtol=1e-6)
    values = sp.csr_matrix((np.array([0.5, 0.0, 0.25, -0.2, 0.01, 0.9, 0.3], dtype=np.float32),
                            np.array([0, 1, 2, 0, 1, 2, 1]), np.array([0, 3, 5, 6, 7])), shape=(4, 3))
    assert values.nnz == 7  # the explicit 0 is stored, as a file's "1:0" would be
    lex = LexicalIndex.fit(values, None, Y, neighbours=2)
    dense = values.toarray()
    unit = dense / np.linalg.norm(dense, axis=1, keepdims=True)
    np.testing.assert_allclose(lex.points.toarray(), unit, rtol=1e-6)
    assert lex.points.nnz == 6 and np.isfinite(lex.points.data).all()
    np.testing.assert_allclose(lex.transform(values).toarray(), unit, rtol=1e-6)  # queries: the same rows
    lex.save(tmp_path / "values")
    assert not (tmp_path / "values" / "idf.npy").exists()
    back = LexicalIndex.load(tmp_path / "values")
    np.testing.assert_allclose(back.transform(values).toarray(), unit, rtol=1e-6)


def _fusion_problem(seed: int, informative: bool):
    rng = np.random.default_rng(seed)
    n, C, L = 500, 20, 400
    ids = np.argsort(rng.random((n, C * 3)), axis=1)[:, :C].astype(np.int64)
    clf, emb, lex = (rng.random((n, C)).astype(np.float32) for _ in range(3))
    top = np.argmax(3.0 * lex + emb if informative else clf, axis=1)  # one relevant label per row
    Y = sp.csr_matrix((np.ones(n), (np.arange(n), ids[np.arange(n), top])), shape=(n, L))
    return Shortlist(ids, clf, emb, None, lex), Y


def test_alpha_fusion_weighs_the_lexical_score_only_where_it_informs():
    """Relevance follows the lexical score: d > 0, better than d = 0 (which is always tried); relevance is the
    classifier's ranking exactly: d = 0 (ties prefer the smaller d). d round-trips through fusion.json; an older
    file without it loads with d = 0; the tree fusion ignores the lexical score."""
    p = FusionParams(grid_step=0.25, lexical_grid=(0.125, 0.25), objective="precision_at_1")
    sl, Y = _fusion_problem(0, informative=True)
    fit = fit_alpha(sl, Y, p, None, None)
    tried = [d for d, _ in fit.lexical_grid]
    assert tried[:3] == [0.0, 0.125, 0.25] and fit.lexical_weight >= 0.5  # extended by doubling from 0.25
    values = dict(fit.lexical_grid)
    assert values[fit.lexical_weight] > values[0.0] + 0.2
    np.testing.assert_allclose(fit.score(sl), fit.alpha * sl.clf + (1 - fit.alpha) * sl.emb
                               + fit.lexical_weight * sl.lex, rtol=1e-6)
    assert fit_alpha(sl, Y, replace(p, lexical_grid_extend=0), None, None).lexical_weight == 0.25
    back = load_fusion(json.loads(json.dumps(fit.to_dict())))
    assert back.lexical_weight == fit.lexical_weight and back.summary()["lexical_weight"] == fit.lexical_weight
    np.testing.assert_array_equal(back.score(sl), fit.score(sl))
    old = {k: v for k, v in fit.to_dict().items() if not k.startswith("lexical")}
    assert load_fusion(old).lexical_weight == 0.0
    with pytest.raises(XCConfigError, match="lexical"):
        fit.score(Shortlist(sl.ids, sl.clf, sl.emb))
    noise, Yn = _fusion_problem(1, informative=False)
    plain = fit_alpha(noise, Yn, p, None, None)
    assert plain.lexical_weight == 0.0 and plain.alpha == 1.0 and plain.objective_value == 1.0
    assert fit_alpha(Shortlist(sl.ids, sl.clf, sl.emb), Y, p, None, None).lexical_grid == []
    with pytest.raises(XCConfigError, match="fusion.lexical_grid"):
        fit_alpha(sl, Y, replace(p, lexical_grid=(-1.0,)), None, None)
    inv = np.ones(Y.shape[1])
    tree = fit_tree(sl, Y, FusionParams(method="tree", tree_depth=2, objective="precision_at_1"), inv, None)
    assert tree.score(sl, inv).shape == sl.ids.shape
    assert isinstance(AlphaFusion.from_dict({"alpha": 0.5}), AlphaFusion)


def test_lexical_source_through_the_pipeline_and_the_bundle(tmp_path, monkeypatch):
    """index.sources with lexical: the index stage writes its folder, the fusion is fitted with the validation
    points excluded from the lexical kNN (the same fit as with them indexed nowhere), evaluation reports the
    lexical-only ranking, and the serving bundle vectorizes raw text to the evaluation's predictions."""
    home = tiny_lf_home(tmp_path, monkeypatch, {**TINY, "pretrain.epochs": 1, "classifier.epochs": 1,
                                                "index.sources": "W,label,lexical", "index.lexical_power": 2})
    spec = Catalog(home.catalog).get("TinyTitles")
    ctx = StageContext(ArtifactStore(home.artifacts), spec, spec.config(), home.cache)
    out = run_all(ctx)
    assert out["index"]["sources"] == ["W", "label", "lexical"] and out["index"]["heldout_knn_points"] == 108
    assert out["index"]["lexical"]["input"] == "text" and out["index"]["lexical"]["points"] == 120
    idx = ctx.dir("index")
    assert (idx / "lexical" / "lexical.json").is_file() and not list(idx.rglob("*.pkl"))
    np.testing.assert_array_equal(np.load(idx / "heldout" / "knn_excluded.npy"), ctx.read.valid_rows())
    m = ctx.read.shortlist_sources(ctx.cfg.index.hnsw_ef_search, heldout=True)
    np.testing.assert_array_equal(m.knn_excluded, ctx.read.valid_rows())
    fitted = json.loads((ctx.dir("fusion") / "fusion.json").read_text())
    assert "lexical_weight" in fitted and [d for d, _ in fitted["lexical_grid"]][:5] == [0, 0.125, 0.25, 0.5, 1]
    metrics = out["evaluate"]["metrics"]
    assert metrics["lexical_only_precision_at_1"] > 0.5  # point titles name their labels' words
    off = StageContext(ctx.store, spec, spec.config({"index.include_validation": False}), home.cache)
    again = run_all(off, ("index", "fusion"))
    assert again["index"]["lexical"]["points"] == 108 and not (off.dir("index") / "heldout").exists()
    assert json.loads((off.dir("fusion") / "fusion.json").read_text()) == fitted
    run_all(ctx, ("index", "fusion"))
    ds = load_dataset(ctx.dir("ingest") / "dataset", features=False)
    serving_bundle.write_bundle(ctx, tmp_path / "bundle")
    bundle = serving_bundle.load_bundle(tmp_path / "bundle", "cpu")
    assert bundle.sources.lexical.power == 2 and bundle.sources.knn_excluded is None
    ids, scores = serving_bundle.predict_topk(ds.test_texts, bundle, 10)
    filtered, _ = remove_filtered(ids, scores, ds.filter_test)
    np.testing.assert_array_equal(filtered, np.load(ctx.dir("evaluate") / "predictions.npz")["ids"])


def _write_bow(folder, n_train: int = 120, n_test: int = 40, L: int = 20, seed: int = 0, vocab: bool = True):
    """A legacy BoW dataset whose points carry their labels' words as features (plus one random word); with
    ``vocab``, its ``X_vocab.txt`` names the features."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True)

    def rows(n: int) -> list[str]:
        out = []
        for _ in range(n):
            labels = sorted(rng.choice(L, size=int(rng.integers(1, 4)), replace=False).tolist())
            feats = sorted(set(labels) | {int(rng.integers(L, L + 10))})
            out.append(",".join(map(str, labels)) + " " + " ".join(f"{f}:{1 + rng.random():.3f}" for f in feats))
        return out

    for name, n in (("tiny_train.txt", n_train), ("tiny_test.txt", n_test)):
        (folder / name).write_text("\n".join([f"{n} {L + 10} {L}", *rows(n)]) + "\n")
    if vocab:
        (folder / "X_vocab.txt").write_text("\n".join(f"word{i}" for i in range(L + 10)) + "\n")
    return folder


def bow_context(tmp_path, monkeypatch, vocab: bool = True, sources: str | None = "W,label,lexical",
                overrides: dict | None = None) -> StageContext:
    """A tiny BoW dataset (with or without its X_vocab.txt) in the catalog, indexed with the lexical source
    (``sources`` None: the strategy's sources), with the config ``overrides``."""
    monkeypatch.setenv("XC_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    home = ready_home(tmp_path / "home")
    enc = write_tiny_encoder(tmp_path / "enc")
    source = _write_bow(tmp_path / "src" / "TinyBow", vocab=vocab)
    Catalog(home.catalog).add(DatasetSpec("TinyBow", str(source), overrides={
        **TINY, "tokenize.encoder": str(enc), "pretrain.epochs": 1, "classifier.epochs": 1,
        **({"index.sources": sources} if sources else {}), **(overrides or {})}))
    spec = Catalog(home.catalog).get("TinyBow")
    return StageContext(ArtifactStore(home.artifacts), spec, spec.config(), home.cache)


def test_lexical_source_on_shipped_bow_features(tmp_path, monkeypatch):
    """A BoW dataset: the lexical source is TF-IDF of the shipped features read as word sets with the dataset's
    feature words (no label-text part: the labels have none in that space), used by the fusion and evaluation;
    the serving bundle maps raw text to the same rows, so the test points' rebuilt texts get the evaluation's
    predictions."""
    ctx = bow_context(tmp_path, monkeypatch, overrides={"index.lexical_classifier_weights": "1,0.25,0.5,2,4"})
    out = run_all(ctx)
    summary = dict(out["index"]["lexical"])
    # 120 fit points x a few labels: solved exactly (lexical_exact), a history value per margin scale tried
    assert summary.pop("classifier_weights") > 0 and summary.pop("classifier_solver") == "liblinear"
    assert len(SCALES) <= len(summary.pop("classifier_history")) <= len(SCALES) + SCALES_EXTEND
    assert summary.pop("classifier_stopped_at_deadline") is False  # the budget leaves the tiny run every label
    assert summary.pop("classifier_skipped_at_deadline") is False
    # the classifiers' weight of best value on the validation points (test_lexical_weight), kept with the index
    grid, weight = summary.pop("classifier_weight_grid"), summary.pop("classifier_weight")
    assert [g for g, _ in grid] == [1.0, 0.25, 0.5, 2.0, 4.0] and weight == max(grid, key=lambda t: t[1])[0]
    assert ctx.read.shortlist_sources(200).lexical.classifier.settings.weight == weight
    assert summary == {"input": "features", "points": 120, "terms": 30, "neighbours": 10, "label_text": False,
                       "feature_words": True, "max_postings": 0}
    assert out["evaluate"]["metrics"]["lexical_only_precision_at_1"] > 0.5
    lex = ctx.read.shortlist_sources(ctx.cfg.index.hnsw_ef_search).lexical
    ds = load_dataset(ctx.dir("ingest") / "dataset")
    assert ds.feature_words == ctx.read.feature_words() == [f"word{i}" for i in range(30)]
    Q = ctx.read.lexical_queries(ctx.read.shortlist_sources(200), "test")
    np.testing.assert_array_equal(Q.toarray(), lex.transform(ds.X_test).toarray())
    np.testing.assert_array_equal(Q.toarray(), lex.transform(ds.test_texts).toarray())  # text = its features
    serving_bundle.write_bundle(ctx, tmp_path / "bundle")
    assert (tmp_path / "bundle" / "lexical" / "feature_words.json").is_file()
    bundle = serving_bundle.load_bundle(tmp_path / "bundle", "cpu")
    assert bundle.sources.lexical.words.words == ds.feature_words
    ids, scores = serving_bundle.predict_topk(ds.test_texts, bundle, 10)
    filtered, _ = remove_filtered(ids, scores, ds.filter_test)
    np.testing.assert_array_equal(filtered, np.load(ctx.dir("evaluate") / "predictions.npz")["ids"])


@pytest.mark.parametrize("density,k", [(0.6, 10), (0.05, 3), (0.002, 5), (0.9, 40)])
def test_dense_topk_equals_sparse_topk_with_ties(density, k):
    S = sp.random(50, 30, density=density, random_state=8, format="csr", dtype=np.float32)
    S.data = np.ceil(S.data * 4) / 4  # few distinct positive values: ties at the k-th value, broken by column
    got, want = sparse_topk(S, k, packed_share=0.0), sparse_topk(S, k, packed_share=np.inf)  # packed vs sorted
    assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])


@pytest.mark.parametrize("threads", [1, 3])
def test_lexical_scores_on_threads_equal_one_thread_within_the_budget(monkeypatch, threads):
    """The blocks of ``scores`` run on the process's threads (scipy's products release the GIL): the same scores
    as one block at a time, and each block's products within 1 / threads of PRODUCT_BUDGET, so the products held
    at once stay within it."""
    points, labels, Y, queries = _corpus(3, 400, 80)
    lex = LexicalIndex.fit(points, labels, Y, neighbours=5)
    Q = lex.transform(queries * 4)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    want = lex.scores(Q).toarray()
    budget = 2_000
    monkeypatch.setattr(lexical_module, "PRODUCT_BUDGET", budget)
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    seen, pools, nearest = [], [], LexicalIndex.nearest

    def spy(self, q, *a, **k):
        c = np.concatenate([[0], np.cumsum(self._work[q.indices])])
        seen.append((q.shape[0], int(c[-1])))
        return nearest(self, q, *a, **k)

    class Pool(ThreadPoolExecutor):
        def __init__(self, workers):
            pools.append(workers)
            super().__init__(workers)

    monkeypatch.setattr(LexicalIndex, "nearest", spy)
    monkeypatch.setattr(device_module, "ThreadPoolExecutor", Pool)
    got = lex.scores(Q).toarray()
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    assert sum(rows for rows, _ in seen) == Q.shape[0] and len(seen) > threads
    assert all(work <= budget // threads or rows == 1 for rows, work in seen)
    assert pools == ([] if threads == 1 else [threads])  # one pool of the process's threads per call


def test_retrieve_blocks_follow_the_queries_postings(monkeypatch):
    """``retrieve`` sizes its blocks by its queries' own lexical products (at most PRODUCT_BUDGET, a single costly
    query alone), not by the worst case ``block_rows``; the shortlist is the same in any blocks."""
    points, labels, Y, queries = _corpus(0, 400, 80)
    lex = LexicalIndex.fit(points, labels, Y, neighbours=5)
    Q = lex.transform(queries)
    work = lex.query_work(Q)
    np.testing.assert_array_equal(work, [int(lex._work[Q.indices[Q.indptr[i]:Q.indptr[i + 1]]].sum())
                                         for i in range(Q.shape[0])])
    E = np.random.default_rng(1).standard_normal((80, 8)).astype(np.float32)
    src = ShortlistSources(E, E, {}, lexical=lex)
    q_emb = np.random.default_rng(2).standard_normal((len(queries), 8)).astype(np.float32)
    whole = retrieve(q_emb, src, 10, lexical_queries=Q)
    budget = int(work.max()) * 8
    monkeypatch.setattr(lexical_module, "PRODUCT_BUDGET", budget)
    rows, scores = [], LexicalIndex.scores

    def spy(self, q, *a, **k):
        rows.append((q.shape[0], int(self.query_work(sp.csr_matrix(q)).sum())))
        return scores(self, q, *a, **k)

    monkeypatch.setattr(LexicalIndex, "scores", spy)
    sl = retrieve(q_emb, src, 10, lexical_queries=Q, block=32)
    assert sum(r for r, _ in rows) == len(queries) and max(r for r, _ in rows) <= 32
    assert all(w <= budget or r == 1 for r, w in rows)
    assert max(r for r, _ in rows) > 2 * lex.block_rows  # the worst case would have cut every block to block_rows
    np.testing.assert_array_equal(sl.ids, whole.ids)
    np.testing.assert_allclose(sl.lex, whole.lex, rtol=1e-6)


@pytest.mark.parametrize("threads", [2, 5])
def test_alpha_grid_on_threads_equals_one_thread(monkeypatch, threads):
    """The fusion grid's cells run on the process's threads, each thread with its own Blend: the same objective at
    every grid point, so the same fit, as one cell at a time."""
    rng = np.random.default_rng(4)
    sl, Y = _fusion_problem(5, informative=True)
    sl = Shortlist(sl.ids, sl.clf, sl.emb, rng.random(sl.ids.shape).astype(np.float32), sl.lex)  # kNN scores too
    params = FusionParams(objective="precision_at_1+precision_at_5", knn_grid=[0.0, 0.5, 1.0], lexical_grid=[0.25, 1.0],
                          smoothing=1)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    one = fit_alpha(sl, Y, params, None, None)
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    many = fit_alpha(sl, Y, params, None, None)
    assert many.grid == one.grid and many.knn_grid == one.knn_grid and many.lexical_grid == one.lexical_grid
    assert (many.alpha, many.knn_weight, many.lexical_weight) == (one.alpha, one.knn_weight, one.lexical_weight)
    assert one.lexical_weight > 0  # the lexical score informs: the threads had distinct c and d cells to share
