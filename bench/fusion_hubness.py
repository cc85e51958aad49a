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
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, for bench.fusion_tail_alpha
from bench.fusion_tail_alpha import _floats, append_rows, load_deployed, metrics_on_test  # noqa: E402


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
    d = load_deployed(args.dataset)
    ds, inv, fusion, valid, model, sl, objective = d.ds, d.inv, d.fusion, d.valid, d.model, d.sl, d.objective
    ctx = d.ctx
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
    append_rows(args.out, args.dataset, fusion, v0, t0, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
