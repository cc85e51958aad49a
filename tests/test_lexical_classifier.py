"""The lexical source's classifiers: sparse per-label logistic regressions over the TF-IDF rows."""

from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np
import pytest
import scipy.sparse as sp

import xc_dagster.retrieval.lexical as lexical
import xc_dagster.retrieval.lexical_classifier as lc
import xc_dagster.retrieval.lexical_tables as tables
from xc_dagster.errors import XCConfigError
from xc_dagster.retrieval.lexical import LexicalIndex
from xc_dagster.retrieval.lexical_classifier import (
    ClassifierSettings,
    LexicalClassifier,
    hard_negatives,
    pruned_support,
)


def sgd(**settings) -> ClassifierSettings:
    """The stochastic trainer's settings: these small sets would otherwise be solved exactly (test_lexical_exact)."""
    return ClassifierSettings(solver="sgd", **settings)


def test_support_is_each_labels_positive_terms_pruned_to_the_largest():
    X = sp.csr_matrix(np.array([[0.5, 0.0, 0.3, 0.0],
                                [0.0, 0.2, 0.4, 0.0],
                                [0.0, 0.0, 0.0, 0.9]], dtype=np.float32))
    Y = sp.csr_matrix(np.array([[1, 0], [1, 0], [0, 1]], dtype=np.float32))
    # label 0: centroid weights (0.5, 0.2, 0.7, 0); label 1: (0, 0, 0, 0.9); keys l * 4 + t
    assert pruned_support(X, Y, 10).tolist() == [0, 1, 2, 7]
    assert pruned_support(X, Y, 2).tolist() == [0, 2, 7]  # label 0 keeps its two largest: terms 2 (0.7), 0 (0.5)
    assert pruned_support(X, Y, 1).tolist() == [2, 7]


def test_hard_negatives_are_the_top_scored_non_positives_ties_to_the_smaller_label():
    C = sp.csr_matrix(np.array([[0.9, 0.5, 0.5, 0.1, 0.0],
                                [0.0, 0.0, 0.3, 0.0, 0.2]], dtype=np.float32))
    Y = sp.csr_matrix(np.array([[1, 0, 0, 0, 0], [0, 0, 1, 0, 0]], dtype=np.float32))
    H = hard_negatives(C, Y, 2)
    assert H.toarray().tolist() == [[0, 1, 1, 0, 0], [0, 0, 0, 0, 1]]
    assert hard_negatives(C, Y, 0).nnz == 0


@pytest.mark.parametrize("dense_up_to", [0, 1 << 24])  # keys looked up, or a dense table
@pytest.mark.parametrize("budget", [7, 1 << 22])
def test_pair_scores_equal_the_dense_logistic_model_in_any_chunking(monkeypatch, budget, dense_up_to):
    monkeypatch.setattr(lc, "LOOKUP_BUDGET", budget)
    monkeypatch.setattr(tables, "DENSE_UP_TO", dense_up_to)
    rng = np.random.default_rng(0)
    V, L = 12, 5
    keys = np.sort(rng.choice(L * V, 30, replace=False)).astype(np.int64)
    w = rng.normal(size=30).astype(np.float32)
    b = rng.normal(size=L).astype(np.float32)
    model = LexicalClassifier(keys, w, b, V)
    dense = np.zeros(L * V, np.float32)
    dense[keys] = w
    Q = sp.random(9, V, density=0.4, random_state=1, format="csr", dtype=np.float32)
    rows, labels = rng.integers(0, 9, 40), rng.integers(0, L, 40)
    want = 1 / (1 + np.exp(-(np.einsum("ij,ij->i", Q.toarray()[rows], dense.reshape(L, V)[labels]) + b[labels])))
    np.testing.assert_allclose(model.pair_scores(Q, rows, labels), want, rtol=1e-5, atol=1e-6)
    S = sp.csr_matrix(np.where(rng.random((9, L)) < 0.5, 1.0, 0.0).astype(np.float32))
    got = model.on_pattern(Q, S)
    r, c = S.nonzero()
    np.testing.assert_allclose(np.asarray(got[r, c]).ravel(), model.pair_scores(Q, r, c), rtol=1e-6)
    assert model.pair_scores(Q, np.zeros(0, int), np.zeros(0, int)).shape == (0,)
    capped = LexicalClassifier(keys, w, b, V, sgd(candidates=2)).on_pattern(Q, S.multiply(
        sp.csr_matrix(np.arange(1, L + 1, dtype=np.float32)[None, :])))  # the two largest labels of each row
    for i in range(9):
        top = sorted(np.flatnonzero(S[i].toarray()[0]))[-2:]
        assert capped[i].indices.tolist() == top
        np.testing.assert_allclose(capped[i].data, model.pair_scores(Q, [i] * len(top), top), rtol=1e-6)


