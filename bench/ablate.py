"""Re-run the later stages of a trained model with overrides, in a copy of its home: an ablation without retraining.

  python bench/ablate.py --home /tmp/h --name LF-WordNetNounsTitles --out /tmp/h-lex --from index \
      --set index.sources=W,label,knn,lexical [--to fusion] [--json results.jsonl]

The home's artifacts of ``--name`` are copied to ``--out`` (files hard-linked where the file system allows; each
stage replaces its folder as a whole, so the original is never written), its catalog entry gets the overrides,
and the stages from ``--from`` to ``--to`` run with ``xc_dagster.pipeline.run_all``. Prints the test metrics (P@k,
PSP@k; when the evaluate stage ran) and each stage's seconds, and appends them, with the command, to ``--json``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

from xc_dagster.artifacts import STAGE_ORDER
from xc_dagster.catalog import Catalog
from xc_dagster.config import parse_set_options
from xc_dagster.home import Home
from xc_dagster.pipeline import StageContext, run_all
from xc_dagster.storage import ArtifactStore, link_or_copy

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, for bench.rows
from bench.rows import emit  # noqa: E402

SHOWN = ("precision_at_1", "precision_at_3", "precision_at_5", "psprecision_at_1", "psprecision_at_3",
         "psprecision_at_5", "ndcg_at_5")


def copy_home(src: Path, dst: Path, name: str) -> None:
    """``dst`` gets ``src``'s catalog and the artifacts of ``name`` (hard links, else copies)."""
    if dst.exists():
        raise SystemExit(f"{dst} exists; pick a new --out")
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("artifacts", "mlartifacts", "mlflow.db", "dagster", "cache"))
    art = dst / "artifacts"
    art.mkdir(parents=True, exist_ok=True)
    # stage links copied as links: each still names its (hard-linked) version folder; writer locks not shared
    shutil.copytree(src / "artifacts" / name, art / name, symlinks=True, copy_function=link_or_copy,
                    ignore=shutil.ignore_patterns(".*.lock"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--home", type=Path, required=True)
    ap.add_argument("--name", required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--from", dest="start", choices=STAGE_ORDER, default="index")
    ap.add_argument("--to", dest="stop", choices=STAGE_ORDER, default=STAGE_ORDER[-1],
                    help="the last stage run (default: evaluate); before it, the row holds the stages' seconds")
    ap.add_argument("--set", action="append", default=[], metavar="STAGE.FIELD=VALUE")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    copy_home(args.home, args.out, args.name)
    os.environ["XC_HOME"] = str(args.out)
    home = Home.from_env().ensure()
    cat = Catalog(home.catalog)
    spec = cat.get(args.name)
    spec.overrides = {**spec.overrides, **parse_set_options(args.set)}
    cat.add(spec, replace=True)
    stages = STAGE_ORDER[STAGE_ORDER.index(args.start):STAGE_ORDER.index(args.stop) + 1]
    if not stages:
        raise SystemExit(f"--to {args.stop} comes before --from {args.start}")
    out = run_all(StageContext(ArtifactStore(home.artifacts), spec, spec.config(), home.cache), stages)
    metrics = out.get("evaluate", {}).get("metrics", out.get("evaluate", {}))
    row = {"name": args.name, "from": args.start, "to": args.stop, "set": args.set, "argv": sys.argv,
           **{k: metrics.get(k) for k in SHOWN}, "fusion": {k: v for k, v in out.get("fusion", {}).items()
                                                             if isinstance(v, (int, float, str))},
           "stage_seconds": {s: round(float(out[s].get("wall_seconds", out[s].get("seconds", 0.0))), 1)
                             for s in stages}}
    emit(row, args.json)


if __name__ == "__main__":
    main()
