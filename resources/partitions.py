"""Datasets as Dagster dynamic partitions.

The partition keys live in the Dagster instance (``DynamicPartitionsDefinition`` named ``datasets``), each
dataset's options in the catalog file. ``xc-dagster datasets add`` registers the key with the instance and the
click-log sensor adds a new feed's key through its ``SensorResult``, so a new dataset is launchable in the UI
without reloading the code location. Loading the definitions registers every catalog dataset the instance lacks
(``resources.home.sync_on_load``): a home made when the partitions were static (read from the catalog at load) keeps
its datasets, and their history, which Dagster keys by the partition's name, is unchanged
(docs/decisions.md#dynamic-partitions).

Run as ``python -m resources.partitions add|remove NAME...`` with ``DAGSTER_HOME`` set (the CLI does, through
:func:`xc_dagster.project.project_import`, so a working directory with packages of the same names does not matter).
The module imports Dagster and nothing of the library, so that process takes 1 to 2 s
(docs/decisions.md#add-imports).
"""

from __future__ import annotations

import sys
from collections.abc import Iterable

import dagster as dg
from sqlalchemy.exc import IntegrityError

PARTITIONS_NAME = "datasets"
DATASETS = dg.DynamicPartitionsDefinition(name=PARTITIONS_NAME)


def register(instance: dg.DagsterInstance, names: Iterable[str]) -> list[str]:
    """Add the names the instance lacks as partitions; returns those added. Safe against a concurrent adder: the
    instance's unique index refuses a duplicate, and the add is retried with what is then missing."""
    wanted = sorted(set(names))
    for attempt in range(5):
        known = registered(instance)  # one query, whatever the catalog's size (every load of the definitions)
        missing = [n for n in wanted if n not in known]
        if not missing:
            return []
        try:
            instance.add_dynamic_partitions(PARTITIONS_NAME, missing)
            return missing
        except IntegrityError:  # another process added one of them between the read and the insert
            if attempt == 4:
                raise
    return []


def unregister(instance: dg.DagsterInstance, name: str) -> bool:
    """Remove a partition key (its runs and materializations stay in the instance); False when it was absent."""
    if not instance.has_dynamic_partition(PARTITIONS_NAME, name):
        return False
    instance.delete_dynamic_partition(PARTITIONS_NAME, name)
    return True


def registered(instance: dg.DagsterInstance) -> set[str]:
    return set(instance.get_dynamic_partitions(PARTITIONS_NAME))


def main(argv: list[str] | None = None) -> int:
    """``add NAME...`` / ``remove NAME...`` against the instance of ``DAGSTER_HOME``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) < 2 or argv[0] not in ("add", "remove"):
        print("usage: python -m resources.partitions add|remove NAME...", file=sys.stderr)
        return 2
    with dg.DagsterInstance.get() as instance:
        if argv[0] == "add":
            register(instance, argv[1:])
        else:
            for name in argv[1:]:
                unregister(instance, name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
