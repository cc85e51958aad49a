"""The registered MLflow model of a dataset (after evaluation): an MLflow pyfunc bundling the encoder,
tokenizer, classifier matrix, label ids and texts, both ANNS indexes and the fusion; text in, top-k labels
with scores out (``params={"k": ...}``). Registered as ``xc-<dataset>``: the first version gets the alias
``champion``, later ones ``challenger``. The blocking check ``champion_gate`` compares the challenger's test
P@1 and PSP@1 with the champion's on the same test split and promotes it (moves ``champion``) when neither
is worse by more than ``tolerance`` percentage points (the run config's; without one, as in the runs of the
click-log sensor and the retrain schedule, the dataset's catalog ``gate_tolerance``, else 0); refused, the
check fails with severity ERROR, which blocks assets downstream of this one. A model that cannot serve text (its
points had none: BoW features without their vocabulary) is not registered: the asset says why, and the check fails
with severity WARN. Serve the champion with ``mlflow models serve -m models:/xc-<dataset>@champion --env-manager
local``."""


import json
import warnings
from typing import Any, Optional

import dagster as dg
import pydantic

from assets._stage import asset_deps
from resources.compute import ComputeResource
from resources.home import XCHomeResource
from resources.tracking import MLflowResource
from xc_dagster.artifacts import REGISTERED_MODEL
from xc_dagster.pipeline import STAGE_ORDER, StageContext
from xc_dagster.pipeline.provenance import with_upstream_params
from xc_dagster.serving.bundle import unservable
from xc_dagster.serving.registry import champion_gate, register_model

ASSET = REGISTERED_MODEL.asset
CHECK = "champion_gate"
CHECK_DESCRIPTION = ("Champion/challenger gate: the new version's test P@1 and PSP@1 against the champion's on "
                     "the same test split; promoted (alias champion moves) when neither is worse by more than "
                     "the tolerance; passes for the first version. Refused: fails with severity ERROR (blocking).")


class RegisteredModelConfig(dg.Config):
    """How the model is logged and gated."""

    tolerance: Optional[float] = pydantic.Field(
        default=None, ge=0.0, description="how many percentage points of test P@1 and of PSP@1 the challenger may "
                                          "lose against the champion and still be promoted (0.5 = half a point); "
                                          "empty = the dataset's catalog gate_tolerance, else 0")
    default_k: int = pydantic.Field(default=10, ge=1, description="top-k returned when a request gives no k")
    bundle_code: bool = pydantic.Field(
        default=True, description="ship a copy of the xc_dagster library with the model (MLflow code_paths)")
    shortlist_size: int = pydantic.Field(
        default=0, ge=0, description="neighbours per index when serving (0 = index.shortlist_size, as evaluated); "
                                     "another value re-evaluates the model so the gate sees the served numbers")
    ef_search: int = pydantic.Field(default=0, ge=0, description="HNSW efSearch when serving (0 = as evaluated)")
    graph_above: int = pydantic.Field(
        default=0, ge=0, description="serve each exact index of more vectors than this from an HNSW graph built at "
                                     "registration (single-query latency); 0 = as evaluated. Re-evaluates the model")


