"""The XC home folder as a resource: storage root for artifacts, the dataset catalog, the cache."""

from __future__ import annotations

from pathlib import Path

import dagster as dg

from resources.partitions import DATASETS
from xc_dagster.catalog import Catalog
from xc_dagster.home import Home
from xc_dagster.storage import ArtifactStore


class XCHomeResource(dg.ConfigurableResource):
    """Where all state lives. ``root`` empty = the ``XC_HOME`` environment variable (default ~/.xc-dagster)."""

    root: str = ""

    def home(self) -> Home:
        return (Home(Path(self.root).expanduser().resolve()) if self.root else Home.from_env()).ensure()

    def store(self) -> ArtifactStore:
        return ArtifactStore(self.home().artifacts)

    def catalog(self) -> Catalog:
        return Catalog(self.home().catalog)


def dataset_partitions() -> dg.DynamicPartitionsDefinition:
    """The dataset partitions: dynamic, their keys in the Dagster instance (``resources.partitions``)."""
    return DATASETS
