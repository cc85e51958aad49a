"""Vectorised sampling over the label matrix: positives per point, positive masks, de-duplication, and the
label draws of SiameseXML Module I (labels by frequency^power, positive points per label)."""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp


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


# ------------------------------------------------------------------ SiameseXML Module I: batches over labels

def label_sampling_probs(freq: np.ndarray, power: float) -> np.ndarray:
    """Label distribution ``freq ** power`` normalised (SiameseXML: power 0.45); labels with freq 0 get 0.

    ``power`` = 0 is uniform over the labels that have a training point, 1 the (heavy-tailed) label
    distribution that batches over points give implicitly.
    """
    freq = np.asarray(freq, dtype=np.float64)
    w = np.where(freq > 0, np.power(np.maximum(freq, 1.0), power), 0.0)
    total = w.sum()
    return w / total if total > 0 else w


def sample_label_batch(probs: np.ndarray, batch_size: int, rng: np.random.Generator) -> np.ndarray:
    """``batch_size`` distinct labels drawn with probability ``probs`` (without replacement within the batch).

    Successive weighted draws (numpy's ``choice(replace=False, p=...)``): each draw is proportional to
    ``probs`` over the labels not yet in the batch, so inclusion probabilities equal ``probs`` for a batch of
    one and flatten slightly as the batch becomes a large share of the labels (negligible at 256 of 21K).
    """
    size = min(int(batch_size), int(np.count_nonzero(probs)))
    if size <= 0:
        return np.zeros(0, dtype=np.int64)
    return rng.choice(len(probs), size=size, replace=False, p=probs).astype(np.int64)


def sample_label_points(Yc: sp.csc_matrix, labels: np.ndarray, extra: int,
                        rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """One uniformly random positive row of each label (the anchor) and ``extra`` more positives per label.

    ``Yc`` is the label matrix in CSC form (rows = points), e.g. restricted to the training rows. Returns
    ``(anchors (B,), others (B, extra))`` as row indices of ``Yc``. The ``others`` are distinct from each
    other and from the anchor while the label has enough positives (uniform random subset, drawn with
    random offsets into the label's column: the j-th draw picks the r-th not-yet-taken offset); once they run
    out they repeat uniformly among the non-anchor positives, and a label with a single positive repeats
    its anchor. Every label must have a positive.
    """
    labels = np.asarray(labels, dtype=np.int64)
    starts = Yc.indptr[labels].astype(np.int64)
    n = (Yc.indptr[labels + 1] - starts).astype(np.int64)
    if np.any(n <= 0):
        raise ValueError("sample_label_points: every label needs at least one positive row")
    B = len(labels)
    anchor = np.minimum((rng.random(B) * n).astype(np.int64), n - 1)
    taken = anchor[:, None]
    for j in range(extra):
        avail = n - 1 - j  # offsets not yet taken
        r = np.minimum((rng.random(B) * np.maximum(avail, 1)).astype(np.int64), np.maximum(avail, 1) - 1)
        for col in np.sort(taken, axis=1).T:  # map r to the r-th untaken offset (ascending shift)
            r = r + (r >= col)
        # ran out of distinct positives: uniform among the non-anchor ones (or the anchor itself if alone)
        u = np.minimum((rng.random(B) * np.maximum(n - 1, 1)).astype(np.int64), np.maximum(n - 1, 1) - 1)
        fallback = np.where(n >= 2, (anchor + 1 + u) % n, anchor)
        off = np.where(avail >= 1, r, fallback)
        taken = np.column_stack([taken, off])
    rows = Yc.indices[starts[:, None] + taken].astype(np.int64)
    return rows[:, 0], rows[:, 1:]
