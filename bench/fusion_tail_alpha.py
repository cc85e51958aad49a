"""Would a tail-only alpha pay? The deployed alpha fusion with the classifier/embedding blend shifted on tail labels.

  XC_HOME=<home> python bench/fusion_tail_alpha.py --dataset LF-WordNetNounsTitles \
      [--counts 1,2,3,5,10,20] [--shifts -0.3,-0.2,-0.1,0.1,0.2,0.3,0.5] [--out bench/results/<name>.jsonl]

NGAME and SiameseXML blend one alpha for every label, while a tail label's classifier saw few positives and its
embedding score (label text, centroid) may deserve more weight there. For each training-count threshold t and shift
delta this scores s = fused + delta * [n_l <= t] * (embedding - classifier), i.e. alpha - delta on the labels with at
most t training points, the deployed fusion's other weights as fitted, and reports the change of the validation
objective (``fusion.objective``, on the shortlists the fusion stage fits on) and of test P@1 / P@5 / PSP@1 / PSP@5
(filter pairs removed from the top 5, as ``fusion_frontier``). A shift worth a fusion axis would raise validation.
One JSON row per (t, delta) with ``--out`` (docs/decisions.md#fusion-tail-alpha).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from xc_dagster.catalog import Catalog
from xc_dagster.evaluation.metrics import evaluate, remove_filtered
from xc_dagster.home import Home
from xc_dagster.pipeline import StageContext
from xc_dagster.pipeline.evaluate import encode_split
from xc_dagster.pipeline.fusion import validation_shortlists
from xc_dagster.retrieval.fitted_sources import fitted_choice
from xc_dagster.retrieval.fusion.objective import ObjectiveOnShortlist
from xc_dagster.retrieval.shortlist import retrieve, topk_from_scores
from xc_dagster.storage import ArtifactStore

METRICS = ("precision_at_1", "precision_at_5", "psprecision_at_1", "psprecision_at_5")


def _floats(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"expected comma-separated numbers, got {text!r}") from None


def tail_parts(fusion, sl, inv_prop: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The deployed fused scores, embedding - classifier (0 on padding) and each candidate's training count."""
    base = fusion.score(sl, inv_prop)
    with np.errstate(invalid="ignore"):
        diff = np.nan_to_num(sl.emb - sl.clf, nan=0.0, posinf=0.0, neginf=0.0)
    diff = np.where(sl.ids < 0, 0.0, diff).astype(np.float32)
    n = np.where(sl.ids < 0, np.iinfo(np.int64).max, counts[np.maximum(sl.ids, 0)])
    return base, diff, n


def metrics_on_test(sl, scores: np.ndarray, Y, filter_pairs, inv_prop: np.ndarray) -> list[float]:
    top, _ = remove_filtered(*topk_from_scores(sl.ids, scores, 5), filter_pairs)
    m = evaluate(top, Y, ks=(1, 5), inv_prop=inv_prop, filter_pairs=filter_pairs)
    return [round(100 * m[k], 2) for k in METRICS]


@dataclass
class DeployedFit:
    """A materialized model's deployed fusion with the shortlists it is probed on: the validation points' (as the
    fusion stage fits) and the test points' (deployed sources), the validation objective, propensities."""

    ctx: StageContext
    ds: Any
    inv: np.ndarray
    fusion: Any
    valid: Any
    model: Any
    sl: Any
    objective: ObjectiveOnShortlist


def load_deployed(dataset: str) -> DeployedFit:
    """``dataset`` of the catalog in $XC_HOME, its deployed fusion and the shortlists to probe it on."""
    home = Home.from_env()
    spec = Catalog(home.catalog).get(dataset)
    cfg = spec.config()
    ctx = StageContext(ArtifactStore(home.artifacts), spec, cfg, home.cache)
    ds = ctx.read.labels()
    valid = next(validation_shortlists(ctx, [fitted_choice(ctx.read.fusion_file())]))
    model = ctx.read.deployed_sources(cfg.index.hnsw_ef_search)
    sl = retrieve(encode_split(ctx, "test"), model, cfg.index.shortlist_size,
                  lexical_queries=ctx.read.lexical_queries(model, "test"))
    objective = ObjectiveOnShortlist(valid.shortlist.ids, valid.Y, cfg.fusion.objective, valid.inv_prop,
                                     valid.filter_pairs, 10)
    return DeployedFit(ctx, ds, ctx.inv_prop(ds.Y_train), ctx.read.fusion(), valid, model, sl, objective)


def append_rows(out: Path | None, dataset: str, fusion: Any, v0: float, t0: list[float], rows: list[dict]) -> None:
    """Append the deployed fusion's row and ``rows`` to ``out`` (JSON lines; nothing without ``out``)."""
    if not out:
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    head = {"dataset": dataset, "deployed": fusion.summary(), "validation": v0, "test": t0,
            "machine": f"{platform.processor() or platform.machine()}, {platform.system()}"}
    with out.open("a") as f:
        for r in [head, *rows]:
            f.write(json.dumps(r) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dataset", required=True, help="a materialized partition of the catalog in $XC_HOME")
    ap.add_argument("--counts", default="1,2,3,5,10,20", help="training-count thresholds t of the tail")
    ap.add_argument("--shifts", default="-0.3,-0.2,-0.1,0.1,0.2,0.3,0.5", help="shifts delta of alpha on the tail")
    ap.add_argument("--out", type=Path, help="append the rows (JSON lines) here")
    args = ap.parse_args(argv)
    d = load_deployed(args.dataset)
    ds, inv, fusion, valid, sl, objective = d.ds, d.inv, d.fusion, d.valid, d.sl, d.objective
    counts = np.asarray(ds.Y_train[d.ctx.read.train_rows(ds.num_train)].sum(0)).ravel()  # the models' training points
    bv, dv, nv = tail_parts(fusion, valid.shortlist, valid.inv_prop, counts)
    bt, dt, nt = tail_parts(fusion, sl, inv, counts)
    v0, t0 = objective.value(bv), metrics_on_test(sl, bt, ds.Y_test, ds.filter_test, inv)
    print(f"{args.dataset}: deployed {fusion.summary()}\n  validation {v0:.5f}, test {t0}")
    rows = []
    for t in _floats(args.counts):
        for delta in _floats(args.shifts):
            v = objective.value(bv + np.float32(delta) * (nv <= t) * dv)
            m = metrics_on_test(sl, bt + np.float32(delta) * (nt <= t) * dt, ds.Y_test, ds.filter_test, inv)
            rows.append({"dataset": args.dataset, "t": t, "delta": delta, "validation": v, "validation_change": v - v0,
                         "test": m, "test_change": [round(a - b, 2) for a, b in zip(m, t0)],
                         "tail_share_of_test_candidates": round(float((nt <= t).mean()), 4)})
            print(f"  t {t:g} delta {delta:+g}: validation {v - v0:+.5f}, test change {rows[-1]['test_change']}")
    append_rows(args.out, args.dataset, fusion, v0, t0, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
