"""Model comparison: the evaluation runs of a dataset from MLflow, best first, beside reference results.

Every evaluation run logs the same metric names (precision_at_1, psprecision_at_5, ...), the full effective
config as params (strategy, preset, tokenize.encoder, every hyperparameter) and each stage's wall seconds
(``stage_seconds.<stage>``, ``stage_seconds.training_total``), so runs of different strategies line up here
and in MLflow's compare view. Reference rows are the papers' published numbers (or the team's measured
baselines) for the dataset, from :mod:`xc_dagster.data.registry`.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field
from pathlib import Path

from mlflow.tracking import MlflowClient

from xc_dagster.data.registry import reference_results
from xc_dagster.tracking import experiment_name

COMPARE_METRICS = ("precision_at_1", "precision_at_3", "precision_at_5", "psprecision_at_1",
                   "psprecision_at_3", "psprecision_at_5", "ndcg_at_5", "coverage_at_5")
_SHORT = {"precision": "P", "psprecision": "PSP", "ndcg": "nDCG", "psndcg": "PSnDCG", "recall": "R",
          "coverage": "cov"}


@dataclass
class ComparisonRow:
    """One line of the comparison: a run (metrics as fractions x 100) or a reference result."""

    label: str  # run id prefix, or "ref"
    strategy: str  # strategy, or the reference's method
    preset: str = ""
    encoder: str = ""
    when: str = ""  # run start (UTC), or the reference's source
    metrics: dict[str, float] = field(default_factory=dict)  # in percent
    train_minutes: float | None = None
    reference: bool = False
    params: dict[str, str] = field(default_factory=dict)  # the run's full effective config


def evaluation_runs(tracking_uri: str, dataset: str) -> list[ComparisonRow]:
    """Finished evaluation runs of ``dataset`` (experiment ``xc-dagster/<dataset>``), newest first."""
    client = MlflowClient(tracking_uri=tracking_uri)
    exp = client.get_experiment_by_name(experiment_name(dataset))
    if exp is None:
        return []
    runs = client.search_runs([exp.experiment_id], "tags.asset = 'evaluate' and attributes.status = 'FINISHED'",
                              order_by=["attributes.start_time DESC"], max_results=1000)
    rows = []
    for r in runs:
        p, m = r.data.params, r.data.metrics
        enc = p.get("tokenize.encoder", "")
        train_s = m.get("stage_seconds.training_total")
        rows.append(ComparisonRow(
            label=r.info.run_id[:8], strategy=p.get("strategy", r.data.tags.get("strategy", "?")),
            preset=p.get("preset", ""), encoder=Path(enc).name if "/" in enc else enc,
            when=dt.datetime.fromtimestamp(r.info.start_time / 1000, dt.timezone.utc).strftime("%Y-%m-%d %H:%M"),
            metrics={k: 100 * v for k, v in m.items() if k in COMPARE_METRICS},
            train_minutes=None if train_s is None else train_s / 60, params=dict(p)))
    return rows


_SHOWN = {"strategy", "preset", "tokenize.encoder"}
_NOT_MODEL = ("evaluate.", "ingest.verify_counts")  # evaluation settings, not the model's


def differing_params(rows: list[ComparisonRow]) -> list[str]:
    """Config keys whose values differ between the runs (beyond strategy, preset and encoder, shown anyway)."""
    keys = sorted({k for r in rows for k in r.params} - _SHOWN)
    return [k for k in keys if not k.startswith(_NOT_MODEL) and len({r.params.get(k) for r in rows}) > 1]


def reference_rows(dataset: str) -> list[ComparisonRow]:
    """The registry's reference results of ``dataset`` as comparison rows."""
    return [ComparisonRow("ref", r.method, when=r.source, metrics=dict(r.metrics), reference=True,
                          train_minutes=None if r.train_hours is None else 60 * r.train_hours)
            for r in reference_results(dataset)]


def rank_runs(rows: list[ComparisonRow], sort_by: str = "precision_at_1") -> list[ComparisonRow]:
    """Runs best first by ``sort_by`` (then PSP@1, then newest); runs missing the metric go last."""
    def key(r: ComparisonRow) -> tuple:
        v = r.metrics.get(sort_by)
        return (v is None, -(v or 0.0), -r.metrics.get("psprecision_at_1", 0.0))
    return sorted(rows, key=key)


def _header(metric: str) -> str:
    fam, _, k = metric.rpartition("_at_")
    return f"{_SHORT.get(fam, fam)}@{k}"


def comparison_table(runs: list[ComparisonRow], refs: list[ComparisonRow],
                     metrics: tuple[str, ...] = COMPARE_METRICS) -> str:
    """Fixed-width text table: runs (ranked by the caller), a rule, then reference rows with their source.

    The last column lists, for each run, the hyperparameters whose values differ between the runs shown.
    """
    heads = ["#", "run", "strategy", "preset", "encoder", "started (UTC)"] + [_header(m) for m in metrics] + [
        "train min", "differs"]
    lines = []

    diff = differing_params(runs)

    def cells(i: str, r: ComparisonRow) -> list[str]:
        vals = ["" if r.metrics.get(m) is None else f"{r.metrics[m]:.2f}" for m in metrics]
        tm = "" if r.train_minutes is None else f"{r.train_minutes:.1f}"
        rest = " ".join(f"{k}={r.params.get(k, '-')}" for k in diff) if not r.reference else ""
        return [i, r.label, r.strategy, r.preset, r.encoder, "" if r.reference else r.when] + vals + [tm, rest]

    body = [cells(str(i + 1), r) for i, r in enumerate(runs)]
    ref_body = [cells("", r) for r in refs]
    widths = [max(len(x) for x in col) for col in zip(heads, *body, *ref_body)]

    last = len(heads) - 1

    def fmt(row: list[str]) -> str:
        return "  ".join(c.ljust(w) if j < 6 or j == last else c.rjust(w)
                         for j, (c, w) in enumerate(zip(row, widths))).rstrip()

    lines.append(fmt(heads))
    lines.append("  ".join("-" * w for w in widths))
    lines.extend(fmt(r) for r in body)
    if ref_body:
        lines.append("  ".join("-" * w for w in widths))
        lines.extend(fmt(r) for r in ref_body)
        lines.append("")
        lines.append("reference rows:")
        lines.extend(f"  {r.strategy}: {r.when}" for r in refs)
    return "\n".join(lines)
