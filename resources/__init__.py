"""Dagster resources: the home folder (storage root + catalog), MLflow tracking, compute device."""

from resources.compute import ComputeResource
from resources.home import XCHomeResource, dataset_partitions
from resources.tracking import MLflowResource

__all__ = ["ComputeResource", "MLflowResource", "XCHomeResource", "dataset_partitions"]
