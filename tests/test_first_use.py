"""First use of a fresh home by several processes at once (issue 27 item 2): real processes released together by a
shared start signal each prepare the home as the CLI does, then use the MLflow store (a run with a metric) and the
Dagster instance (read runs, report an event). Without the home's first-use lock they raced on the stores' schema
migrations (``UNIQUE constraint failed: alembic_version``, ``_alembic_tmp_tags already exists``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import mlflow

from tests.tinydata import release_together
from xc_dagster.home import Home
from xc_dagster.tracking import Tracker, experiment_name

ROOT = Path(__file__).resolve().parent.parent
N_PROCESSES = 4

# one process's first use: import, say ready, wait for the start signal (WAIT_FOR_GO), then prepare the home and
# use both stores
IMPORTS = textwrap.dedent("""
    import dagster as dg
    from xc_dagster.home import Home
    from xc_dagster.tracking import Tracker
""")
CHILD = textwrap.dedent("""
    home = Home.from_env().ensure(instance=True)
    with Tracker(home.mlflow_uri, home.mlflow_artifacts).run("FirstUse", "ingest", {"i": i}, {}) as run:
        run.log_final({"value": float(i)})
    with dg.DagsterInstance.get() as instance:
        instance.get_runs()
        instance.report_runless_asset_event(dg.AssetMaterialization(f"first_use_{i}"))
    print("ok", i)
""")


def _env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    env.update({"XC_HOME": str(home), "DAGSTER_HOME": str(home / "dagster"), "OMP_NUM_THREADS": "1",
                "PYTHONPATH": str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""), "DAGSTER_DISABLE_TELEMETRY": "1"})
    return env


def _release_together(tmp: Path, home: Path) -> list[subprocess.CompletedProcess]:
    """Start the children, wait until each has imported and is waiting, then release them at once."""
    return release_together(IMPORTS, CHILD, N_PROCESSES, tmp, _env(home))


def _error_line(stderr: str) -> str:
    """The exception line of a child's traceback (the last line naming an error), else its last line."""
    lines = stderr.strip().splitlines() or [""]
    return next((ln for ln in reversed(lines) if "Error" in ln or "Exception" in ln), lines[-1])[:300]


def test_processes_first_using_a_fresh_home_together_all_succeed(tmp_path):
    home = tmp_path / "home"
    results = _release_together(tmp_path, home)
    failed = [f"exit {r.returncode}: {_error_line(r.stderr)}" for r in results if r.returncode != 0]
    assert failed == []

    # the stores work afterwards: every run and every event is there, and a new run can be logged
    h = Home(home)
    client = mlflow.MlflowClient(h.mlflow_uri)
    exp = client.get_experiment_by_name(experiment_name("FirstUse"))
    runs = client.search_runs([exp.experiment_id])
    assert sorted(r.data.metrics["value"] for r in runs) == [float(i) for i in range(N_PROCESSES)]
    assert {r.info.status for r in runs} == {"FINISHED"}
    with Tracker(h.mlflow_uri, h.mlflow_artifacts).run("FirstUse", "after", {}, {}) as run:
        run.log_final({"value": 1.0})
    code = ("import json\nimport dagster as dg\n"
            "with dg.DagsterInstance.get() as inst:\n"
            "    print(json.dumps(sorted(k.to_user_string() for k in inst.all_asset_keys())))\n")
    keys = subprocess.run([sys.executable, "-c", code], env=_env(home), capture_output=True, text=True, timeout=120)
    assert keys.returncode == 0, keys.stderr[-1500:]
    assert json.loads(keys.stdout.strip().splitlines()[-1]) == [f"first_use_{i}" for i in range(N_PROCESSES)]


def test_a_prepared_home_is_not_prepared_again(tmp_path):
    """The marker lets later processes skip the lock and the stores' creation; a store removed by hand, or another
    tracking URI, is not taken as made."""
    home = Home(tmp_path / "home").ensure()
    assert home.is_prepared() and not home.is_prepared(instance=True)
    made = home.mlflow_db.stat().st_mtime_ns
    assert Home(home.root).ensure().mlflow_db.stat().st_mtime_ns == made
    other = f"sqlite:///{tmp_path / 'other.db'}"
    assert not home.is_prepared(tracking_uri=other)
    home.ensure(tracking_uri=other)
    assert (tmp_path / "other.db").exists() and home.is_prepared(tracking_uri=other) and home.is_prepared()
    home.mlflow_db.unlink()
    assert not home.is_prepared()
