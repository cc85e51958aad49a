"""Oracle frontier of the alpha fusion on the TEST split: how far re-weighting a trained model's scores can go.

  XC_HOME=<home> python bench/fusion_frontier.py --dataset LF-WordNetNounsTitles \
      [--thresholds 38,37,36,35] [--out bench/results/frontier_<name>.json]

Reads a materialized partition (its deployed encoder, W, indexes and fitted fusion), shortlists every test point
as the evaluate stage does, and ranks the shortlist with every weighting of the alpha fusion's grid:
a * classifier + (1 - a) * embedding + c * kNN + b * log(1 / p_l) for a in 0..1 (``--alpha-step``), c in
``--knn-weights`` (0 only when the index has no kNN source) and b in ``--propensity-weights``, the deployed fusion's
other terms (lexical and co-occurrence weights, kNN discount) kept as fitted. For each it computes
test P@1 and PSP@1 (filter pairs removed, propensity A/B from the dataset's config) and prints:

- the best PSP@1 among the weightings whose P@1 is at least each threshold (the P@1 / PSP@1 frontier),
- the largest PSP@1 and the largest P@1 + PSP@1 of the grid,
- where the deployed fusion (fitted on validation) sits, re-scored the same way.

With ``--smoothing 1,3,5`` it also refits the alpha fusion on the validation shortlists (as the fusion stage does)
with each ``fusion.smoothing`` width and scores each fit on test: how much the choice among near-equal validation
optima moves the test numbers (docs/decisions.md#fusion-smoothing-off).

The sweep is a diagnostic, never a fit: weights chosen on test overstate what a model delivers. It answers "is the
fusion the bottleneck, or the scores it fuses?" (results in bench/RESULTS.md).
A tree fusion in the partition is reported as deployed; the grid is the alpha fusion's.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from xc_dagster.catalog import Catalog
from xc_dagster.evaluation.metrics import evaluate, remove_filtered
from xc_dagster.home import Home
from xc_dagster.pipeline import StageContext
from xc_dagster.pipeline.evaluate import encode_split
from xc_dagster.pipeline.fusion import validation_shortlists
from xc_dagster.retrieval.fitted_sources import fitted_choice
from xc_dagster.retrieval.fusion import fit_alpha, propensity_boost
from xc_dagster.retrieval.shortlist import fuse, retrieve, topk_from_scores
from xc_dagster.storage import ArtifactStore

KEPT = ("lexical_weight", "cooccurrence_weight", "knn_discount")  # the deployed alpha fusion's terms the sweep keeps


def _floats(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"expected comma-separated numbers, got {text!r}") from None


def frontier(results: np.ndarray, thresholds: list[float]) -> dict[str, dict | None]:
    """Best PSP@1 row among the rows with P@1 >= each threshold (rows: P@1, PSP@1, a, c, b)."""
    out: dict[str, dict | None] = {}
    for thr in thresholds:
        ok = results[results[:, 0] >= thr]
        out[f"{thr:g}"] = None if not len(ok) else _row(ok[ok[:, 1].argmax()])
    return out


def _row(r: np.ndarray) -> dict:
    return {"p1": round(float(r[0]), 2), "psp1": round(float(r[1]), 2), "alpha": round(float(r[2]), 4),
            "knn_weight": float(r[3]), "propensity_weight": float(r[4])}


def p1_psp1(ids: np.ndarray, scores: np.ndarray, Y_test, filter_test, inv_prop: np.ndarray) -> tuple[float, float]:
    """Test P@1 and PSP@1 in percent of a shortlist ranked by ``scores``, as the evaluate stage ranks it (top 5,
    filter pairs removed before the top 1 is read)."""
    top, sc = remove_filtered(*topk_from_scores(ids, scores, 5), filter_test)
    m = evaluate(top, Y_test, ks=(1,), inv_prop=inv_prop, filter_pairs=filter_test)
    return 100 * m["precision_at_1"], 100 * m["psprecision_at_1"]


def sweep(sl, Y_test, filter_test, inv_prop: np.ndarray, alphas: np.ndarray, knn_weights: list[float],
          propensity_weights: list[float], kept: dict[str, float] | None = None) -> np.ndarray:
    """(P@1, PSP@1, a, c, b) in percent for every weighting of the grid on the given shortlist; ``kept``: the
    fusion's other weights (``KEPT``: lexical, co-occurrence, kNN discount), 0 when absent."""
    boost = propensity_boost(sl.ids, inv_prop)
    d, e, f = (float((kept or {}).get(k, 0.0)) for k in KEPT)
    rows = []
    for c in knn_weights:
        for a in alphas:
            base = fuse(sl, float(a), c, d, e, f)
            for b in propensity_weights:
                rows.append((*p1_psp1(sl.ids, base + np.float32(b) * boost, Y_test, filter_test, inv_prop), a, c, b))
    return np.asarray(rows, dtype=np.float64)


