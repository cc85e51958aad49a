"""The metric families of :mod:`xc_dagster.evaluation.metrics` as streaming sums over row blocks (private).

Each family (``FAMILIES``: precision, nDCG, recall, their propensity-scored versions, coverage, correct coverage)
is a small accumulator: ``add`` takes one :class:`Block` of ranked predictions against its truth, ``value`` gives
its metric at every k. The per-block arrays several families use (hit counts within the top k, the
propensity-weighted hits, the ideal propensity ranking) are computed once per block, rank-major ((kmax, nb),
so every step is a vector operation over the block's rows).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import cached_property

import numpy as np
import scipy.sparse as sp

from xc_dagster.evaluation._ranking import hits, row_blocks, true_keys

PROPENSITY_FAMILIES = ("psprecision", "psndcg", "psrecall")


class Setup:
    """What every family needs for one evaluation: the ks, their rank discounts, the inverse propensities."""

    def __init__(self, ks: list[int], L: int, ip: np.ndarray | None, nnz: int) -> None:
        self.ks, self.L, self.ip = ks, L, ip
        self.kmax = max(ks)
        self.ks_arr = np.asarray(ks)
        self.disc = 1.0 / np.log2(np.arange(2, self.kmax + 2, dtype=np.float64))
        self.cum_disc = np.cumsum(self.disc)
        self.upto = np.arange(self.kmax)[:, None] < self.ks_arr[None, :]  # (kmax, nk): rank j counts for k
        self.rank_dtype = np.int16 if self.kmax < 2**15 else np.int64
        self.label_rank = self.ip_desc = None
        if ip is not None and L <= 8 * nnz:  # worth one sort of all labels: rows then sort by int keys
            by_ip = np.argsort(-ip, kind="stable")  # labels by ip descending
            self.label_rank = np.empty(L, dtype=np.int64)
            self.label_rank[by_ip] = np.arange(L)
            self.ip_desc = ip[by_ip]


def prefix_sums(xT: np.ndarray, ks: Sequence[int]) -> np.ndarray:
    """``out[c, i] = sum_{j < ks[c]} xT[j, i]`` for a rank-major (kmax, nb) array: per-row sums at each k.

    A running sum over the ranks (a loop over at most kmax ranks, vectorised over rows); see
    docs/decisions.md#metrics-running-sums-over-ranks.
    """
    want = set(ks)
    run = np.zeros(xT.shape[1], dtype=np.float64)
    at: dict[int, np.ndarray] = {}
    for j in range(max(ks)):
        run += xT[j]
        if j + 1 in want:
            at[j + 1] = run.copy()
    return np.stack([at[k] for k in ks])


class Block:
    """One row block: ranked predictions (nb, kmax) against the block of ``Y``, rank-major, plus the positives.

    With ``drop_empty_rows`` the rows without positives are removed (and the positives' rows renumbered).
    """

    def __init__(self, s: Setup, b_idx: np.ndarray, Yb: sp.csr_matrix, canonical: bool,
                 drop_empty_rows: bool) -> None:
        self.s = s
        nb, L = b_idx.shape[0], s.L
        keys = true_keys(Yb, canonical)
        t_rows = keys // L
        self.t_lab = keys - t_rows * L  # label of each positive
        npos = np.bincount(t_rows, minlength=nb)
        hit = hits(b_idx, keys, L)
        if drop_empty_rows and not (npos > 0).all():
            use = npos > 0
            b_idx, hit, npos = b_idx[use], hit[use], npos[use]
            t_rows = np.cumsum(use)[t_rows] - 1  # renumber the kept rows (all rows with positives)
        self.nb, self.npos, self.t_rows = b_idx.shape[0], npos, t_rows
        self.bT = np.ascontiguousarray(b_idx.T)
        self.hT = np.ascontiguousarray(hit.T)

    @cached_property
    def hf(self) -> np.ndarray:
        return self.hT.astype(np.float64)

    @cached_property
    def hit_counts(self) -> np.ndarray:
        """(nk, nb) hits within the top k."""
        return prefix_sums(self.hf, self.s.ks)

    @cached_property
    def has(self) -> np.ndarray:
        return self.npos > 0

    @cached_property
    def ip_hits(self) -> np.ndarray:
        """(kmax, nb) inverse propensity of the hit at each rank (0 where none)."""
        return np.where(self.hT, self.s.ip[np.maximum(self.bT, 0)], 0.0)

    @cached_property
    def ip_hit_sums(self) -> np.ndarray:
        """(nk, nb) summed inverse propensities of the hits within the top k."""
        return prefix_sums(self.ip_hits, self.s.ks)

    @cached_property
    def ideal_by_rank(self) -> np.ndarray:
        """(kmax,) sum over rows of the r-th largest inverse propensity among each row's positives."""
        s, t_rows, npos = self.s, self.t_rows, self.npos
        t_val = s.ip[self.t_lab]
        if s.label_rank is not None:
            sorted_keys = np.sort(t_rows * s.L + s.label_rank[self.t_lab])
            t_r = sorted_keys // s.L
            t_val_sorted = s.ip_desc[sorted_keys - t_r * s.L]
        else:
            order = np.lexsort((-t_val, t_rows))
            t_r, t_val_sorted = t_rows[order], t_val[order]
        rank_in_row = np.arange(t_r.size) - (np.cumsum(npos) - npos)[t_r]
        top = rank_in_row < s.kmax
        return np.bincount(rank_in_row[top], weights=t_val_sorted[top], minlength=s.kmax)


def _mean(v: np.ndarray, n_used: int) -> np.ndarray:
    return v / n_used if n_used else np.zeros_like(v)


def _ratio(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    return np.where(den > 0, num / np.where(den > 0, den, 1.0), 0.0)


class Precision:
    """P@k = mean_i hits@k / k."""

    def __init__(self, s: Setup) -> None:
        self.s, self.sum = s, np.zeros(len(s.ks))

    def add(self, b: Block) -> None:
        self.sum += b.hit_counts.sum(axis=1) / self.s.ks_arr

    def value(self, n_used: int) -> np.ndarray:
        return _mean(self.sum, n_used)


class NDCG(Precision):
    """nDCG@k = mean_i DCG@k / IDCG@k, discount 1 / log2(rank + 1), IDCG over min(k, |y_i|) positives."""

    def add(self, b: Block) -> None:
        s, has = self.s, b.has
        n_ideal = np.minimum(b.npos[has][None, :], s.ks_arr[:, None])  # min(k, |y_i|) >= 1
        dcg = prefix_sums(b.hf * s.disc[:, None], s.ks)
        self.sum += (dcg[:, has] / s.cum_disc[n_ideal - 1]).sum(axis=1)


class Recall(Precision):
    """R@k = mean_i hits@k / |y_i|."""

    def add(self, b: Block) -> None:
        self.sum += (b.hit_counts[:, b.has] / b.npos[b.has]).sum(axis=1)


class PSRecall(Precision):
    """PSR@k = mean_i (sum of ip over hits@k) / (sum of ip over y_i): per-row ratios averaged."""

    def add(self, b: Block) -> None:
        ip_total = np.bincount(b.t_rows, weights=self.s.ip[b.t_lab], minlength=b.nb)
        pos_ip = ip_total > 0
        self.sum += (b.ip_hit_sums[:, pos_ip] / ip_total[pos_ip]).sum(axis=1)


class PSPrecision:
    """PSP@k = mean_i (sum of ip over hits@k) / k over mean_i (sum of the top-min(k, |y_i|) ip of y_i) / k: a
    ratio of means (pyxclib), not a mean of per-row ratios."""

    def __init__(self, s: Setup) -> None:
        self.s, self.num, self.den = s, np.zeros(len(s.ks)), np.zeros(len(s.ks))

    def add(self, b: Block) -> None:
        self.num += b.ip_hit_sums.sum(axis=1) / self.s.ks_arr
        self.den += (self.s.upto * b.ideal_by_rank[:, None]).sum(axis=0) / self.s.ks_arr

    def value(self, n_used: int) -> np.ndarray:
        return _ratio(self.num, self.den)


class PSNDCG(PSPrecision):
    """PSnDCG@k: as PSP@k, with the rank discount in the numerator and in the ideal denominator."""

    def add(self, b: Block) -> None:
        s = self.s
        self.num += (s.upto * (b.ip_hits.sum(axis=1) * s.disc)[:, None]).sum(axis=0)
        self.den += (s.upto * (b.ideal_by_rank * s.disc)[:, None]).sum(axis=0)


class Coverage:
    """coverage@k = |labels predicted in the top k of at least one row| / L."""

    def __init__(self, s: Setup) -> None:
        self.s = s
        self.best = np.full(s.L, s.kmax, dtype=s.rank_dtype)  # best 0-based rank of each label

    def labels_at(self, b: Block, j: int) -> np.ndarray:
        lab = b.bT[j]
        return lab[lab >= 0]

    def add(self, b: Block) -> None:
        for j in range(self.s.kmax):  # a loop over ranks, not rows
            lab = self.labels_at(b, j)
            self.best[lab] = np.minimum(self.best[lab], j)

    def value(self, n_used: int) -> np.ndarray:
        L = self.s.L
        return np.array([np.count_nonzero(self.best < k) / L if L else 0.0 for k in self.s.ks])


class CorrectCoverage(Coverage):
    """correct coverage@k = |labels that are a hit in the top k of at least one row| / |labels with a positive|
    (tail-label coverage)."""

    def __init__(self, s: Setup) -> None:
        super().__init__(s)
        self.has_pos = np.zeros(s.L, dtype=bool)

    def labels_at(self, b: Block, j: int) -> np.ndarray:
        return b.bT[j][b.hT[j]]

    def add(self, b: Block) -> None:
        self.has_pos[b.t_lab] = True
        super().add(b)

    def value(self, n_used: int) -> np.ndarray:
        n_pos_labels = int(self.has_pos.sum())
        return np.array([np.count_nonzero(self.best < k) / n_pos_labels if n_pos_labels else 0.0
                         for k in self.s.ks])


FAMILIES = {"precision": Precision, "ndcg": NDCG, "recall": Recall, "psprecision": PSPrecision,
            "psndcg": PSNDCG, "psrecall": PSRecall, "coverage": Coverage, "correct_coverage": CorrectCoverage}


def accumulate(ranked: Callable[[int, int], np.ndarray], Y: sp.csr_matrix, ks: list[int], ip: np.ndarray | None,
               block_rows: int, drop_empty_rows: bool, families: Sequence[str]) -> dict[str, float]:
    """``{f"{family}_at_{k}": value in [0, 1]}`` of ``families`` (in that order), streamed over row blocks of the
    ranked (nb, max(ks)) predictions ``ranked(r0, r1)``."""
    n, L = Y.shape
    s = Setup(ks, L, ip, Y.nnz)
    accs = [FAMILIES[f](s) for f in families]
    canonical = bool(Y.has_canonical_format)
    n_used = 0
    for r0, r1 in row_blocks(n, block_rows):
        b = Block(s, ranked(r0, r1), Y[r0:r1], canonical, drop_empty_rows)
        n_used += b.nb
        for acc in accs:
            acc.add(b)
    out: dict[str, float] = {}
    for name, acc in zip(families, accs):
        vals = acc.value(n_used)
        for j, k in enumerate(ks):
            out[f"{name}_at_{k}"] = float(np.clip(vals[j], 0.0, 1.0))
    return out
