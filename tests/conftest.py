"""Suite-wide set-up. Under pytest-xdist (the README's test command runs two workers on a 2-core machine) each
worker and the processes its tests start use one CPU thread, so two workers share the cores without
oversubscribing them. No test may leave the variables that choose a home or a tracking store changed: a worker
runs many test files in one process, and a leaked ``MLFLOW_TRACKING_URI`` sends later tests to another store."""

from __future__ import annotations

import os

import pytest
import torch

from tests.tinydata import write_tiny_encoder

GUARDED = ("MLFLOW_TRACKING_URI", "XC_HOME", "DAGSTER_HOME", "XC_ARTIFACT_ROOT")

if os.environ.get("PYTEST_XDIST_WORKER"):
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[var] = "1"
    torch.set_num_threads(1)


# Test files of the longest wall time (Dagster CLI runs, several processes, PostgreSQL), longest first, from
# `pytest --durations` on the 2-core machine. They are handed to the two workers first (and pyproject.toml turns
# off xdist's reordering by test count, which put these few-test files last): started last, the longest one ran
# alone for minutes while the other worker idled.
LONGEST_FIRST = (
    "test_postgres.py", "test_dynamic_partitions.py", "test_concurrent_partitions.py", "test_pipes_launch.py",
    "test_pipeline.py", "test_catalog_concurrency.py", "test_dead_run_slots.py", "test_hostile_input.py",
    "test_automation.py", "test_ddp_pretrain.py", "test_serving.py", "test_killed_runs.py", "test_clicklog.py",
    "test_label_sharded.py", "test_cli_materialize_set.py", "test_lifecycle_cycle.py", "test_registry_checks.py",
    "test_checkpoint_damage.py", "test_astra_mips.py",
)


def pytest_collection_modifyitems(config, items):
    """Files of ``LONGEST_FIRST`` first, in its order; every other file after them in collection order."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: a file's tests keep their order

@pytest.fixture(autouse=True)
def _no_leaked_store_variables():
    before = {v: os.environ.get(v) for v in GUARDED}
    yield
    after = {v: os.environ.get(v) for v in GUARDED}
    for var, value in before.items():  # restored first, so one leak does not fail every later test
        if value is None:
            os.environ.pop(var, None)
        else:
            os.environ[var] = value
    assert after == before, f"the test left environment variables changed: {after} (before: {before})"


@pytest.fixture
def one_torch_thread():
    """One torch thread for the test: tiny matrices run faster, and the sums' order is fixed."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)



@pytest.fixture(scope="module")
def tiny_encoder(tmp_path_factory):
    """The tiny random transformer (``tests.tinydata.write_tiny_encoder``), written once per test module."""
    return write_tiny_encoder(tmp_path_factory.mktemp("enc") / "tiny-bert")
