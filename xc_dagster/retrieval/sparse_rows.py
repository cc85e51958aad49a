"""Row-wise operations on sparse score matrices shared by the shortlist sources: the top-k stored entries of each
row (by a sort, or by a partition of the rows packed into a dense block), row-wise lookups, each row's postings
capped (static index pruning) and row ranges of bounded work; and the neighbours' votes that the dense and the
lexical kNN scores both sum (``vote_weights``, with its setting's check)."""

from __future__ import annotations

from typing import Any

import numpy as np
import scipy.sparse as sp

from xc_dagster.config.bounds import is_finite_number
from xc_dagster.errors import XCConfigError


def check_power(power: Any, field: str) -> float:
    """``power`` as a float if it is a finite number > 0, else an error naming the setting ``field``."""
    if not is_finite_number(power) or power <= 0:
        raise XCConfigError(f"{field}: expected a number > 0 (1: votes are the similarities), got {power!r}")
    return float(power)


def vote_weights(sims: np.ndarray, power: float) -> np.ndarray:
    """A neighbour's vote in a kNN score: its similarity, or max(similarity, 0) ** ``power`` for ``power`` != 1
    (> 1 lets the nearest neighbours outvote the farther ones: docs/decisions.md#knn-vote-power)."""
    if power == 1:
        return sims
    return (np.maximum(sims, 0) ** np.float32(power)).astype(sims.dtype, copy=False)


PACKED_SHARE = 0.125  # rows whose stored entries fill at least this share of a block as wide as the longest row
# are packed into that block (at most 8x the entries' memory) and partitioned; sparser ones are sorted


