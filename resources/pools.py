"""The training assets' Dagster concurrency pool: made in the instance before any run claims a slot of it, and
freed of the slots of runs whose process was killed.

Dagster makes a pool's limit row (the yaml's ``concurrency: pools: default_limit``) when a run first claims a slot:
two runs doing so at once both insert, and on PostgreSQL the loser's fallback update runs in the transaction the
failed insert aborted, which fails its run (``UniqueViolation`` then ``InFailedSqlTransaction``; dagster 1.13.27).
The same path runs again whenever the row's limit differs from the yaml's default. Loading the definitions makes
the row with the yaml's default first (docs/decisions.md#training-pool), so runs find it and never take that path.

A run whose process is killed (the OOM killer, SIGKILL, a reboot) keeps its claimed slot and its waiting steps, and
Dagster's default run launcher has no run monitoring to end it: with the pool's limit of 1, every later training
step waits forever ("Step blocked by limit for pool xc_training"). ``release_dead_runs`` ends such runs as failed
and frees their slots when the definitions load (every ``xc-dagster materialize``, the webserver, the daemon); a
run's process is its run worker, named in its tags by its first step (``record_run_owner``) or, before a step ran,
by the pid of its RUN_START event (docs/decisions.md#dead-run-slots).

A step that asks for a slot while another run's step frees the last one can wait forever too: Dagster checks for
an unassigned slot, the other run frees its slot and assigns it to the steps already waiting (none), and only then
is the asking step queued, unassigned; a slot is assigned only when one is freed, so nothing assigns it (dagster
1.13.27, SQLite and PostgreSQL alike). ``repair_lost_assignments`` makes a blocked claim that finds a slot nobody
was assigned assign the queue's next step, as freeing that slot would have (docs/decisions.md#concurrent-runs-time).

While a run's only runnable steps wait for a slot, Dagster's multiprocess executor loops without pausing (its step
processes' events are awaited with a timeout, but with none in flight nothing waits): the waiting run's worker
spins a whole core for as long as the other run trains (on a 2-core machine the other run's calibration then
read 18.4 s a step instead of ~3 and planned no pretraining: docs/decisions.md#blocked-run-pause).
``pause_blocked_runs`` makes that loop pause ``BLOCKED_PAUSE`` between passes.

Two steps that ask at once can both be assigned the one slot (each sees it unassigned before the other queues), and
Dagster's claim then reads a free slot row and writes its step into it as two statements, the read's row lock
(``FOR UPDATE SKIP LOCKED``) held by no transaction and meaningless on SQLite: both read the free row, both write
it, both steps run (two training steps of two partitions overlapped under the limit of 1).
``repair_lost_assignments`` also makes that write a compare-and-set (docs/decisions.md#pool-slot-compare-and-set).
"""

from __future__ import annotations

import logging
import time

import dagster as dg
import psutil
import sqlalchemy as sa
from dagster._core.execution.plan.active import ActiveExecution
from dagster._core.storage.event_log.schema import ConcurrencySlotsTable
from dagster._core.storage.event_log.sql_event_log import SqlEventLogStorage
from dagster._core.storage.sqlite_storage import SqliteRunStorage
from dagster._utils.concurrency import ConcurrencySlotStatus
from sqlalchemy.exc import SQLAlchemyError

from xc_dagster.home import TRAINING_POOL
from xc_dagster.tracking import OWNER_HOST, owner_alive, owner_tags

log = logging.getLogger("xc_dagster")
# A run worker's pause between passes while its only runnable steps wait for a pool slot: Dagster re-asks for the
# slot every 1-15 s, so a slot freed is taken at most this much later, and an interrupt is seen within it
BLOCKED_PAUSE = 0.5


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


def _run_worker(instance: dg.DagsterInstance, run_id: str) -> tuple[int, float] | None:
    """(pid, time) of the run's RUN_START event: the run worker's process, which executes its steps."""
    for e in instance.all_logs(run_id, of_type=dg.DagsterEventType.RUN_START):
        if e.dagster_event is not None and e.dagster_event.pid is not None:
            return e.dagster_event.pid, e.timestamp
    return None


def record_run_owner(instance: dg.DagsterInstance, run_id: str) -> None:
    """Name the run's worker process (host, pid, start) in its tags, once, from one of its steps."""
    run = instance.get_run_by_id(run_id)
    if run is None or OWNER_HOST in run.tags:  # named already (every step of the run calls this)
        return
    worker = _run_worker(instance, run_id)
    if worker is not None:
        instance.add_run_tags(run_id, owner_tags(worker[0]))


def _worker_alive(instance: dg.DagsterInstance, run: dg.DagsterRun) -> bool | None:
    """Whether the run's worker still runs; None when this process cannot tell (another host)."""
    if OWNER_HOST in run.tags:
        return owner_alive(dict(run.tags))
    worker = _run_worker(instance, run.run_id)
    if worker is None or not isinstance(instance.run_storage, SqliteRunStorage):
        return None  # a shared run storage (PostgreSQL) may hold runs of other hosts: their pids mean nothing here
    try:  # the pid's process started before the run did (a later one reused the pid)
        proc = psutil.Process(worker[0])
        return proc.status() != psutil.STATUS_ZOMBIE and proc.create_time() <= worker[1] + 1.0
    except psutil.NoSuchProcess:
        return False


