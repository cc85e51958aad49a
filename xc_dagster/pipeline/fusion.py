"""Stage ``fusion``: the score fusion fitted on the shortlists of the validation points carved from train
(SiameseXML's alpha blend or NGAME's tree), saved as plain JSON."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from xc_dagster.artifacts import FUSION, SUMMARY
from xc_dagster.data.splits import validation_targets
from xc_dagster.pipeline.context import StageContext
from xc_dagster.retrieval.fusion import check_method, fit_fusion, missed_positive_features
from xc_dagster.retrieval.shortlist import Shortlist, ShortlistSources, retrieve
from xc_dagster.storage import save_json


def filter_rows(pairs: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Filter pairs of ``rows`` (original row ids) re-indexed to positions within ``rows``."""
    pos = np.full(int(max(pairs[:, 0].max(initial=-1), rows.max(initial=-1))) + 1, -1, dtype=np.int64)
    pos[rows] = np.arange(len(rows))
    keep = pairs[:, 0] < len(pos)
    p = pairs[keep]
    new = pos[p[:, 0]]
    ok = new >= 0
    return np.stack([new[ok], p[ok, 1]], axis=1) if ok.any() else np.zeros((0, 2), dtype=np.int64)


@dataclass
class ValidationShortlists:
    """What the fusion is fitted on: the validation points' shortlists from the held-out model (their own
    points left out of the kNN index and centroids), their targets and filter pairs, the labels' propensities."""

    shortlist: Shortlist
    Y: Any  # csr (validation points x labels)
    filter_pairs: np.ndarray
    inv_prop: np.ndarray
    queries: np.ndarray
    model: ShortlistSources
    unseen_dropped: int


def validation_shortlists(ctx: StageContext) -> ValidationShortlists:
    """Shortlist the validation points as the fusion stage fits on them (also for bench scripts)."""
    ds = ctx.read.labels()
    valid = ctx.read.valid_rows()
    m = ctx.read.shortlist_sources(ctx.cfg.index.hnsw_ef_search, heldout=True)
    q = ctx.read.embeddings("train", mmap=True)[valid]
    # the lexical source's TF-IDF rows of the same points (its kNN leaves the validation points out, as knn's)
    sl = retrieve(q, m, ctx.cfg.index.shortlist_size, lexical_queries=ctx.read.lexical_queries(m, "train", valid))
    # pairs of labels whose only training points are validation points are left out (unseen by the models)
    Yv, pairs, unseen = validation_targets(ds.Y_train, valid, ctx.read.train_rows(ds.num_train),
                                           filter_rows(ds.filter_train, valid))
    return ValidationShortlists(sl, Yv, pairs, ctx.inv_prop(ds.Y_train), q, m, unseen)


def run(ctx: StageContext) -> dict[str, Any]:
    """Fit the score fusion ``fusion.method`` on the held-out validation points' shortlists (deployed indexes).

    The fitted fusion is plain JSON (a tree as arrays), loadable without executing code.
    """
    t0 = time.perf_counter()
    p = ctx.cfg.fusion
    check_method(p.method)  # a bad method fails before any work
    valid = ctx.read.valid_rows()
    if len(valid) == 0:  # alpha 0.5 ranks as the tree's T-free score emb + clf
        fit = {"method": "alpha", "alpha": 0.5, "grid": [], "note": "no validation rows; alpha defaulted"}
        fit_summary = {"method": "alpha", "alpha": 0.5, "note": fit["note"]}
    else:
        vs = validation_shortlists(ctx)
        extra = (missed_positive_features(vs.shortlist, vs.Y, vs.queries, vs.model.W, vs.model.label_repr,
                                          vs.inv_prop)
                 if p.method == "tree" and p.tree_add_positives else None)
        f = fit_fusion(vs.shortlist, vs.Y, p, vs.inv_prop, vs.filter_pairs, extra=extra)
        fit, fit_summary = f.to_dict(), f.summary()
        fit_summary["valid_pairs_unseen_dropped"] = vs.unseen_dropped
    summary = {**fit_summary, "objective": p.objective, "n_valid": int(len(valid)),
               "seconds": time.perf_counter() - t0}
    with ctx.writing() as out:
        save_json(out / FUSION, fit)
        save_json(out / SUMMARY, summary)
    ctx.info(f"fusion {ctx.name}: " + ", ".join(f"{k}={v}" for k, v in fit_summary.items()))
    return summary
