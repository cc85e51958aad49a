"""Extreme-classification metrics with the XC repository conventions (pyxclib, NGAME, SiameseXML, ASTRA).

Everything is vectorised with numpy/scipy; rows are processed in blocks of ``block_rows`` so memory stays
bounded on test sets with millions of rows (no Python loop over rows anywhere).

Conventions (shared by every public function here):

* Predictions come either as an ``(n, K)`` integer array ``indices`` of label ids (any integer dtype and
  layout; :func:`evaluate` never copies it whole), ``-1`` being padding, optionally with an ``(n, K)`` array of
  ``scores``; or as an ``(n, L)`` scipy sparse *score matrix* whose stored entries are the predictions
  (explicit zeros included, see :func:`topk_from_csr`).
* With scores, each row is ranked by score descending, ties broken by the smaller label id, padding last.
  Without scores the given column order is the ranking, and a ``-1`` in the middle of a row keeps its
  rank (a miss). NaN scores on real predictions are rejected.
* ``filter_pairs`` (XC filter files: 0-based ``[row, label]``) are removed from the predictions first;
  the surviving predictions move up.
* A label repeated within a row counts once: later copies are misses. When fewer than ``max(ks)``
  predictions are left, the missing ranks are misses.
* ``Y_true`` is an ``(n, L)`` sparse matrix; any stored nonzero value is a relevant label.
* Rows without positives count as 0 in every per-row mean and stay in the denominator ``n`` (the XC
  convention), unless ``drop_empty_rows=True``.
* Propensity-scored precision / nDCG are pyxclib-style *ratios of means*: the numerator and the ideal
  (best achievable) denominator are each averaged over all rows, then divided. PS-recall is instead a
  per-row ratio averaged over rows.
* coverage@k is the fraction of all L labels predicted in the top k of at least one row; correct
  coverage@k the fraction of labels with a positive that are a hit in the top k of at least one row.

:func:`evaluate` computes every metric family in one pass; :func:`precision`, :func:`ndcg`, :func:`recall`,
:func:`psprecision`, :func:`psndcg`, :func:`psrecall`, :func:`coverage` and :func:`correct_coverage` compute one
family each (as pyxclib's functions do), with the same numbers. The ranking and filtering kernels are in
``evaluation/_ranking.py``, the per-family sums in ``evaluation/_families.py``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import scipy.sparse as sp

from xc_dagster.evaluation._families import PROPENSITY_FAMILIES, accumulate
from xc_dagster.evaluation._ranking import (
    as_index_array,
    as_score_matrix,
    as_targets,
    block_pairs,
    block_ranker,
    check_inv_prop,
    check_pairs,
    check_predictions,
    check_targets,
    dedup,
    hits,
    neg_scores,
    pairs_by_row,
    ranked_csr,
    row_blocks,
    true_keys,
)

__all__ = ["inverse_propensity", "remove_filtered", "evaluate", "recall_at", "topk_from_csr", "precision", "ndcg",
           "recall", "psprecision", "psndcg", "psrecall", "coverage", "correct_coverage"]

_DEFAULT_BLOCK = 65536
_ALL = ("precision", "ndcg", "recall", *PROPENSITY_FAMILIES, "coverage", "correct_coverage")


def inverse_propensity(Y_train: sp.csr_matrix | np.ndarray, A: float = 0.55, B: float = 1.5) -> np.ndarray:
    """Inverse label propensities of Jain et al. (2016), as in pyxclib, for PSP@k / PSnDCG@k.

    ``1/p_l = 1 + C (N_l + B)^(-A)`` with ``C = (ln N - 1)(B + 1)^A``, where ``N`` is the number of
    training rows and ``N_l`` the number of training rows having label ``l`` (stored nonzeros per
    column). Rare labels get large weights, so tail-label hits count more. Returns float64, length L.
    """
    if sp.issparse(Y_train):
        Y = sp.csr_matrix(Y_train, copy=True)
        Y.data = (Y.data != 0).astype(np.float64)
        Y.sum_duplicates()  # a label stored twice in a row still counts once
        Y.eliminate_zeros()
        counts = np.bincount(Y.indices, minlength=Y.shape[1]).astype(np.float64)
        N = Y.shape[0]
    else:
        arr = np.asarray(Y_train)
        if arr.ndim != 2:
            raise ValueError(f"Y_train must be a 2-D (N, L) matrix, got shape {arr.shape}")
        counts = np.count_nonzero(arr, axis=0).astype(np.float64)
        N = arr.shape[0]
    if N < 1:
        raise ValueError("Y_train has no rows: propensities need at least one training row")
    C = (np.log(N) - 1.0) * (B + 1.0) ** A
    return 1.0 + C * np.power(counts + B, -A)


def remove_filtered(indices: np.ndarray, scores: np.ndarray | None,
                    filter_pairs: np.ndarray | None) -> tuple[np.ndarray, np.ndarray | None]:
    """Drop the (row, label) predictions listed in ``filter_pairs`` (XC repository filter files).

    ``filter_pairs`` is an (m, 2) array of 0-based ``[row, label]``; pairs on rows beyond ``indices``
    are ignored. Surviving predictions keep their order and move left; freed slots at the end of the
    row become -1 in ``indices`` and -inf in ``scores``. Existing -1 padding is kept where it is.
    Returns new arrays; the inputs are not modified.
    """
    idx = as_index_array(indices)
    sc = None if scores is None else np.asarray(scores)
    if sc is not None and sc.shape != idx.shape:
        raise ValueError(f"scores has shape {sc.shape} but indices has shape {idx.shape}")
    if filter_pairs is None:
        return idx.copy(), None if sc is None else sc.copy()
    fp = check_pairs(filter_pairs)
    n, K = idx.shape
    if fp.shape[0] == 0 or idx.size == 0:
        return idx.copy(), None if sc is None else sc.copy()
    L_big = int(max(idx.max(), fp[:, 1].max())) + 1
    filt_keys = fp[:, 0] * L_big + fp[:, 1]
    pred_keys = np.arange(n, dtype=np.int64)[:, None] * L_big + np.where(idx >= 0, idx, 0)
    keep = ~((idx >= 0) & np.isin(pred_keys, filt_keys))
    new_pos = np.cumsum(keep, axis=1) - 1
    rows = np.broadcast_to(np.arange(n)[:, None], idx.shape)
    out = np.full_like(idx, -1)
    out[rows[keep], new_pos[keep]] = idx[keep]
    out_sc = None
    if sc is not None:
        out_sc = np.full(sc.shape, -np.inf, dtype=np.result_type(sc.dtype, np.float32))
        out_sc[rows[keep], new_pos[keep]] = sc[keep]
    return out, out_sc


def topk_from_csr(scores: sp.spmatrix, k: int, block_rows: int = _DEFAULT_BLOCK,
                  filter_pairs: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Top-``k`` (label ids, scores) per row of a sparse ``(n, L)`` score matrix, best first.

    Every stored entry is a prediction -- an explicitly stored 0 included -- and absent entries are not;
    duplicate entries of a non-canonical matrix are summed first (scipy's meaning of the matrix). Rows are
    ranked by score descending, ties broken by the smaller label id. Rows with fewer than ``k`` entries
    are padded with -1 ids and -inf scores. ``filter_pairs`` (optional, ``[row, label]``) are removed
    before the selection. Returns an int64 ``(n, k)`` array and a float ``(n, k)`` array (float32 scores
    stay float32). Vectorised per block of ``block_rows`` rows.
    """
    if not sp.issparse(scores):
        raise ValueError(f"scores must be a scipy sparse (n, L) score matrix, got {type(scores).__name__}")
    if int(k) < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    k = int(k)
    S = as_score_matrix(scores)
    n = S.shape[0]
    fp = fp_rows = None
    if filter_pairs is not None:
        fp, fp_rows = pairs_by_row(check_pairs(filter_pairs))
    out_i = np.full((n, k), -1, dtype=np.int64)
    out_s = np.full((n, k), -np.inf, dtype=neg_scores(S.data[:0]).dtype)
    for r0, r1 in row_blocks(n, block_rows):
        pr, pl = block_pairs(fp, fp_rows, r0, r1)
        ids, negv = ranked_csr(S[r0:r1], pr, pl, k)
        out_i[r0:r1] = ids
        out_s[r0:r1] = np.where(ids >= 0, -negv, -np.inf)
    return out_i, out_s


