"""Candidate pools of the hardest-negative classifier trainer (NGAME M2/M4, SiameseXML Module IV).

Each step takes, per point of the batch, the ``num`` highest-scoring labels w_l.x under the current W among a
candidate pool, chosen by ``classifier.negatives`` from ``HARD_NEGATIVE_POOLS``: ``shortlist`` = the point's
mined ANNS shortlist (SiameseXML Module IV); ``in-batch`` = every label sampled as a positive by a point of the
batch (NGAME M2: with cluster batches these are labels of similar points); ``both`` = their union (a label in
both counts once). True positives of the point are never negatives.
"""

from __future__ import annotations

from typing import Callable, Protocol

import numpy as np
import scipy.sparse as sp
import torch

from xc_dagster.sampling.labels import positive_mask

Candidates = list[tuple[torch.Tensor, torch.Tensor]]  # (ids (B, C) -1 padded, scores (B, C) -inf padded) parts


class HardNegativePool(Protocol):
    """A pool of negative candidates per point, built as ``cls(Y, shortlist)`` (a new pool: one class and one
    ``HARD_NEGATIVE_POOLS`` line)."""

    uses_shortlist: bool  # whether the candidates come from the shortlist rows (a pool without it: assumed True)

    def candidates(self, x: torch.Tensor, W: torch.Tensor, batch: np.ndarray, pos: np.ndarray) -> Candidates:
        """Candidate label ids and their scores x.w_l for the points ``batch`` (embeddings ``x``), whose sampled
        positives are ``pos`` (-1 padded); positives of the point are -1 / -inf."""


class ShortlistPool:
    """The point's mined shortlist (SiameseXML Module IV)."""

    uses_shortlist = True

    def __init__(self, Y: sp.csr_matrix, shortlist: np.ndarray):
        self.Y, self.shortlist = Y, shortlist

    def candidates(self, x: torch.Tensor, W: torch.Tensor, batch: np.ndarray, pos: np.ndarray) -> Candidates:
        c = self.shortlist[batch].astype(np.int64)
        c = np.where(positive_mask(self.Y, batch, c), -1, c)
        ct = torch.from_numpy(c).to(x.device)
        return [(ct, torch.einsum("bd,bkd->bk", x, W[ct.clamp_min(0)]).masked_fill(ct < 0, float("-inf")))]


class InBatchPool:
    """Every label sampled as a positive in the batch (NGAME M2), scored with one (B x U) matmul;
    ``skip_shortlisted``: not the labels of the point's shortlist (they are candidates already)."""

    uses_shortlist = False

    def __init__(self, Y: sp.csr_matrix, shortlist: np.ndarray, skip_shortlisted: bool = False):
        self.Y, self.shortlist, self.skip_shortlisted = Y, shortlist, skip_shortlisted

    def candidates(self, x: torch.Tensor, W: torch.Tensor, batch: np.ndarray, pos: np.ndarray) -> Candidates:
        u = np.unique(pos[pos >= 0])
        ub = np.broadcast_to(u, (len(batch), len(u)))
        drop = positive_mask(self.Y, batch, ub)
        if self.skip_shortlisted:
            c = self.shortlist[batch]
            r = np.repeat(np.arange(len(batch)), c.shape[1])[c.ravel() >= 0]
            S = sp.csr_matrix((np.ones(len(r), dtype=np.int8), (r, c.ravel()[c.ravel() >= 0])),
                              shape=(len(batch), W.shape[0]))
            drop |= positive_mask(S, np.arange(len(batch)), ub)
        ut = torch.from_numpy(u).to(x.device)
        drop_t = torch.from_numpy(drop).to(x.device)
        return [(ut.expand(len(batch), -1).masked_fill(drop_t, -1), (x @ W[ut].T).masked_fill(drop_t, float("-inf")))]


class ShortlistAndInBatchPool:
    """The union of the shortlist and in-batch pools."""

    uses_shortlist = True

    def __init__(self, Y: sp.csr_matrix, shortlist: np.ndarray):
        self.parts = [ShortlistPool(Y, shortlist), InBatchPool(Y, shortlist, skip_shortlisted=True)]

    def candidates(self, x: torch.Tensor, W: torch.Tensor, batch: np.ndarray, pos: np.ndarray) -> Candidates:
        return [c for part in self.parts for c in part.candidates(x, W, batch, pos)]


HARD_NEGATIVE_POOLS: dict[str, type[HardNegativePool]] = {
    "shortlist": ShortlistPool,
    "in-batch": InBatchPool,
    "both": ShortlistAndInBatchPool,
}


def hardest(pool: HardNegativePool, x: torch.Tensor, W: torch.Tensor, batch: np.ndarray, pos: np.ndarray,
            num: int, reduce: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """The ``num`` hardest negatives (highest w_l.x under the current W) per point of ``batch`` in ``pool``,
    -1 padded. ``reduce``: applied to the pool's scores first (W's label ranges on several ranks: their sum)."""
    with torch.no_grad():
        parts = pool.candidates(x, W, batch, pos)
        cand, sc = torch.cat([ids for ids, _ in parts], 1), torch.cat([s for _, s in parts], 1)
        if reduce is not None:
            sc = reduce(sc)
        top = sc.topk(min(num, sc.shape[1]), dim=1)
        return torch.gather(cand, 1, top.indices).masked_fill(torch.isinf(top.values), -1)


def hardest_negatives(x: torch.Tensor, W: torch.Tensor, batch: np.ndarray, pos: np.ndarray,
                      shortlist: np.ndarray, Y: sp.csr_matrix, mode: str, num: int) -> torch.Tensor:
    """``hardest`` in the ``mode`` pool of ``HARD_NEGATIVE_POOLS``."""
    return hardest(HARD_NEGATIVE_POOLS[mode](Y, shortlist), x, W, batch, pos, num)
