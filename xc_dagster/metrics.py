"""Extreme-classification metrics with the XC repository conventions (pyxclib, NGAME, SiameseXML, ASTRA).

Everything is vectorised with numpy/scipy; rows are processed in blocks of ``block_rows`` so memory stays
bounded on test sets with millions of rows.

Conventions (shared by every public function here):

* ``indices`` is an ``(n, K)`` integer array of predicted label ids, best first; ``-1`` is padding
  ("no prediction"). A label repeated within a row counts once: later copies are misses.
  When ``K < max(ks)`` the missing ranks are misses.
* ``Y_true`` is an ``(n, L)`` CSR matrix; any stored nonzero value is a relevant label.
* Rows without positives count as 0 in every per-row mean and stay in the denominator ``n`` (the XC
  convention), unless ``drop_empty_rows=True``.
* Propensity-scored precision / nDCG are pyxclib-style *ratios of means*: the numerator and the ideal
  (best achievable) denominator are each averaged over all rows, then divided. PS-recall is instead a
  per-row ratio averaged over rows.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import scipy.sparse as sp

__all__ = ["inverse_propensity", "remove_filtered", "evaluate", "recall_at"]

_DEFAULT_BLOCK = 65536


# ----------------------------------------------------------------------------------------------- helpers


def _as_index_array(indices: np.ndarray) -> np.ndarray:
    """Check that ``indices`` is a 2-D integer array and return it as int64."""
    arr = np.asarray(indices)
    if arr.ndim != 2:
        raise ValueError(f"indices must be a 2-D (n, K) array of label ids, got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"indices must hold integer label ids, got dtype {arr.dtype}")
    arr = arr.astype(np.int64, copy=False)
    if arr.size and arr.min() < -1:
        raise ValueError(f"indices must be label ids >= 0 or -1 for padding, got {int(arr.min())}")
    return arr


def _check_pairs(filter_pairs: np.ndarray) -> np.ndarray:
    """Check that ``filter_pairs`` is an (m, 2) array of non-negative [row, label] ids."""
    fp = np.asarray(filter_pairs)
    if fp.size == 0:
        return np.zeros((0, 2), dtype=np.int64)
    if fp.ndim != 2 or fp.shape[1] != 2:
        raise ValueError(f"filter_pairs must be an (m, 2) array of [row, label], got shape {fp.shape}")
    fp = fp.astype(np.int64, copy=False)
    if fp.min() < 0:
        raise ValueError("filter_pairs must hold non-negative 0-based [row, label] ids")
    return fp


def _check_targets(indices: np.ndarray, Y_true: sp.spmatrix) -> sp.csr_matrix:
    """Check row counts and label range of ``indices`` against ``Y_true``; return ``Y_true`` as CSR."""
    if not sp.issparse(Y_true):
        Y_true = sp.csr_matrix(np.asarray(Y_true))
    Y = Y_true.tocsr()
    if indices.shape[0] != Y.shape[0]:
        raise ValueError(f"indices has shape {indices.shape} but Y_true has shape {Y.shape}: "
                         f"row counts differ")
    if indices.size and indices.max() >= Y.shape[1]:
        raise ValueError(f"indices holds label id {int(indices.max())} but Y_true has only "
                         f"{Y.shape[1]} labels (shape {Y.shape})")
    return Y


def _true_keys(Yb: sp.csr_matrix) -> np.ndarray:
    """Sorted unique int64 keys ``local_row * L + label`` of the stored nonzeros of a block of Y."""
    L = Yb.shape[1]
    rows = np.repeat(np.arange(Yb.shape[0], dtype=np.int64), np.diff(Yb.indptr))
    keep = Yb.data != 0
    keys = rows[keep] * L + Yb.indices[keep].astype(np.int64)
    return np.unique(keys)  # sorts, and merges duplicate entries of a non-canonical CSR


def _rank(idx: np.ndarray, sc: np.ndarray | None) -> np.ndarray:
    """Order each row by score descending, ties by smaller label id, padding (-1) last."""
    if sc is None:
        return idx
    # lexsort: last key is primary -> (padding flag, -score, label id)
    order = np.lexsort((idx, -sc, idx < 0), axis=1)
    return np.take_along_axis(idx, order, axis=1)


def _dedup(idx: np.ndarray) -> np.ndarray:
    """Replace later copies of a label within a row by -1 (they become misses; ranks do not move)."""
    if idx.shape[1] < 2:
        return idx
    order = np.argsort(idx, axis=1, kind="stable")
    s = np.take_along_axis(idx, order, axis=1)
    dup_sorted = np.zeros_like(s, dtype=bool)
    dup_sorted[:, 1:] = (s[:, 1:] == s[:, :-1]) & (s[:, 1:] >= 0)
    dup = np.empty_like(dup_sorted)
    np.put_along_axis(dup, order, dup_sorted, axis=1)
    return np.where(dup, -1, idx)


def _fit_width(idx: np.ndarray, width: int) -> np.ndarray:
    """Truncate to ``width`` ranks, or pad with -1 (misses) up to it."""
    if idx.shape[1] >= width:
        return idx[:, :width]
    pad = np.full((idx.shape[0], width - idx.shape[1]), -1, dtype=idx.dtype)
    return np.concatenate([idx, pad], axis=1)


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


def _prepare_block(idx: np.ndarray, sc: np.ndarray | None, fp: np.ndarray | None, fp_rows: np.ndarray | None,
                   r0: int, r1: int, width: int | None) -> np.ndarray:
    """Filter, rank, truncate/pad and de-duplicate the predictions of rows ``r0:r1``."""
    b_idx = idx[r0:r1]
    b_sc = None if sc is None else sc[r0:r1]
    if fp is not None and fp_rows is not None:
        lo, hi = np.searchsorted(fp_rows, [r0, r1])
        if hi > lo:
            local = fp[lo:hi].copy()
            local[:, 0] -= r0
            b_idx, b_sc = remove_filtered(b_idx, b_sc, local)
    b_idx = _rank(b_idx, b_sc)
    if width is not None:
        b_idx = _fit_width(b_idx, width)
    return _dedup(b_idx)


def evaluate(indices: np.ndarray, Y_true: sp.csr_matrix, ks: Sequence[int] = (1, 3, 5),
             inv_prop: np.ndarray | None = None, filter_pairs: np.ndarray | None = None,
             scores: np.ndarray | None = None, block_rows: int = _DEFAULT_BLOCK,
             drop_empty_rows: bool = False) -> dict[str, float]:
    """P@k, nDCG@k, recall@k (and PSP@k, PSnDCG@k, PS-recall@k given ``inv_prop``) as fractions in [0, 1].

    Steps: drop ``filter_pairs`` (see :func:`remove_filtered`); if ``scores`` is given, rank each row by
    score descending with ties broken by the smaller label id; keep the top ``max(ks)`` ranks (missing
    ranks are misses); later duplicates of a label are misses. Then, per row ``i`` with positives ``y_i``:

    * ``precision_at_k`` = mean_i hits@k / k
    * ``ndcg_at_k`` = mean_i DCG@k / IDCG@k with discount ``1/log2(rank+1)``, IDCG over
      ``min(k, |y_i|)`` positives
    * ``recall_at_k`` = mean_i hits@k / |y_i|
    * ``psprecision_at_k`` = mean_i (sum of ip over hits@k)/k  /  mean_i (sum of the top-min(k,|y_i|)
      ip of the true labels)/k -- ratio of means (pyxclib), not mean of per-row ratios
    * ``psndcg_at_k`` = likewise, with the rank discount in numerator and ideal denominator
    * ``psrecall_at_k`` = mean_i (sum of ip over hits@k) / (sum of ip over y_i) -- per-row ratio averaged

    Rows with no positives score 0 and stay in the mean, unless ``drop_empty_rows`` removes them.
    Rows are processed in blocks of ``block_rows`` to bound memory.
    """
    idx = _as_index_array(indices)
    Y = _check_targets(idx, Y_true)
    n, L = Y.shape
    ks = [int(k) for k in ks]
    if any(k < 1 for k in ks):
        raise ValueError(f"ks must all be >= 1, got {list(ks)}")
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
    kcol = np.asarray(ks) - 1
    ranks = np.arange(1, kmax + 1, dtype=np.float64)
    disc = 1.0 / np.log2(ranks + 1.0)
    cum_disc = np.cumsum(disc)
    nk = len(ks)
    acc = {name: np.zeros(nk) for name in ("p", "ndcg", "r", "psp_num", "psp_den",
                                             "psn_num", "psn_den", "psr")}
    n_used = 0

    for r0, r1 in _row_blocks(n, block_rows):
        b_idx = _prepare_block(idx, sc, fp, fp_rows, r0, r1, kmax)
        nb = r1 - r0
        keys = _true_keys(Y[r0:r1])
        t_rows = keys // L
        npos = np.bincount(t_rows, minlength=nb)
        use = npos > 0 if drop_empty_rows else np.ones(nb, dtype=bool)
        n_used += int(use.sum())
        hit = _hits(b_idx, keys, L)
        hf = hit.astype(np.float64)

        cs = np.cumsum(hf, axis=1)[:, kcol]                       # hits within top-k
        acc["p"] += cs[use].sum(axis=0) / np.asarray(ks)
        safe_pos = np.maximum(npos, 1)[:, None]
        acc["r"] += np.where(npos[:, None] > 0, cs / safe_pos, 0.0)[use].sum(axis=0)
        dcg = np.cumsum(hf * disc, axis=1)[:, kcol]
        n_ideal = np.minimum(npos[:, None], np.asarray(ks)[None, :])  # min(k, |y_i|)
        idcg = np.where(n_ideal > 0, cum_disc[np.maximum(n_ideal, 1) - 1], 1.0)
        acc["ndcg"] += np.where(n_ideal > 0, dcg / idcg, 0.0)[use].sum(axis=0)

        if ip is not None:
            w = np.where(hit, ip[np.maximum(b_idx, 0)], 0.0)
            ps_cs = np.cumsum(w, axis=1)[:, kcol]
            ps_dcg = np.cumsum(w * disc, axis=1)[:, kcol]
            # ideal: each row's true-label ip sorted descending, placed at ranks 1..min(kmax, |y_i|)
            t_val = ip[keys % L]
            order = np.lexsort((-t_val, t_rows))
            t_val, t_r = t_val[order], t_rows[order]
            starts = np.concatenate([[0], np.cumsum(npos)[:-1]])
            rank_in_row = np.arange(t_r.size) - starts[t_r]
            top = rank_in_row < kmax
            ideal = np.zeros((nb, kmax))
            ideal[t_r[top], rank_in_row[top]] = t_val[top]
            acc["psp_num"] += ps_cs[use].sum(axis=0) / np.asarray(ks)
            acc["psp_den"] += np.cumsum(ideal, axis=1)[:, kcol][use].sum(axis=0) / np.asarray(ks)
            acc["psn_num"] += ps_dcg[use].sum(axis=0)
            acc["psn_den"] += np.cumsum(ideal * disc, axis=1)[:, kcol][use].sum(axis=0)
            ip_total = np.bincount(t_rows, weights=ip[keys % L], minlength=nb)[:, None]
            acc["psr"] += np.where(ip_total > 0, ps_cs / np.where(ip_total > 0, ip_total, 1.0),
                                   0.0)[use].sum(axis=0)

    def mean(v: np.ndarray) -> np.ndarray:
        return v / n_used if n_used else np.zeros_like(v)

    def ratio(num: np.ndarray, den: np.ndarray) -> np.ndarray:
        return np.where(den > 0, num / np.where(den > 0, den, 1.0), 0.0)

    out: dict[str, float] = {}
    cols = {"precision": mean(acc["p"]), "ndcg": mean(acc["ndcg"]), "recall": mean(acc["r"])}
    if ip is not None:
        cols["psprecision"] = ratio(acc["psp_num"], acc["psp_den"])
        cols["psndcg"] = ratio(acc["psn_num"], acc["psn_den"])
        cols["psrecall"] = mean(acc["psr"])
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
