"""The XC home folder as a resource: storage root for artifacts, the dataset catalog, the cache."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import dagster as dg

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


def dataset_partitions(home: Home | None = None, extra: Iterable[str] = ()) -> dg.StaticPartitionsDefinition:
    """One partition per catalog dataset (plus ``extra`` names: the click-log feed's dataset folders, whose
    catalog entries the sensor creates), read when the code location loads (reload to see new ones)."""
    home = home or Home.from_env()
    return dg.StaticPartitionsDefinition(sorted(set(Catalog(home.catalog).names()) | set(extra)))
