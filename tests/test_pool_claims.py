"""A training step that asks for the pool's slot while another run's step frees it must get the slot: Dagster
(1.13.27) checks for an unassigned slot, the other step frees it and assigns it to the steps already queued
(none), then queues the asking step unassigned, and nothing assigns it again (its run waited forever, its executor
busy, in two partitions materialized at once). The interleaving is forced here, in one process, on the home's real
SQLite instance: between two processes it happens only by timing (tests/test_concurrent_partitions.py runs them)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import dagster as dg
import psutil
import pytest
from dagster._core.storage.event_log.schema import ConcurrencySlotsTable
from dagster._core.storage.event_log.sql_event_log import SqlEventLogStorage

from resources.pools import _take_free_slot, repair_lost_assignments
from tests.tinydata import ready_home
from xc_dagster.home import TRAINING_POOL

# Dagster's own slot claim, whether or not the definitions replaced it in this process already
_DAGSTERS_CLAIM = getattr(_take_free_slot, "replaces", SqlEventLogStorage._claim_concurrency_slot)


@pytest.fixture
def instance(tmp_path, monkeypatch):
    monkeypatch.delenv("XC_TRAINING_CONCURRENCY", raising=False)
    monkeypatch.delenv("XC_DAGSTER_POSTGRES_URL", raising=False)
    home = ready_home(tmp_path / "home")
    with dg.DagsterInstance.from_config(str(home.dagster_home)) as inst:
        inst.event_log_storage.initialize_concurrency_limit_to_default(TRAINING_POOL)  # the yaml's limit: 1
        yield inst


def _claim_racing_a_free(storage, holder: tuple[str, str], asker: tuple[str, str]):
    """``asker``'s first claim, with ``holder``'s step freeing the slot right after the claim looked for an
    unassigned one."""
    real = type(storage).has_unassigned_slots

    def racing(self, key):
        answer = real(self, key)
        if self.get_concurrency_info(key).claimed_slots:  # once: the holder frees between the check and the queue
            self.free_concurrency_slot_for_step(*holder)
        return answer

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(type(storage), "has_unassigned_slots", racing)
        return storage.claim_concurrency_slot(TRAINING_POOL, *asker)


def _race(storage) -> list[bool]:
    assert storage.claim_concurrency_slot(TRAINING_POOL, "run-b", "fusion").is_claimed
    first = _claim_racing_a_free(storage, ("run-b", "fusion"), ("run-a", "fusion"))
    again = [storage.claim_concurrency_slot(TRAINING_POOL, "run-a", "fusion").is_claimed for _ in range(3)]
    return [first.is_claimed, *again]


def test_a_step_queued_as_the_slot_is_freed_gets_it(instance, monkeypatch):
    storage = instance.event_log_storage
    assert isinstance(storage, SqlEventLogStorage)
    # Dagster's own claim: the asking step stays queued, unassigned, with the pool's only slot free
    monkeypatch.setattr(SqlEventLogStorage, "claim_concurrency_slot", SqlEventLogStorage.claim_concurrency_slot)
    unrepaired = getattr(SqlEventLogStorage.claim_concurrency_slot, "repairs", None)
    if unrepaired is not None:  # the definitions were loaded in this process already
        monkeypatch.setattr(SqlEventLogStorage, "claim_concurrency_slot", unrepaired)
    assert _race(storage) == [False, False, False, False]
    info = storage.get_concurrency_info(TRAINING_POOL)
    assert info.claimed_slots == [] and [s.assigned_timestamp for s in info.pending_steps] == [None]

    storage.free_concurrency_slots_for_run("run-a")
    repair_lost_assignments()
    repair_lost_assignments()  # once per process: not wrapped twice
    assert not hasattr(SqlEventLogStorage.claim_concurrency_slot.repairs, "repairs")
    assert _race(storage) == [True, True, True, True]  # the first claim after the free takes the slot
    info = storage.get_concurrency_info(TRAINING_POOL)
    assert [(s.run_id, s.step_key) for s in info.claimed_slots] == [("run-a", "fusion")]

    # the pool's limit still holds: with the slot taken, a third step waits, and gets it once it is freed
    assert not storage.claim_concurrency_slot(TRAINING_POOL, "run-c", "classifiers").is_claimed
    storage.free_concurrency_slot_for_step("run-a", "fusion")
    assert storage.claim_concurrency_slot(TRAINING_POOL, "run-c", "classifiers").is_claimed
    assert not storage.claim_concurrency_slot(TRAINING_POOL, "run-d", "classifiers").is_claimed


def _both_claim_the_freed_row(home: Path) -> list[bool]:
    """Two steps both assigned the pool's one slot (each saw it unassigned before the other queued) claim it at
    once, each through its own instance as two run workers would (an instance serialises its own SQLite
    connections): each reads the free slot row before either writes it (a barrier before the writes)."""
    a, b = (dg.DagsterInstance.from_config(str(home)) for _ in range(2))
    storages = {"run-a": a.event_log_storage, "run-b": b.event_log_storage}
    for run_id, storage in storages.items():
        storage.add_pending_step(TRAINING_POOL, run_id, "siamese_encoder", should_assign=True)
    # 30 s: under the suite's two workers a thread has taken over 10 s to reach its write, breaking the barrier and
    # with it the race this reproduces
    barrier, real = threading.Barrier(2, timeout=30), ConcurrencySlotsTable.update

    def update_after_both_read():
        try:
            barrier.wait()
        except threading.BrokenBarrierError:  # the other read no free row (a store that locks the read row)
            pass
        return real()

    out: dict[str, bool] = {}

    def claim(run_id: str) -> None:
        out[run_id] = storages[run_id].claim_concurrency_slot(TRAINING_POOL, run_id, "siamese_encoder").is_claimed

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ConcurrencySlotsTable, "update", update_after_both_read)
        threads = [threading.Thread(target=claim, args=(r,)) for r in ("run-a", "run-b")]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    a.dispose()
    b.dispose()
    return [out["run-a"], out["run-b"]]


def test_two_steps_assigned_the_one_slot_at_once_do_not_both_take_it(instance, monkeypatch):
    """Dagster's claim reads a free slot row, then writes its step into it: both steps read it, both write it, both
    run under a limit of 1. As a compare-and-set (``repair_lost_assignments``) one takes it and the other waits
    for it, and gets it once it is freed."""
    storage, home = instance.event_log_storage, Path(instance.root_directory)
    monkeypatch.setattr(SqlEventLogStorage, "_claim_concurrency_slot", _DAGSTERS_CLAIM)
    assert _both_claim_the_freed_row(home) == [True, True]  # Dagster's own: the limit of 1 broken
    for run_id in ("run-a", "run-b"):
        storage.free_concurrency_slots_for_run(run_id)
    repair_lost_assignments()
    claimed = _both_claim_the_freed_row(home)
    assert sorted(claimed) == [False, True]
    holder, waiter = ("run-a", "run-b") if claimed[0] else ("run-b", "run-a")
    info = storage.get_concurrency_info(TRAINING_POOL)
    assert [(s.run_id, s.step_key) for s in info.claimed_slots] == [(holder, "siamese_encoder")]
    assert not storage.claim_concurrency_slot(TRAINING_POOL, waiter, "siamese_encoder").is_claimed  # it waits
    storage.free_concurrency_slot_for_step(holder, "siamese_encoder")
    assert storage.claim_concurrency_slot(TRAINING_POOL, waiter, "siamese_encoder").is_claimed


WAITING_RUN = '''
import sys

import dagster as dg

from resources.pools import pause_blocked_runs

if sys.argv[1:] == ["pause"]:
    pause_blocked_runs()


@dg.op(pool="{pool}")
def train():
    return 1


@dg.job(executor_def=dg.multiprocess_executor)
def waits():
    train()


if __name__ == "__main__":
    with dg.DagsterInstance.get() as instance:
        sys.exit(0 if dg.execute_job(dg.reconstructable(waits), instance=instance).success else 1)
'''


def _cpu_while_blocked(tmp_path, mode: str) -> float:
    """CPU seconds a real run worker (multiprocess executor) spends in 3 s while its one step waits for the pool's
    only slot, which another run holds; the slot is then freed and the run must finish."""
    home = ready_home(tmp_path / mode)
    script = tmp_path / f"waits_{mode}.py"
    script.write_text(WAITING_RUN.replace("{pool}", TRAINING_POOL))
    env = {**os.environ, "DAGSTER_HOME": str(home.dagster_home), "PYTHONPATH": str(Path(__file__).parents[1])}
    with dg.DagsterInstance.from_config(str(home.dagster_home)) as inst:
        storage = inst.event_log_storage
        storage.initialize_concurrency_limit_to_default(TRAINING_POOL)
        assert storage.claim_concurrency_slot(TRAINING_POOL, "holder", "train").is_claimed
        proc = subprocess.Popen([sys.executable, str(script), mode], env=env, cwd=tmp_path,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 120
            while not [s for s in storage.get_concurrency_info(TRAINING_POOL).pending_steps if s.run_id != "holder"]:
                assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read().decode()[-3000:]
                time.sleep(0.1)
            worker = psutil.Process(proc.pid)
            time.sleep(1.0)  # the claim's first retry is due 1 s after the step was queued
            before = sum(worker.cpu_times()[:2])
            time.sleep(3.0)
            spent = sum(worker.cpu_times()[:2]) - before
            storage.free_concurrency_slot_for_step("holder", "train")
            out = proc.communicate(timeout=120)[0].decode()
            assert proc.returncode == 0, out[-3000:]
        finally:
            if proc.poll() is None:
                proc.kill()
    return spent


def test_a_run_waiting_for_the_pool_does_not_spin_a_core(tmp_path):
    """Dagster's multiprocess executor asks for its next steps again at once while its only step waits for a slot
    (alone 3.0 CPU seconds of 3: a core; a third of one at least on a busy 2-core machine); with
    ``pause_blocked_runs``, as the definitions install it, it pauses between passes (0.02 s alone), and the run
    still takes the slot once it is freed."""
    assert _cpu_while_blocked(tmp_path, "spin") > 1.0
    assert _cpu_while_blocked(tmp_path, "pause") < 0.3
