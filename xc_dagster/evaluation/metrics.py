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
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import scipy.sparse as sp

__all__ = ["inverse_propensity", "remove_filtered", "evaluate", "recall_at", "topk_from_csr"]

_DEFAULT_BLOCK = 65536
_PAIR_CHUNK = 65536  # filter pairs compared at a time (bounds the (pairs, K) comparison matrix)


# ----------------------------------------------------------------------------------------------- helpers


def _as_index_array(indices: np.ndarray) -> np.ndarray:
    """Check that ``indices`` is a 2-D integer array of ids >= -1 and return it as int64."""
    arr = _check_index_array(indices)
    arr = arr.astype(np.int64, copy=False)
    if arr.size and arr.min() < -1:
        raise ValueError(f"indices must be label ids >= 0 or -1 for padding, got {int(arr.min())}")
    return arr


def _check_index_array(indices: np.ndarray) -> np.ndarray:
    """Check shape and dtype of ``indices`` without copying it (values are checked block by block)."""
    arr = np.asarray(indices)
    if arr.ndim != 2:
        raise ValueError(f"indices must be a 2-D (n, K) array of label ids, got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"indices must hold integer label ids, got dtype {arr.dtype}")
    return arr


def _check_block_ids(b: np.ndarray, L: int, shape: tuple[int, int]) -> int:
    """Check that a block of ids lies in [-1, L); return its minimum (so callers can skip padding work)."""
    if b.size == 0:
        return 0
    lo, hi = int(b.min()), int(b.max())
    if lo < -1:
        raise ValueError(f"indices must be label ids >= 0 or -1 for padding, got {lo}")
    if hi >= L:
        raise ValueError(f"indices holds label id {hi} but Y_true has only {L} labels (shape {shape})")
    return lo


def _check_pairs(filter_pairs: np.ndarray) -> np.ndarray:
    """Check that ``filter_pairs`` is an (m, 2) array of non-negative [row, label] ids."""
    fp = np.asarray(filter_pairs)
    if fp.size == 0:
        return np.zeros((0, 2), dtype=np.int64)
    if fp.ndim != 2 or fp.shape[1] != 2:
        raise ValueError(f"filter_pairs must be an (m, 2) array of [row, label], got shape {fp.shape}")
    fpi = fp.astype(np.int64, copy=False)
    if not np.issubdtype(fp.dtype, np.integer) and not np.array_equal(fpi, fp):
        raise ValueError(f"filter_pairs must hold integer [row, label] ids, got non-integral {fp.dtype} values")
    fp = fpi
    if fp.min() < 0:
        raise ValueError("filter_pairs must hold non-negative 0-based [row, label] ids")
    return fp


def _as_targets(Y_true: sp.spmatrix | np.ndarray) -> sp.csr_matrix:
    """``Y_true`` as a 2-D CSR matrix."""
    if not sp.issparse(Y_true):
        arr = np.asarray(Y_true)
        if arr.ndim != 2:
            raise ValueError(f"Y_true must be a 2-D (n, L) matrix, got shape {arr.shape}")
        Y_true = sp.csr_matrix(arr)
    return sp.csr_matrix(Y_true)


def _check_targets(indices: np.ndarray, Y_true: sp.spmatrix) -> sp.csr_matrix:
    """Check row counts and label range of ``indices`` against ``Y_true``; return ``Y_true`` as CSR."""
    Y = _as_targets(Y_true)
    if indices.shape[0] != Y.shape[0]:
        raise ValueError(f"indices has shape {indices.shape} but Y_true has shape {Y.shape}: "
                         f"row counts differ")
    if indices.size and indices.max() >= Y.shape[1]:
        raise ValueError(f"indices holds label id {int(indices.max())} but Y_true has only "
                         f"{Y.shape[1]} labels (shape {Y.shape})")
    return Y


def _true_keys(Yb: sp.csr_matrix, canonical: bool = False) -> np.ndarray:
    """Sorted unique int64 keys ``local_row * L + label`` of the stored nonzeros of a block of Y."""
    L = Yb.shape[1]
    rows = np.repeat(np.arange(Yb.shape[0], dtype=np.int64), np.diff(Yb.indptr))
    keys = rows * L + Yb.indices.astype(np.int64)
    keep = Yb.data != 0
    if not keep.all():
        keys = keys[keep]
    if canonical:  # sorted column indices without duplicates: keys are already sorted and unique
        return keys
    return np.unique(keys)  # sorts, and merges duplicate entries of a non-canonical CSR


def _dedup(idx: np.ndarray) -> np.ndarray:
    """Replace later copies of a label within a row by -1 (they become misses; ranks do not move)."""
    K = idx.shape[1]
    if K < 2:
        return idx
    if K <= 16:  # narrow (top-k) arrays: K(K-1)/2 column comparisons beat a per-row sort
        t = np.ascontiguousarray(idx.T)
        dup_t = np.zeros(t.shape, dtype=bool)
        for j in range(1, K):  # loops over ranks, not rows
            for i in range(j):
                dup_t[j] |= t[j] == t[i]
        dup_t &= t >= 0
        if not dup_t.any():
            return idx
        return np.where(dup_t.T, -1, idx)
    order = np.argsort(idx, axis=1, kind="stable")
    s = np.take_along_axis(idx, order, axis=1)
    dup_sorted = np.zeros_like(s, dtype=bool)
    dup_sorted[:, 1:] = (s[:, 1:] == s[:, :-1]) & (s[:, 1:] >= 0)
    if not dup_sorted.any():
        return idx
    dup = np.empty_like(dup_sorted)
    np.put_along_axis(dup, order, dup_sorted, axis=1)
    return np.where(dup, -1, idx)


def _hits(idx: np.ndarray, keys: np.ndarray, L: int) -> np.ndarray:
    """Boolean (nb, K) matrix: is the predicted label at each rank a true label of its row."""
    valid = idx >= 0
    pred = np.arange(idx.shape[0], dtype=np.int64)[:, None] * L + np.where(valid, idx, 0)
    if keys.size == 0:
        return np.zeros(idx.shape, dtype=bool)
    pos = np.searchsorted(keys, pred)
    found = keys[np.minimum(pos, keys.size - 1)] == pred
    return valid & found


def _row_blocks(n: int, block_rows: int):
    """Yield ``(start, stop)`` row ranges of at most ``block_rows`` rows."""
    if block_rows < 1:
        raise ValueError(f"block_rows must be >= 1, got {block_rows}")
    for r0 in range(0, n, block_rows):
        yield r0, min(n, r0 + block_rows)


def _pairs_by_row(fp: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Filter pairs sorted by row, plus the sorted row column, so a block's pairs are one slice."""
    order = np.argsort(fp[:, 0], kind="stable")
    fp = fp[order]
    return fp, fp[:, 0]


def _block_pairs(fp: np.ndarray | None, fp_rows: np.ndarray | None, r0: int,
                 r1: int) -> tuple[np.ndarray, np.ndarray]:
    """Block-local rows and labels of the filter pairs on rows ``r0:r1`` (empty arrays if none)."""
    if fp is None or fp_rows is None:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    lo, hi = np.searchsorted(fp_rows, [r0, r1])
    return fp[lo:hi, 0] - r0, fp[lo:hi, 1]


def _filter_positions(b_idx: np.ndarray, pr: np.ndarray, pl: np.ndarray) -> np.ndarray:
    """Flat positions ``row * w + col`` in the (nb, w) block ``b_idx`` whose (row, label) is filtered.

    Each pair is compared with its own row only, so the cost is O(pairs * w), not O(nb * w * log m).
    """
    w = b_idx.shape[1]
    if pr.size == 0 or w == 0:
        return np.zeros(0, dtype=np.int64)
    out = []
    for c0 in range(0, pr.size, _PAIR_CHUNK):
        p, lab = pr[c0:c0 + _PAIR_CHUNK], pl[c0:c0 + _PAIR_CHUNK]
        f = np.flatnonzero(b_idx[p] == lab[:, None])
        out.append(p[f // w] * w + f % w)
    return np.concatenate(out)


def _neg_scores(sc: np.ndarray) -> np.ndarray:
    """A fresh array ``-scores`` (float32 stays float32, integers become float64): the sort key."""
    if np.issubdtype(sc.dtype, np.floating):
        dt = np.result_type(sc.dtype, np.float32)
        return np.negative(sc, dtype=dt, order="C")  # C order: flat positions are written into it
    if np.issubdtype(sc.dtype, np.integer) or sc.dtype == np.bool_:
        return -(sc.astype(np.float64))
    raise ValueError(f"scores must be real numbers, got dtype {sc.dtype}")


def _select_topk(ids: np.ndarray, v: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Per row, the ``k`` entries of smallest ``v`` (= largest score), ties by smaller id; NaN = no entry.

    Returns ``(ids, v)`` of shape (nb, k), ranked, padded with -1 / NaN. Only candidates at or above each
    row's k-th value (``np.partition``) are sorted, so the cost is O(nb * w) plus a sort of about nb * k
    values; ties at the boundary are all kept as candidates, so the selection is exact.
    """
    nb, w = v.shape
    out_i = np.full((nb, k), -1, dtype=np.int64)
    out_v = np.full((nb, k), np.nan, dtype=v.dtype)
    if nb == 0 or w == 0:
        return out_i, out_v
    if w > k:
        t = np.partition(v, k - 1, axis=1)[:, k - 1]  # k-th smallest; NaN sorts last
        t[np.isnan(t)] = np.inf  # fewer than k real entries: all real entries are candidates
        cand = v <= t[:, None]
    else:
        cand = ~np.isnan(v)
    counts = np.count_nonzero(cand, axis=1)
    f = np.flatnonzero(cand)
    cw = int(counts.max())
    if cw == 0:
        return out_i, out_v
    r = np.repeat(np.arange(nb), counts)
    pos = np.arange(f.size) - (np.cumsum(counts) - counts)[r]
    cv = np.full((nb, cw), np.nan, dtype=v.dtype)
    ci = np.full((nb, cw), -1, dtype=np.int64)
    cv[r, pos] = v.ravel()[f]
    ci[r, pos] = ids.ravel()[f]
    order = np.argsort(cv, axis=1)  # NaN last
    cv = np.take_along_axis(cv, order, axis=1)
    ci = np.take_along_axis(ci, order, axis=1)
    if cw > 1:
        tie_rows = np.flatnonzero((cv[:, 1:] == cv[:, :-1]).any(axis=1))  # NaN never ties
        if tie_rows.size:  # re-rank those rows by (value, label id)
            o2 = np.lexsort((ci[tie_rows], cv[tie_rows]), axis=1)
            cv[tie_rows] = np.take_along_axis(cv[tie_rows], o2, axis=1)
            ci[tie_rows] = np.take_along_axis(ci[tie_rows], o2, axis=1)
    m = min(k, cw)
    out_i[:, :m] = ci[:, :m]
    out_v[:, :m] = cv[:, :m]
    return out_i, out_v


def _ranked_dense_scored(b_idx: np.ndarray, b_sc: np.ndarray, pr: np.ndarray, pl: np.ndarray,
                         k: int, has_padding: bool) -> np.ndarray:
    """Top-k ids of a block of (indices, scores) after filtering, ranked by score then label id."""
    v = _neg_scores(b_sc)
    if np.isnan(v).any() and (np.isnan(v) & (b_idx >= 0)).any():
        raise ValueError("scores contain NaN for real predictions (indices >= 0); cannot rank them")
    if has_padding:
        np.copyto(v, np.nan, where=b_idx < 0)
    v.ravel()[_filter_positions(b_idx, pr, pl)] = np.nan
    return _select_topk(b_idx, v, k)[0]


def _ranked_dense_ordered(b_idx: np.ndarray, pr: np.ndarray, pl: np.ndarray, k: int) -> np.ndarray:
    """Top-k ids of a block of already ranked indices after filtering (survivors move up, -1 kept).

    Only the first ``k + (filter pairs per row)`` columns are read (more only if a filtered label is
    repeated so often that a row runs short), and only rows that lose a prediction are compacted.
    """
    nb, K = b_idx.shape
    out = np.full((nb, k), -1, dtype=np.int64)
    m = min(k, K)
    out[:, :m] = b_idx[:, :m]
    if pr.size == 0 or K == 0:
        return out
    w = min(K, k + int(np.bincount(pr).max()))
    while True:
        b = b_idx[:, :w]
        pos = _filter_positions(b, pr, pl)
        if pos.size == 0:
            return out
        rows_f, local = np.unique(pos // w, return_inverse=True)
        keep = np.ones((rows_f.size, w), dtype=bool)
        keep[local, pos % w] = False
        if w == K or int(keep.sum(axis=1).min()) >= k:
            break
        w = min(K, 2 * w)
    new_pos = np.cumsum(keep, axis=1) - 1
    r, c = np.nonzero(keep & (new_pos < k))
    sub = np.full((rows_f.size, k), -1, dtype=np.int64)
    sub[r, new_pos[r, c]] = b[rows_f[r], c]
    out[rows_f] = sub
    return out


def _as_score_matrix(S: sp.spmatrix, shape: tuple[int, int] | None = None) -> sp.csr_matrix:
    """A canonical CSR copy-free view of a sparse score matrix (duplicates summed, as scipy does)."""
    S = sp.csr_matrix(S)
    if shape is not None and S.shape != shape:
        raise ValueError(f"score matrix has shape {S.shape} but Y_true has shape {shape}")
    if not (np.issubdtype(S.dtype, np.floating) or np.issubdtype(S.dtype, np.integer)
            or S.dtype == np.bool_):
        raise ValueError(f"score matrix must hold real scores, got dtype {S.dtype}")
    if not S.has_canonical_format:
        S = S.copy()
        S.sum_duplicates()
    if np.issubdtype(S.dtype, np.floating) and np.isnan(S.data).any():
        raise ValueError("score matrix contains NaN scores; cannot rank them")
    return S


def _ranked_csr(Sb: sp.csr_matrix, pr: np.ndarray, pl: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Top-k (ids, -scores) of a CSR block of scores after filtering; stored zeros are predictions."""
    nb, L = Sb.shape
    counts = np.diff(Sb.indptr)
    nnz = int(counts.sum())
    w = int(counts.max()) if nb else 0
    cols = Sb.indices[:nnz]
    negv = _neg_scores(Sb.data[:nnz])
    if nb * w <= 4 * nnz + nb * k:  # rows of similar length: pad to (nb, w) and use the dense selection
        if nnz == nb * w:  # every row has w entries: a reshape, no scatter
            ids, v = cols.reshape(nb, w), negv.reshape(nb, w)
        else:
            r = np.repeat(np.arange(nb, dtype=np.int64), counts)
            flat = np.arange(nnz, dtype=np.int64) + (r * w - Sb.indptr[:-1].astype(np.int64)[r])
            ids = np.full(nb * w, -1, dtype=cols.dtype)
            v = np.full(nb * w, np.nan, dtype=negv.dtype)
            ids[flat] = cols
            v[flat] = negv
            ids, v = ids.reshape(nb, w), v.reshape(nb, w)
        v.ravel()[_filter_positions(ids, pr, pl)] = np.nan
        return _select_topk(ids, v, k)
    r = np.repeat(np.arange(nb, dtype=np.int64), counts)
    cols = cols.astype(np.int64)
    # very uneven rows: sort the stored entries of the block by (row, -score, label)
    inside = pl < L  # a pair with label >= L matches nothing (and would alias another key)
    if inside.any():
        keep = ~np.isin(r * L + cols, pr[inside] * L + pl[inside])
        r, cols, negv = r[keep], cols[keep], negv[keep]
    order = np.lexsort((cols, negv, r))
    r, cols, negv = r[order], cols[order], negv[order]
    cnt = np.bincount(r, minlength=nb)
    rank = np.arange(r.size) - (np.cumsum(cnt) - cnt)[r]
    top = rank < k
    out_i = np.full((nb, k), -1, dtype=np.int64)
    out_v = np.full((nb, k), np.nan, dtype=negv.dtype)
    out_i[r[top], rank[top]] = cols[top]
    out_v[r[top], rank[top]] = negv[top]
    return out_i, out_v


# ----------------------------------------------------------------------------------------------- public


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
    idx = _as_index_array(indices)
    sc = None if scores is None else np.asarray(scores)
    if sc is not None and sc.shape != idx.shape:
        raise ValueError(f"scores has shape {sc.shape} but indices has shape {idx.shape}")
    if filter_pairs is None:
        return idx.copy(), None if sc is None else sc.copy()
    fp = _check_pairs(filter_pairs)
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
    S = _as_score_matrix(scores)
    n = S.shape[0]
    fp = fp_rows = None
    if filter_pairs is not None:
        fp, fp_rows = _pairs_by_row(_check_pairs(filter_pairs))
    out_i = np.full((n, k), -1, dtype=np.int64)
    out_s = np.full((n, k), -np.inf, dtype=_neg_scores(S.data[:0]).dtype)
    for r0, r1 in _row_blocks(n, block_rows):
        pr, pl = _block_pairs(fp, fp_rows, r0, r1)
        ids, negv = _ranked_csr(S[r0:r1], pr, pl, k)
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
    row ``i`` with positives ``y_i``:

    * ``precision_at_k`` = mean_i hits@k / k
    * ``ndcg_at_k`` = mean_i DCG@k / IDCG@k with discount ``1/log2(rank+1)``, IDCG over
      ``min(k, |y_i|)`` positives
    * ``recall_at_k`` = mean_i hits@k / |y_i|
    * ``psprecision_at_k`` = mean_i (sum of ip over hits@k)/k  /  mean_i (sum of the top-min(k,|y_i|)
      ip of the true labels)/k -- ratio of means (pyxclib), not mean of per-row ratios
    * ``psndcg_at_k`` = likewise, with the rank discount in numerator and ideal denominator
    * ``psrecall_at_k`` = mean_i (sum of ip over hits@k) / (sum of ip over y_i) -- per-row ratio averaged
    * ``coverage_at_k`` = |labels predicted in the top k of at least one row| / L
    * ``correct_coverage_at_k`` = |labels that are a hit in the top k of at least one row| /
      |labels with at least one positive in Y_true| (tail-label coverage)

    Rows with no positives score 0 and stay in the means, unless ``drop_empty_rows`` removes them; dropped
    rows are removed from every metric, so their predictions do not count for ``coverage_at_k`` either
    (they have no positives, so ``correct_coverage_at_k`` does not depend on the option).
    Rows are processed in blocks of ``block_rows``; per block only the top ``max(ks)`` candidates are
    sorted, so memory is O(block_rows * K + L) and time is linear in the input size.
    """
    Y = _as_targets(Y_true)
    n, L = Y.shape
    sparse_in = sp.issparse(indices)
    if sparse_in:
        if scores is not None:
            raise ValueError("scores must be None when indices is a sparse score matrix (it holds the scores)")
        S = _as_score_matrix(indices, Y.shape)
    else:
        idx = _check_index_array(indices)
        if idx.shape[0] != n:
            raise ValueError(f"indices has shape {idx.shape} but Y_true has shape {Y.shape}: "
                             f"row counts differ")
    ks = [int(k) for k in ks]
    if any(k < 1 for k in ks):
        raise ValueError(f"ks must all be >= 1, got {list(ks)}")
    if block_rows < 1:
        raise ValueError(f"block_rows must be >= 1, got {block_rows}")
    if not ks:
        return {}
    ip = None
    if inv_prop is not None:
        ip = np.asarray(inv_prop, dtype=np.float64).ravel()
        if ip.shape[0] != L:
            raise ValueError(f"inv_prop has length {ip.shape[0]} but Y_true has {L} labels (shape {Y.shape})")
    sc = None
    if scores is not None:
        sc = np.asarray(scores)
        if sc.shape != idx.shape:
            raise ValueError(f"scores has shape {sc.shape} but indices has shape {idx.shape}")
    fp = fp_rows = None
    if filter_pairs is not None:
        fp, fp_rows = _pairs_by_row(_check_pairs(filter_pairs))

    kmax = max(ks)

    def ranked(r0: int, r1: int) -> np.ndarray:
        """The (r1 - r0, kmax) ranked, filtered, de-duplicated predictions of a block."""
        pr, pl = _block_pairs(fp, fp_rows, r0, r1)
        if sparse_in:
            b = _ranked_csr(S[r0:r1], pr, pl, kmax)[0]
        else:
            lo = _check_block_ids(idx[r0:r1], L, Y.shape)
            if sc is None:
                b = _ranked_dense_ordered(idx[r0:r1], pr, pl, kmax)
            else:
                b = _ranked_dense_scored(idx[r0:r1], sc[r0:r1], pr, pl, kmax, has_padding=lo < 0)
        return _dedup(b)

    return _accumulate(ranked, Y, ks, ip, block_rows, drop_empty_rows)


def _prefix_sums(xT: np.ndarray, ks: Sequence[int]) -> np.ndarray:
    """``out[c, i] = sum_{j < ks[c]} xT[j, i]`` for a rank-major (kmax, nb) array: per-row sums at each k.

    A running sum over the ranks (a loop over at most kmax ranks, vectorised over rows) -- faster than
    ``np.cumsum`` along either axis or a skinny BLAS product on these shapes.
    """
    want = set(ks)
    run = np.zeros(xT.shape[1], dtype=np.float64)
    at: dict[int, np.ndarray] = {}
    for j in range(max(ks)):
        run += xT[j]
        if j + 1 in want:
            at[j + 1] = run.copy()
    return np.stack([at[k] for k in ks])


def _accumulate(ranked: Callable[[int, int], np.ndarray], Y: sp.csr_matrix, ks: list[int],
                ip: np.ndarray | None, block_rows: int, drop_empty_rows: bool) -> dict[str, float]:
    """Stream the metric sums of :func:`evaluate` over row blocks of ranked (nb, max(ks)) predictions.

    The per-block work is done rank-major (transposed, (kmax, nb)), so every step is a vector operation
    over the rows of the block.
    """
    n, L = Y.shape
    kmax = max(ks)
    ks_arr = np.asarray(ks)
    disc = 1.0 / np.log2(np.arange(2, kmax + 2, dtype=np.float64))
    cum_disc = np.cumsum(disc)
    upto = np.arange(kmax)[:, None] < ks_arr[None, :]            # (kmax, nk): rank j counts for k
    canonical = bool(Y.has_canonical_format)
    nk = len(ks)
    acc = {name: np.zeros(nk) for name in ("p", "ndcg", "r", "psp_num", "psp_den",
                                            "psn_num", "psn_den", "psr")}
    rank_dtype = np.int16 if kmax < 2**15 else np.int64
    pred_rank = np.full(L, kmax, dtype=rank_dtype)  # best 0-based rank at which each label was predicted
    hit_rank = np.full(L, kmax, dtype=rank_dtype)   # ... at which it was a hit
    has_pos = np.zeros(L, dtype=bool)
    n_used = 0
    label_rank = ip_desc = None
    if ip is not None and L <= 8 * Y.nnz:  # worth one sort of all labels: rows then sort by int keys
        by_ip = np.argsort(-ip, kind="stable")  # labels by ip descending
        label_rank = np.empty(L, dtype=np.int64)
        label_rank[by_ip] = np.arange(L)
        ip_desc = ip[by_ip]

    for r0, r1 in _row_blocks(n, block_rows):
        b_idx = ranked(r0, r1)
        nb = r1 - r0
        keys = _true_keys(Y[r0:r1], canonical)
        t_rows = keys // L
        t_lab = keys - t_rows * L
        npos = np.bincount(t_rows, minlength=nb)
        hit = _hits(b_idx, keys, L)
        if drop_empty_rows and not (npos > 0).all():
            use = npos > 0
            b_idx, hit, npos = b_idx[use], hit[use], npos[use]
            t_rows = np.cumsum(use)[t_rows] - 1  # renumber the kept rows (all rows with positives)
            nb = b_idx.shape[0]
        n_used += nb
        has_pos[t_lab] = True
        bT = np.ascontiguousarray(b_idx.T)
        hT = np.ascontiguousarray(hit.T)
        for j in range(kmax):  # a loop over ranks, not rows
            lab = bT[j]
            lab = lab[lab >= 0]
            pred_rank[lab] = np.minimum(pred_rank[lab], j)
            lab = bT[j][hT[j]]
            hit_rank[lab] = np.minimum(hit_rank[lab], j)

        hf = hT.astype(np.float64)
        cs = _prefix_sums(hf, ks)                                 # (nk, nb) hits within top-k
        acc["p"] += cs.sum(axis=1) / ks_arr
        has = npos > 0
        acc["r"] += (cs[:, has] / npos[has]).sum(axis=1)
        n_ideal = np.minimum(npos[has][None, :], ks_arr[:, None])  # min(k, |y_i|) >= 1
        dcg = _prefix_sums(hf * disc[:, None], ks)
        acc["ndcg"] += (dcg[:, has] / cum_disc[n_ideal - 1]).sum(axis=1)

        if ip is not None:
            wT = np.where(hT, ip[np.maximum(bT, 0)], 0.0)
            ps_cs = _prefix_sums(wT, ks)
            w_by_rank = wT.sum(axis=1)
            acc["psp_num"] += ps_cs.sum(axis=1) / ks_arr
            acc["psn_num"] += (upto * (w_by_rank * disc)[:, None]).sum(axis=0)
            # ideal: each row's true-label ip sorted descending, placed at ranks 1..min(kmax, |y_i|)
            t_val = ip[t_lab]
            if label_rank is not None:
                sorted_keys = np.sort(t_rows * L + label_rank[t_lab])
                t_r = sorted_keys // L
                t_val_sorted = ip_desc[sorted_keys - t_r * L]
            else:
                order = np.lexsort((-t_val, t_rows))
                t_r, t_val_sorted = t_rows[order], t_val[order]
            rank_in_row = np.arange(t_r.size) - (np.cumsum(npos) - npos)[t_r]
            top = rank_in_row < kmax
            ideal_by_rank = np.bincount(rank_in_row[top], weights=t_val_sorted[top], minlength=kmax)
            acc["psp_den"] += (upto * ideal_by_rank[:, None]).sum(axis=0) / ks_arr
            acc["psn_den"] += (upto * (ideal_by_rank * disc)[:, None]).sum(axis=0)
            ip_total = np.bincount(t_rows, weights=t_val, minlength=nb)
            pos_ip = ip_total > 0
            acc["psr"] += (ps_cs[:, pos_ip] / ip_total[pos_ip]).sum(axis=1)

    def mean(v: np.ndarray) -> np.ndarray:
        return v / n_used if n_used else np.zeros_like(v)

    def ratio(num: np.ndarray, den: np.ndarray) -> np.ndarray:
        return np.where(den > 0, num / np.where(den > 0, den, 1.0), 0.0)

    n_pos_labels = int(has_pos.sum())
    cols = {"precision": mean(acc["p"]), "ndcg": mean(acc["ndcg"]), "recall": mean(acc["r"])}
    if ip is not None:
        cols["psprecision"] = ratio(acc["psp_num"], acc["psp_den"])
        cols["psndcg"] = ratio(acc["psn_num"], acc["psn_den"])
        cols["psrecall"] = mean(acc["psr"])
    cols["coverage"] = np.array([np.count_nonzero(pred_rank < k) / L if L else 0.0 for k in ks])
    cols["correct_coverage"] = np.array([np.count_nonzero(hit_rank < k) / n_pos_labels if n_pos_labels
                                         else 0.0 for k in ks])
    out: dict[str, float] = {}
    for name, vals in cols.items():
        for j, k in enumerate(ks):
            out[f"{name}_at_{k}"] = float(np.clip(vals[j], 0.0, 1.0))
    return out


def recall_at(indices: np.ndarray, Y_true: sp.csr_matrix, block_rows: int = _DEFAULT_BLOCK) -> float:
    """Recall of the whole prediction list (e.g. an ANN shortlist): mean_i |list_i ∩ y_i| / |y_i|.

    -1 padding and repeated labels count once; rows without positives count 0 and stay in the mean.
    """
    idx = _as_index_array(indices)
    Y = _check_targets(idx, Y_true)
    n, L = Y.shape
    if n == 0:
        return 0.0
    total = 0.0
    for r0, r1 in _row_blocks(n, block_rows):
        b_idx = _dedup(idx[r0:r1])
        keys = _true_keys(Y[r0:r1])
        npos = np.bincount(keys // L, minlength=r1 - r0)
        found = _hits(b_idx, keys, L).sum(axis=1)
        total += float(np.where(npos > 0, found / np.maximum(npos, 1), 0.0).sum())
    return total / n
