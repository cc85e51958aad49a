"""Stage ``index``: the ANNS indexes of ``index.sources`` that inference shortlists from (NGAME dual MIPS: W and
label embeddings; SiameseXML Module II: label embeddings, label centroids, training-point kNN)."""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from xc_dagster.artifacts import HELDOUT, SUMMARY
from xc_dagster.errors import XCConfigError
from xc_dagster.pipeline.context import StageContext
from xc_dagster.retrieval.ann import LabelIndex
from xc_dagster.retrieval.shortlist import (
    KNN_EXCLUDED_FILE,
    build_sources,
    check_label_repr,
    check_sources,
    label_centroids,
    save_parts,
    save_sources,
)
from xc_dagster.storage import save_json


def _check(p: Any) -> None:
    check_sources(p.sources, "index.sources")
    check_label_repr(p.label_repr, "index.label_repr")
    if not (isinstance(p.knn_neighbours, int) and p.knn_neighbours >= 0):
        raise XCConfigError(f"index.knn_neighbours: expected an int >= 0, got {p.knn_neighbours!r}")
    if not isinstance(p.include_validation, bool):
        raise XCConfigError(f"index.include_validation: expected true or false, got {p.include_validation!r}")


def run(ctx: StageContext) -> dict[str, Any]:
    """Build and save the indexes; with ``index.include_validation`` the deployed kNN index and centroids hold
    every training point, and ``heldout/`` what the fusion is fitted with: the centroids without the validation
    points and the kNN rows to exclude (the deployed kNN index searched without them: no second build)."""
    p = ctx.cfg.index
    _check(p)
    t0 = time.perf_counter()
    W = ctx.read.W()
    label_emb = ctx.read.embeddings("label")
    need_centroids = "centroid" in p.sources or p.label_repr == "text+centroid"
    centroids = point_emb = knn_labels = h_centroids = None
    heldout = False  # the fusion is fitted without the validation points (index/heldout/)
    if need_centroids or "knn" in p.sources:
        ds = ctx.read.labels()
        rows = ctx.read.train_rows(ds.num_train)
        # from the deployed encoder's embeddings: mining's centroids are stale once ASTRA/MIPS-s fine-tuned it
        train_emb = ctx.read.embeddings("train", mmap=True)
        heldout = p.include_validation and len(rows) < ds.num_train
        deployed = np.arange(ds.num_train) if heldout else rows
        if need_centroids:
            centroids = label_centroids(train_emb, ds.Y_train, deployed)
            h_centroids = label_centroids(train_emb, ds.Y_train, rows) if heldout else None
        if "knn" in p.sources:
            point_emb, knn_labels = np.asarray(train_emb[deployed]), ds.Y_train[deployed]
    src = build_sources(p.sources, W, label_emb, centroids, point_emb, knn_labels, p.label_repr, p.kind,
                        p.hnsw_m, p.hnsw_ef_construction, p.hnsw_ef_search)
    with ctx.writing() as out:
        save_sources(src, out, centroids)
        summary = {"kind": p.kind, "sources": list(p.sources), "label_repr": p.label_repr,
                   "labels": int(len(W)), "dim": int(W.shape[1]),
                   "knn_points": int(point_emb.shape[0]) if point_emb is not None else 0,
                   "knn_neighbours": int(p.knn_neighbours) if "knn" in p.sources else 0}
        if heldout:  # what the fusion is fitted with: the same parts without the validation points
            held = out / HELDOUT
            save_parts(held, {"centroid": LabelIndex(p.kind, h_centroids, m=p.hnsw_m,
                                                     ef_construction=p.hnsw_ef_construction,
                                                     ef_search=p.hnsw_ef_search)} if "centroid" in p.sources else {},
                       None, h_centroids)
            if "knn" in p.sources:
                np.save(held / KNN_EXCLUDED_FILE, np.setdiff1d(np.arange(ds.num_train), rows))
            summary["heldout_knn_points"] = int(len(rows)) if "knn" in p.sources else 0
        summary["seconds"] = time.perf_counter() - t0
        save_json(out / SUMMARY, summary)
    return summary
