"""The metrics of many rankings of one fixed shortlist, with everything that does not depend on the scores done
once: what a search over score weightings needs (the fusion's grid evaluates thousands of them).

:class:`FixedShortlistMetrics` checks the candidates, matches them against the targets and the filter pairs, and
finds the duplicates once per row block; :meth:`FixedShortlistMetrics.evaluate` then only ranks by the new
scores and sums the families. Its numbers are those of :func:`~xc_dagster.evaluation.metrics.evaluate_families`
on the same inputs, to the bit: the same ranking (score descending, ties by the smaller label id, filtered pairs
and padding never ranked, later copies of a label misses), the same row blocks and the same per-family sums.

The ranking skips the full per-row selection: the maximum of two column halves, halved again while the row stays
wide, leaves column groups whose maxima bound each row's k-th score from below; only the entries at or above the
bound are sorted.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import scipy.sparse as sp

from xc_dagster.evaluation._families import FAMILIES, PROPENSITY_FAMILIES, Block, Setup
from xc_dagster.evaluation._ranking import (
    _check_block_ids,
    _filter_positions,
    as_targets,
    block_pairs,
    check_inv_prop,
    check_pairs,
    check_predictions,
    dedup,
    hits,
    neg_scores,
    pairs_by_row,
    row_blocks,
    true_keys,
)
from xc_dagster.evaluation.metrics import _DEFAULT_BLOCK  # its row blocks: the sums are added per block, in order

_NAN_ERROR = "scores contain NaN for real predictions (indices >= 0); cannot rank them"
_SUPPORTED = ("precision", "ndcg", "recall", *PROPENSITY_FAMILIES)  # coverage needs every label's best rank


def has_duplicates(ids: np.ndarray) -> bool:
    """Whether a row of ``ids`` holds a label id >= 0 twice (then later copies in a top k are misses)."""
    if ids.shape[1] < 2:
        return False
    s = np.sort(ids, axis=1)
    return bool(((s[:, 1:] == s[:, :-1]) & (s[:, 1:] >= 0)).any())


def row_floor(s: np.ndarray, k: int) -> np.ndarray:
    """Per row, a value with at least ``k`` entries of ``s`` at or above it (-inf: keep the whole row), found
    from the maxima of disjoint column groups instead of a selection over the row; a NaN raises."""
    m = s
    while m.shape[1] >= 8 * k:  # each column becomes the maximum of two (NaN kept); an odd last one stays
        h = m.shape[1] // 2
        half = np.maximum(m[:, :h], m[:, h:2 * h])
        m = half if m.shape[1] == 2 * h else np.concatenate([half, m[:, 2 * h:]], axis=1)
    if np.isnan(m).any():
        raise ValueError(_NAN_ERROR)
    if m.shape[1] <= k:
        return np.full(s.shape[0], -np.inf, dtype=s.dtype)
    return np.partition(m, m.shape[1] - k, axis=1)[:, m.shape[1] - k]


def candidate_order(r: np.ndarray, v: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """The argsort of candidates by (row ``r``, value ``v``, label id): for float32 one sort of an int64 key
    (the row, then the float's bits in order), re-sorting only exactly tied keys by id; else a lexsort."""
    if v.dtype != np.float32 or (r.size and r[-1] >= 2**31):
        return np.lexsort((ids, v, r))
    bits = (v + np.float32(0)).view(np.int32)  # + 0 turns -0 into 0 (they compare equal, their bits do not)
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # negative floats: flip the magnitude, so ints order as floats
    key = (r.astype(np.int64) << 32) + (ordered.astype(np.int64) + 2**31)
    order = np.argsort(key)
    ks = key[order]
    tie = ks[1:] == ks[:-1]
    if tie.any():
        slots = np.flatnonzero(np.concatenate([tie, [False]]) | np.concatenate([[False], tie]))
        sub = order[slots]  # the tied runs, in key order: re-sorted by (key, id) in the same slots
        order[slots] = sub[np.lexsort((ids[sub], key[sub]))]
    return order


class _Ranked(Block):
    """One row block ranked by new scores: :class:`Block` with the truth taken from its :class:`_BlockTruth`."""

    def __init__(self, truth: _BlockTruth, bT: np.ndarray, hT: np.ndarray) -> None:
        self.s, self.nb, self.npos, self.t_rows, self.t_lab = truth.s, truth.nb, truth.npos, truth.t_rows, truth.t_lab
        self.truth, self.bT, self.hT = truth, bT, hT

    @property
    def ideal_by_rank(self) -> np.ndarray:
        """The block's ideal propensity ranking, computed by the first ranking and shared (it has no scores)."""
        if self.truth.ideal is None:
            self.truth.ideal = Block.ideal_by_rank.func(self)
        return self.truth.ideal


class _BlockTruth:
    """What one row block's rankings share: its candidates, their relevance, masks and duplicates, its positives."""

    def __init__(self, s: Setup, ids: np.ndarray, Yb: sp.csr_matrix, canonical: bool, pr: np.ndarray,
                 pl: np.ndarray) -> None:
        self.s, self.nb, self.ids = s, ids.shape[0], ids
        keys = true_keys(Yb, canonical)
        self.t_rows = keys // s.L
        self.t_lab = keys - self.t_rows * s.L
        self.npos = np.bincount(self.t_rows, minlength=self.nb)
        self.filtered = _filter_positions(ids, pr, pl)  # flat positions of the filtered (real) candidates
        masked = ids < 0
        masked.ravel()[self.filtered] = True
        self.masked = masked if masked.any() else None  # never ranked: padding and filtered pairs
        self.pad_pos = np.flatnonzero(ids < 0)
        self.filtered_per_row = int(np.bincount(self.filtered // ids.shape[1]).max()) if self.filtered.size else 0
        self.rel = hits(ids, keys, s.L) & ~masked
        self.dups = has_duplicates(ids)
        self.ideal: np.ndarray | None = None

    def worst_masked(self, sc: np.ndarray) -> tuple[np.ndarray, int]:
        """Scores where no masked entry outranks a real one, and the masked entries per row that still may: ``sc``
        itself when its padding is -inf (the filtered candidates, at most ``extra`` per row, are then skipped by
        a looser floor), else a float copy with every masked entry -inf."""
        if sc.dtype.kind == "f" and (self.pad_pos.size == 0 or (sc.ravel()[self.pad_pos] == -np.inf).all()):
            return sc, self.filtered_per_row
        work = sc.astype(np.result_type(sc.dtype, np.float32) if sc.dtype.kind == "f" else np.float64)
        if self.masked is not None:
            np.copyto(work, -np.inf, where=self.masked)
        return work, 0

    def rank(self, sc: np.ndarray) -> _Ranked:
        """The block ranked by ``sc`` (score descending, ties by the smaller id), top ``kmax``, as a Block."""
        k, w = self.s.kmax, self.ids.shape[1]
        sc = np.ascontiguousarray(sc)
        if self.filtered.size and np.isnan(sc.ravel()[self.filtered]).any():
            raise ValueError(_NAN_ERROR)
        work, extra = self.worst_masked(sc)
        f = np.flatnonzero(work >= row_floor(work, k + extra)[:, None])
        if self.masked is not None:
            f = f[~self.masked.ravel()[f]]
        r = f // max(w, 1)
        order = candidate_order(r, neg_scores(sc.ravel()[f]), self.ids.ravel()[f])
        f, r = f[order], r[order]
        counts = np.bincount(r, minlength=self.nb)
        rank = np.arange(f.size) - (np.cumsum(counts) - counts)[r]
        top = rank < k
        f, r, rank = f[top], r[top], rank[top]
        bT = np.full((k, self.nb), -1, dtype=np.int64)
        hT = np.zeros((k, self.nb), dtype=bool)
        bT[rank, r] = self.ids.ravel()[f]
        hT[rank, r] = self.rel.ravel()[f]
        if self.dups:
            bT = np.ascontiguousarray(dedup(np.ascontiguousarray(bT.T)).T)
            hT &= bT >= 0
        return _Ranked(self, bT, hT)


class FixedShortlistMetrics:
    """``evaluate_families(families, ids, Y_true, ks, inv_prop, filter_pairs, scores)`` for many ``scores`` of
    one shortlist ``ids``, its score-free work done here once."""

    def __init__(self, families: Sequence[str], ids: np.ndarray, Y_true: sp.spmatrix, ks: Sequence[int],
                 inv_prop: np.ndarray | None = None, filter_pairs: np.ndarray | None = None,
                 block_rows: int = _DEFAULT_BLOCK) -> None:
        unknown = [f for f in families if f not in _SUPPORTED]
        if unknown:
            raise ValueError(f"unsupported metric families {unknown}; supported are {list(_SUPPORTED)}")
        Y = as_targets(Y_true)
        if sp.issparse(ids):
            raise ValueError("ids must be an (n, K) array of label ids, not a sparse score matrix")
        pred = check_predictions(ids, None, Y)
        self.ks = [int(k) for k in ks]
        if not self.ks or any(k < 1 for k in self.ks):
            raise ValueError(f"ks must be non-empty and all >= 1, got {list(ks)}")
        ip = check_inv_prop(inv_prop, Y)
        if ip is None and any(f in PROPENSITY_FAMILIES for f in families):
            raise ValueError(f"{', '.join(families)} need inv_prop, the labels' inverse propensities")
        self.families, self.shape = list(families), pred.shape
        self.s = Setup(self.ks, Y.shape[1], ip, Y.nnz)
        fp = fp_rows = None
        if filter_pairs is not None:
            fp, fp_rows = pairs_by_row(check_pairs(filter_pairs))
        canonical = bool(Y.has_canonical_format)
        self.blocks: list[tuple[int, int, _BlockTruth]] = []
        for r0, r1 in row_blocks(pred.shape[0], block_rows):
            ids_b = np.asarray(pred[r0:r1])
            _check_block_ids(ids_b, Y.shape[1], Y.shape)
            pr, pl = block_pairs(fp, fp_rows, r0, r1)
            truth = _BlockTruth(self.s, ids_b.astype(np.int64, copy=False), Y[r0:r1], canonical, pr, pl)
            self.blocks.append((r0, r1, truth))

    def evaluate(self, scores: np.ndarray) -> dict[str, float]:
        """``{f"{family}_at_{k}": value in [0, 1]}`` of the shortlist ranked by ``scores`` (same shape as ids)."""
        sc = np.asarray(scores)
        if sc.shape != self.shape:
            raise ValueError(f"scores has shape {sc.shape} but indices has shape {self.shape}")
        if not (np.issubdtype(sc.dtype, np.floating) or np.issubdtype(sc.dtype, np.integer) or sc.dtype == np.bool_):
            raise ValueError(f"scores must be real numbers, got dtype {sc.dtype}")
        accs = [FAMILIES[f](self.s) for f in self.families]
        n_used = 0
        for r0, r1, truth in self.blocks:
            b = truth.rank(sc[r0:r1])
            n_used += b.nb
            for acc in accs:
                acc.add(b)
        out: dict[str, float] = {}
        for name, acc in zip(self.families, accs):
            vals = acc.value(n_used)
            for j, k in enumerate(self.ks):
                out[f"{name}_at_{k}"] = float(np.clip(vals[j], 0.0, 1.0))
        return out
