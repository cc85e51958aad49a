"""Evaluation on the test split: P@1/3/5, nDCG@1/3/5, PSP@1/3/5, PSnDCG@3/5 and the shortlist's recall,
with filter pairs removed from predictions and propensities by the XC convention; a markdown table and a
P@k/PSP@k plot in the metadata and in MLflow."""


import base64
from typing import Any

import dagster as dg

from assets._stage import stage_asset
from xc_dagster.pipeline import StageContext
from xc_dagster.reports import metrics_table, pk_plot

STAGE = "evaluate"


def _report(ctx: StageContext, summary: dict[str, Any], run) -> dict[str, Any]:
    metrics = summary["metrics"]
    out_dir = ctx.store.stage_dir(ctx.name, STAGE)
    table = metrics_table(metrics)
    plot = pk_plot(metrics, out_dir / "pk_plot.png", f"{ctx.name} ({ctx.cfg.strategy}, {ctx.cfg.preset})")
    run.log_artifact(plot)
    run.log_artifact(out_dir / "metrics.json")
    b64 = base64.b64encode(plot.read_bytes()).decode()
    return {
        "metrics_table": dg.MetadataValue.md(table),
        "pk_plot": dg.MetadataValue.md(f"![P@k and PSP@k](data:image/png;base64,{b64})"),
        "P@1": dg.MetadataValue.float(100 * metrics["precision_at_1"]),
        "P@5": dg.MetadataValue.float(100 * metrics["precision_at_5"]),
        "PSP@1": dg.MetadataValue.float(100 * metrics["psprecision_at_1"]),
        "PSP@5": dg.MetadataValue.float(100 * metrics["psprecision_at_5"]),
    }


build = stage_asset(STAGE, "evaluation", deps=["fusion"], group="evaluation", kinds={"python", "mlflow"},
                    description=__doc__, extra_metadata=_report)
