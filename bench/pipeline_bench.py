"""Run every stage on one dataset without Dagster and write the timings and test metrics as JSON.

  python bench/pipeline_bench.py --name LF-WordNetNounsTitles --source builtin:LF-WordNetNouns \
      [--preset quick] [--set stage.field=value ...] [--out bench/results/NAME.json]

Runs where Dagster and MLflow are not installed too (e.g. a GPU box with only torch + transformers +
faiss): it uses the library alone, artifacts in a temporary folder.
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path

import torch

from xc_dagster.catalog import DatasetSpec
from xc_dagster.config import parse_set_options
from xc_dagster.pipeline import StageContext, run_all
from xc_dagster.storage import ArtifactStore


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--name", default="LF-WordNetNounsTitles")
    ap.add_argument("--source", default="builtin:LF-WordNetNouns")
    ap.add_argument("--preset", default="quick")
    ap.add_argument("--strategy", default="ngame")
    ap.add_argument("--set", action="append", default=[])
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    spec = DatasetSpec(args.name, args.source, preset=args.preset, strategy=args.strategy,
                       overrides=parse_set_options(args.set)).validate("bench")
    cfg = spec.config()
    with tempfile.TemporaryDirectory() as tmp:
        ctx = StageContext(ArtifactStore(Path(tmp) / "artifacts"), spec, cfg, Path(tmp) / "cache",
                           info=lambda m: print(m, flush=True))
        t0 = time.perf_counter()
        out = run_all(ctx)
        total = time.perf_counter() - t0
    result = {
        "dataset": args.name, "preset": args.preset, "strategy": args.strategy, "overrides": args.set,
        "machine": {"platform": platform.platform(), "processor": platform.processor(),
                    "cpu_threads": torch.get_num_threads(),
                    "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None},
        "total_seconds": total,
        "stage_seconds": {s: v["wall_seconds"] for s, v in out.items()},
        "metrics": out["evaluate"]["metrics"],
        "summaries": out,
    }
    text = json.dumps(result, indent=2, default=str)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    m = result["metrics"]
    print(f"\n{args.name} ({args.strategy}, {args.preset}) in {total:.0f}s")
    print(" ".join(f"{k}={v:.0f}s" for k, v in result["stage_seconds"].items()))
    print(f"P@1 {100 * m['precision_at_1']:.2f}  P@5 {100 * m['precision_at_5']:.2f}  "
          f"PSP@1 {100 * m['psprecision_at_1']:.2f}  PSP@5 {100 * m['psprecision_at_5']:.2f}")


if __name__ == "__main__":
    main()
