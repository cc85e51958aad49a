"""The Dagster code location: every stage asset partitioned by dataset (dynamic partitions whose keys the
instance holds and whose options the catalog holds), the resources, the job that materializes a whole partition,
and the retraining automation on it (``click_log_sensor``, ``retrain_schedule``; both STOPPED until switched on,
see ``docs/AUTOMATION.md``). The only module of the library that imports Dagster."""

from __future__ import annotations

import dagster as dg

from xc_dagster.project import project_import

project_import("assets", "assets.automation", "resources")  # ours, whatever the working directory holds

from assets import build_assets, build_lifecycle_assets  # noqa: E402
from assets.automation import build_click_log_sensor, build_retrain_schedule  # noqa: E402
from resources.clicklogs import ClickLogFeedResource  # noqa: E402
from resources.compute import ComputeResource  # noqa: E402
from resources.home import XCHomeResource, dataset_partitions, sync_on_load  # noqa: E402
from resources.pools import pause_blocked_runs, repair_lost_assignments  # noqa: E402
from resources.tracking import MLflowResource  # noqa: E402
from xc_dagster.home import Home  # noqa: E402
from xc_dagster.strategies import STRATEGIES  # noqa: E402

PIPELINE_JOB = "xc_pipeline"
# Each step process forks from a server that imported the code location (torch, transformers, the pipeline, the
# definitions) once, instead of importing it all again (docs/decisions.md#forkserver-steps), and the modules the
# stages would import on first use: torch._dynamo (torch's optimizers import it when first made) and scikit-learn's
# text features (the lexical index), 2-5 s of each training, index, fusion and evaluation step
# (docs/decisions.md#concurrent-runs-time).
STEP_PRELOAD = ["xc_dagster.definitions", "torch._dynamo", "sklearn.feature_extraction.text"]
EXECUTOR = dg.multiprocess_executor.configured(
    {"start_method": {"forkserver": {"preload_modules": STEP_PRELOAD}}}, name="multiprocess")
JOB_DESCRIPTION = ("Every stage of one dataset partition, ingest to evaluation, then the registered MLflow model "
                   "and its champion gate. The dataset's catalog entry picks the strategy (`xc-dagster strategies` "
                   "prints each one's settings):\n\n"
                   + "\n".join(f"- `{name}`: {s.summary}" for name, s in STRATEGIES.items()))


def pipeline_resources(home: Home) -> dict[str, object]:
    """The resources every stage asset needs, bound to ``home``."""
    return {"home": XCHomeResource(root=str(home.root)), "mlflow": MLflowResource(), "compute": ComputeResource()}


def build_definitions(home: Home | None = None) -> dg.Definitions:
    """Definitions for the catalog under ``home`` (default: ``XC_HOME``). The partitions are dynamic: loading
    registers the catalog's datasets and the click-log feed's folders with the instance (``DAGSTER_HOME``) when
    it lacks them; later ones are added by ``xc-dagster datasets add`` and by the click-log sensor."""
    home = (home or Home.from_env()).ensure()
    repair_lost_assignments()  # the run worker claims its steps' pool slots in this process
    pause_blocked_runs()  # ... and loops over its steps while they wait for them
    clicklogs = ClickLogFeedResource()
    sync_on_load(home, extra=clicklogs.partition_names(home))
    partitions = dataset_partitions()
    assets = build_assets(partitions) + build_lifecycle_assets(partitions)
    job = dg.define_asset_job(PIPELINE_JOB, selection=dg.AssetSelection.all(), partitions_def=partitions,
                              description=JOB_DESCRIPTION)
    return dg.Definitions(
        assets=assets,
        jobs=[job],
        sensors=[build_click_log_sensor(job, partitions)],
        schedules=[build_retrain_schedule(job, partitions)],
        resources={**pipeline_resources(home), "clicklogs": clicklogs},
        executor=EXECUTOR,
    )


defs = build_definitions()