def evaluate(indices: np.ndarray | sp.spmatrix, Y_true: sp.csr_matrix, ks: Sequence[int] = (1, 3, 5),
             inv_prop: np.ndarray | None = None, filter_pairs: np.ndarray | None = None,
             scores: np.ndarray | None = None, block_rows: int = _DEFAULT_BLOCK,
             drop_empty_rows: bool = False) -> dict[str, float]:
    """P@k, nDCG@k, recall@k, coverage@k (and PSP@k, PSnDCG@k, PS-recall@k given ``inv_prop``) in [0, 1].

    ``indices`` is an ``(n, K)`` array of label ids (with optional ``scores`` of the same shape), or an
    ``(n, L)`` scipy sparse score matrix (then ``scores`` must be None; every stored entry -- explicit
    zeros included -- is a prediction, see :func:`topk_from_csr`).

    Steps: drop ``filter_pairs``; if scores are given, rank each row by score descending with ties broken
    by the smaller label id (padding last; a NaN score on a real prediction raises ValueError); keep the
    top ``max(ks)`` ranks (missing ranks are misses); later duplicates of a label are misses. Then, per
    row ``i`` with positives ``y_i``, each family as its own function defines it: ``precision_at_k``
    (:func:`precision`), ``ndcg_at_k`` (:func:`ndcg`), ``recall_at_k`` (:func:`recall`), ``psprecision_at_k``
    (:func:`psprecision`), ``psndcg_at_k`` (:func:`psndcg`), ``psrecall_at_k`` (:func:`psrecall`),
    ``coverage_at_k`` (:func:`coverage`) and ``correct_coverage_at_k`` (:func:`correct_coverage`).

    Rows with no positives score 0 and stay in the means, unless ``drop_empty_rows`` removes them; dropped
    rows are removed from every metric, so their predictions do not count for ``coverage_at_k`` either
    (they have no positives, so ``correct_coverage_at_k`` does not depend on the option).
    Rows are processed in blocks of ``block_rows``; per block only the top ``max(ks)`` candidates are
    sorted, so memory is O(block_rows * K + L) and time is linear in the input size.
    """
    return _evaluate(None, indices, Y_true, ks, inv_prop, filter_pairs, scores, block_rows, drop_empty_rows)


