"""Vectorised sampling over the label matrix: positives per point, shortlist negatives, validation split."""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp


def validation_split(n: int, fraction: float, max_rows: int, seed: int) -> np.ndarray:
    """Sorted row ids of a seeded random validation split of ``n`` training rows."""
    size = min(int(round(n * fraction)), max_rows, max(n - 1, 0))
    if size <= 0:
        return np.zeros(0, dtype=np.int64)
    rng = np.random.default_rng(seed)
    return np.sort(rng.choice(n, size=size, replace=False)).astype(np.int64)


def sample_positives(Y: sp.csr_matrix, rows: np.ndarray, per_row: int, rng: np.random.Generator) -> np.ndarray:
    """Up to ``per_row`` distinct random positives of each row: (len(rows), per_row) int64, -1 padded."""
    rows = np.asarray(rows, dtype=np.int64)
    starts = Y.indptr[rows]
    counts = (Y.indptr[rows + 1] - starts).astype(np.int64)
    out = np.full((len(rows), per_row), -1, dtype=np.int64)
    total = int(counts.sum())
    if total == 0:
        return out
    owner = np.repeat(np.arange(len(rows)), counts)
    offsets = np.arange(total) - np.repeat(np.cumsum(counts) - counts, counts)
    flat = Y.indices[np.repeat(starts, counts) + offsets]
    order = np.lexsort((rng.random(total), owner))
    owner, flat = owner[order], flat[order]
    rank = np.arange(total) - np.repeat(np.cumsum(counts) - counts, counts)
    keep = rank < per_row
    out[owner[keep], rank[keep]] = flat[keep]
    return out


def positive_mask(Y: sp.csr_matrix, rows: np.ndarray, cands: np.ndarray) -> np.ndarray:
    """Boolean (len(rows), C): is ``cands[i, j]`` a positive label of ``rows[i]``? (-1 -> False)."""
    rows = np.asarray(rows, dtype=np.int64)
    L = Y.shape[1]
    sub = Y[rows]
    sub.sort_indices()
    r = np.repeat(np.arange(len(rows), dtype=np.int64), np.diff(sub.indptr))
    keys = r * L + sub.indices.astype(np.int64)
    ck = np.arange(len(rows), dtype=np.int64)[:, None] * L + np.where(cands < 0, 0, cands)
    pos = np.searchsorted(keys, ck)
    hit = (pos < len(keys)) & (keys[np.minimum(pos, max(len(keys) - 1, 0))] == ck) if len(keys) else np.zeros(
        ck.shape, dtype=bool)
    return hit & (cands >= 0)


def dedupe_rows(ids: np.ndarray) -> np.ndarray:
    """Replace repeated ids within each row by -1 (first occurrence kept), order otherwise unchanged."""
    order = np.argsort(ids, axis=1, kind="stable")
    sorted_ids = np.take_along_axis(ids, order, 1)
    dup_sorted = np.zeros_like(sorted_ids, dtype=bool)
    dup_sorted[:, 1:] = sorted_ids[:, 1:] == sorted_ids[:, :-1]
    dup = np.zeros_like(dup_sorted)
    np.put_along_axis(dup, order, dup_sorted, 1)
    return np.where(dup | (ids < 0), -1, ids)
