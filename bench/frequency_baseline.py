"""The label-frequency baseline of an ingested dataset: every test point gets the most frequent training labels,
scored with the evaluation stage's metrics (filter pairs out). What "the planted structure is learned" is
measured against (bench/SCALE.md).

  python bench/frequency_baseline.py $XC_HOME/artifacts/<dataset>/ingest/dataset [--a 0.55 --b 1.5] [--out F.json]

``--a`` / ``--b``: the propensity model's A and B (those of the run's ``evaluate`` parameters).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import scipy.sparse as sp

from xc_dagster.evaluation.metrics import evaluate, inverse_propensity

KS = (1, 3, 5)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dataset", type=Path, help="the ingest stage's dataset folder (Y_train.npz, Y_test.npz, ...)")
    ap.add_argument("--a", type=float, default=0.55)
    ap.add_argument("--b", type=float, default=1.5)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    Y_train = sp.load_npz(a.dataset / "Y_train.npz").tocsr()
    Y_test = sp.load_npz(a.dataset / "Y_test.npz").tocsr()
    filter_path = a.dataset / "filter_test.npy"
    fp = np.load(filter_path).reshape(-1, 2) if filter_path.exists() else None
    counts = np.bincount(Y_train.indices, minlength=Y_train.shape[1])
    extra = 0 if fp is None or not len(fp) else int(np.bincount(fp[:, 0]).max())  # filtered pairs push the list
    top = np.argsort(-counts, kind="stable")[:max(KS) + extra]
    ids = np.broadcast_to(top, (Y_test.shape[0], len(top)))
    inv = inverse_propensity(Y_train, a.a, a.b)
    metrics = evaluate(ids, Y_test, ks=KS, inv_prop=inv, filter_pairs=fp)
    out = {"dataset": str(a.dataset), "train_points": Y_train.shape[0], "test_points": Y_test.shape[0],
           "labels": Y_train.shape[1], "top_label_points": int(counts[top[0]]), "a": a.a, "b": a.b,
           **{k: round(100 * v, 2) for k, v in metrics.items() if k.split("_at_")[0] in ("precision", "psprecision")}}
    if a.out:
        a.out.write_text(json.dumps(out, indent=2))
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
