"""The lexical classifiers solved exactly: liblinear's squared-hinge SVM per label over its positives' terms."""

from __future__ import annotations

import time

import numpy as np
import pytest
import scipy.sparse as sp
from sklearn.svm import LinearSVC

import xc_dagster.retrieval.lexical as lexical
import xc_dagster.retrieval.lexical_exact as exact
from tests.test_lexical_classifier import _p_at_1, _topic_texts
from xc_dagster.errors import XCConfigError
from xc_dagster.retrieval.lexical import LexicalIndex
from xc_dagster.retrieval.lexical_classifier import ClassifierSettings, LexicalClassifier, pruned_support


def _problem(n: int = 120, terms: int = 15, labels: int = 5, seed: int = 0) -> tuple[sp.csr_matrix, sp.csr_matrix]:
    """Random nonnegative rows; label 3 carried by no point, label 4 by every point, the others by a rule on the
    rows' terms with label noise (so that no label is separable by accident)."""
    rng = np.random.default_rng(seed)
    X = sp.random(n, terms, density=0.3, random_state=seed, format="csr", dtype=np.float32)
    Xd = X.toarray()
    Y = np.zeros((n, labels), np.float32)
    Y[:, 0] = (Xd[:, 0] + Xd[:, 1] > Xd[:, 2]) ^ (rng.random(n) < 0.1)
    Y[:, 1] = (Xd[:, 3] > 0.2) ^ (rng.random(n) < 0.1)
    Y[:, 2] = rng.random(n) < 0.3
    Y[:, 4] = 1
    return X, sp.csr_matrix(Y)