def _topic_texts(n: int, labels: int, seed: int) -> tuple[list[str], sp.csr_matrix]:
    """One label per point; its text is one of its label's two cue words among five shared noise words, so that
    the points' TF-IDF neighbours mostly share noise, not the label: a kNN vote is weak, a linear model is not."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, labels, n)
    texts = [" ".join([f"cue{l}x{rng.integers(2)}"] + [f"noise{w}" for w in rng.integers(0, 40, 5)]) for l in y]
    return texts, sp.csr_matrix((np.ones(n, np.float32), (np.arange(n), y)), shape=(n, labels))


def _p_at_1(S: sp.csr_matrix, Y: sp.csr_matrix) -> float:
    top = np.asarray(S.argmax(axis=1)).ravel()
    return float(np.asarray(Y[np.arange(Y.shape[0]), top]).mean())


def test_classifiers_learn_what_the_knn_vote_misses(monkeypatch):
    monkeypatch.setattr(lexical, "PRIOR_LABELS", 0)  # the classifiers on the other parts' labels only (no prior,
    monkeypatch.setattr(lc, "OWN_LABELS", 0)  # none of their own)
    texts, Y = _topic_texts(1200, 30, 0)
    test_texts, Y_test = _topic_texts(300, 30, 1)
    plain = LexicalIndex.fit(texts, None, Y, 10, min_df=1)
    index = LexicalIndex.fit(texts, None, Y, 10, min_df=1, classifier=sgd(epochs=5, seed=0))
    Q = plain.transform(test_texts)
    S0, S = plain.scores(Q), index.scores(Q)
    assert _p_at_1(S, Y_test) >= _p_at_1(S0, Y_test) + 0.2  # 0.34 -> 0.61
    # the classifier part alone ranks the candidates the other parts propose: where the true label is among them
    # (2 in 3 test points), it is first for nearly all (0.995), where the kNN and label parts get half (0.50)
    parts = S - S0
    assert np.array_equal(parts.indices, S0.indices) and 0 < parts.data.min() <= parts.data.max() < 1
    found = np.asarray(S0.multiply(Y_test).sum(axis=1)).ravel() > 0
    assert _p_at_1(parts[found], Y_test[found]) >= 0.95 and _p_at_1(S0[found], Y_test[found]) <= 0.7


def test_classifiers_train_on_the_fit_points_only_and_are_seeded(monkeypatch):
    texts, Y = _topic_texts(400, 10, 2)
    fit_on = np.arange(300)
    a = LexicalIndex.fit(texts, None, Y, 5, min_df=1, fit_on=fit_on, classifier=sgd(epochs=2))
    b = LexicalIndex.fit(texts, None, Y, 5, min_df=1, fit_on=fit_on, classifier=sgd(epochs=2))
    np.testing.assert_array_equal(a.classifier.weights.numpy(), b.classifier.weights.numpy())
    assert a.classifier.history == b.classifier.history and len(a.classifier.history) == 2
    # the dense table (this size's), the keys looked up with dense gradients, and with sparse ones: the same
    # model up to the sums' order
    monkeypatch.setattr(tables, "DENSE_UP_TO", 0)
    for sparse_from in (1 << 21, 1):
        monkeypatch.setattr(tables, "SPARSE_FROM", sparse_from)
        c = LexicalIndex.fit(texts, None, Y, 5, min_df=1, fit_on=fit_on, classifier=sgd(epochs=2))
        np.testing.assert_allclose(c.classifier.weights.numpy(), a.classifier.weights.numpy(), rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(c.classifier.bias.numpy(), a.classifier.bias.numpy(), rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(c.classifier.history, a.classifier.history, atol=1e-6)
    assert np.abs(a.classifier.weights.numpy()).max() > 0.1  # trained, not left at 0
    monkeypatch.setattr(tables, "DENSE_UP_TO", 1 << 24)
    # the held-out points' labels are not in the support: a label only they carry has no weights, its bias only
    # ever met random negatives
    Y2 = Y.tolil()
    Y2[300:, :] = 0
    Y2[300:, 9] = 1
    Y2[:300, 9] = 0
    c = LexicalIndex.fit(texts, None, Y2.tocsr(), 5, min_df=1, fit_on=fit_on, classifier=sgd(epochs=2))
    keys = c.classifier.keys.numpy()
    assert not ((keys // c.classifier.num_terms) == 9).any()
    assert c.classifier.bias[9] < 0


def test_max_pairs_caps_the_training():
    texts, Y = _topic_texts(400, 10, 3)
    full = LexicalIndex.fit(texts, None, Y, 5, min_df=1, classifier=sgd(epochs=3))
    capped = LexicalIndex.fit(texts, None, Y, 5, min_df=1, classifier=sgd(epochs=3, max_pairs=500))
    # 500 pairs of ~105 per point: a sample of 5 points trained, so the weights barely moved
    assert np.abs(capped.classifier.weights.numpy()).sum() < 0.05 * np.abs(full.classifier.weights.numpy()).sum()


def test_a_deadline_stops_training_after_the_first_pass(monkeypatch):
    """The training budget's deadline: one pass at least, then the pass in progress is the last; the same seed
    and no deadline train every pass, and a deadline that never comes changes nothing."""
    texts, Y = _topic_texts(600, 10, 5)
    fit_on = np.arange(500)  # the other 100 judge each pass
    full = LexicalIndex.fit(texts, None, Y, 5, min_df=1, fit_on=fit_on, classifier=sgd(epochs=4))
    assert len(full.classifier.history) == 4 and not full.classifier.stopped_at_deadline
    past = LexicalIndex.fit(texts, None, Y, 5, min_df=1, fit_on=fit_on, classifier=sgd(epochs=4),
                            deadline=0.0)
    assert len(past.classifier.history) == 1 and past.classifier.stopped_at_deadline
    assert past.classifier.history[0] == full.classifier.history[0]  # the same first pass, seeded
    late = LexicalIndex.fit(texts, None, Y, 5, min_df=1, fit_on=fit_on, classifier=sgd(epochs=4),
                            deadline=float("inf"))
    np.testing.assert_array_equal(late.classifier.weights.numpy(), full.classifier.weights.numpy())
    # a deadline passed in the middle of the second pass: that pass is cut there, judged, and training ends
    # (a clock read once per batch after the first pass: 0, 1, 2, ...; 2 batches of ~19 run)
    clock = iter(range(10**6))
    monkeypatch.setattr(lc, "time", SimpleNamespace(perf_counter=lambda: float(next(clock))))
    cut = LexicalIndex.fit(texts, None, Y, 5, min_df=1, fit_on=fit_on, classifier=sgd(epochs=4),
                           deadline=1.5)
    assert len(cut.classifier.history) == 2 and cut.classifier.stopped_at_deadline
    assert next(clock) == 3  # the second pass read the clock three times: two batches, then the stop
    assert cut.classifier.history[1] != full.classifier.history[1]  # a part of the pass, not the whole
    # a hard stop cuts the first pass too, after a batch: the clock read before the 2nd, 3rd and 4th batches
    # (one block of hard negatives: no projection reads the clock)
    clock = iter(range(10**6))
    hard = LexicalIndex.fit(texts, None, Y, 5, min_df=1, fit_on=fit_on, classifier=sgd(epochs=4),
                            skip_after=1.5)
    assert len(hard.classifier.history) == 1 and hard.classifier.stopped_at_deadline and next(clock) == 3
    assert hard.classifier.history[0] != full.classifier.history[0]  # three batches of the first pass


def test_ends_past_projects_the_rate_so_far(monkeypatch):
    """10 s for 1 of 3 units: 20 s more at that rate, so the work ends at now + 20."""
    monkeypatch.setattr(lc, "time", SimpleNamespace(perf_counter=lambda: 100.0))
    assert lc.ends_past(115.0, 90.0, 1, 3) and not lc.ends_past(125.0, 90.0, 1, 3)
    assert not lc.ends_past(None, 90.0, 1, 3) and not lc.ends_past(0.0, 90.0, 0, 3)  # no deadline, no rate yet
    assert lc.ends_past(115.0, 90.0, 10, 100) and not lc.ends_past(115.0, 90.0, 9, 100)  # judged from 10% done


def test_hard_negatives_that_would_outlast_the_deadline_leave_the_classifiers_out(monkeypatch):
    """Finding the hard negatives (the other parts' scores of every fit point) is the classifiers' work that no
    pass boundary cuts: where its first blocks project past ``skip_after`` the classifiers are left out, the index
    scoring as one built without them; a time that the blocks' rate meets trains as before."""
    texts, Y = _topic_texts(600, 10, 5)
    fit_on = np.arange(500)
    blocks = LexicalIndex.query_blocks
    monkeypatch.setattr(LexicalIndex, "query_blocks", lambda self, Q, step: blocks(self, Q, 100))  # 5 blocks
    settings = sgd(epochs=2)
    full = LexicalIndex.fit(texts, None, Y, 5, min_df=1, fit_on=fit_on, classifier=settings)
    assert full.classifier is not None and not full.classifier_skipped
    past = LexicalIndex.fit(texts, None, Y, 5, min_df=1, fit_on=fit_on, classifier=settings, deadline=0.0,
                            skip_after=0.0)
    assert past.classifier is None and past.classifier_skipped
    # past the deadline but with no skip_after: one pass, as before
    one = LexicalIndex.fit(texts, None, Y, 5, min_df=1, fit_on=fit_on, classifier=settings, deadline=0.0)
    assert len(one.classifier.history) == 1 and not one.classifier_skipped
    plain = LexicalIndex.fit(texts, None, Y, 5, min_df=1, fit_on=fit_on)
    Q = plain.transform(texts[:50])
    np.testing.assert_array_equal(past.scores(Q).toarray(), plain.scores(Q).toarray())
    met = LexicalIndex.fit(texts, None, Y, 5, min_df=1, fit_on=fit_on, classifier=settings,
                           deadline=time.perf_counter() + 3600, skip_after=time.perf_counter() + 3600)
    assert not met.classifier_skipped
    np.testing.assert_array_equal(met.classifier.weights.numpy(), full.classifier.weights.numpy())


def test_queries_the_other_parts_give_few_labels_get_the_classifiers_prior(monkeypatch):
    """Rows with fewer than PRIOR_LABELS labels are topped up with the labels of largest bias, each scored
    sigmoid(b_l) (here no weights: every classifier score is its bias); fuller rows are left as they were."""
    monkeypatch.setattr(lexical, "PRIOR_LABELS", 7)  # the kNN part gives these rows 3-9 labels: both kinds
    texts, Y = _topic_texts(300, 30, 2)
    index = LexicalIndex.fit(texts, None, Y, 10, min_df=1)
    plain = index.scores(index.transform(texts[:40] + ["unseenword", ""]))
    bias = np.linspace(-3.0, 1.0, 30).astype(np.float32)[np.random.default_rng(0).permutation(30)]
    index.classifier = LexicalClassifier(np.zeros(0, np.int64), np.zeros(0, np.float32), bias, index.points.shape[1])
    S = index.scores(index.transform(texts[:40] + ["unseenword", ""]))
    prior = np.argsort(-bias)[:lexical.PRIOR_LABELS]
    sig = 1.0 / (1.0 + np.exp(-bias.astype(np.float64)))
    for r in (40, 41):  # no term in common with anything: the prior alone, each label at its sigmoid(b_l)
        assert plain[r].nnz == 0 and np.array_equal(np.sort(S[r].indices), np.sort(prior))
        np.testing.assert_allclose(S[r].toarray()[0, prior], sig[prior], rtol=1e-6)
    counts = np.diff(plain.indptr)[:40]
    assert (counts < lexical.PRIOR_LABELS).any() and (counts >= lexical.PRIOR_LABELS).any()
    for r in range(40):
        want = plain[r].toarray()[0]
        labels = set(plain[r].indices) | (set(prior) if counts[r] < lexical.PRIOR_LABELS else set())
        want[sorted(labels)] += sig[sorted(labels)]
        assert set(S[r].indices) == labels
        np.testing.assert_allclose(S[r].toarray()[0], want, rtol=1e-5, atol=1e-6)


def test_classifiers_propose_their_own_top_labels_where_the_knn_vote_misses(monkeypatch):
    """Each query also gets its OWN_LABELS labels of largest w_l . q + b_l: on the test points whose label the kNN
    part does not propose (1 in 3 here), P@1 goes from 0 to nearly all; where it does, as before."""
    monkeypatch.setattr(lexical, "PRIOR_LABELS", 0)
    texts, Y = _topic_texts(1200, 30, 0)
    test_texts, Y_test = _topic_texts(300, 30, 1)
    index = LexicalIndex.fit(texts, None, Y, 10, min_df=1, classifier=ClassifierSettings(seed=0))  # liblinear
    Q = index.transform(test_texts)
    clf, index.classifier = index.classifier, None
    S0 = index.scores(Q)
    index.classifier = clf
    S = index.scores(Q)
    monkeypatch.setattr(lc, "OWN_LABELS", 0)
    S_before = index.scores(Q)
    missed = np.asarray(S0.multiply(Y_test).sum(axis=1)).ravel() == 0
    assert 50 <= missed.sum() <= 150
    assert _p_at_1(S_before[missed], Y_test[missed]) == 0 and _p_at_1(S[missed], Y_test[missed]) >= 0.9
    assert _p_at_1(S[~missed], Y_test[~missed]) >= _p_at_1(S_before[~missed], Y_test[~missed]) - 0.01
    assert _p_at_1(S, Y_test) >= _p_at_1(S_before, Y_test) + 0.25  # 0.67 -> 1.0


@pytest.mark.parametrize("budget", [1 << 22, 7])
def test_top_labels_are_the_largest_logits_among_the_labels_a_term_meets(monkeypatch, budget):
    """top_labels = the k largest w_l . q + b_l over the labels whose weights meet a query term (hand-built
    weights), in any row blocking; a query with no such term gets none (the prior covers it)."""
    monkeypatch.setattr(lc, "LOOKUP_BUDGET", budget)
    V, L = 6, 5
    W = np.zeros((L, V), np.float32)
    W[0, [0, 1]], W[1, 1], W[2, [2, 3]], W[3, 4], W[4, 0] = [1.0, 0.5], 2.0, [0.25, -1.0], 3.0, -0.5
    keys = np.flatnonzero(W.ravel())
    bias = np.array([0.0, -1.0, 0.5, -4.0, 0.2], np.float32)
    clf = LexicalClassifier(keys, W.ravel()[keys], bias, V)
    Q = sp.csr_matrix(np.array([[1, 1, 0, 0, 0, 0], [0, 0, 1, 1, 0, 0], [0, 0, 0, 0, 1, 0], [0, 0, 0, 0, 0, 1],
                                [0.5, 0, 0, 0, 0.5, 0]], np.float32))
    # logits of the labels met: row 0 {0: 1.5, 1: 1.0, 4: -0.3}; row 1 {2: -0.25}; row 2 {3: -1.0}; row 3 none;
    # row 4 {0: 0.5, 3: -2.5, 4: -0.05}
    got = clf.top_labels(Q, 2)
    assert got.tolist() == [[0, 1], [2, -1], [3, -1], [-1, -1], [0, 4]]
    assert clf.top_labels(Q, 0).shape == (5, 0)
    # each term keeping its largest weight (the lexical index's postings cap at scale): label 4 (only -0.5 on term
    # 0, where label 0 has 1.0) is never met; row 4 reads label 0 at 0.5 and label 3 at 1.5 - 4
    capped = clf.top_labels(Q, 2, max_postings=1)
    assert capped[4].tolist() == [0, 3] and 4 not in capped


def test_own_labels_are_scored_first_when_a_row_has_more_candidates_than_are_scored(monkeypatch):
    """candidates(): the other parts' labels, the prior where a row has fewer, the query's own top labels; with
    more than ``candidates`` labels in a row, on_pattern scores the own ones and then the other parts' best."""
    monkeypatch.setattr(lc, "OWN_LABELS", 1)
    V, L = 2, 6
    keys = np.array([5 * V + 1])  # label 5 weighs term 1
    clf = LexicalClassifier(keys, np.array([3.0], np.float32), np.zeros(L, np.float32), V,
                            ClassifierSettings(candidates=3))
    Q = sp.csr_matrix(np.array([[1.0, 1.0], [1.0, 0.0]], np.float32))
    S = sp.csr_matrix(np.array([[0.9, 0.8, 0.7, 0.6, 0, 0], [0.5, 0, 0, 0, 0, 0]], np.float32))
    P = clf.candidates(Q, S, np.array([4, 3]))
    assert P[0].indices.tolist() == [0, 1, 2, 3, 5] and P[1].indices.tolist() == [0, 3, 4]  # row 1: no own label
    scored = clf.on_pattern(Q, P)
    assert scored[0].indices.tolist() == [0, 1, 5]  # its own label, then the other parts' two best
    np.testing.assert_allclose(scored[0].data, 1 / (1 + np.exp(-np.array([0.0, 0.0, 3.0]))), rtol=1e-6)


def test_prior_is_the_labels_by_decreasing_bias_ties_to_the_smaller_id():
    clf = LexicalClassifier(np.zeros(0, np.int64), np.zeros(0, np.float32),
                            np.array([0.5, 2.0, 0.5, -1.0, 2.0], np.float32), 3)
    assert clf.prior(3).tolist() == [1, 4, 0] and clf.prior(10).tolist() == [1, 4, 0, 2, 3]
    assert clf.prior(0).size == 0


def test_classifier_round_trips_with_the_index(tmp_path):
    texts, Y = _topic_texts(200, 8, 4)
    index = LexicalIndex.fit(texts, None, Y, 5, min_df=1, classifier=sgd(epochs=1))
    index.save(tmp_path / "lex")
    loaded = LexicalIndex.load(tmp_path / "lex")
    Q = index.transform(texts[:20])
    assert loaded.classifier is not None and loaded.classifier.settings == index.classifier.settings
    np.testing.assert_array_equal(loaded.scores(Q).toarray(), index.scores(Q).toarray())
    plain = LexicalIndex.fit(texts, None, Y, 5, min_df=1)
    plain.save(tmp_path / "plain")
    assert LexicalIndex.load(tmp_path / "plain").classifier is None


@pytest.mark.parametrize("field,value", [("epochs", 0), ("hard_negatives", -1), ("max_terms", 0), ("lr", float("nan")),
                                         ("l2", -1.0), ("random_negatives", True),
                                         ("candidates", 0), ("weight", 0.0)])
def test_bad_settings_name_their_field(field, value):
    # g is set as index.lexical_classifier_weights (a list, chosen on validation): the error names that field
    name = "weights" if field == "weight" else field
    with pytest.raises(XCConfigError, match=f"index.lexical_classifier_{name}:"):
        ClassifierSettings(**{field: value}).check()
