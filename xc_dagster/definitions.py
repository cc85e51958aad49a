"""The Dagster code location: every stage asset partitioned by the catalog's datasets, the resources, and
the job that materializes a whole partition. The only module of the library that imports Dagster."""

from __future__ import annotations

import dagster as dg

from assets import build_assets, build_lifecycle_assets
from resources import ComputeResource, MLflowResource, XCHomeResource, dataset_partitions
from xc_dagster.home import Home

PIPELINE_JOB = "xc_pipeline"


def pipeline_resources(home: Home) -> dict[str, object]:
    """The resources every stage asset needs, bound to ``home``."""
    return {"home": XCHomeResource(root=str(home.root)), "mlflow": MLflowResource(), "compute": ComputeResource()}


def build_definitions(home: Home | None = None) -> dg.Definitions:
    """Definitions for the catalog under ``home`` (default: ``XC_HOME``)."""
    home = (home or Home.from_env()).ensure()
    partitions = dataset_partitions(home)
    assets = build_assets(partitions) + build_lifecycle_assets(partitions)
    job = dg.define_asset_job(PIPELINE_JOB, selection=dg.AssetSelection.all(), partitions_def=partitions,
                              description="Every stage of one dataset partition, ingest to evaluation, then "
                                          "the registered MLflow model and its champion gate.")
    return dg.Definitions(
        assets=assets,
        jobs=[job],
        resources=pipeline_resources(home),
    )


defs = build_definitions()
