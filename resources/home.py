"""The XC home folder as a resource: storage root for artifacts, the dataset catalog, the cache; and the catalog's
datasets registered as partitions with the Dagster instance when the definitions load."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from pathlib import Path

import dagster as dg

from resources.partitions import DATASETS, register
from resources.pools import ensure_pool, release_dead_runs
from xc_dagster.catalog import Catalog
from xc_dagster.home import Home
from xc_dagster.storage import ArtifactStore

log = logging.getLogger("xc_dagster")


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


def sync_catalog(instance: dg.DagsterInstance, home: Home, extra: Iterable[str] = ()) -> list[str]:
    """Register every catalog dataset (plus ``extra``, e.g. the click-log feed's folders) the instance lacks."""
    return register(instance, set(Catalog(home.catalog).names()) | set(extra))


def sync_on_load(home: Home, extra: Iterable[str] = ()) -> list[str]:
    """At code-location load: register the catalog's datasets with the instance of ``DAGSTER_HOME`` (the CLI,
    webserver and daemon set it), make the training pool's limit row and free the slots of killed runs
    (``resources.pools``). Without an instance (a bare Python import) nothing is done: logged, not raised."""
    if not os.environ.get("DAGSTER_HOME"):
        log.info("DAGSTER_HOME not set: the catalog's datasets are registered as partitions when an instance "
                 "loads these definitions")
        return []
    instance = dg.DagsterInstance.get()
    ensure_pool(instance)
    release_dead_runs(instance)
    added = sync_catalog(instance, home, extra)
    if added:
        log.info("registered dataset partitions from the catalog: %s", ", ".join(added))
    return added
