"""A run killed while its training step holds the training pool's slot (SIGKILL: what the OOM killer or a reboot
does) must not block every later training step of the home: the next `xc-dagster materialize` ends that run as
failed and frees its slot (resources/pools.py), and leaves the slot of a run whose process still runs alone."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import dagster as dg

from resources.pools import release_dead_runs
from tests.test_concurrent_partitions import add_two_datasets
from xc_dagster.home import TRAINING_POOL, Home
from xc_dagster.tracking import OWNER_HOST, OWNER_PID


def _materialize(env: dict, *args: str, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "xc_dagster.cli", "materialize", "TinyA", *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kw)


def _slot_holders(instance: dg.DagsterInstance) -> set[str]:
    info = instance.event_log_storage.get_concurrency_info(TRAINING_POOL)
    return {s.run_id for s in info.claimed_slots}


def test_a_killed_run_frees_its_training_slot_at_the_next_materialize(tmp_path):
    home_dir, env = add_two_datasets(tmp_path, names=("TinyA",))
    # pretraining long enough to be killed in the middle; its own process group, so the kill takes the run worker
    # and its step process together
    first = _materialize(env, "--select", "dataset,tokens,siamese_encoder", "--set", "pretrain.epochs=5000",
                         start_new_session=True)
    instance = dg.DagsterInstance.from_config(str(Home(home_dir).dagster_home))
    deadline = time.monotonic() + 240
    while not _slot_holders(instance):
        assert first.poll() is None and time.monotonic() < deadline, first.stdout.read() if first.poll() else "slow"
        time.sleep(0.5)
    (held,) = _slot_holders(instance)
    run = instance.get_run_by_id(held)
    deadline = time.monotonic() + 60
    while OWNER_HOST not in run.tags:  # the step names its run worker as soon as it starts
        assert time.monotonic() < deadline, run.tags
        time.sleep(0.2)
        run = instance.get_run_by_id(held)
    assert int(run.tags[OWNER_PID]) != first.pid  # the worker is `dagster asset materialize`, not the CLI wrapper

    assert release_dead_runs(instance) == []  # its process runs: left alone
    assert _slot_holders(instance) == {held}

    os.killpg(first.pid, signal.SIGKILL)
    first.wait(timeout=60)
    time.sleep(0.5)
    assert _slot_holders(instance) == {held}  # nobody freed it: without the sweep the next step waits forever
    assert not instance.get_run_by_id(held).is_finished

    second = _materialize(env, "--select", "siamese_encoder", "--set", "pretrain.epochs=1")
    out, _ = second.communicate(timeout=300)
    assert second.returncode == 0, out[-3000:]
    dead = instance.get_run_by_id(held)
    assert dead.status == dg.DagsterRunStatus.FAILURE
    failure = [e for e in instance.all_logs(held, of_type=dg.DagsterEventType.RUN_FAILURE)]
    assert failure and "run worker process is gone" in failure[-1].message
    assert _slot_holders(instance) == set()
    assert instance.event_log_storage.get_concurrency_info(TRAINING_POOL).pending_steps == []
