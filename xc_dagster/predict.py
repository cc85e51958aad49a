"""Inference: shortlist from the ANNS indexes, exact re-scoring, fusion, top-k.

Dual MIPS (NGAME): the union of the top neighbours of the query embedding among the classifiers W and among
the label embeddings is the shortlist; each candidate gets its classifier score w_l.e and embedding score
z_l.e, which the fitted fusion combines. Work is done in row blocks so memory stays bounded.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from xc_dagster.ann import LabelIndex
from xc_dagster.sampling import dedupe_rows


@dataclass
class Shortlist:
    ids: np.ndarray  # (n, C) int64, -1 padded, unique per row
    clf: np.ndarray  # (n, C) float32 classifier scores w_l.e (-inf on padding)
    emb: np.ndarray  # (n, C) float32 embedding scores z_l.e (-inf on padding)


def shortlist(queries: np.ndarray, W: np.ndarray, label_emb: np.ndarray, w_index: LabelIndex,
              e_index: LabelIndex, k: int, block: int = 1024) -> Shortlist:
    """Union of the two indexes' top-k per query, with both scores of every candidate."""
    n = len(queries)
    ids_all = np.full((n, 2 * k), -1, dtype=np.int64)
    clf_all = np.full((n, 2 * k), -np.inf, dtype=np.float32)
    emb_all = np.full((n, 2 * k), -np.inf, dtype=np.float32)
    Wt = torch.from_numpy(np.ascontiguousarray(W, dtype=np.float32))
    Et = torch.from_numpy(np.ascontiguousarray(label_emb, dtype=np.float32))
    for s in range(0, n, block):
        q = np.ascontiguousarray(queries[s:s + block], dtype=np.float32)
        _, a = w_index.search(q, k)
        _, b = e_index.search(q, k)
        ids = dedupe_rows(np.concatenate([a, b], axis=1))
        safe = torch.from_numpy(np.maximum(ids, 0))
        qt = torch.from_numpy(q)
        clf = torch.einsum("bd,bkd->bk", qt, Wt[safe]).numpy()
        emb = torch.einsum("bd,bkd->bk", qt, Et[safe]).numpy()
        pad = ids < 0
        ids_all[s:s + len(q)] = ids
        clf_all[s:s + len(q)] = np.where(pad, -np.inf, clf)
        emb_all[s:s + len(q)] = np.where(pad, -np.inf, emb)
    return Shortlist(ids_all, clf_all, emb_all)


def fuse(sl: Shortlist, alpha: float) -> np.ndarray:
    """Fused score a * classifier + (1 - a) * embedding; -inf on padding."""
    with np.errstate(invalid="ignore"):
        s = alpha * sl.clf + (1.0 - alpha) * sl.emb
    return np.where(sl.ids < 0, -np.inf, s).astype(np.float32)


def topk_from_scores(ids: np.ndarray, scores: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Top-k (ids, scores) per row by score descending, ties broken by smaller label id; -1 padded."""
    tie = np.where(ids < 0, np.iinfo(np.int64).max, ids)
    order = np.lexsort((tie, -scores), axis=1)[:, :k]
    out_ids = np.take_along_axis(ids, order, 1)
    out_s = np.take_along_axis(scores, order, 1)
    out_ids = np.where(np.isfinite(out_s), out_ids, -1)
    if out_ids.shape[1] < k:
        pad = k - out_ids.shape[1]
        out_ids = np.pad(out_ids, ((0, 0), (0, pad)), constant_values=-1)
        out_s = np.pad(out_s, ((0, 0), (0, pad)), constant_values=-np.inf)
    return out_ids, out_s
