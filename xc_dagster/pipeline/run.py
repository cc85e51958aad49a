"""The stages by name, and ``run_all``: the whole pipeline without Dagster (scripts, notebooks, a GPU box)."""

from __future__ import annotations

import dataclasses
import resource
import sys
import time
from typing import Any, Callable

from xc_dagster.artifacts import CONTRACT, STAGE_ORDER
from xc_dagster.errors import XCConfigError
from xc_dagster.pipeline import classifier, evaluate, fusion, index, ingest, mining, pretrain, tokenize
from xc_dagster.pipeline.context import StageContext
from xc_dagster.pipeline.provenance import with_upstream_params

Stage = Callable[[StageContext], dict[str, Any]]
STAGES: dict[str, Stage] = {
    "ingest": ingest.run, "tokenize": tokenize.run, "pretrain": pretrain.run, "mining": mining.run,
    "classifier": classifier.run, "index": index.run, "fusion": fusion.run, "evaluate": evaluate.run,
}


def run_stage(ctx: StageContext, stage: str) -> dict[str, Any]:
    """Run one stage with ``ctx`` bound to it (its ``ctx.writing`` records the config it ran with in its artifacts).

    With a remote artifact root (``XC_ARTIFACT_ROOT``) the stages it reads are first brought to their published
    versions, and its complete folder (the record included) is published after it: the run fails if that fails."""
    sync_reads(ctx, stage)
    return finish_stage(ctx, stage, STAGES[stage](ctx.for_stage(stage)))


def sync_reads(ctx: StageContext, stage: str) -> None:
    """Bring the stages ``stage`` reads to their published versions (a remote root; file-locked: processes sharing
    a store fetch a stage once)."""
    for upstream in CONTRACT[stage].reads:
        ctx.store.sync(ctx.name, upstream)


def finish_stage(ctx: StageContext, stage: str, summary: dict[str, Any], writer: bool = True) -> dict[str, Any]:
    """After a stage ran: the process that wrote its artifacts (``writer``; rank 0 of several) publishes the folder
    (the config it ran with recorded in it by ``ctx.writing``) to a remote root; every process adds its peak memory
    to ``summary``."""
    if writer:
        published = ctx.store.publish(ctx.name, stage)
        if published is not None:  # in the MLflow run's <stage>_summary.json: which remote version this run made
            summary["published_version"] = published.version
    summary["peak_rss_mb"] = peak_rss_mb()  # the step's own peak under Dagster's multiprocess executor
    return summary


def peak_rss_mb() -> float:
    """This process's peak resident memory so far, MiB (ru_maxrss: KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return round(peak / (1 << 20 if sys.platform == "darwin" else 1 << 10), 1)


def run_all(ctx: StageContext, stages: tuple[str, ...] = STAGE_ORDER) -> dict[str, dict[str, Any]]:
    """Run the stages in order without Dagster; returns every summary.

    As the Dagster assets do (``xc_dagster.pipeline.provenance``): the sections of the stages before the first one
    run come from their artifacts' records, and each stage run records the config it ran with."""
    unknown = [s for s in stages if s not in STAGES]
    if unknown:
        raise XCConfigError(f"run_all: unknown stage(s) {unknown}; stages are {list(STAGE_ORDER)}")
    first = min((STAGE_ORDER.index(s) for s in stages), default=0)
    ctx = dataclasses.replace(ctx, cfg=with_upstream_params(ctx.cfg, ctx.store, ctx.name, STAGE_ORDER[:first]).cfg)
    out = {}
    for s in stages:
        t0 = time.perf_counter()
        out[s] = run_stage(ctx, s)
        out[s]["wall_seconds"] = time.perf_counter() - t0
        ctx.info(f"stage {s} done in {out[s]['wall_seconds']:.1f}s")
    return out
