"""The pipeline's cost model, fitted on measured runs of one dataset shape at several scales: each stage's seconds
and peak memory as a power of the scale, and the prediction for another shape.

  python bench/cost_model.py --run 0.25=/runs/sc_0.25 --run 0.5=/runs/sc_0.5 --run 1=/runs/sc_1 \
      [--predict 7.62] [--markdown]

Each ``--run SCALE=HOME`` is an ``XC_HOME`` whose one dataset was materialized at SCALE x the shape's points and
labels (``python -m xc_dagster.data.synthetic --scale``). Per stage it reads the recorded ``seconds`` (stage
summaries) and the step's peak RSS (``peak_rss_mb``, logged to MLflow by every stage), fits ``t = a * scale^b`` by
least squares on logs (b: the measured exponent; 1 is linear in N and L together) and prints the fit, and with
``--predict S`` the extrapolation to S x the shape (e.g. 7.62: the 1.3M shape's 2,248,619 training points against
the 131K shape's 294,805). An extrapolation holds only while each stage keeps its algorithm: index kinds switch
from exact search to HNSW at 2^18 vectors, 2^19 where exact search scores in bf16 (``xc_dagster.retrieval.ann``).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import mlflow
import numpy as np

STAGES = ("ingest", "tokenize", "pretrain", "mining", "classifier", "index", "fusion", "evaluate")


def stage_seconds(home: Path) -> tuple[str, dict[str, float]]:
    """The one dataset of ``home`` and each stage's recorded seconds."""
    names = [p.name for p in (home / "artifacts").iterdir() if p.is_dir() and not p.name.startswith((".", "_"))]
    if len(names) != 1:
        raise SystemExit(f"{home}: expected one dataset under artifacts/, found {names}")
    out = {}
    for stage in STAGES:
        path = home / "artifacts" / names[0] / stage / "summary.json"
        if path.is_file():
            s = json.loads(path.read_text())
            out[stage] = float(s.get("seconds", s.get("train_seconds", 0.0)))
    return names[0], out


def stage_peak_rss(home: Path) -> dict[str, float]:
    """Each stage's last logged ``peak_rss_mb`` in the home's MLflow store (empty when not logged)."""
    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{home / 'mlflow.db'}")
    out: dict[str, float] = {}
    for exp in client.search_experiments():
        for run in client.search_runs([exp.experiment_id], order_by=["attributes.start_time ASC"]):
            stage = run.data.tags.get("asset") or run.info.run_name
            if stage in STAGES and "peak_rss_mb" in run.data.metrics:
                out[stage] = float(run.data.metrics["peak_rss_mb"])
    return out


def fit(scales: list[float], values: list[float]) -> tuple[float, float]:
    """(a, b) of ``value = a * scale^b``, least squares on logs; b = nan with fewer than two positive points."""
    pts = [(math.log(s), math.log(v)) for s, v in zip(scales, values) if v > 0]
    if len(pts) < 2:
        return (values[0] if values else float("nan")), float("nan")
    x, y = np.array(pts).T
    b, log_a = np.polyfit(x, y, 1)
    return float(math.exp(log_a)), float(b)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", action="append", required=True, metavar="SCALE=HOME")
    ap.add_argument("--predict", type=float, action="append", default=[], metavar="SCALE")
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args()
    runs = sorted((float(s), Path(h)) for s, h in (r.split("=", 1) for r in args.run))
    scales = [s for s, _ in runs]
    secs = [stage_seconds(h)[1] for _, h in runs]
    rss = [stage_peak_rss(h) for _, h in runs]
    head = ["stage"] + [f"{s:g}x s" for s in scales] + ["exponent"] + [f"{p:g}x s (pred.)" for p in args.predict] \
        + [f"{s:g}x peak RSS MB" for s in scales] + ["RSS exponent"]
    rows = []
    for stage in STAGES + ("total",):
        t = [sum(x.values()) if stage == "total" else x.get(stage, float("nan")) for x in secs]
        a, b = fit(scales, t)
        m = [max(r.values(), default=float("nan")) if stage == "total" else r.get(stage, float("nan")) for r in rss]
        _, bm = fit(scales, m)
        rows.append([stage] + [f"{v:.1f}" for v in t] + [f"{b:.2f}"] + [f"{a * p ** b:.0f}" for p in args.predict]
                    + [f"{v:.0f}" for v in m] + [f"{bm:.2f}"])
    if args.markdown:
        print("| " + " | ".join(head) + " |")
        print("|" + "---|" * len(head))
        for r in rows:
            print("| " + " | ".join(r) + " |")
    else:
        print("\t".join(head))
        for r in rows:
            print("\t".join(r))


if __name__ == "__main__":
    main()
