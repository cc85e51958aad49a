"""Retraining automation, both STOPPED by default (switch them on in the UI's Automation page; they run in
the Dagster daemon, which ``dagster dev`` starts with the webserver). See ``docs/AUTOMATION.md``.

``click_log_sensor``: every ``$XC_CLICKLOG_INTERVAL`` seconds (default 60) lists the click-log feed
(resource ``clicklogs``); for each dataset folder with new or changed files (a drop) builds the dataset
from them, points its catalog entry at it and requests a pipeline run of that partition (run key unique per
drop: a drop never trains twice). Its cursor records the files consumed. A drop that fails to build (a
bad file, named with its line, or any other error) is not consumed and is logged; the other feeds' drops
still build and run, and when no drop was built the tick fails with those errors. A failed drop is retried
once the file is fixed or removed.

``retrain_schedule``: on ``$XC_RETRAIN_CRON`` (default ``0 3 * * *``, in ``$XC_RETRAIN_TIMEZONE``, default
UTC) requests a pipeline run for every partition whose source changed since its last ingest.

Both skip a partition while a run of it is queued or in progress. The library logic is
``xc_dagster.serving.retraining``.
"""

from __future__ import annotations

import os
import time

import dagster as dg

from resources.clicklogs import ClickLogFeedResource
from resources.home import XCHomeResource, sync_catalog
from resources.partitions import DATASETS, registered
from xc_dagster.config.env import env_positive
from xc_dagster.errors import XCError
from xc_dagster.serving.retraining import (
    build_drop,
    decode_cursor,
    encode_cursor,
    list_feeds,
    pending_drops,
)
from xc_dagster.serving.source_changes import changed_datasets

SENSOR = "click_log_sensor"
SCHEDULE = "retrain_schedule"
ENV_CRON, DEFAULT_CRON = "XC_RETRAIN_CRON", "0 3 * * *"
ENV_TIMEZONE, DEFAULT_TIMEZONE = "XC_RETRAIN_TIMEZONE", "UTC"
ENV_INTERVAL, DEFAULT_INTERVAL = "XC_CLICKLOG_INTERVAL", 60
TRIGGER_TAG = "xc/trigger"
ACTIVE_STATUSES = [dg.DagsterRunStatus.QUEUED, dg.DagsterRunStatus.NOT_STARTED, dg.DagsterRunStatus.STARTING,
                   dg.DagsterRunStatus.STARTED, dg.DagsterRunStatus.CANCELING]


def active_run(instance: dg.DagsterInstance, partition: str) -> str | None:
    """The id of a queued or in-progress run of ``partition``, if any."""
    runs = instance.get_runs(filters=dg.RunsFilter(tags={"dagster/partition": partition},
                                                   statuses=ACTIVE_STATUSES), limit=1)
    return runs[0].run_id if runs else None


def _interval() -> int:
    return int(env_positive(ENV_INTERVAL, DEFAULT_INTERVAL))  # seconds between sensor ticks