def refit_by_smoothing(valid, params, widths: list[int], sl_test, Y_test, filter_test,
                       inv_prop: np.ndarray) -> list[dict]:
    """The alpha fusion refitted on ``valid`` (a ``pipeline.fusion.ValidationShortlists``) with each smoothing width,
    and each fit's test P@1 / PSP@1."""
    out = []
    for w in widths:
        fit = fit_alpha(valid.shortlist, valid.Y, replace(params, smoothing=w), valid.inv_prop, valid.filter_pairs)
        p1, psp1 = p1_psp1(sl_test.ids, fit.score(sl_test, inv_prop), Y_test, filter_test, inv_prop)
        out.append({"smoothing": w, "alpha": fit.alpha, "knn_weight": fit.knn_weight,
                    "propensity_weight": fit.propensity_weight, "validation": round(100 * fit.objective_value, 2),
                    "validation_smoothed": round(100 * fit.objective_smoothed, 2),
                    "p1": round(p1, 2), "psp1": round(psp1, 2)})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dataset", required=True, help="a materialized partition of the catalog in $XC_HOME")
    ap.add_argument("--alpha-step", type=float, default=0.05)
    ap.add_argument("--knn-weights", default="0,0.25,0.5,1")
    ap.add_argument("--propensity-weights", default="0,0.02,0.04,0.08,0.12,0.16")
    ap.add_argument("--thresholds", default="38,37,36,35", help="P@1 floors (percent) of the frontier")
    ap.add_argument("--smoothing", default="", help="fusion.smoothing widths to refit on validation, e.g. 1,3,5")
    ap.add_argument("--out", type=Path, help="write the results as JSON here")
    args = ap.parse_args(argv)

    if not 0 < args.alpha_step <= 1:
        raise SystemExit(f"--alpha-step: expected a number in (0, 1], got {args.alpha_step}")
    home = Home.from_env()
    spec = Catalog(home.catalog).get(args.dataset)
    cfg = spec.config()
    ctx = StageContext(ArtifactStore(home.artifacts), spec, cfg, home.cache)
    t0 = time.perf_counter()
    ds = ctx.read.labels()
    inv = ctx.inv_prop(ds.Y_train)
    model = ctx.read.deployed_sources(cfg.index.hnsw_ef_search)
    sl = retrieve(encode_split(ctx, "test"), model, cfg.index.shortlist_size,
                  lexical_queries=ctx.read.lexical_queries(model, "test"))
    knn = _floats(args.knn_weights) if sl.knn is not None else [0.0]
    alphas = np.round(np.arange(0.0, 1.0 + 1e-9, args.alpha_step), 6)
    deployed = ctx.read.fusion()
    kept = {k: getattr(deployed, k, 0.0) for k in KEPT}  # a tree fusion has none: the three-term grid
    res = sweep(sl, ds.Y_test, ds.filter_test, inv, alphas, knn, _floats(args.propensity_weights), kept)

    dep_p1, dep_psp1 = p1_psp1(sl.ids, deployed.score(sl, inv), ds.Y_test, ds.filter_test, inv)
    best_psp, best_sum = res[res[:, 1].argmax()], res[(res[:, 0] + res[:, 1]).argmax()]
    out = {"dataset": args.dataset, "strategy": cfg.strategy, "n_test": int(ds.Y_test.shape[0]),
           "grid_size": int(len(res)), "kept": kept, "frontier": frontier(res, _floats(args.thresholds)),
           "max_psp1": _row(best_psp), "max_p1_plus_psp1": _row(best_sum),
           "deployed": {"fusion": deployed.summary(), "p1": round(dep_p1, 2), "psp1": round(dep_psp1, 2)},
           "machine": f"{platform.processor() or platform.machine()}, {platform.system()}",
           "seconds": round(time.perf_counter() - t0, 1)}
    print(f"{args.dataset} ({cfg.strategy}), test, {len(res)} weightings of the alpha fusion:")
    print(f"  deployed (fitted on validation): P@1 {out['deployed']['p1']:.2f}  PSP@1 {out['deployed']['psp1']:.2f}")
    for thr, r in out["frontier"].items():
        print(f"  P@1 >= {thr}: " + ("none" if r is None else
                                     f"best PSP@1 {r['psp1']:.2f} (P@1 {r['p1']:.2f}; a {r['alpha']:g}, "
                                     f"c {r['knn_weight']:g}, b {r['propensity_weight']:g})"))
    print(f"  max PSP@1 {best_psp[1]:.2f} (P@1 {best_psp[0]:.2f}); "
          f"max P@1 + PSP@1 {best_sum[0] + best_sum[1]:.2f} ({best_sum[0]:.2f} + {best_sum[1]:.2f})")
    if args.smoothing:
        widths = [int(w) for w in _floats(args.smoothing)]
        valid = next(validation_shortlists(ctx, [fitted_choice(ctx.read.fusion_file())]))  # as deployed
        out["smoothing"] = refit_by_smoothing(valid, cfg.fusion, widths, sl, ds.Y_test, ds.filter_test, inv)
        for r in out["smoothing"]:
            print(f"  refit, smoothing {r['smoothing']}: a {r['alpha']:g}, c {r['knn_weight']:g}, "
                  f"b {r['propensity_weight']:g}, validation {r['validation']:.2f} (smoothed "
                  f"{r['validation_smoothed']:.2f}) -> test P@1 {r['p1']:.2f}  PSP@1 {r['psp1']:.2f}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
