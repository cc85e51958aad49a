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
