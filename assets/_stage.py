"""What every stage asset does around its library call: resolve config, open the MLflow run, attach metadata.

Assets stay thin: each asset module declares the asset (group, kinds, description) and calls
``materialize_stage``; the work itself is ``xc_dagster.pipeline.STAGES[stage]``. The asset's name and its
``deps`` come from the artifact contract (``xc_dagster.artifacts.CONTRACT``): an asset depends on exactly the
stages whose artifacts it reads, so the asset graph is the data flow.

The training stages run out of the step's process when the compute resource's ``launcher`` says so
(``launch_stage``: ``python -m xc_dagster.training.launch`` in a subprocess or a Kubernetes pod, through Dagster
Pipes); the MLflow run, the metadata and the checks stay here either way.
"""

import json
from typing import Any, Callable, Sequence

import dagster as dg

from assets.config import CONFIG_CLASSES, run_overrides
from resources.compute import ComputeResource
from resources.home import XCHomeResource
from resources.pools import record_run_owner
from resources.tracking import MLflowResource
from xc_dagster.artifacts import CONTRACT, StageArtifacts
from xc_dagster.device import resolve_device
from xc_dagster.home import Home
from xc_dagster.pipeline import STAGE_ORDER, StageContext, run_stage
from xc_dagster.pipeline.provenance import with_upstream_params
from xc_dagster.strategies import STRATEGIES
from xc_dagster.tracking import RunLogger, Tracker, mlflow_dataset
from xc_dagster.training.launch import (
    HOME_ENV,
    RUN_ID_ENV,
    TRACKING_URI_ENV,
    LaunchRequest,
    launched_summary,
    step_logger,
)


def _flat_numbers(d: dict[str, Any], prefix: str = "") -> dict[str, float]:
    out: dict[str, float] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):  # a stage's "metrics" keep their MLflow names (precision_at_1, ...)
            out.update(_flat_numbers(v, "" if k == "metrics" else f"{key}."))
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            out[key.replace("@", "_at_")] = float(v)
    return out


def materialize_stage(context: dg.AssetExecutionContext, stage: str, config: dg.Config, home: XCHomeResource,
                      mlflow: MLflowResource, compute: ComputeResource,
                      extra_metadata: Callable[[StageContext, dict[str, Any], Any], dict[str, Any]] | None = None,
                      check_results: Callable[[StageContext, dict[str, Any]], list[dg.AssetCheckResult]] | None = None,
                      ) -> dg.MaterializeResult:
    dataset = context.partition_key
    record_run_owner(context.instance, context.run_id)  # so a later load can tell this run's process is gone
    h = home.home()
    spec = home.catalog().get(dataset)
    store = home.store()
    # upstream sections as their artifacts were built (an upstream run's run config included), not as this
    # run resolves them: what the stage uses and what MLflow logs (xc_dagster.pipeline.provenance)
    upstream = with_upstream_params(spec.config(run_overrides(stage, config)), store, dataset,
                                    STAGE_ORDER[:STAGE_ORDER.index(stage)])
    cfg = upstream.cfg
    for key, v in upstream.differs.items():
        context.log.info(f"{key} = {v['recorded']!r} as the upstream artifacts were built (this run's "
                         f"catalog/preset value: {v['resolved']!r})")
    launched = compute.launches(stage)  # a training stage out of this process (compute.launcher)
    tracker = mlflow.tracker(h)
    tags = {"dagster_run_id": context.run_id, "strategy": cfg.strategy, "preset": cfg.preset}
    with tracker.run(dataset, stage, cfg.flat(), tags) as run:
        log_metrics = step_logger(stage, context.log.info, run)  # the same step lines as a launched stage's
        ctx = StageContext(store=store, spec=spec, cfg=cfg, cache_dir=h.cache,
                           device=resolve_device("cpu") if launched else compute.torch_device(),
                           log_metrics=log_metrics, info=context.log.info,
                           tracking_uri=tracker.tracking_uri, stage=stage)
        summary = launch_stage(context, compute, ctx, h, tracker, run) if launched else run_stage(ctx, stage)
        ingest = summary if stage == "ingest" else ctx.read.summary("ingest", missing_ok=True)
        if ingest and ingest.get("source_fingerprint"):  # the data the run read, as MLflow's dataset input
            run.log_dataset(mlflow_dataset(dataset, ingest["source_fingerprint"], spec.source),
                            "test" if stage == "evaluate" else "train")
        numbers = _flat_numbers(summary)
        run.log_final(numbers)
        run.log_dict(summary, f"{stage}_summary.json")
        run.log_dict(cfg.flat(), "config.json")
        run.log_dict(upstream.report(), "config_sources.json")
        metadata: dict[str, Any] = {k: dg.MetadataValue.float(v) for k, v in numbers.items()}
        stage_dir = ctx.store.stage_dir(dataset, stage)
        size = sum(f.stat().st_size for f in stage_dir.rglob("*") if f.is_file())
        metadata.update({
            "artifact_bytes": dg.MetadataValue.int(int(size)),
            "mlflow_run_id": dg.MetadataValue.text(run.run_id),
            "artifacts": dg.MetadataValue.path(str(stage_dir)),
            "strategy": dg.MetadataValue.text(cfg.strategy),
            "strategy_help": dg.MetadataValue.md(f"**{cfg.strategy}**: {STRATEGIES[cfg.strategy].summary}"),
            "preset": dg.MetadataValue.text(cfg.preset),
            "config": dg.MetadataValue.json(json.loads(json.dumps(
                {k: v for k, v in cfg.flat().items() if k.startswith(stage + ".")}, default=str))),
        })
        if summary.get("published_version"):  # XC_ARTIFACT_ROOT: the remote version this materialization made
            metadata["published_version"] = dg.MetadataValue.text(str(summary["published_version"]))
        if upstream.differs:
            metadata["config_from_upstream"] = dg.MetadataValue.json(
                json.loads(json.dumps(upstream.differs, default=str)))
        if extra_metadata is not None:
            metadata.update(extra_metadata(ctx, summary, run))
        checks = check_results(ctx, summary) if check_results is not None else None
    return dg.MaterializeResult(metadata=metadata, check_results=checks)


