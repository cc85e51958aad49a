"""The lexical classifiers solved exactly: one squared-hinge linear SVM per label on every fit point (DiSMEC).

DiSMEC (Babbar & Schoelkopf, WSDM 2017) and Parabel's leaves train each label's weights by liblinear's
L2-regularised squared-hinge solver; the stochastic trainer of ``lexical_classifier`` (Adagrad on sampled pairs)
stops far from that optimum on small BoW sets: the classifiers alone read P@1 61.6 (Bibtex) and 62.3 (Delicious)
against 64.7 and 67.0 for the exact solution on the same terms (docs/decisions.md#lexical-classifier-exact). Where
every (fit point, label) pair is cheap to visit (``EXACT_PAIRS``) each label is solved here by scikit-learn's
``LinearSVC`` over its keys' terms (the model's sparse support, as the other trainer's), every fit point a
positive or a negative. An SVM's margins sit near +-1, where the logistic model's logits spread wider, so the
weights are scaled by the factor of ``SCALES`` whose sigmoid scores the held-out points best (``judge``).

``liblinear_sampled`` solves the same per-label problems on a sample of the pairs (Parabel's and Slice's per-label
problems): each label's positives, the points that have it among their hard negatives and a seeded uniform draw
of the others, ``random_negatives`` x n / L of them, weighted up to the negatives they stand for (unweighted lost),
so that the sum estimates the exact objective at O(N (k + r)) pairs instead of O(N L).
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import scipy.sparse as sp
import torch
from sklearn.exceptions import ConvergenceWarning
from sklearn.svm import LinearSVC

if TYPE_CHECKING:
    from xc_dagster.retrieval.lexical_classifier import ClassifierSettings, LexicalClassifier

SOLVERS = ("auto", "sgd", "liblinear", "liblinear_sampled")
EXACT_PAIRS = 1 << 25  # "auto": fit points x labels up to this are solved exactly (Delicious: 12.3K x 983)
SCALES = (1.0, 2.0, 4.0)  # sigmoid(a * (w . x + b)): the margins' scale, picked on held-out points
SCALES_EXTEND = 3  # while the largest scale tried is the best, twice it is tried, up to 2^3 x SCALES[-1]
ABSENT_BIAS = -1.0  # a label without positives (or terms) among the fit points: its margin, never positive
SAMPLED_LABELS = 1 << 16  # "auto" above EXACT_PAIRS: liblinear_sampled up to this many labels (~1.4 ms a label
# on Titles' 21.5K), the stochastic trainer beyond, where a deadline would leave the rarest labels unsolved


def solver_for(settings: ClassifierSettings, num_points: int, num_labels: int) -> str:
    """The trainer ``settings.solver`` picks for ``num_points`` fit points and ``num_labels``: "liblinear" (every
    pair), "liblinear_sampled" or "sgd"."""
    if settings.solver != "auto":
        return settings.solver
    if num_points * num_labels <= EXACT_PAIRS:
        return "liblinear"
    return "liblinear_sampled" if num_labels <= SAMPLED_LABELS else "sgd"


def solves_exactly(settings: ClassifierSettings, num_points: int, num_labels: int) -> bool:
    """Whether ``settings.solver`` picks the exact solver (every pair, no hard negatives) here."""
    return solver_for(settings, num_points, num_labels) == "liblinear"


def _label_rows(label: int, pos: np.ndarray, hard: sp.csc_matrix, n: int, draws: int,
                rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """liblinear_sampled's rows for ``label`` besides its positives ``pos``: its hard negatives and up to ``draws``
    other points drawn uniformly (first draws of a seeded stream, repeats dropped), with each row's weight."""
    neg = hard.indices[hard.indptr[label]:hard.indptr[label + 1]]
    taken = np.concatenate([pos, neg])
    cand = rng.integers(0, n, 2 * draws + 16)
    _, first = np.unique(cand, return_index=True)
    cand = cand[np.sort(first)]
    cand = cand[~np.isin(cand, taken)][:draws]
    rest = n - len(np.unique(taken))
    weight = rest / len(cand) if len(cand) else 1.0  # each drawn point stands for rest / drawn negatives
    rows = np.concatenate([neg, cand])
    return rows, np.concatenate([np.ones(len(neg)), np.full(len(cand), weight)])