def sparse_topk(S: sp.spmatrix, k: int, packed_share: float = PACKED_SHARE,
                unique: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """The k largest stored entries of each row of ``S``, by value descending then column: (columns int64,
    values float32), -1 / 0 padded. Rows filling ``packed_share`` of a block as wide as the longest row go through
    :func:`_packed_candidates` (O(rows x longest row), no sort of every entry); others through one sort of the
    entries. ``unique``: no row stores a column twice (a sparse product's rows), so duplicates are not summed
    (scipy sorts every row's columns for that, ~10% of an evaluation's retrieval); the order of a row's entries
    does not matter either way."""
    S = sp.csr_matrix(S)
    if not unique:
        S.sum_duplicates()
    n = S.shape[0]
    lengths = np.diff(S.indptr)
    width = int(lengths.max(initial=0))
    if S.nnz == 0 or k < 1:
        return np.full((n, k), -1, dtype=np.int64), np.zeros((n, k), dtype=np.float32)
    if S.nnz >= packed_share * n * width:
        return _ranked_topk(n, k, *_packed_candidates(S, k, lengths, width))
    return _ranked_topk(n, k, np.repeat(np.arange(n), lengths), S.indices, S.data)


def _packed_candidates(S: sp.csr_matrix, k: int, lengths: np.ndarray,
                       width: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each row's top min(k, width) entries and every tie at the last of them, as (rows, columns, values): the rows'
    stored entries packed to the left of a dense block as wide as the longest row (padded with -inf, in the
    entries' dtype so that ties break as in the sort), where one partition finds each row's k-th value (4.3 s ->
    0.2 s for a 291 x 57,480 block of full-text cosines, 57% dense; 0.60 s -> 0.08 s for 1,024 queries' kNN votes
    over 1.3M labels)."""
    n = S.shape[0]
    kk = min(k, width)
    row = np.repeat(np.arange(n), lengths)
    pos = np.arange(S.nnz) - S.indptr[row]
    D = np.full((n, width), -np.inf, dtype=S.data.dtype if S.data.dtype.kind == "f" else np.float64)
    D[row, pos] = S.data
    thr = -np.partition(-D, kk - 1, axis=1)[:, kk - 1:kk]  # each row's kk-th largest (-inf: fewer entries)
    r, p = np.nonzero((D >= thr) & (np.arange(width) < lengths[:, None]))  # the top kk and every tie at the kk-th
    return r, S.indices[S.indptr[r] + p], D[r, p]


def _ranked_topk(n: int, k: int, rows: np.ndarray, cols: np.ndarray,
                 values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The first k of each row's entries by value descending then column: (n, k) columns int64 and values float32,
    -1 / 0 padded."""
    ids = np.full((n, k), -1, dtype=np.int64)
    vals = np.zeros((n, k), dtype=np.float32)
    order = np.lexsort((cols, -values, rows))
    rows, cols, values = rows[order], cols[order], values[order]
    rank = np.arange(len(rows)) - np.searchsorted(rows, np.arange(n))[rows]  # rows sorted: where each row starts
    keep = rank < k
    ids[rows[keep], rank[keep]] = cols[keep]
    vals[rows[keep], rank[keep]] = values[keep]
    return ids, vals


def dense_topk(D: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """:func:`sparse_topk` of the positive entries of a dense block ``D`` (the others taken as not stored), without
    building the sparse block: one partition finds each row's k-th value, the top k and the ties at it are ranked."""
    n, width = D.shape
    if n == 0 or width == 0 or k < 1:
        return np.full((n, max(k, 0)), -1, dtype=np.int64), np.zeros((n, max(k, 0)), dtype=np.float32)
    kk = min(k, width)
    thr = -np.partition(-D, kk - 1, axis=1)[:, kk - 1:kk]
    r, c = np.nonzero((D >= thr) & (D > 0))
    return _ranked_topk(n, k, r, c, D[r, c])


DENSE_GAIN = 16  # a dense product's cell costs ~1/16 of a sparse product's stored entry (BLAS against scipy's
# per-entry loop: 512 Mediamill-shaped queries x 31K points, 0.28 s against 4.75 s, Xeon, one thread)
DENSE_MAX_CELLS = 1 << 25  # a dense copy of the postings holds at most this many cells (128 MB)


def dense_postings(Mt: sp.csr_matrix) -> np.ndarray | None:
    """The postings ``Mt`` (terms, points) as a dense float32 array where a query's products cost less so: the
    points' mean products as queries (sum over terms of df ** 2 / points) above terms x points / DENSE_GAIN (dense
    feature rows: Mediamill's 120 features, each in nearly every point), at most DENSE_MAX_CELLS cells; else None."""
    terms, n = Mt.shape
    df = np.diff(Mt.indptr).astype(np.float64)
    if n == 0 or terms * n > DENSE_MAX_CELLS or DENSE_GAIN * float((df ** 2).sum()) / n < terms * n:
        return None
    return np.asarray(Mt.toarray(), dtype=np.float32)


def sparse_lookup(P: sp.csr_matrix, ids: np.ndarray) -> np.ndarray:
    """Row-wise ``P[i, ids[i, j]]`` (0 where not stored or ``ids`` is -1): (n, C) float32. ``P``: CSR with
    sorted indices and no duplicates, so that the keys row * L + column are sorted for one search."""
    n, L = P.shape
    row = np.repeat(np.arange(n, dtype=np.int64), np.diff(P.indptr))
    keys = row * L + P.indices
    if keys.size == 0:
        return np.zeros(ids.shape, dtype=np.float32)
    probe = np.arange(n, dtype=np.int64)[:, None] * L + np.maximum(ids, 0)
    pos = np.minimum(np.searchsorted(keys, probe), keys.size - 1)
    return np.where((keys[pos] == probe) & (ids >= 0), P.data[pos], 0.0).astype(np.float32)


def cap_postings(Mt: sp.csr_matrix, cap: int) -> sp.csr_matrix:
    """Each row of ``Mt`` (a term's postings) keeping its ``cap`` largest entries, ties by smaller column; ``cap``
    0: all. One sort of the stored entries of the rows longer than ``cap``."""
    Mt = sp.csr_matrix(Mt)
    lengths = np.diff(Mt.indptr)
    if cap <= 0 or lengths.max(initial=0) <= cap:
        return Mt
    row = np.repeat(np.arange(Mt.shape[0]), lengths)
    order = np.lexsort((Mt.indices, -Mt.data, row))
    rank = np.arange(len(order)) - Mt.indptr[row]  # row is sorted, so row[order] == row
    keep = np.sort(order[rank < cap])  # back in (row, column) order
    out = sp.csr_matrix((Mt.data[keep], Mt.indices[keep], np.concatenate([[0], np.cumsum(np.minimum(lengths, cap))])),
                        shape=Mt.shape)
    return out


def row_postings(Q: sp.csr_matrix, postings: np.ndarray) -> np.ndarray:
    """Per row of ``Q``, the sum of ``postings`` over its stored columns (int64): its products with a matrix whose
    row t stores ``postings[t]`` entries, the work :func:`work_blocks` bounds."""
    c = np.concatenate([[0], np.cumsum(np.asarray(postings)[Q.indices], dtype=np.int64)])
    return c[Q.indptr[1:]] - c[Q.indptr[:-1]]


def work_blocks(work: np.ndarray, budget: int, step: int) -> list[tuple[int, int]]:
    """Consecutive (start, end) row ranges of at most ``step`` rows whose ``work`` sums to at most ``budget``
    (a row over the budget alone in its range)."""
    cum = np.cumsum(np.asarray(work, dtype=np.int64))
    out, s, n = [], 0, len(cum)
    while s < n:
        base = cum[s - 1] if s else 0
        e = int(np.searchsorted(cum, base + budget, side="right"))
        e = min(max(e, s + 1), s + step, n)
        out.append((s, e))
        s = e
    return out


def topped_up(S: sp.csr_matrix, labels: np.ndarray) -> sp.csr_matrix:
    """``S``'s pattern with ``labels`` added to each row storing fewer than ``len(labels)`` entries (the added
    entries hold float32's smallest normal value: a pattern to score, not a score)."""
    S, k = sp.csr_matrix(S), len(labels)
    short = np.flatnonzero(np.diff(S.indptr) < k)  # none when k is 0
    if not short.size:
        return S
    fill = sp.csr_matrix((np.full(short.size * k, np.finfo(np.float32).tiny, dtype=np.float32),
                          (np.repeat(short, k), np.tile(np.asarray(labels, dtype=np.int64), short.size))),
                         shape=S.shape)
    return sp.csr_matrix(S + fill)