def _check_spec(partitions: dg.PartitionsDefinition) -> dg.AssetCheckSpec:
    """Blocking and partitioned like the asset (as ingest's checks; preview feature in Dagster 1.13)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", getattr(dg, "PreviewWarning", Warning))
            return dg.AssetCheckSpec(CHECK, asset=ASSET, blocking=True, partitions_def=partitions,
                                     description=CHECK_DESCRIPTION)
    except TypeError:
        return dg.AssetCheckSpec(CHECK, asset=ASSET, blocking=True, description=CHECK_DESCRIPTION)


def _json(v: Any) -> dg.MetadataValue:
    return dg.MetadataValue.json(json.loads(json.dumps(v, default=str)))


def _pct(metrics: dict[str, float] | None, name: str) -> float | None:
    return None if metrics is None or metrics.get(name) is None else round(100.0 * float(metrics[name]), 4)


def _gate_result(decision: dict[str, Any]) -> dg.AssetCheckResult:
    meta: dict[str, Any] = {
        "decision": dg.MetadataValue.text(decision["verdict"]),
        "promoted": dg.MetadataValue.bool(bool(decision["promote"])),
        "tolerance_pp": dg.MetadataValue.float(decision["tolerance_pp"]),
        "tolerance_source": dg.MetadataValue.text(str(decision.get("tolerance_source", "argument"))),
        "challenger_version": dg.MetadataValue.text(decision["challenger_version"]),
        "champion_version": dg.MetadataValue.text(str(decision["champion_version"])),
        "champion_metrics_source": dg.MetadataValue.text(str(decision["champion_metrics_source"])),
        "challenger_metrics": _json(decision["challenger"]),
        "champion_metrics": _json(decision["champion"]),
        "delta_pp": _json(decision["delta_pp"]),
        "reasons": dg.MetadataValue.md("\n".join(f"- {r}" for r in decision["reasons"])),
        "aliases": _json(decision["aliases"]),
    }
    for side in ("challenger", "champion"):
        for m, label in (("precision_at_1", "P@1"), ("psprecision_at_1", "PSP@1")):
            v = _pct(decision[side], m)
            if v is not None:
                meta[f"{side} {label}"] = dg.MetadataValue.float(v)
    return dg.AssetCheckResult(check_name=CHECK, asset_key=ASSET, passed=bool(decision["promote"]),
                               severity=dg.AssetCheckSeverity.ERROR, description=decision["verdict"],
                               metadata=meta)


def build(partitions: dg.PartitionsDefinition) -> dg.AssetsDefinition:
    @dg.asset(name=ASSET, deps=asset_deps(REGISTERED_MODEL), partitions_def=partitions, group_name="serving",
              kinds={"mlflow", "python"}, description=__doc__, check_specs=[_check_spec(partitions)])
    def registered_model(context: dg.AssetExecutionContext, config: RegisteredModelConfig, home: XCHomeResource,
                         mlflow: MLflowResource, compute: ComputeResource) -> dg.MaterializeResult:
        dataset = context.partition_key
        h = home.home()
        spec = home.catalog().get(dataset)
        store = home.store()
        # every stage's section as its artifacts were built (xc_dagster.pipeline.provenance): the bundle and the params
        cfg = with_upstream_params(spec.config(), store, dataset, STAGE_ORDER).cfg
        device = compute.torch_device()
        ctx = StageContext(store=store, spec=spec, cfg=cfg, cache_dir=h.cache, device=device,
                           info=context.log.info, stage=REGISTERED_MODEL.stage)
        why = unservable(ctx)
        if why:  # the model was evaluated; what it reads is not what a text request carries
            context.log.warning(f"registered_model {dataset}: not registered: {why}")
            return dg.MaterializeResult(
                metadata={"registered": dg.MetadataValue.bool(False), "why": dg.MetadataValue.text(why)},
                check_results=[dg.AssetCheckResult(check_name=CHECK, asset_key=ASSET, passed=False,
                                                   severity=dg.AssetCheckSeverity.WARN,
                                                   description=f"not registered: {why}")])
        tracker = mlflow.tracker(h)
        reg = register_model(ctx, tracker, {"dagster_run_id": context.run_id, "strategy": cfg.strategy,
                                            "preset": cfg.preset},
                             default_k=config.default_k, bundle_code=config.bundle_code, device=device,
                             shortlist_size=config.shortlist_size, ef_search=config.ef_search,
                             graph_above=config.graph_above)
        tolerance, tolerance_source = spec.champion_tolerance(config.tolerance)
        decision = champion_gate(ctx, tracker, reg, tolerance, device=device)
        decision["tolerance_source"] = tolerance_source
        metadata = {
            "model_name": dg.MetadataValue.text(reg["name"]),
            "version": dg.MetadataValue.text(reg["version"]),
            "alias": dg.MetadataValue.text(_alias_after(decision, reg)),
            "model_uri": dg.MetadataValue.text(reg["model_uri"]),
            "champion_uri": dg.MetadataValue.text(f"models:/{reg['name']}@champion"),
            "logged_model_uri": dg.MetadataValue.text(reg["artifact_uri"]),
            "mlflow_run_id": dg.MetadataValue.text(reg["run_id"]),
            "evaluation_run_id": dg.MetadataValue.text(str(reg["evaluation_run_id"])),
            "P@1": dg.MetadataValue.float(_pct(reg["metrics"], "precision_at_1")),
            "PSP@1": dg.MetadataValue.float(_pct(reg["metrics"], "psprecision_at_1")),
            "metrics_source": dg.MetadataValue.text(reg["metrics_source"]),
            "gate": dg.MetadataValue.text(decision["verdict"]),
            "serve": dg.MetadataValue.md(f"`mlflow models serve -m models:/{reg['name']}@champion "
                                         f"--env-manager local -p 5001`"),
            "serving": _json(reg["serving"]),
        }
        return dg.MaterializeResult(metadata=metadata, check_results=[_gate_result(decision)])

    return registered_model


def _alias_after(decision: dict[str, Any], reg: dict[str, Any]) -> str:
    """The version's alias after the gate: champion when promoted (or first), else challenger."""
    return "champion" if decision["promote"] else reg["alias"]