def _evaluate(families: Sequence[str] | None, indices: np.ndarray | sp.spmatrix, Y_true: sp.csr_matrix,
              ks: Sequence[int], inv_prop: np.ndarray | None, filter_pairs: np.ndarray | None,
              scores: np.ndarray | None, block_rows: int, drop_empty_rows: bool) -> dict[str, float]:
    """:func:`evaluate` restricted to ``families`` (None: all of them, the propensity-scored ones given
    ``inv_prop``): check the inputs, rank every row block, accumulate each family's sums."""
    Y = as_targets(Y_true)
    pred = check_predictions(indices, scores, Y)
    ks = [int(k) for k in ks]
    if any(k < 1 for k in ks):
        raise ValueError(f"ks must all be >= 1, got {list(ks)}")
    if block_rows < 1:
        raise ValueError(f"block_rows must be >= 1, got {block_rows}")
    if not ks:
        return {}
    ip = check_inv_prop(inv_prop, Y)
    if families is None:
        families = [f for f in _ALL if ip is not None or f not in PROPENSITY_FAMILIES]
    elif ip is None and any(f in PROPENSITY_FAMILIES for f in families):
        raise ValueError(f"{', '.join(families)} need inv_prop, the labels' inverse propensities")
    ranked = block_ranker(pred, scores, Y, filter_pairs, max(ks))
    return accumulate(ranked, Y, ks, ip, block_rows, drop_empty_rows, families)


def evaluate_families(families: Sequence[str], indices: np.ndarray | sp.spmatrix, Y_true: sp.csr_matrix,
                      ks: Sequence[int], inv_prop: np.ndarray | None = None, filter_pairs: np.ndarray | None = None,
                      scores: np.ndarray | None = None) -> dict[str, float]:
    """:func:`evaluate` computing only ``families`` (e.g. ``("precision", "psprecision")``): what a search that
    evaluates many rankings of the same shortlist needs (the fusion fit), at a fraction of the cost."""
    unknown = [f for f in families if f not in _ALL]
    if unknown:
        raise ValueError(f"unknown metric families {unknown}; families are {list(_ALL)}")
    return _evaluate(list(families), indices, Y_true, ks, inv_prop, filter_pairs, scores, _DEFAULT_BLOCK, False)


# ---------------------------------------------------------------------------------- one metric family each
# Same options and conventions as :func:`evaluate`; each returns ``{f"<family>_at_{k}": value}``.


def precision(indices: np.ndarray | sp.spmatrix, Y_true: sp.csr_matrix, ks: Sequence[int] = (1, 3, 5),
              filter_pairs: np.ndarray | None = None, scores: np.ndarray | None = None,
              block_rows: int = _DEFAULT_BLOCK, drop_empty_rows: bool = False) -> dict[str, float]:
    """P@k = mean_i hits@k / k."""
    return _evaluate(("precision",), indices, Y_true, ks, None, filter_pairs, scores, block_rows, drop_empty_rows)


def ndcg(indices: np.ndarray | sp.spmatrix, Y_true: sp.csr_matrix, ks: Sequence[int] = (1, 3, 5),
         filter_pairs: np.ndarray | None = None, scores: np.ndarray | None = None,
         block_rows: int = _DEFAULT_BLOCK, drop_empty_rows: bool = False) -> dict[str, float]:
    """nDCG@k = mean_i DCG@k / IDCG@k with discount ``1/log2(rank+1)``, IDCG over ``min(k, |y_i|)`` positives."""
    return _evaluate(("ndcg",), indices, Y_true, ks, None, filter_pairs, scores, block_rows, drop_empty_rows)


