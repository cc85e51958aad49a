"""Would a hubness correction pay? The deployed alpha fusion less g * r_l, CSLS's hubness of each label.

  XC_HOME=<home> python bench/fusion_hubness.py --dataset LF-WordNetNounsTitles \
      [--neighbours 5,20] [--weights 0.02,0.05,0.1,0.2,0.3,0.5] [--out bench/results/<name>.jsonl]

A label vector near many points (a hub) scores high for any query near its crowd; CSLS (Conneau et al., 2018)
subtracts r_l, the mean similarity of the label's representation (the embedding score's r_l) to its k nearest
training points, from its scores. This scores s = fused - g * r_l with the deployed fusion's other weights as
fitted, r_l over the points the fusion's held-out model indexes (the validation points left out) for validation
and over the same points for test, and reports the change of the validation objective (``fusion.objective``) and
of test P@1 / P@5 / PSP@1 / PSP@5 (filter pairs removed, as ``fusion_tail_alpha``). A correction worth a fusion axis
would raise validation. One JSON row per (k, g) with ``--out`` (docs/decisions.md#fusion-hubness).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, for bench.fusion_tail_alpha
from bench.fusion_tail_alpha import _floats, metrics_on_test  # noqa: E402
from xc_dagster.catalog import Catalog  # noqa: E402
from xc_dagster.home import Home  # noqa: E402
from xc_dagster.pipeline import StageContext  # noqa: E402
from xc_dagster.pipeline.evaluate import encode_split  # noqa: E402
from xc_dagster.pipeline.fusion import validation_shortlists  # noqa: E402
from xc_dagster.retrieval.fitted_sources import fitted_choice  # noqa: E402
from xc_dagster.retrieval.fusion.objective import ObjectiveOnShortlist  # noqa: E402
from xc_dagster.retrieval.shortlist import retrieve  # noqa: E402
from xc_dagster.storage import ArtifactStore  # noqa: E402


def hubness(label_repr: np.ndarray, points: torch.Tensor, k: int, block: int = 2048) -> np.ndarray:
    """r_l: the mean of each label vector's ``k`` largest similarities to ``points`` (blocks of labels)."""
    R = torch.from_numpy(np.ascontiguousarray(label_repr, dtype=np.float32))
    return torch.cat([torch.topk(R[i:i + block] @ points.T, k, dim=1).values.mean(1)
                      for i in range(0, len(R), block)]).numpy()


def per_candidate(ids: np.ndarray, r: np.ndarray) -> np.ndarray:
    return np.where(ids < 0, 0.0, r[np.maximum(ids, 0)]).astype(np.float32)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dataset", required=True, help="a materialized partition of the catalog in $XC_HOME")
    ap.add_argument("--neighbours", default="5,20", help="k of r_l")
    ap.add_argument("--weights", default="0.02,0.05,0.1,0.2,0.3,0.5", help="weights g of the correction")
    ap.add_argument("--out", type=Path, help="append the rows (JSON lines) here")
    args = ap.parse_args(argv)
    home = Home.from_env()
    spec = Catalog(home.catalog).get(args.dataset)
    cfg = spec.config()
    ctx = StageContext(ArtifactStore(home.artifacts), spec, cfg, home.cache)
    ds = ctx.read.labels()
    inv = ctx.inv_prop(ds.Y_train)
    fusion = ctx.read.fusion()
    valid = next(validation_shortlists(ctx, [fitted_choice(ctx.read.fusion_file())]))
    model = ctx.read.deployed_sources(cfg.index.hnsw_ef_search)
    sl = retrieve(encode_split(ctx, "test"), model, cfg.index.shortlist_size,
                  lexical_queries=ctx.read.lexical_queries(model, "test"))
    objective = ObjectiveOnShortlist(valid.shortlist.ids, valid.Y, cfg.fusion.objective, valid.inv_prop,
                                     valid.filter_pairs, 10)
    fit_rows = np.setdiff1d(ctx.read.train_rows(ds.num_train), ctx.read.valid_rows())
    points = torch.from_numpy(np.ascontiguousarray(ctx.read.embeddings("train")[fit_rows], dtype=np.float32))
    bv, bt = fusion.score(valid.shortlist, valid.inv_prop), fusion.score(sl, inv)
    v0, t0 = objective.value(bv), metrics_on_test(sl, bt, ds.Y_test, ds.filter_test, inv)
    print(f"{args.dataset}: deployed {fusion.summary()}\n  validation {v0:.5f}, test {t0}")
    rows = []
    for k in (int(x) for x in _floats(args.neighbours)):
        pv = per_candidate(valid.shortlist.ids, hubness(valid.model.label_repr, points, k))
        rt = hubness(model.label_repr, points, k)
        pt = per_candidate(sl.ids, rt)
        for g in _floats(args.weights):
            v = objective.value(bv - np.float32(g) * pv)
            m = metrics_on_test(sl, bt - np.float32(g) * pt, ds.Y_test, ds.filter_test, inv)
            rows.append({"dataset": args.dataset, "k": k, "g": g, "validation": v, "validation_change": v - v0,
                         "test": m, "test_change": [round(a - b, 2) for a, b in zip(m, t0)],
                         "r_mean": round(float(rt.mean()), 4), "r_sd": round(float(rt.std()), 4)})
            print(f"  k {k} g {g:g}: validation {v - v0:+.5f}, test change {rows[-1]['test_change']}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        head = {"dataset": args.dataset, "deployed": fusion.summary(), "validation": v0, "test": t0,
                "machine": f"{platform.processor() or platform.machine()}, {platform.system()}"}
        with args.out.open("a") as f:
            for r in [head, *rows]:
                f.write(json.dumps(r) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
