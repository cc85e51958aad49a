"""Stage ``fusion``: the score fusion fitted on the shortlists of the validation points carved from train
(SiameseXML's alpha blend or NGAME's tree), saved as plain JSON."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from xc_dagster.artifacts import FUSION, SUMMARY
from xc_dagster.data.splits import filter_rows, validation_targets
from xc_dagster.errors import XCConfigError
from xc_dagster.pipeline.context import StageContext
from xc_dagster.pipeline.cross_fit import FIT_ON, cross_fit_shortlists
from xc_dagster.retrieval.fusion import check_method, fit_fusion, missed_positive_features
from xc_dagster.retrieval.shortlist import Shortlist, ShortlistSources, retrieve
from xc_dagster.storage import save_json


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


def fit_on(ctx: StageContext, n_valid: int) -> str:
    """What ``fusion.fit_on`` resolves to: "validation", "cross_fit", or "none" (no validation points and
    cross-fitting not asked for: a default blend)."""
    choice = ctx.cfg.fusion.fit_on
    if choice not in FIT_ON:
        raise XCConfigError(f"fusion.fit_on: expected one of {' | '.join(FIT_ON)}, got {choice!r}")
    if choice == "auto":
        return "validation" if n_valid else "cross_fit"
    return "none" if choice == "validation" and not n_valid else choice


def _fit(ctx: StageContext, how: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The fitted fusion's ``to_dict`` and summary, fitted on validation or cross-fitted."""
    p = ctx.cfg.fusion
    tree_extra = p.method == "tree" and p.tree_add_positives
    if how == "cross_fit":
        inv_prop = ctx.inv_prop(ctx.read.labels().Y_train)
        cf = cross_fit_shortlists(ctx, inv_prop, missed_positive_features if tree_extra else None)
        f = fit_fusion(cf.shortlist, cf.Y, p, inv_prop, cf.filter_pairs, extra=cf.extra)
        return f.to_dict(), {**f.summary(), "valid_pairs_unseen_dropped": cf.unseen_dropped,
                             "cross_fit_folds": p.cross_fit_folds, "cross_fit_points": cf.points}
    vs = validation_shortlists(ctx)
    extra = (missed_positive_features(vs.shortlist, vs.Y, vs.queries, vs.model.W, vs.model.label_repr, vs.inv_prop)
             if tree_extra else None)
    f = fit_fusion(vs.shortlist, vs.Y, p, vs.inv_prop, vs.filter_pairs, extra=extra)
    return f.to_dict(), {**f.summary(), "valid_pairs_unseen_dropped": vs.unseen_dropped}


def run(ctx: StageContext) -> dict[str, Any]:
    """Fit the score fusion ``fusion.method`` on the held-out validation points' shortlists (deployed indexes),
    or cross-fitted over folds of the training points (``fusion.fit_on``).

    The fitted fusion is plain JSON (a tree as arrays), loadable without executing code.
    """
    t0 = time.perf_counter()
    p = ctx.cfg.fusion
    check_method(p.method)  # a bad method fails before any work
    valid = ctx.read.valid_rows()
    how = fit_on(ctx, len(valid))
    if how == "none":  # alpha 0.5 ranks as the tree's T-free score emb + clf
        fit = {"method": "alpha", "alpha": 0.5, "grid": [], "note": "no validation rows; alpha defaulted"}
        fit_summary = {"method": "alpha", "alpha": 0.5, "note": fit["note"]}
    else:
        fit, fit_summary = _fit(ctx, how)
    summary = {**fit_summary, "objective": p.objective, "fit_on": how, "n_valid": int(len(valid)),
               "seconds": time.perf_counter() - t0}
    with ctx.writing() as out:
        save_json(out / FUSION, fit)
        save_json(out / SUMMARY, summary)
    ctx.info(f"fusion {ctx.name}: " + ", ".join(f"{k}={v}" for k, v in fit_summary.items()))
    return summary
