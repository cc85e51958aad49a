"""Fit a trained model's alpha fusion with each ``fusion.search`` ("grid", "coordinate") on its validation
shortlists and score each fit on the test points: seconds, objective evaluations, the weights chosen, the
validation objective and the test P@k / PSP@k. Reads the home (the test embeddings' cache aside) and writes
nothing else.

  python bench/fusion_search.py --home /tmp/h --name LF-WordNetNounsTitles [--json results.jsonl]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from xc_dagster.catalog import Catalog
from xc_dagster.evaluation.metrics import evaluate, remove_filtered
from xc_dagster.home import Home
from xc_dagster.pipeline import StageContext
from xc_dagster.pipeline.evaluate import encode_split_reused
from xc_dagster.pipeline.fusion import validation_shortlists
from xc_dagster.retrieval.fitted_sources import fitted_choice
from xc_dagster.retrieval.fusion import fit_alpha
from xc_dagster.retrieval.fusion.objective import ObjectiveOnShortlist
from xc_dagster.retrieval.shortlist import retrieve, topk_from_scores
from xc_dagster.storage import ArtifactStore

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, for bench.rows
from bench.rows import emit  # noqa: E402

WEIGHTS = ("alpha", "knn_weight", "lexical_weight", "cooccurrence_weight", "propensity_weight", "objective_value")
SHOWN = ("precision_at_1", "precision_at_5", "psprecision_at_1", "psprecision_at_5")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--home", type=Path, required=True)
    ap.add_argument("--name", required=True)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--search", action="append", choices=("grid", "coordinate"),
                    help="the searches to fit (repeatable; default both)")
    args = ap.parse_args()
    os.environ["XC_HOME"] = str(args.home)
    home = Home.from_env()
    spec = Catalog(home.catalog).get(args.name)
    # read as the evaluation reads (the encoded test points' cache is keyed on the versions it reads)
    ctx = StageContext(ArtifactStore(home.artifacts), spec, spec.config(), home.cache, stage="evaluate")
    vs = next(validation_shortlists(ctx, [fitted_choice(ctx.read.fusion_file())]))  # as deployed
    ds, q = ctx.read.labels(), encode_split_reused(ctx, "test")[0]
    m = ctx.read.deployed_sources(ctx.cfg.index.hnsw_ef_search)
    test = retrieve(q, m, ctx.cfg.index.shortlist_size, lexical_queries=ctx.read.lexical_queries(m, "test"))
    calls = [0]
    value = ObjectiveOnShortlist.value

    def counted(self: ObjectiveOnShortlist, scores: object) -> float:
        calls[0] += 1
        return value(self, scores)

    ObjectiveOnShortlist.value = counted  # type: ignore[method-assign]
    for search in args.search or ("grid", "coordinate"):
        calls[0], t0 = 0, time.perf_counter()
        fit = fit_alpha(vs.shortlist, vs.Y, replace(ctx.cfg.fusion, search=search), vs.inv_prop, vs.filter_pairs)
        seconds, evaluations = time.perf_counter() - t0, calls[0]
        fp = None if ds.filter_test is None else np.asarray(ds.filter_test, dtype=np.int64).reshape(-1, 2)
        ids, scores = topk_from_scores(test.ids, fit.score(test, vs.inv_prop), 10)
        ids, _ = remove_filtered(ids, scores, fp)  # reciprocal/self pairs never predicted, as evaluation
        metrics = evaluate(ids, ds.Y_test, ks=(1, 5), inv_prop=vs.inv_prop, filter_pairs=ds.filter_test)
        row = {"name": args.name, "search": search, "seconds": round(seconds, 2), "evaluations": evaluations,
               "n_valid": int(vs.Y.shape[0]), **{k: fit.summary()[k] for k in WEIGHTS},
               **{k: round(100 * metrics[k], 2) for k in SHOWN}, "argv": sys.argv}
        emit(row, args.json)


if __name__ == "__main__":
    main()
