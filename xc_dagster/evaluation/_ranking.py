"""The ranking and filtering kernels of :mod:`xc_dagster.evaluation.metrics` (private: its public functions
check their inputs with these and rank every row block with them).

A row block of predictions is filtered (``filter_pairs``), ranked (by score, ties by the smaller label id, or in
the given column order) down to its top k, and de-duplicated; ``true_keys`` / ``hits`` match it against the
block of ``Y_true``. Everything is vectorised over the rows of a block.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import scipy.sparse as sp

PAIR_CHUNK = 65536  # filter pairs compared at a time (bounds the (pairs, K) comparison matrix)


def as_index_array(indices: np.ndarray) -> np.ndarray:
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


def check_pairs(filter_pairs: np.ndarray) -> np.ndarray:
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


def as_targets(Y_true: sp.spmatrix | np.ndarray) -> sp.csr_matrix:
    """``Y_true`` as a 2-D CSR matrix."""
    if not sp.issparse(Y_true):
        arr = np.asarray(Y_true)
        if arr.ndim != 2:
            raise ValueError(f"Y_true must be a 2-D (n, L) matrix, got shape {arr.shape}")
        Y_true = sp.csr_matrix(arr)
    return sp.csr_matrix(Y_true)


def check_targets(indices: np.ndarray, Y_true: sp.spmatrix) -> sp.csr_matrix:
    """Check row counts and label range of ``indices`` against ``Y_true``; return ``Y_true`` as CSR."""
    Y = as_targets(Y_true)
    if indices.shape[0] != Y.shape[0]:
        raise ValueError(f"indices has shape {indices.shape} but Y_true has shape {Y.shape}: "
                         f"row counts differ")
    if indices.size and indices.max() >= Y.shape[1]:
        raise ValueError(f"indices holds label id {int(indices.max())} but Y_true has only "
                         f"{Y.shape[1]} labels (shape {Y.shape})")
    return Y


def true_keys(Yb: sp.csr_matrix, canonical: bool = False) -> np.ndarray:
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


def dedup(idx: np.ndarray) -> np.ndarray:
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


def hits(idx: np.ndarray, keys: np.ndarray, L: int) -> np.ndarray:
    """Boolean (nb, K) matrix: is the predicted label at each rank a true label of its row."""
    valid = idx >= 0
    pred = np.arange(idx.shape[0], dtype=np.int64)[:, None] * L + np.where(valid, idx, 0)
    if keys.size == 0:
        return np.zeros(idx.shape, dtype=bool)
    pos = np.searchsorted(keys, pred)
    found = keys[np.minimum(pos, keys.size - 1)] == pred
    return valid & found


def row_blocks(n: int, block_rows: int):
    """Yield ``(start, stop)`` row ranges of at most ``block_rows`` rows."""
    if block_rows < 1:
        raise ValueError(f"block_rows must be >= 1, got {block_rows}")
    for r0 in range(0, n, block_rows):
        yield r0, min(n, r0 + block_rows)


def pairs_by_row(fp: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Filter pairs sorted by row, plus the sorted row column, so a block's pairs are one slice."""
    order = np.argsort(fp[:, 0], kind="stable")
    fp = fp[order]
    return fp, fp[:, 0]


def block_pairs(fp: np.ndarray | None, fp_rows: np.ndarray | None, r0: int,
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
    for c0 in range(0, pr.size, PAIR_CHUNK):
        p, lab = pr[c0:c0 + PAIR_CHUNK], pl[c0:c0 + PAIR_CHUNK]
        f = np.flatnonzero(b_idx[p] == lab[:, None])
        out.append(p[f // w] * w + f % w)
    return np.concatenate(out)


def neg_scores(sc: np.ndarray) -> np.ndarray:
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
    v = neg_scores(b_sc)
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


def as_score_matrix(S: sp.spmatrix, shape: tuple[int, int] | None = None) -> sp.csr_matrix:
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


def ranked_csr(Sb: sp.csr_matrix, pr: np.ndarray, pl: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Top-k (ids, -scores) of a CSR block of scores after filtering; stored zeros are predictions."""
    nb, L = Sb.shape
    counts = np.diff(Sb.indptr)
    nnz = int(counts.sum())
    w = int(counts.max()) if nb else 0
    cols = Sb.indices[:nnz]
    negv = neg_scores(Sb.data[:nnz])
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


def check_inv_prop(inv_prop: np.ndarray | None, Y: sp.csr_matrix) -> np.ndarray | None:
    """``inv_prop`` as float64, one per label of ``Y``, or None."""
    if inv_prop is None:
        return None
    ip = np.asarray(inv_prop, dtype=np.float64).ravel()
    if ip.shape[0] != Y.shape[1]:
        raise ValueError(f"inv_prop has length {ip.shape[0]} but Y_true has {Y.shape[1]} labels (shape {Y.shape})")
    return ip


def check_predictions(indices: np.ndarray | sp.spmatrix, scores: np.ndarray | None,
                      Y: sp.csr_matrix) -> np.ndarray | sp.csr_matrix:
    """``indices`` checked against ``Y``: an (n, K) id array (values checked block by block), or a sparse (n, L)
    score matrix as canonical CSR (then ``scores`` must be None)."""
    if sp.issparse(indices):
        if scores is not None:
            raise ValueError("scores must be None when indices is a sparse score matrix (it holds the scores)")
        return as_score_matrix(indices, Y.shape)
    idx = _check_index_array(indices)
    if idx.shape[0] != Y.shape[0]:
        raise ValueError(f"indices has shape {idx.shape} but Y_true has shape {Y.shape}: "
                         f"row counts differ")
    return idx


def block_ranker(pred: np.ndarray | sp.csr_matrix, scores: np.ndarray | None, Y: sp.csr_matrix,
                 filter_pairs: np.ndarray | None, kmax: int) -> Callable[[int, int], np.ndarray]:
    """``ranked(r0, r1)``: the (r1 - r0, kmax) ranked, filtered, de-duplicated predictions of rows r0:r1 of
    ``pred`` (what :func:`check_predictions` returned), ranked by ``scores`` when given."""
    sc = None
    if scores is not None:
        sc = np.asarray(scores)
        if sc.shape != pred.shape:
            raise ValueError(f"scores has shape {sc.shape} but indices has shape {pred.shape}")
    fp = fp_rows = None
    if filter_pairs is not None:
        fp, fp_rows = pairs_by_row(check_pairs(filter_pairs))
    sparse_in = sp.issparse(pred)
    L = Y.shape[1]

    def ranked(r0: int, r1: int) -> np.ndarray:
        pr, pl = block_pairs(fp, fp_rows, r0, r1)
        if sparse_in:
            b = ranked_csr(pred[r0:r1], pr, pl, kmax)[0]
        else:
            lo = _check_block_ids(pred[r0:r1], L, Y.shape)
            if sc is None:
                b = _ranked_dense_ordered(pred[r0:r1], pr, pl, kmax)
            else:
                b = _ranked_dense_scored(pred[r0:r1], sc[r0:r1], pr, pl, kmax, has_padding=lo < 0)
        return dedup(b)

    return ranked
