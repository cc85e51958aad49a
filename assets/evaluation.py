"""Evaluation on the test split with the XC repository's metrics (filter pairs removed, propensities by the
XC convention): P@k, nDCG@k, PSP@k, PSnDCG@k, recall@k, PS-recall@k and coverage@k for k = 1..10, shortlist
recall, the training time of every stage; reports as markdown tables and plots (P@k/PSP@k curve, head-to-tail
decile contributions to P@5/PSP@5, recall by label frequency) in the metadata and in MLflow."""


import base64
from pathlib import Path
from typing import Any

import dagster as dg

from assets._stage import stage_asset
from xc_dagster.artifacts import METRICS, PLOTS, REPORTS
from xc_dagster.evaluation.reports import decile_table, metrics_table
from xc_dagster.pipeline import StageContext
from xc_dagster.storage import load_json

STAGE = "evaluate"


def _image(path: Path, alt: str) -> dg.MetadataValue:
    b64 = base64.b64encode(path.read_bytes()).decode()
    return dg.MetadataValue.md(f"![{alt}](data:image/png;base64,{b64})")


def _report(ctx: StageContext, summary: dict[str, Any], run) -> dict[str, Any]:
    metrics = summary["metrics"]
    out_dir = ctx.store.stage_dir(ctx.name, STAGE)
    reports = load_json(out_dir / REPORTS)
    for f in (METRICS, REPORTS, *PLOTS.values()):
        run.log_artifact(out_dir / f, "reports")
    times = summary.get("stage_seconds", {})
    time_md = "| stage | seconds |\n|---|---|\n" + "\n".join(f"| {k} | {v:.1f} |" for k, v in times.items())
    return {
        "metrics_table": dg.MetadataValue.md(metrics_table(metrics, (1, 3, 5, 10))),
        "pk_plot": _image(out_dir / PLOTS["pk_plot"], "P@k and PSP@k for k = 1..10"),
        "decile_table": dg.MetadataValue.md(decile_table(reports["deciles"])),
        "decile_plot": _image(out_dir / PLOTS["decile_plot"], "contribution of label deciles to P@5/PSP@5"),
        "recall_by_frequency_plot": _image(out_dir / PLOTS["recall_plot"], "recall by label frequency"),
        "stage_seconds_table": dg.MetadataValue.md(time_md),
        "P@1": dg.MetadataValue.float(100 * metrics["precision_at_1"]),
        "P@5": dg.MetadataValue.float(100 * metrics["precision_at_5"]),
        "PSP@1": dg.MetadataValue.float(100 * metrics["psprecision_at_1"]),
        "PSP@5": dg.MetadataValue.float(100 * metrics["psprecision_at_5"]),
    }


build = stage_asset(STAGE, group="evaluation", kinds={"python", "mlflow"},
                    description=__doc__, extra_metadata=_report)
