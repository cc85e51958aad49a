"""Cross-fitting the fusion (``fusion.fit_on``): every training point scored by models fitted without its fold.

A small dataset's validation split holds a few hundred points: too few to fit the fusion's weights on, and too
many to take from training. Cross-fitting instead splits the training points into K folds; for each fold, the
classifiers are retrained on the other folds (the encoder is shared: retraining it K times would not fit a
budget), and the fold's points are shortlisted with those classifiers, the label centroids of the other folds and
the kNN and lexical neighbours among the other folds. The fusion is fitted on all folds' shortlists together
(docs/decisions.md#fusion-cross-fitting).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np
import scipy.sparse as sp

from xc_dagster.data.splits import cross_fit_folds, filter_rows, validation_targets
from xc_dagster.errors import XCConfigError
from xc_dagster.pipeline.classifier import fold_trainer
from xc_dagster.pipeline.context import StageContext
from xc_dagster.retrieval.ann import LabelIndex
from xc_dagster.retrieval.shortlist import (
    Shortlist,
    ShortlistSources,
    label_centroids,
    label_representation,
    retrieve,
)
from xc_dagster.retrieval.votes import Votes, with_votes

FIT_ON = ("auto", "validation", "cross_fit")


def concat_shortlists(parts: list[Shortlist]) -> Shortlist:
    """The shortlists of several query sets, one after the other (every part of the same width)."""

    def cat(name: str) -> np.ndarray | None:
        arrays = [getattr(p, name) for p in parts]
        return None if arrays[0] is None else np.concatenate(arrays)

    return Shortlist(*(cat(f.name) for f in dataclasses.fields(Shortlist)))


def fit_on(ctx: StageContext, n_valid: int) -> str:
    """What ``fusion.fit_on`` resolves to: "validation", "cross_fit", or "none" (no validation points and
    cross-fitting not asked for: a default blend)."""
    choice = ctx.cfg.fusion.fit_on
    if choice not in FIT_ON:
        raise XCConfigError(f"fusion.fit_on: expected one of {' | '.join(FIT_ON)}, got {choice!r}")
    if choice == "auto":
        return "validation" if n_valid else "cross_fit"
    return "none" if choice == "validation" and not n_valid else choice


def fold_sources(m: ShortlistSources, W: np.ndarray, point_emb: np.ndarray, label_emb: np.ndarray,
                 Y: sp.csr_matrix, keep: np.ndarray, left_out: np.ndarray, index_rows: np.ndarray,
                 index_info: dict[str, Any], ann: dict[str, int]) -> ShortlistSources:
    """The deployed sources ``m`` as a fold's models see them: W (and its index) from the fold's classifiers,
    label centroids over ``keep`` only, and the kNN / lexical neighbours without the ``left_out`` rows
    (``index_rows``: the training point of each kNN / lexical index row)."""
    indexes = dict(m.indexes)
    if "W" in indexes:
        indexes["W"] = LabelIndex(index_info["kind"], W, **ann)
    rep_kind, rep = index_info.get("label_repr", "text"), m.label_repr
    if "centroid" in indexes or rep_kind == "text+centroid":
        centroids = label_centroids(point_emb, Y, keep)
        if "centroid" in indexes:
            indexes["centroid"] = LabelIndex(index_info["kind"], centroids, **ann)
        rep = label_representation(label_emb, centroids, rep_kind)
    # the fold's rows as positions in the kNN / lexical index, with the rows the sources already leave out
    pos = np.flatnonzero(np.isin(index_rows, left_out))
    excluded = pos if m.knn_excluded is None else np.union1d(pos, m.knn_excluded)
    return dataclasses.replace(m, W=W, label_repr=rep, indexes=indexes, knn_excluded=excluded.astype(np.int64))


@dataclasses.dataclass
class CrossFitShortlists:
    """What the fusion is fitted on when cross-fitted: the out-of-fold shortlists of the scored training points,
    their targets and filter pairs, and (NGAME's tree) the descriptors of the positives each shortlist missed."""

    shortlist: Shortlist
    Y: sp.csr_matrix
    filter_pairs: np.ndarray
    unseen_dropped: int
    points: int
    extra: tuple[np.ndarray, np.ndarray] | None


def cross_fit_shortlists(ctx: StageContext, inv_prop: np.ndarray, missed: Any = None,
                         candidates: Sequence[Votes | None] = (None,)) -> list[CrossFitShortlists]:
    """Shortlist every fold's scored points with the models fitted without the fold (``fusion.cross_fit_*``),
    once per candidate of the kNN votes (None: the index stage's; each fold's classifiers trained once);
    ``missed(sl, Y, queries, W, label_repr, inv_prop)``: the tree's missed-positive descriptors, or None."""
    f, ip = ctx.cfg.fusion, ctx.cfg.index
    ds = ctx.read.labels()
    rows = ctx.read.train_rows(ds.num_train)  # the points the deployed models trained on
    held = len(rows) < ds.num_train  # a validation split exists (fit_on=cross_fit): its points stay left out
    m = ctx.read.shortlist_sources(ip.hnsw_ef_search, heldout=held)
    info = ctx.read.summary("index")
    index_rows = np.arange(ds.num_train) if info.get("knn_points", 0) == ds.num_train else rows
    point_emb, label_emb = ctx.read.embeddings("train", mmap=True), ctx.read.embeddings("label")
    ann = {"m": ip.hnsw_m, "ef_construction": ip.hnsw_ef_construction, "ef_search": ip.hnsw_ef_search}
    folds = cross_fit_folds(rows, f.cross_fit_folds, f.cross_fit_max_points, f.seed)
    offsets = np.cumsum([0] + [len(scored) for _, scored in folds])
    # read once for every fold: the fold trainer's inputs and the scored points' lexical rows
    train = fold_trainer(ctx, ds, label_emb)
    lex = ctx.read.lexical_queries(m, "train", np.concatenate([scored for _, scored in folds]))
    # per fold, per candidate: (shortlist, targets, filter pairs, unseen pairs, missed positives)
    from_folds = [_score_fold(ctx, m, train, rows, fold, scored, None if lex is None else lex[a:b], point_emb,
                              label_emb, ds, index_rows, info, ann, inv_prop, missed, candidates)
                  for (fold, scored), a, b in zip(folds, offsets[:-1], offsets[1:])]
    return [_joined([fold[c] for fold in from_folds], offsets, missed is not None) for c in range(len(candidates))]


def _joined(parts: list[tuple], offsets: np.ndarray, missed: bool) -> CrossFitShortlists:
    """One candidate's folds (``_score_fold``'s tuples, in fold order) as one set of scored points."""
    pairs = np.concatenate([p[2] + [o, 0] for p, o in zip(parts, offsets)])
    extra = None
    if missed:
        extra = (np.concatenate([p[4][0] + o for p, o in zip(parts, offsets)]),
                 np.concatenate([p[4][1] for p in parts]))
    return CrossFitShortlists(concat_shortlists([p[0] for p in parts]), sp.vstack([p[1] for p in parts], format="csr"),
                              pairs, int(sum(p[3] for p in parts)), int(offsets[-1]), extra)


def _score_fold(ctx: StageContext, m: ShortlistSources, train: Any, rows: np.ndarray, fold: np.ndarray,
                scored: np.ndarray, lexical_rows: Any, point_emb: np.ndarray, label_emb: np.ndarray, ds: Any,
                index_rows: np.ndarray, info: dict[str, Any], ann: dict[str, int], inv_prop: np.ndarray,
                missed: Any, candidates: Sequence[Votes | None]) -> list[tuple]:
    """One fold: its classifiers trained (``train``) on the other folds, its scored points (with their lexical
    rows) shortlisted by them, once per vote candidate."""
    keep = np.setdiff1d(rows, fold)
    W = train(keep) if m.dense else m.W  # not dense: W's scores are 0, nothing to train
    src = fold_sources(m, W, point_emb, label_emb, ds.Y_train, keep, fold, index_rows, info, ann)
    q = np.asarray(point_emb[scored], dtype=np.float32)
    Y, pairs, unseen = validation_targets(ds.Y_train, scored, keep, filter_rows(ds.filter_train, scored))
    out = []
    for votes in candidates:
        sl = retrieve(q, with_votes(src, votes), ctx.cfg.index.shortlist_size, lexical_queries=lexical_rows)
        extra = missed(sl, Y, q, W, src.label_repr, inv_prop) if missed is not None else None
        out.append((sl, Y, pairs, unseen, extra))
    ctx.info(f"fusion {ctx.name}: cross-fitting fold of {len(fold)} points ({len(scored)} scored)")
    return out
