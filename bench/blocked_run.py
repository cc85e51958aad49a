"""Two partitions materialized at once on one home: the first run's pretraining rate while the second run waits for
the `xc_training` pool's slot, and the waiting run worker's CPU meanwhile (docs/decisions.md#blocked-run-pause).

  python bench/blocked_run.py --home <new folder> [--budget-minutes 3] [--json out.jsonl]

Registers partitions A and B of the embedded LF-WordNetNouns titles in a new home, starts `xc-dagster materialize A`,
and once A's pretraining holds the slot starts `xc-dagster materialize B`, whose training steps then wait. B's run
worker's CPU (the `dagster asset materialize` process and its children) is read when its step starts waiting and
when A's pretraining has written its summary; then both runs are stopped. Run it with PYTHONPATH pointing at the
code to measure.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import dagster as dg
import psutil

from xc_dagster.home import TRAINING_POOL, Home

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, for bench.rows
from bench.rows import emit  # noqa: E402

CLI = [sys.executable, "-m", "xc_dagster.cli"]


def _tree_cpu(proc: psutil.Process) -> float:
    """User + system CPU seconds of a process and its live children."""
    total = 0.0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            total += sum(p.cpu_times()[:2])
        except psutil.NoSuchProcess:
            pass
    return total


def _wait(what: str, fn, runs: dict, timeout: float = 600.0):
    deadline = time.monotonic() + timeout
    while not (value := fn()):
        ended = [n for n, p in runs.items() if p.poll() is not None]
        if ended or time.monotonic() > deadline:
            sys.exit(f"waiting for {what}: " + (f"run {ended} ended (see its log in the home)" if ended else "timeout"))
        time.sleep(0.5)
    return value


def _waiting_runs(inst: dg.DagsterInstance) -> set[str]:
    """Runs with a step waiting for the training pool's slot (none of theirs claimed)."""
    info = inst.event_log_storage.get_concurrency_info(TRAINING_POOL)
    return {s.run_id for s in info.pending_steps} - {s.run_id for s in info.claimed_slots}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--home", type=Path, required=True)
    ap.add_argument("--budget-minutes", type=float, default=3.0)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    home = Home(args.home).ensure()
    env = {**os.environ, "XC_HOME": str(home.root)}
    for name in ("A", "B"):
        subprocess.run([*CLI, "datasets", "add", name, "--source", "builtin:LF-WordNetNouns", "--text", "title",
                        "--strategy", "ngame", "--set", f"train.budget_minutes={args.budget_minutes}"],
                       env=env, check=True, capture_output=True)
    logs = {n: open(home.root / f"{n}.log", "wb") for n in ("A", "B")}
    runs = {"A": subprocess.Popen([*CLI, "materialize", "A"], env=env, stdout=logs["A"],
                                  stderr=subprocess.STDOUT, start_new_session=True)}
    summary = home.artifacts / "A" / "pretrain" / "summary.json"
    try:
        with dg.DagsterInstance.from_config(str(home.dagster_home)) as inst:
            _wait("A's training slot", lambda: inst.event_log_storage.get_concurrency_info(TRAINING_POOL).claimed_slots,
                  runs)
            runs["B"] = subprocess.Popen([*CLI, "materialize", "B"], env=env, stdout=logs["B"],
                                         stderr=subprocess.STDOUT, start_new_session=True)
            _wait("B's step waiting", lambda: _waiting_runs(inst), runs)
        worker = psutil.Process(runs["B"].pid)
        t0, c0 = time.monotonic(), _tree_cpu(worker)
        _wait("A's pretraining summary", summary.is_file, {"A": runs["A"]}, timeout=3600)
        waited, cpu = time.monotonic() - t0, _tree_cpu(worker) - c0
    finally:
        for proc in runs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        for f in logs.values():
            f.close()
    pre = json.loads(summary.read_text())
    row = {"code": os.environ.get("PYTHONPATH", ""), "budget_minutes": args.budget_minutes,
           "a_points_per_s": round(pre["points_per_s"], 1), "a_steps": pre["steps"],
           "a_seconds_per_step_calibrated": round(pre["budget"]["seconds_per_step"], 3),
           "b_waited_s": round(waited, 1), "b_worker_cpu_s": round(cpu, 1),
           "b_worker_cores": round(cpu / max(waited, 1e-9), 2)}
    emit(row, args.json)


if __name__ == "__main__":
    main()
