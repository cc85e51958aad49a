"""A tracked step killed by the kernel (OOM, SIGKILL) never ends its MLflow run (issue 27 item 9): the next tracked
run on the store ends it as KILLED, and leaves the run of a process that still runs alone."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import mlflow

from tests.tinydata import ready_home
from xc_dagster import tracking
from xc_dagster.home import Home

ROOT = Path(__file__).resolve().parent.parent

# a tracked stage that logs a step, says which run it is, then works until it is killed
CHILD = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from xc_dagster.home import Home
    from xc_dagster.tracking import Tracker

    home, started = Home(Path(sys.argv[1])), Path(sys.argv[2])
    with Tracker(home.mlflow_uri, home.mlflow_artifacts).run("Killed", "pretrain", {"epochs": 3}, {}) as run:
        run.log_metrics(0, {"loss": 1.0})
        started.write_text(run.run_id)
        time.sleep(600)
""")


def _start_stage(home: Home, started: Path) -> tuple[subprocess.Popen, str]:
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    env.update({"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")})
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(home.root), str(started)], env=env,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not started.exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.poll() else "slow"
        time.sleep(0.05)
    return proc, started.read_text()


def test_the_run_of_a_killed_step_ends_as_killed_and_a_live_one_is_left_alone(tmp_path):
    home = ready_home(tmp_path / "home")
    killed, killed_run = _start_stage(home, tmp_path / "killed")
    live, live_run = _start_stage(home, tmp_path / "live")
    try:
        os.kill(killed.pid, signal.SIGKILL)  # what the OOM killer does: no handler, no finally runs
        killed.wait(timeout=60)
        client = mlflow.MlflowClient(home.mlflow_uri)
        assert client.get_run(killed_run).info.status == "RUNNING"  # nobody has ended it yet

        # the next tracked run on the store ends it
        with tracking.Tracker(home.mlflow_uri, home.mlflow_artifacts).run("Other", "ingest", {}, {}) as run:
            assert client.get_run(run.run_id).info.status == "RUNNING"
        ended = client.get_run(killed_run)
        assert ended.info.status == "KILLED" and ended.info.end_time is not None
        assert str(killed.pid) in ended.data.tags[tracking.ENDED_BY]
        assert ended.data.metrics == {"loss": 1.0}  # what it logged is kept
        assert client.get_run(live_run).info.status == "RUNNING"
        assert client.get_run(run.run_id).info.status == "FINISHED"
    finally:
        for p in (killed, live):
            if p.poll() is None:
                p.kill()
            p.wait(timeout=60)
    # once the live one is killed too, a sweep ends it
    assert tracking.end_dead_runs(client) == [live_run]
    assert client.get_run(live_run).info.status == "KILLED"
    assert tracking.end_dead_runs(client) == []


def test_owner_of_a_run_is_judged_by_its_process_not_only_its_pid():
    me = tracking.owner_tags()
    assert me[tracking.OWNER_PID] == str(os.getpid()) and me[tracking.OWNER_HOST] == socket.gethostname()
    assert tracking.owner_alive(me) is True
    if tracking.HAS_PROC:  # the same pid with another start time is another (earlier) process: reused pid
        scope, _, ticks = me[tracking.OWNER_PROCESS].rpartition("/")
        assert tracking.owner_alive({**me, tracking.OWNER_PROCESS: f"{scope}/{int(ticks) + 1}"}) is False
        rebooted = "0" * 32 + scope[scope.index("/"):]
        assert tracking.owner_alive({**me, tracking.OWNER_PROCESS: f"{rebooted}/{ticks}"}) is False
    assert tracking.owner_alive({**me, tracking.OWNER_HOST: "elsewhere.example"}) is None  # cannot tell
    assert tracking.owner_alive({}) is None  # a run from before owners were recorded


def test_a_run_its_owner_ended_before_exiting_is_not_marked_killed(tmp_path, monkeypatch):
    """The sweep's search saw the run RUNNING; its owner then ended it FINISHED and exited before the sweep
    checked the owner: the sweep reads the run again once the owner is gone and leaves it FINISHED."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = mlflow.MlflowClient(uri)
    exp = client.create_experiment("Race")
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = int(gone.stdout)  # a process that has exited (its pid not reused within the test, or reused: another start)
    run = client.create_run(exp, tags={**tracking.owner_tags(os.getpid()), tracking.OWNER_PID: str(pid),
                                       tracking.OWNER_PROCESS: tracking.owner_tags(os.getpid())[tracking.OWNER_PROCESS]
                                       .rsplit("/", 1)[0] + "/1"})
    stale = client.get_run(run.info.run_id)  # what the search returned: RUNNING
    client.set_terminated(run.info.run_id, "FINISHED")  # the owner's last write before it exited
    monkeypatch.setattr(tracking, "_running_runs", lambda c: iter([stale]))
    assert tracking.owner_alive(stale.data.tags) is False
    assert tracking.end_dead_runs(client) == []
    assert client.get_run(run.info.run_id).info.status == "FINISHED"