def fit_exact(model: LexicalClassifier, X: sp.csr_matrix, Y: sp.csr_matrix,
              judge: Callable[[LexicalClassifier], float] | None, stop: float | None,
              hard: sp.csr_matrix | None = None) -> None:
    """Solve each label of ``model`` (zero weights on its keys) on the fit rows ``X`` with their binary labels
    ``Y`` (with ``hard``, the points' hard negatives: on liblinear_sampled's rows), the most frequent labels first;
    past ``stop`` (``time.perf_counter()``) the labels left keep ABSENT_BIAS (``model.stopped_at_deadline``). Then
    the weights are scaled by the best of SCALES on ``judge``, doubled past the largest while that is the best
    (SCALES_EXTEND; each value in ``model.history``; SCALES[0] without one)."""
    s, model.solver = model.settings, "liblinear" if hard is None else "liblinear_sampled"
    n, V, L = X.shape[0], model.num_terms, model.num_labels
    Xc = sp.csc_matrix(X, dtype=np.float64) if hard is None else sp.csr_matrix(X, dtype=np.float64)
    Yc = sp.csc_matrix(Y)
    Hc, rng = (None, None) if hard is None else (sp.csc_matrix(hard), np.random.default_rng(s.seed))
    draws = math.ceil(s.random_negatives * n / max(L, 1))
    keys = model.keys.numpy()
    bounds = np.searchsorted(keys, np.arange(L + 1, dtype=np.int64) * V)
    weights, bias = np.zeros(len(keys), np.float32), np.full(L, ABSENT_BIAS, np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)  # liblinear's iteration cap: its best so far is kept
        for label in np.argsort(-np.diff(Yc.indptr), kind="stable"):  # a deadline leaves the rarest unsolved
            if stop is not None and time.perf_counter() > stop:
                model.stopped_at_deadline = True
                break
            lo, hi = bounds[label], bounds[label + 1]
            pos = Yc.indices[Yc.indptr[label]:Yc.indptr[label + 1]]
            if lo == hi or len(pos) == 0:
                continue
            if len(pos) == n:  # every point carries it: a constant positive margin
                bias[label] = -ABSENT_BIAS
                continue
            cols = keys[lo:hi] - label * V
            if hard is None:
                A, y, w = Xc[:, cols], np.zeros(n, np.int8), None
                y[pos] = 1
            else:
                rows, w = _label_rows(label, pos, Hc, n, draws, rng)
                A = Xc[np.concatenate([pos, rows])][:, cols]
                y, w = np.r_[np.ones(len(pos), np.int8), np.zeros(len(rows), np.int8)], np.r_[np.ones(len(pos)), w]
            svm = LinearSVC(C=s.c, loss="squared_hinge", random_state=s.seed).fit(A, y, sample_weight=w)
            weights[lo:hi], bias[label] = svm.coef_[0], svm.intercept_[0]
    best, scales = (-np.inf, SCALES[0]), list(SCALES if judge is not None else SCALES[:1])
    while scales:
        scale = scales.pop(0)
        model.weights, model.bias = torch.from_numpy(scale * weights), torch.from_numpy(scale * bias)
        value = judge(model) if judge is not None else 0.0
        model.history.append(round(float(value), 6))
        if value > best[0]:
            best = (value, scale)
            if judge is not None and not scales and scale < SCALES[-1] * 2 ** SCALES_EXTEND:  # largest best: twice
                scales.append(2 * scale)
    model.weights, model.bias = torch.from_numpy(best[1] * weights), torch.from_numpy(best[1] * bias)