def recall(indices: np.ndarray | sp.spmatrix, Y_true: sp.csr_matrix, ks: Sequence[int] = (1, 3, 5),
           filter_pairs: np.ndarray | None = None, scores: np.ndarray | None = None,
           block_rows: int = _DEFAULT_BLOCK, drop_empty_rows: bool = False) -> dict[str, float]:
    """recall@k = mean_i hits@k / |y_i|."""
    return _evaluate(("recall",), indices, Y_true, ks, None, filter_pairs, scores, block_rows, drop_empty_rows)


def psprecision(indices: np.ndarray | sp.spmatrix, Y_true: sp.csr_matrix, inv_prop: np.ndarray,
                ks: Sequence[int] = (1, 3, 5), filter_pairs: np.ndarray | None = None,
                scores: np.ndarray | None = None, block_rows: int = _DEFAULT_BLOCK,
                drop_empty_rows: bool = False) -> dict[str, float]:
    """PSP@k = mean_i (sum of ip over hits@k)/k  /  mean_i (sum of the top-min(k,|y_i|) ip of the true labels)/k:
    a ratio of means (pyxclib), not a mean of per-row ratios."""
    return _evaluate(("psprecision",), indices, Y_true, ks, inv_prop, filter_pairs, scores, block_rows,
                     drop_empty_rows)


def psndcg(indices: np.ndarray | sp.spmatrix, Y_true: sp.csr_matrix, inv_prop: np.ndarray,
           ks: Sequence[int] = (1, 3, 5), filter_pairs: np.ndarray | None = None,
           scores: np.ndarray | None = None, block_rows: int = _DEFAULT_BLOCK,
           drop_empty_rows: bool = False) -> dict[str, float]:
    """PSnDCG@k: as :func:`psprecision`, with the rank discount in the numerator and the ideal denominator."""
    return _evaluate(("psndcg",), indices, Y_true, ks, inv_prop, filter_pairs, scores, block_rows, drop_empty_rows)


def psrecall(indices: np.ndarray | sp.spmatrix, Y_true: sp.csr_matrix, inv_prop: np.ndarray,
             ks: Sequence[int] = (1, 3, 5), filter_pairs: np.ndarray | None = None,
             scores: np.ndarray | None = None, block_rows: int = _DEFAULT_BLOCK,
             drop_empty_rows: bool = False) -> dict[str, float]:
    """PS-recall@k = mean_i (sum of ip over hits@k) / (sum of ip over y_i): per-row ratios averaged."""
    return _evaluate(("psrecall",), indices, Y_true, ks, inv_prop, filter_pairs, scores, block_rows,
                     drop_empty_rows)


def coverage(indices: np.ndarray | sp.spmatrix, Y_true: sp.csr_matrix, ks: Sequence[int] = (1, 3, 5),
             filter_pairs: np.ndarray | None = None, scores: np.ndarray | None = None,
             block_rows: int = _DEFAULT_BLOCK, drop_empty_rows: bool = False) -> dict[str, float]:
    """coverage@k = |labels predicted in the top k of at least one row| / L."""
    return _evaluate(("coverage",), indices, Y_true, ks, None, filter_pairs, scores, block_rows, drop_empty_rows)


def correct_coverage(indices: np.ndarray | sp.spmatrix, Y_true: sp.csr_matrix, ks: Sequence[int] = (1, 3, 5),
                     filter_pairs: np.ndarray | None = None, scores: np.ndarray | None = None,
                     block_rows: int = _DEFAULT_BLOCK, drop_empty_rows: bool = False) -> dict[str, float]:
    """correct coverage@k = |labels that are a hit in the top k of at least one row| / |labels with at least
    one positive in Y_true| (tail-label coverage)."""
    return _evaluate(("correct_coverage",), indices, Y_true, ks, None, filter_pairs, scores, block_rows,
                     drop_empty_rows)


def recall_at(indices: np.ndarray, Y_true: sp.csr_matrix, block_rows: int = _DEFAULT_BLOCK) -> float:
    """Recall of the whole prediction list (e.g. an ANN shortlist): mean_i |list_i ∩ y_i| / |y_i|.

    -1 padding and repeated labels count once; rows without positives count 0 and stay in the mean.
    """
    idx = as_index_array(indices)
    Y = check_targets(idx, Y_true)
    n, L = Y.shape
    if n == 0:
        return 0.0
    total = 0.0
    for r0, r1 in row_blocks(n, block_rows):
        b_idx = dedup(idx[r0:r1])
        keys = true_keys(Y[r0:r1])
        npos = np.bincount(keys // L, minlength=r1 - r0)
        found = hits(b_idx, keys, L).sum(axis=1)
        total += float(np.where(npos > 0, found / np.maximum(npos, 1), 0.0).sum())
    return total / n
