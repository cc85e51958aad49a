"""Stage ``fusion``: the score fusion fitted on the shortlists of the validation points carved from train
(SiameseXML's alpha blend or NGAME's tree), saved as plain JSON; fitted once per candidate of the sources --
each (K, p) of ``fusion.vote_grid``, with and without the lexical classifiers -- and the best kept with its choice
(``xc_dagster.retrieval.fitted_sources``). Under ``train.budget_minutes`` a further candidate is fitted only while
the budget's end is not projected to pass (``fusion_deadline``)."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from xc_dagster.artifacts import FUSION, SUMMARY
from xc_dagster.data.splits import filter_rows, validation_targets
from xc_dagster.errors import XCConfigError
from xc_dagster.pipeline.context import StageContext
from xc_dagster.pipeline.cross_fit import cross_fit_shortlists, fit_on
from xc_dagster.retrieval import votes
from xc_dagster.retrieval.fitted_sources import Choice, choices, with_choice
from xc_dagster.retrieval.fusion import check_method, fit_fusion, missed_positive_features
from xc_dagster.retrieval.shortlist import Shortlist, ShortlistSources, retrieve
from xc_dagster.retrieval.votes import Votes, parse_vote_grid
from xc_dagster.storage import save_json
from xc_dagster.training.budget import stage_deadline


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


def validation_shortlists(ctx: StageContext, candidates: Sequence[Choice] = (Choice(),)
                          ) -> Iterator[ValidationShortlists]:
    """Shortlist the validation points as the fusion stage fits on them (also for bench scripts), once per
    candidate of the sources (``Choice()``: the index stage's), one candidate's shortlists held at a time; the
    sources, queries and targets are read once."""
    ds = ctx.read.labels()
    valid = ctx.read.valid_rows()
    m = ctx.read.shortlist_sources(ctx.cfg.index.hnsw_ef_search, heldout=True)
    q = ctx.read.embeddings("train", mmap=True)[valid]
    # the lexical source's TF-IDF rows of the same points (its kNN leaves the validation points out, as knn's)
    lex_q = ctx.read.lexical_queries(m, "train", valid)
    # pairs of labels whose only training points are validation points are left out (unseen by the models)
    Yv, pairs, unseen = validation_targets(ds.Y_train, valid, ctx.read.train_rows(ds.num_train),
                                           filter_rows(ds.filter_train, valid))
    inv_prop = ctx.inv_prop(ds.Y_train)
    for candidate in candidates:
        src = with_choice(m, candidate)
        sl = retrieve(q, src, ctx.cfg.index.shortlist_size, lexical_queries=lex_q)
        yield ValidationShortlists(sl, Yv, pairs, inv_prop, q, src, unseen)


def vote_candidates(ctx: StageContext) -> list[Votes | None]:
    """The (K, p) candidates of ``fusion.vote_grid`` this model is fitted with, by the index stage's sources
    (``xc_dagster.retrieval.votes.vote_candidates``)."""
    sources = ctx.read.summary("index").get("sources", ())
    return votes.vote_candidates(ctx.cfg.fusion.vote_grid, sources, ctx.cfg.explicit)


def source_choices(ctx: StageContext, how: str) -> list[Choice]:
    """The candidates this model's fusion is fitted with: each (K, p) of :func:`vote_candidates`, and each again
    without the lexical classifiers where the index stage trained them and ``fusion.try_without_lexical_classifiers``
    (fitted on validation: a cross-fitted fusion has no lexical classifiers)."""
    lexical = ctx.read.summary("index").get("lexical") or {}
    without = (ctx.cfg.fusion.try_without_lexical_classifiers and how == "validation"
               and bool(lexical.get("classifier_weights")))
    return choices(vote_candidates(ctx), without)


def fusion_deadline(ctx: StageContext, started: float) -> float | None:
    """When the fusion stops fitting further candidates under ``train.budget_minutes``: the budget less what the
    stages before it took (the last of the budgeted stages: nothing kept after it); None without a budget or where
    the user set the candidates (``fusion.vote_grid``, ``fusion.try_without_lexical_classifiers``: they win)."""
    if {"fusion.vote_grid", "fusion.try_without_lexical_classifiers"} & set(ctx.cfg.explicit):
        return None
    return stage_deadline(ctx.cfg.train, ctx.read.spent_before("fusion"), started, 0.0)


def _fits(ctx: StageContext, how: str, candidates: list[Choice],
          deadline: float | None = None) -> list[tuple[Any, dict[str, Any]]]:
    """The fitted fusion and its summary's extra entries, per candidate, fitted on validation or cross-fitted;
    on validation the candidates after the first only while one more, at the mean seconds of those fitted, ends
    by ``deadline`` (the first candidate is the index's sources whole: :func:`choices`)."""
    p = ctx.cfg.fusion
    tree_extra = p.method == "tree" and p.tree_add_positives
    if how == "cross_fit":
        index = ctx.read.summary("index")
        if "cooccurrence" in index.get("sources", ()) or index.get("lexical", {}).get("classifier_weights"):
            raise XCConfigError(f"fusion.fit_on: {ctx.name}'s index stage was built for a fusion fitted on validation: "
                                "its co-occurrence source or lexical classifiers count every training point, which a "
                                "cross-fitted fusion scores; run the index stage again with this fusion.fit_on")
        inv_prop = ctx.inv_prop(ctx.read.labels().Y_train)
        cfs = cross_fit_shortlists(ctx, inv_prop, missed_positive_features if tree_extra else None,
                                   [c.votes for c in candidates])
        return [(fit_fusion(cf.shortlist, cf.Y, p, inv_prop, cf.filter_pairs, extra=cf.extra),
                 {"valid_pairs_unseen_dropped": cf.unseen_dropped, "cross_fit_folds": p.cross_fit_folds,
                  "cross_fit_points": cf.points}) for cf in cfs]
    out, started = [], time.perf_counter()
    for vs in validation_shortlists(ctx, candidates):
        extra = (missed_positive_features(vs.shortlist, vs.Y, vs.queries, vs.model.W, vs.model.label_repr,
                                          vs.inv_prop) if tree_extra else None)
        out.append((fit_fusion(vs.shortlist, vs.Y, p, vs.inv_prop, vs.filter_pairs, extra=extra),
                    {"valid_pairs_unseen_dropped": vs.unseen_dropped}))
        now = time.perf_counter()
        if deadline is not None and len(out) < len(candidates) and now + (now - started) / len(out) > deadline:
            break  # the next candidate's shortlists are never retrieved
    return out


def _fit(ctx: StageContext, how: str, deadline: float | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """The fitted fusion's ``to_dict`` (with the chosen votes and lexical classifiers) and summary: of the
    candidates fitted (:func:`_fits`), the one of the best objective (ties: the one with the classifiers, then the
    earlier)."""
    candidates = source_choices(ctx, how)
    fits = _fits(ctx, how, candidates, deadline)
    values = [f.summary().get("objective_value") for f, _ in fits]
    best = max(range(len(fits)), key=lambda i: (-np.inf if values[i] is None else values[i],
                                                candidates[i].lexical_classifiers, -i))
    f, extra = fits[best]
    chosen = candidates[best]
    fit, summary = {**f.to_dict(), **chosen.record()}, {**f.summary(), **extra, **chosen.record()}
    same = [(c, v) for c, v in zip(candidates, values) if c.lexical_classifiers == chosen.lexical_classifiers]
    if chosen.votes is not None:
        summary["vote_grid"] = [[int(c.votes[0]), float(c.votes[1]), v] for c, v in same]
    if not all(c.lexical_classifiers for c in candidates[:len(fits)]):  # the objective with and without them
        summary["lexical_classifier_grid"] = [[c.lexical_classifiers, v] for c, v in zip(candidates, values)
                                              if c.votes == chosen.votes]
    if len(fits) < len(candidates):
        summary["candidates_skipped_at_deadline"] = len(candidates) - len(fits)
    return fit, summary


def run(ctx: StageContext) -> dict[str, Any]:
    """Fit the score fusion ``fusion.method`` on the held-out validation points' shortlists (deployed indexes),
    or cross-fitted over folds of the training points (``fusion.fit_on``).

    The fitted fusion is plain JSON (a tree as arrays), loadable without executing code.
    """
    t0 = time.perf_counter()
    p = ctx.cfg.fusion
    check_method(p.method)  # a bad method or vote grid fails before any work
    parse_vote_grid(p.vote_grid)
    valid = ctx.read.valid_rows()
    how = fit_on(ctx, len(valid))
    if how == "none":  # alpha 0.5 ranks as the tree's T-free score emb + clf
        fit = {"method": "alpha", "alpha": 0.5, "grid": [], "note": "no validation rows; alpha defaulted"}
        fit_summary = {"method": "alpha", "alpha": 0.5, "note": fit["note"]}
    else:
        fit, fit_summary = _fit(ctx, how, fusion_deadline(ctx, t0))
    summary = {**fit_summary, "objective": p.objective, "fit_on": how, "n_valid": int(len(valid)),
               "seconds": time.perf_counter() - t0}
    with ctx.writing() as out:
        save_json(out / FUSION, fit)
        save_json(out / SUMMARY, summary)
    ctx.info(f"fusion {ctx.name}: " + ", ".join(f"{k}={v}" for k, v in fit_summary.items()))
    return summary