def build_click_log_sensor(job: dg.UnresolvedAssetJobDefinition,
                           partitions: dg.PartitionsDefinition) -> dg.SensorDefinition:
    @dg.sensor(name=SENSOR, job=job, minimum_interval_seconds=_interval(),
               default_status=dg.DefaultSensorStatus.STOPPED,
               description="New click-log files under the feed root (resource clicklogs; $XC_CLICKLOG_ROOT, "
                           "default $XC_HOME/clicklog-inbox/<dataset>/) -> the dataset rebuilt from them, its "
                           "catalog entry updated, and a run of the pipeline for that partition.")
    def click_log_sensor(context: dg.SensorEvaluationContext, home: XCHomeResource,
                         clicklogs: ClickLogFeedResource) -> dg.SensorResult:
        h = home.home()
        root = clicklogs.root_for(h)
        seen = decode_cursor(context.cursor)
        listing = list_feeds(root)
        drops, waiting = pending_drops(listing, seen, now=time.time(), settle_seconds=clicklogs.settle_seconds,
                                       history=clicklogs.history)
        known = registered(context.instance)
        notes = [f"{name}: {why}" for name, why in waiting.items()]
        notes += [f"folder {name!r} under {root} ignored: not a valid dataset name" for name in listing.ignored]
        requests: list[dg.RunRequest] = []
        errors: list[str] = []
        new_partitions: list[str] = []  # feeds seen for the first time: added with the run requests
        for drop in drops:
            run_id = active_run(context.instance, drop.name)
            if run_id is not None:
                notes.append(f"{drop.name}: {len(drop.new)} new file(s) wait for run {run_id} of this "
                             "partition to finish")
                continue
            try:
                info = build_drop(h, root, drop, min_clicks=clicklogs.min_clicks,
                                  test_fraction=clicklogs.test_fraction)
            except Exception as e:  # any failure is this feed's alone: the other feeds' drops still build and run
                why = str(e) if isinstance(e, XCError) else f"{type(e).__name__}: {e}"
                errors.append(f"{drop.name}: {why}")
                context.log.error(f"click-log drop of {drop.name} not built: {why}")
                continue
            seen.setdefault(drop.name, {}).update(drop.consumed())
            if drop.name not in known:
                new_partitions.append(drop.name)
            context.log.info(f"{drop.name}: {len(drop.new)} new file(s) -> {info['folder']} ({info['n_train']} "
                             f"train / {info['n_test']} test queries, {info['n_labels']} labels, "
                             f"{info['n_new_labels']} new); catalog entry {info['registered']}")
            requests.append(dg.RunRequest(
                run_key=drop.run_key, partition_key=drop.name,
                tags={TRIGGER_TAG: SENSOR, "xc/drop": drop.digest, "xc/clicklog_folder": info["folder"],
                      "xc/new_files": str(len(drop.new))}))
        for note in notes:
            context.log.info(note)
        if errors and not requests:
            raise XCError("click-log sensor: the drop was not built (fix or remove the file; the drop is "
                          "retried on the next tick): " + " | ".join(errors))
        if requests:
            added = [dg.AddDynamicPartitionsRequest(partitions_def_name=DATASETS.name,
                                                    partition_keys=new_partitions)] if new_partitions else None
            return dg.SensorResult(run_requests=requests, dynamic_partitions_requests=added,
                                   cursor=encode_cursor(seen))
        if not drops and not waiting:
            notes.insert(0, f"no new click-log files under {root}")
        return dg.SensorResult(skip_reason="; ".join(notes), cursor=context.cursor)

    return click_log_sensor


def build_retrain_schedule(job: dg.UnresolvedAssetJobDefinition,
                           partitions: dg.PartitionsDefinition) -> dg.ScheduleDefinition:
    @dg.schedule(name=SCHEDULE, job=job, cron_schedule=os.environ.get(ENV_CRON) or DEFAULT_CRON,
                 execution_timezone=os.environ.get(ENV_TIMEZONE) or DEFAULT_TIMEZONE,
                 default_status=dg.DefaultScheduleStatus.STOPPED,
                 description="A pipeline run for every dataset partition whose source changed since its last "
                             f"ingest (cron ${ENV_CRON}, default '{DEFAULT_CRON}').")
    def retrain_schedule(context: dg.ScheduleEvaluationContext, home: XCHomeResource):
        h = home.home()
        sync_catalog(context.instance, h)  # a dataset written to the catalog by hand becomes a partition too
        requests, notes = [], []
        for change in changed_datasets(h):
            if not change.changed:
                notes.append(f"{change.name}: {change.reason}")
            elif (run_id := active_run(context.instance, change.name)) is not None:
                notes.append(f"{change.name}: changed, but run {run_id} of it is queued or in progress")
            else:
                context.log.info(f"{change.name}: {change.reason}; requesting a run")
                requests.append(dg.RunRequest(run_key=change.run_key, partition_key=change.name,
                                              tags={TRIGGER_TAG: SCHEDULE, "xc/reason": change.reason[:500]}))
        for note in notes:
            context.log.info(note)
        return requests or dg.SkipReason("; ".join(notes) or "no datasets in the catalog")

    return retrain_schedule