def launch_stage(context: dg.AssetExecutionContext, compute: ComputeResource, ctx: StageContext, home: Home,
                 tracker: Tracker, run: RunLogger) -> dict[str, Any]:
    """Run ``ctx``'s training stage with the compute resource's launcher (``python -m xc_dagster.training.launch``
    through Dagster Pipes) with exactly ``ctx.cfg``; the child logs its step metrics into ``run`` and its lines to
    this step's log. Returns the summary it wrote to the artifact store (with the numbers it reported of its run)."""
    stage = str(ctx.stage)
    request = LaunchRequest(stage, ctx.spec, ctx.cfg, compute.device, compute.threads)
    env = {HOME_ENV: str(home.root), TRACKING_URI_ENV: tracker.tracking_uri, RUN_ID_ENV: run.run_id}
    context.log.info(f"{stage} {ctx.name}: launching the stage with compute.launcher={compute.launcher}")
    reported = compute.launch(context, request, env)
    return launched_summary(ctx.store, ctx.name, stage, reported)


ExtraMetadata = Callable[[StageContext, dict[str, Any], Any], dict[str, Any]]
CheckResults = Callable[[StageContext, dict[str, Any]], list[dg.AssetCheckResult]]
CheckSpecs = Callable[[dg.PartitionsDefinition], Sequence[dg.AssetCheckSpec]]


def asset_deps(entry: StageArtifacts) -> list[str]:
    """The assets whose artifacts ``entry`` reads, in pipeline order (its Dagster ``deps``)."""
    return [CONTRACT[s].asset for s in entry.reads]


def stage_asset(stage: str, group: str, kinds: set[str], description: str,
                extra_metadata: ExtraMetadata | None = None,
                check_specs: CheckSpecs | None = None,
                check_results: CheckResults | None = None,
                pool: str | None = None) -> Callable[[dg.PartitionsDefinition], dg.AssetsDefinition]:
    """A builder of the asset of library stage ``stage`` (its name and deps from the artifact contract) for the
    given dataset partitions.

    ``check_specs(partitions)`` declares asset checks on it (partitioned like the asset);
    ``check_results(ctx, summary)`` reports them with the materialization (one result per spec).
    ``pool``: the Dagster concurrency pool its step takes a slot of (the training stages: ``xc_training``, whose
    limit the instance's ``dagster.yaml`` sets), None for none.
    """
    config_cls = CONFIG_CLASSES[stage]

    def build(partitions: dg.PartitionsDefinition) -> dg.AssetsDefinition:
        @dg.asset(name=CONTRACT[stage].asset, deps=asset_deps(CONTRACT[stage]), partitions_def=partitions,
                  group_name=group, kinds=kinds, description=description,
                  check_specs=list(check_specs(partitions)) if check_specs is not None else None, pool=pool)
        def _asset(context: dg.AssetExecutionContext, config: config_cls, home: XCHomeResource,  # type: ignore[valid-type]
                   mlflow: MLflowResource, compute: ComputeResource) -> dg.MaterializeResult:
            return materialize_stage(context, stage, config, home, mlflow, compute, extra_metadata, check_results)

        return _asset

    return build
