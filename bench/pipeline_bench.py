"""Run every stage on one dataset without Dagster and write the timings and test metrics as JSON.

  python bench/pipeline_bench.py --name LF-WordNetNounsTitles --source builtin:LF-WordNetNouns \
      [--preset quick] [--set stage.field=value ...] [--out bench/results/NAME.json]

Runs where Dagster is not installed (it uses the library alone, artifacts in a temporary folder); on a machine
without MLflow too, through ``bench/no_tracking.py`` (the library imports MLflow, but these stages track nothing).
The JSON gives each stage's seconds, the process's peak RSS after it and, with CUDA, the stage's peak GPU memory.
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
from xc_dagster.pipeline import STAGE_ORDER, StageContext, run_all
from xc_dagster.storage import ArtifactStore


def _gpu_peak_gb() -> float | None:
    """The GPU memory torch allocated at its peak since the last reset, GiB (None without CUDA)."""
    if not torch.cuda.is_available():
        return None
    peak = torch.cuda.max_memory_allocated() / 2**30
    torch.cuda.reset_peak_memory_stats()
    return round(peak, 2)


def _machine() -> dict:
    return {"platform": platform.platform(), "processor": platform.processor(),
            "cpu_threads": torch.get_num_threads(),
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--name", default="LF-WordNetNounsTitles")
    ap.add_argument("--source", default="builtin:LF-WordNetNouns")
    ap.add_argument("--text", default=None, help="title | full (the catalog's text field; default: the source's)")
    ap.add_argument("--preset", default="quick")
    ap.add_argument("--strategy", default="ngame")
    ap.add_argument("--set", action="append", default=[])
    ap.add_argument("--out", type=Path, help="the JSON, rewritten after every stage (a cut-off run keeps its stages)")
    args = ap.parse_args()
    extra = {"text": args.text} if args.text else {}
    spec = DatasetSpec(args.name, args.source, preset=args.preset, strategy=args.strategy,
                       overrides=parse_set_options(args.set), **extra).validate("bench")
    result = {"dataset": args.name, "preset": args.preset, "strategy": args.strategy, "overrides": args.set,
              "machine": _machine(), "stage_seconds": {}, "stage_peak_rss_mb": {}, "stage_gpu_peak_gb": {},
              "summaries": {}}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        ctx = StageContext(ArtifactStore(Path(tmp) / "artifacts"), spec, spec.config(), Path(tmp) / "cache",
                           info=lambda m: print(m, flush=True))
        for stage in STAGE_ORDER:  # one at a time: each stage's own GPU peak, and the JSON after each
            summary = run_all(ctx, (stage,))[stage]
            result["stage_seconds"][stage] = summary["wall_seconds"]
            result["stage_peak_rss_mb"][stage] = summary.get("peak_rss_mb")  # the process's peak so far
            result["stage_gpu_peak_gb"][stage] = _gpu_peak_gb()
            result["summaries"][stage] = summary
            result["total_seconds"] = time.perf_counter() - t0
            if args.out:
                args.out.parent.mkdir(parents=True, exist_ok=True)
                args.out.write_text(json.dumps(result, indent=2, default=str))
    result["metrics"] = m = result["summaries"]["evaluate"]["metrics"]
    if args.out:
        args.out.write_text(json.dumps(result, indent=2, default=str))
    print(f"\n{args.name} ({args.strategy}, {args.preset}) in {result['total_seconds']:.0f}s")
    print(" ".join(f"{k}={v:.0f}s" for k, v in result["stage_seconds"].items()))
    print(f"P@1 {100 * m['precision_at_1']:.2f}  P@5 {100 * m['precision_at_5']:.2f}  "
          f"PSP@1 {100 * m['psprecision_at_1']:.2f}  PSP@5 {100 * m['psprecision_at_5']:.2f}")


if __name__ == "__main__":
    main()