def release_dead_runs(instance: dg.DagsterInstance, pool: str = TRAINING_POOL) -> list[str]:
    """End as failed the unfinished runs holding or waiting for a slot of ``pool`` whose worker process is gone,
    and free the slots of those and of finished runs; returns their run ids. Live runs and runs this process
    cannot judge (another host's) are left alone."""
    info = instance.event_log_storage.get_concurrency_info(pool)
    released = []
    for run_id in sorted({s.run_id for s in info.claimed_slots} | {s.run_id for s in info.pending_steps}):
        run = instance.get_run_by_id(run_id)
        if run is not None and not run.is_finished:
            if _worker_alive(instance, run) is not False:
                continue
            instance.report_run_failed(run, f"its run worker process is gone (killed: OOM, SIGKILL or a restart); "
                                            f"its {pool} slot was freed so later steps do not wait for it")
        instance.event_log_storage.free_concurrency_slots_for_run(run_id)
        released.append(run_id)
        log.warning("run %s: its process is gone; marked failed and its %s slot freed", run_id, pool)
    return released


def _claim_repairing(claim):
    """``SqlEventLogStorage.claim_concurrency_slot`` that, when the step is left queued unassigned while the pool
    has a slot assigned to no step, assigns the queue's next step (by priority, then age) and claims again."""

    def claim_concurrency_slot(self, concurrency_key: str, run_id: str, step_key: str, priority: int | None = None):
        status = claim(self, concurrency_key, run_id, step_key, priority)
        if status.is_claimed or status.is_assigned or not self.has_unassigned_slots(concurrency_key):
            return status
        self.assign_pending_steps([concurrency_key])  # two runs doing so at once: the slot rows still admit one
        return claim(self, concurrency_key, run_id, step_key, priority)

    claim_concurrency_slot.repairs = claim
    return claim_concurrency_slot


def _take_free_slot(self, concurrency_key: str, run_id: str, step_key: str) -> ConcurrencySlotStatus:
    """``SqlEventLogStorage._claim_concurrency_slot`` as a compare-and-set: a free slot row is written only while it
    is still free, so of two steps that read the same free row one claims it and the other is blocked (it asks
    again, as any blocked step, until a slot is freed)."""
    slots = ConcurrencySlotsTable.c
    free = sa.and_(slots.concurrency_key == concurrency_key, slots.step_key.is_(None), slots.deleted == sa.false())
    with self.index_connection() as conn:
        while (row := conn.execute(sa.select(slots.id).where(free).limit(1)).first()) is not None:
            taken = conn.execute(ConcurrencySlotsTable.update().values(run_id=run_id, step_key=step_key)
                                 .where(sa.and_(slots.id == row[0], slots.step_key.is_(None)))).rowcount
            if taken:
                return ConcurrencySlotStatus.CLAIMED
    return ConcurrencySlotStatus.BLOCKED


def repair_lost_assignments() -> None:
    """Install ``_claim_repairing`` and ``_take_free_slot`` on Dagster's SQL event log storages (SQLite, PostgreSQL)
    of this process: the run worker, which loads these definitions and claims its steps' slots. Once per process."""
    if not hasattr(SqlEventLogStorage.claim_concurrency_slot, "repairs"):
        SqlEventLogStorage.claim_concurrency_slot = _claim_repairing(SqlEventLogStorage.claim_concurrency_slot)
    if SqlEventLogStorage._claim_concurrency_slot is not _take_free_slot:
        _take_free_slot.replaces = SqlEventLogStorage._claim_concurrency_slot
        SqlEventLogStorage._claim_concurrency_slot = _take_free_slot


def _steps_pausing(get_steps):
    """``ActiveExecution.get_steps_to_execute`` that pauses ``BLOCKED_PAUSE`` when it has no step to start, none is
    in flight and some wait for a pool slot: the multiprocess executor's loop asks again at once otherwise."""

    def get_steps_to_execute(self, limit: int | None = None):
        steps = get_steps(self, limit)
        waiting = self._instance_concurrency_context  # None where no step of the run has a pool
        if not steps and not self._in_flight and waiting is not None and waiting.has_pending_claims():
            time.sleep(BLOCKED_PAUSE)
        return steps

    get_steps_to_execute.pauses = get_steps
    return get_steps_to_execute


def pause_blocked_runs() -> None:
    """Install ``_steps_pausing`` on Dagster's ``ActiveExecution`` in this process (the run worker, which loads these
    definitions and runs the executor's loop). Once per process."""
    if not hasattr(ActiveExecution.get_steps_to_execute, "pauses"):
        ActiveExecution.get_steps_to_execute = _steps_pausing(ActiveExecution.get_steps_to_execute)
