"""The training assets' Dagster concurrency pool, made in the instance before any run claims a slot of it.

Dagster makes a pool's limit row (the yaml's ``concurrency: pools: default_limit``) when a run first claims a slot:
two runs doing so at once both insert, and on PostgreSQL the loser's fallback update runs in the transaction the
failed insert aborted, which fails its run (``UniqueViolation`` then ``InFailedSqlTransaction``; dagster 1.13.27).
The same path runs again whenever the row's limit differs from the yaml's default. Loading the definitions makes
the row with the yaml's default first (docs/decisions.md#training-pool), so runs find it and never take that path.
"""

from __future__ import annotations

import dagster as dg
from sqlalchemy.exc import SQLAlchemyError

from xc_dagster.home import TRAINING_POOL


def _limit(instance: dg.DagsterInstance, pool: str) -> tuple[int, bool] | None:
    """(limit, from the default) of the pool's row; None when it has none."""
    for p in instance.event_log_storage.get_pool_limits():
        if p.name == pool:
            return p.limit, p.from_default
    return None


def ensure_pool(instance: dg.DagsterInstance, pool: str = TRAINING_POOL) -> bool:
    """Make (or bring to the yaml's default) the pool's limit row; a limit set by hand (``dagster instance
    concurrency set``) is kept. Returns whether it wrote. A concurrent maker's error counts as done when the row
    is then right."""
    default = instance.global_op_concurrency_default_limit
    row = _limit(instance, pool)
    if default is None or (row is not None and (row[0] == default or not row[1])):
        return False
    storage = instance.event_log_storage
    try:
        if row is not None:  # a default that changed: Dagster's own update of the row fails on PostgreSQL
            storage.delete_concurrency_limit(pool)
        storage.initialize_concurrency_limit_to_default(pool)
    except SQLAlchemyError:
        if _limit(instance, pool) != (default, True):
            raise
    return True
