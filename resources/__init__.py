"""Dagster resources: the home folder (storage root + catalog), MLflow tracking, compute device, the
click-log feed the retraining sensor watches."""

from resources.clicklogs import ClickLogFeedResource
from resources.compute import ComputeResource
from resources.home import XCHomeResource, dataset_partitions
from resources.partitions import DATASETS, register, registered, sync_on_load
from resources.tracking import MLflowResource

__all__ = ["DATASETS", "ClickLogFeedResource", "ComputeResource", "MLflowResource", "XCHomeResource",
           "dataset_partitions", "register", "registered", "sync_on_load"]
