"""Dataset ingest: the source (local, file://, http(s):// with resume and SHA-256, fsspec) parsed from its XC layout into canonical tables -- point and label texts, train/test label matrices (CSR), filter pairs, BoW features -- plus the validation split carved from train. Known public datasets are checked against their published counts. Asset checks: label ids in range, counts match, points without labels, duplicate texts, train/test overlap, filter pairs in range; the label-frequency plot is in the metadata and MLflow.
The ERROR checks (label ids, counts, filter pairs) are blocking: one that fails fails the step, and the partition's
downstream stages do not run."""

import base64
import json
import warnings
from typing import Any

import dagster as dg

from assets._stage import stage_asset
from xc_dagster.artifacts import CHECKS as CHECKS_FILE
from xc_dagster.artifacts import CONTRACT, LABEL_FREQ_PLOT
from xc_dagster.data.checks import CHECKS, ERROR, WARN
from xc_dagster.pipeline import StageContext
from xc_dagster.storage import load_json

STAGE = "ingest"
ASSET = CONTRACT[STAGE].asset
_SEVERITY = {ERROR: dg.AssetCheckSeverity.ERROR, WARN: dg.AssetCheckSeverity.WARN}


def _check_specs(partitions: dg.PartitionsDefinition) -> list[dg.AssetCheckSpec]:
    """One spec per library check, partitioned like the asset so each dataset keeps its own results.

    The ERROR checks are blocking: when one fails, Dagster records the materialization and the check results,
    then fails the step (``DagsterAssetCheckFailedError``), so the run fails and the partition's downstream
    stages are skipped; a failed WARN check is reported and blocks nothing.
    Partitioned check specs are a Dagster preview feature (pinned 1.13.x): its PreviewWarning is silenced
    here, and a Dagster without it gets unpartitioned checks (the latest materialized partition's results).
    """
    specs = []
    for name, (sev, desc) in CHECKS.items():
        description = f"{desc} (failure severity {sev}{', blocks the downstream stages' if sev == ERROR else ''})"
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", getattr(dg, "PreviewWarning", Warning))
                specs.append(dg.AssetCheckSpec(name, asset=ASSET, partitions_def=partitions,
                                               description=description, blocking=sev == ERROR))
        except TypeError:
            specs.append(dg.AssetCheckSpec(name, asset=ASSET, description=description, blocking=sev == ERROR))
    return specs


def _meta_value(v: Any) -> Any:
    if isinstance(v, bool):
        return dg.MetadataValue.bool(v)
    if isinstance(v, int):
        return dg.MetadataValue.int(v)
    if isinstance(v, float):
        return dg.MetadataValue.float(v)
    if isinstance(v, str):
        return dg.MetadataValue.text(v)
    return dg.MetadataValue.json(json.loads(json.dumps(v)))


def _check_results(ctx: StageContext, summary: dict[str, Any]) -> list[dg.AssetCheckResult]:
    """The results computed during ingest (``checks.json``), as Dagster asset check results."""
    checks = load_json(ctx.store.stage_dir(ctx.name, STAGE) / CHECKS_FILE)["checks"]
    return [dg.AssetCheckResult(
        check_name=name, asset_key=ASSET, passed=bool(r["passed"]), severity=_SEVERITY[r["severity"]],
        description=r["description"],
        metadata={k: _meta_value(v) for k, v in r["metadata"].items() if v is not None})
        for name, r in checks.items()]


def _report(ctx: StageContext, summary: dict[str, Any], run) -> dict[str, Any]:
    """Label-frequency plot (markdown image) and the check results in the metadata; both logged to MLflow."""
    out_dir = ctx.store.stage_dir(ctx.name, STAGE)
    plot = out_dir / LABEL_FREQ_PLOT
    run.log_artifact(plot)
    run.log_artifact(out_dir / CHECKS_FILE)
    b64 = base64.b64encode(plot.read_bytes()).decode()
    checks = load_json(out_dir / CHECKS_FILE)
    return {
        "label_frequency_plot": dg.MetadataValue.md(
            f"![label frequency vs rank (log-log)](data:image/png;base64,{b64})"),
        "label_frequency": dg.MetadataValue.json(checks["label_frequency"]),
        "checks_failed": dg.MetadataValue.text(", ".join(checks["failed"]) or "none"),
        "registry": dg.MetadataValue.text(summary.get("registry") or "unknown dataset (counts not checked)"),
    }


build = stage_asset(STAGE, group="data", kinds={"python", "parquet"}, description=__doc__,
                    extra_metadata=_report, check_specs=_check_specs, check_results=_check_results)
