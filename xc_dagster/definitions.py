"""The Dagster code location: every stage asset partitioned by the catalog's datasets, the resources, the
job that materializes a whole partition, and the retraining automation on it (``click_log_sensor``,
``retrain_schedule``; both STOPPED until switched on, see ``docs/AUTOMATION.md``). The only module of the
library that imports Dagster."""

from __future__ import annotations

import dagster as dg

from assets import build_assets, build_lifecycle_assets
from assets.automation import build_click_log_sensor, build_retrain_schedule
from resources import ClickLogFeedResource, ComputeResource, MLflowResource, XCHomeResource, dataset_partitions
from xc_dagster.home import Home
from xc_dagster.strategies import STRATEGIES

PIPELINE_JOB = "xc_pipeline"
JOB_DESCRIPTION = ("Every stage of one dataset partition, ingest to evaluation, then the registered MLflow model "
                   "and its champion gate. The dataset's catalog entry picks the strategy (`xc-dagster strategies` "
                   "prints each one's settings):\n\n"
                   + "\n".join(f"- `{name}`: {s.summary}" for name, s in STRATEGIES.items()))


def pipeline_resources(home: Home) -> dict[str, object]:
    """The resources every stage asset needs, bound to ``home``."""
    return {"home": XCHomeResource(root=str(home.root)), "mlflow": MLflowResource(), "compute": ComputeResource()}


def build_definitions(home: Home | None = None) -> dg.Definitions:
    """Definitions for the catalog under ``home`` (default: ``XC_HOME``); the partitions are the catalog's
    datasets plus the click-log feed's dataset folders (whose catalog entries the sensor creates)."""
    home = (home or Home.from_env()).ensure()
    clicklogs = ClickLogFeedResource()
    partitions = dataset_partitions(home, extra=clicklogs.partition_names(home))
    assets = build_assets(partitions) + build_lifecycle_assets(partitions)
    job = dg.define_asset_job(PIPELINE_JOB, selection=dg.AssetSelection.all(), partitions_def=partitions,
                              description=JOB_DESCRIPTION)
    return dg.Definitions(
        assets=assets,
        jobs=[job],
        sensors=[build_click_log_sensor(job, partitions)],
        schedules=[build_retrain_schedule(job, partitions)],
        resources={**pipeline_resources(home), "clicklogs": clicklogs},
    )


defs = build_definitions()
