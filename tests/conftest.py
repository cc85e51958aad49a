"""Suite-wide set-up. Under pytest-xdist (the README's test command runs two workers on a 2-core machine) each
worker and the processes its tests start use one CPU thread, so two workers share the cores without
oversubscribing them. No test may leave the variables that choose a home or a tracking store changed: a worker
runs many test files in one process, and a leaked ``MLFLOW_TRACKING_URI`` sends later tests to another store."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from tests.tinydata import write_tiny_encoder

GUARDED = ("MLFLOW_TRACKING_URI", "XC_HOME", "DAGSTER_HOME", "XC_ARTIFACT_ROOT")

if os.environ.get("PYTEST_XDIST_WORKER"):
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[var] = "1"
    torch.set_num_threads(1)

FILE_SECONDS = Path(__file__).with_name("file_seconds.json")  # each test file's seconds in a timed run of the suite


def pytest_collection_modifyitems(config, items):
    """Test files longest first (the longest-processing-time rule; unknown files after, in collection order),
    tests within a file as collected: the README's command (``--dist loadfile --no-loadscope-reorder``) deals
    files to the two workers in this order, so a long file no longer starts last and leaves one core idle to the
    end. ``python -m tests.file_seconds <junit.xml>`` re-times the files."""
    seconds = json.loads(FILE_SECONDS.read_text()) if FILE_SECONDS.is_file() else {}
    files = [item.nodeid.split("::")[0] for item in items]
    first: dict[str, int] = {}
    for i, f in enumerate(files):
        first.setdefault(f, i)
    order = sorted(range(len(items)), key=lambda i: (-seconds.get(files[i], 0.0), first[files[i]], i))
    items[:] = [items[i] for i in order]


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