def test_each_label_is_liblinears_svm_on_its_positives_terms():
    X, Y = _problem()
    settings = ClassifierSettings(solver="liblinear", c=0.5)
    model = LexicalClassifier.fit(X, Y, sp.csr_matrix(Y.shape, dtype=np.float32), settings)
    assert model.solver == "liblinear" and model.history == [0.0] and not model.stopped_at_deadline
    keys, V = model.keys.numpy(), X.shape[1]
    np.testing.assert_array_equal(keys, pruned_support(X, Y, settings.max_terms))
    weights = model.weights.numpy()
    for label in (0, 1, 2):
        mine = keys[keys // V == label] % V
        svm = LinearSVC(C=0.5, loss="squared_hinge", random_state=0).fit(X[:, mine], Y[:, label].toarray().ravel())
        np.testing.assert_allclose(weights[keys // V == label], svm.coef_[0], rtol=1e-5, atol=1e-6)
        assert model.bias[label].item() == pytest.approx(svm.intercept_[0], rel=1e-5, abs=1e-6)
    # no positive: no terms, a negative margin for every query; on every point: no terms are needed either way
    assert not (keys // V == 3).any() and model.bias[3].item() == exact.ABSENT_BIAS
    assert model.bias[4].item() == -exact.ABSENT_BIAS and (weights[keys // V == 4] == 0).all()
    Q = X[:7]
    rows, labels = np.repeat(np.arange(7), 5), np.tile(np.arange(5), 7)
    scores = model.pair_scores(Q, rows, labels).reshape(7, 5)
    assert (scores[:, 3] < 0.5).all() and (scores[:, 4] > 0.5).all()


def test_the_margins_scale_is_the_judges_pick():
    X, Y = _problem(seed=1)
    hard = sp.csr_matrix(Y.shape, dtype=np.float32)
    base = LexicalClassifier.fit(X, Y, hard, ClassifierSettings(solver="liblinear"))
    seen = []

    def judge(model: LexicalClassifier) -> float:  # best at the middle scale, by the weights it is shown
        seen.append(float(np.abs(model.weights.numpy()).sum() / np.abs(base.weights.numpy()).sum()))
        return -abs(seen[-1] - exact.SCALES[1])

    model = LexicalClassifier.fit(X, Y, hard, ClassifierSettings(solver="liblinear"), judge)
    np.testing.assert_allclose(seen, exact.SCALES, rtol=1e-6)
    assert model.history == pytest.approx([-1.0, 0.0, -2.0])
    np.testing.assert_allclose(model.weights.numpy(), exact.SCALES[1] * base.weights.numpy(), rtol=1e-6)
    np.testing.assert_allclose(model.bias.numpy(), exact.SCALES[1] * base.bias.numpy(), rtol=1e-6)
    # best at the largest: doubled while it stays the best, SCALES_EXTEND times at most
    seen.clear()
    exactly = ClassifierSettings(solver="liblinear")
    rising = LexicalClassifier.fit(X, Y, hard, exactly, lambda m: judge(m) + 2 * seen[-1])
    grown = [exact.SCALES[-1] * 2 ** i for i in range(1, exact.SCALES_EXTEND + 1)]
    np.testing.assert_allclose(seen, list(exact.SCALES) + grown, rtol=1e-6)
    np.testing.assert_allclose(rising.weights.numpy(), grown[-1] * base.weights.numpy(), rtol=1e-6)
    seen.clear()
    LexicalClassifier.fit(X, Y, hard, exactly, lambda m: -abs(judge(m) + 6.0))
    np.testing.assert_allclose(seen, list(exact.SCALES) + grown[:2], rtol=1e-6)  # 8 best, 16 worse: stop


def test_a_stop_already_past_leaves_every_label_unsolved():
    X, Y = _problem(seed=2)
    model = LexicalClassifier.fit(X, Y, sp.csr_matrix(Y.shape, dtype=np.float32),
                                  ClassifierSettings(solver="liblinear"), hard_stop=time.perf_counter() - 1)
    assert model.stopped_at_deadline
    assert (model.weights.numpy() == 0).all() and (model.bias.numpy() == exact.ABSENT_BIAS).all()


def test_exact_classifiers_rank_what_the_knn_vote_misses(monkeypatch):
    """The topic texts of the stochastic trainer's test: the exact SVMs rank the true label first among the other
    parts' candidates for nearly every point, and the index never looks for hard negatives (none are sampled)."""
    texts, Y = _topic_texts(1200, 30, 0)
    test_texts, Y_test = _topic_texts(300, 30, 1)

    def no_hard_negatives(*args, **kwargs):
        raise AssertionError("the exact solver samples no negatives")

    monkeypatch.setattr(lexical, "hard_negatives", no_hard_negatives)
    plain = LexicalIndex.fit(texts, None, Y, 10, min_df=1, fit_on=np.arange(1100))
    index = LexicalIndex.fit(texts, None, Y, 10, min_df=1, fit_on=np.arange(1100),
                             classifier=ClassifierSettings(seed=0))
    assert index.classifier.solver == "liblinear" and len(index.classifier.history) == len(exact.SCALES)
    Q = plain.transform(test_texts)
    S0, S = plain.scores(Q), index.scores(Q)
    assert _p_at_1(S, Y_test) >= _p_at_1(S0, Y_test) + 0.2
    found = np.asarray(S0.multiply(Y_test).sum(axis=1)).ravel() > 0
    assert _p_at_1((S - S0)[found], Y_test[found]) >= 0.95


def test_auto_solves_exactly_up_to_exact_pairs(monkeypatch):
    auto, sgd, forced = (ClassifierSettings(solver=s) for s in ("auto", "sgd", "liblinear"))
    assert exact.solves_exactly(auto, 1 << 15, 1 << 10) and not exact.solves_exactly(auto, 1 << 15, 1 << 10 | 1)
    assert not exact.solves_exactly(sgd, 10, 10) and exact.solves_exactly(forced, 1 << 20, 1 << 20)
    X, Y = _problem(seed=3)
    # above EXACT_PAIRS: liblinear on the sampled pairs up to SAMPLED_LABELS labels, the stochastic trainer beyond
    assert exact.solver_for(auto, 1 << 15, 1 << 11) == "liblinear_sampled"
    assert exact.solver_for(auto, 1 << 15, exact.SAMPLED_LABELS + 1) == "sgd"
    monkeypatch.setattr(exact, "EXACT_PAIRS", X.shape[0] * Y.shape[1] - 1)
    hard = sp.csr_matrix(Y.shape, dtype=np.float32)
    assert LexicalClassifier.fit(X, Y, hard, ClassifierSettings(epochs=1)).solver == "liblinear_sampled"
    monkeypatch.setattr(exact, "SAMPLED_LABELS", Y.shape[1] - 1)
    assert LexicalClassifier.fit(X, Y, hard, ClassifierSettings(epochs=1)).solver == "sgd"


@pytest.mark.parametrize("field,value", [("solver", "newton"), ("c", 0.0), ("c", float("inf"))])
def test_bad_exact_settings_name_their_field(field, value):
    with pytest.raises(XCConfigError, match=f"index.lexical_classifier_{field}"):
        ClassifierSettings(**{field: value}).check()


def test_sampled_rows_are_the_hard_negatives_and_a_weighted_draw():
    hard = sp.csc_matrix(([1.0, 1.0, 1.0], ([2, 3, 5], [0, 0, 1])), shape=(20, 2))
    rows, w = exact._label_rows(0, np.array([0, 1]), hard, 20, 5, np.random.default_rng(0))
    assert rows[:2].tolist() == [2, 3] and len(rows) == 7 and len(set(rows.tolist())) == 7
    assert not set(rows[2:].tolist()) & {0, 1, 2, 3}
    np.testing.assert_allclose(w, [1, 1] + [16 / 5] * 5)  # 16 negatives not taken, 5 drawn for them


def test_sampled_with_every_negative_hard_is_the_exact_solution():
    X, Y = _problem(seed=4)
    every = sp.csr_matrix(1.0 - Y.toarray())
    exact_model = LexicalClassifier.fit(X, Y, every, ClassifierSettings(solver="liblinear"))
    sampled = LexicalClassifier.fit(X, Y, every, ClassifierSettings(solver="liblinear_sampled", random_negatives=0))
    assert sampled.solver == "liblinear_sampled"
    np.testing.assert_allclose(sampled.weights.numpy(), exact_model.weights.numpy(), atol=2e-3)
    np.testing.assert_allclose(sampled.bias.numpy(), exact_model.bias.numpy(), atol=2e-3)


def test_labels_are_solved_most_frequent_first(monkeypatch):
    X, Y = _problem(seed=5)
    clock = iter(range(100))
    monkeypatch.setattr(exact, "time", type("Clock", (), {"perf_counter": staticmethod(lambda: next(clock))}))
    model = LexicalClassifier.fit(X, Y, sp.csr_matrix(Y.shape, dtype=np.float32),
                                  ClassifierSettings(solver="liblinear"), hard_stop=1.5)  # two labels solved
    counts = np.asarray(Y.sum(axis=0)).ravel()
    assert model.stopped_at_deadline and counts[4] > counts[:3].max()
    first = int(np.argmax(counts[:3]))
    assert model.bias[4].item() == -exact.ABSENT_BIAS and model.bias[first].item() != exact.ABSENT_BIAS
    assert all(model.bias[i].item() == exact.ABSENT_BIAS for i in range(3) if i != first)


def test_sampled_classifiers_rank_what_the_knn_vote_misses():
    """liblinear_sampled on the topic texts: from the hard negatives the index searches and a weighted draw, the
    true label first among the other parts' candidates for nearly every point."""
    texts, Y = _topic_texts(1200, 30, 0)
    test_texts, Y_test = _topic_texts(300, 30, 1)
    plain = LexicalIndex.fit(texts, None, Y, 10, min_df=1, fit_on=np.arange(1100))
    index = LexicalIndex.fit(texts, None, Y, 10, min_df=1, fit_on=np.arange(1100),
                             classifier=ClassifierSettings(solver="liblinear_sampled", random_negatives=5))
    assert index.classifier.solver == "liblinear_sampled"
    Q = plain.transform(test_texts)
    S0, S = plain.scores(Q), index.scores(Q)
    found = np.asarray(S0.multiply(Y_test).sum(axis=1)).ravel() > 0
    assert _p_at_1(S, Y_test) >= _p_at_1(S0, Y_test) + 0.2
    assert _p_at_1((S - S0)[found], Y_test[found]) >= 0.95
