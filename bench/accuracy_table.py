"""The accuracy table of docs/accuracy.md: each pipeline run's test metrics next to the best peer on the same split.

  python bench/accuracy_table.py --run NAME=HOME[:DATASET] ... --peers NAME=PEERS.json ... [--ablations A.jsonl]

``HOME`` is an XC_HOME whose ``DATASET`` (default NAME) was materialized; ``PEERS.json`` what
``bench/peers_bench.py --out`` wrote for that dataset. For every NAME it prints P@1, P@5, PSP@1, PSP@5 of the
pipeline and of Omikuji and napkinXC, the margin over the best peer per metric, the training minutes
(``stage_seconds.training_total``) against the budget, and the planned epochs. ``--ablations``: rows written by
``bench/ablate.py --json``, printed after the table.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

METRICS = ("precision_at_1", "precision_at_5", "psprecision_at_1", "psprecision_at_5")
HEAD = ("P@1", "P@5", "PSP@1", "PSP@5")
PEERS = ("omikuji", "napkinxc")


def pipeline_row(home: Path, dataset: str) -> dict:
    """The test metrics (percent), training minutes, budget and plan of ``dataset`` in ``home``."""
    art = home / "artifacts" / dataset
    ev = json.loads((art / "evaluate" / "summary.json").read_text())
    pre = json.loads((art / "pretrain" / "summary.json").read_text())
    clf = json.loads((art / "classifier" / "summary.json").read_text())
    fus = json.loads((art / "fusion" / "summary.json").read_text())
    plan = pre.get("budget") or {}
    return {**{m: 100 * ev["metrics"][m] for m in METRICS},
            "minutes": ev["stage_seconds"]["training_total"] / 60, "budget": plan.get("budget_seconds", 0) / 60,
            "epochs": plan.get("planned_epochs"), "stopped": pre.get("stopped_at_deadline"),
            "clf_epochs": clf.get("epochs_trained"), "fusion": {k: fus.get(k) for k in (
                "alpha", "knn_weight", "lexical_weight", "propensity_weight", "n_valid")}}


def peer_rows(path: Path) -> dict[str, dict[str, float]]:
    res = json.loads(path.read_text())["results"][0]["methods"]
    return {m: {k: 100 * res[m]["metrics"][k] for k in METRICS} for m in PEERS if m in res and "metrics" in res[m]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", action="append", default=[], metavar="NAME=HOME[:DATASET]")
    ap.add_argument("--peers", action="append", default=[], metavar="NAME=PEERS.json")
    ap.add_argument("--ablations", type=Path)
    args = ap.parse_args()
    peers = {k: peer_rows(Path(v)) for k, v in (p.split("=", 1) for p in args.peers)}
    print("| dataset | method | " + " | ".join(HEAD) + " | training min (budget) | planned epochs |")
    print("|---" * (len(HEAD) + 4) + "|")
    for item in args.run:
        name, where = item.split("=", 1)
        home, _, dataset = where.partition(":")
        row = pipeline_row(Path(home), dataset or name)
        best = {m: max((p[m] for p in peers.get(name, {}).values()), default=float("nan")) for m in METRICS}
        cells = [f"{row[m]:.2f} ({row[m] - best[m]:+.2f})" for m in METRICS]
        print(f"| {name} | xc-dagster | " + " | ".join(cells) +
              f" | {row['minutes']:.1f} ({row['budget']:.0f}) | {row['epochs']} |")
        for peer, vals in peers.get(name, {}).items():
            print(f"| {name} | {peer} | " + " | ".join(f"{vals[m]:.2f}" for m in METRICS) + " | | |")
    if args.ablations and args.ablations.exists():
        print()
        for line in args.ablations.read_text().splitlines():
            r = json.loads(line)
            print(f"{r['name']:28s} {' '.join(r['set'])[:70]:70s} " +
                  " ".join(f"{100 * r[m]:.2f}" for m in METRICS))


if __name__ == "__main__":
    main()
