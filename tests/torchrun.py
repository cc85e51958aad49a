"""Two real processes under torchrun for the distributed tests (gloo on the CPU, one thread each), with a timeout so
a hung rank fails the test instead of hanging the suite. No Dagster import: the ranks import this."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TORCHRUN_TIMEOUT_S = 120


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_torchrun(args: list[str], env: dict[str, str] | None = None) -> str:
    """2 ranks of ``args`` (a script and its arguments, or ``-m module ...``) under torchrun; its output (the test
    fails on a non-zero exit or the timeout, with the output's end)."""
    env = {**(os.environ if env is None else env), "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
           "CUDA_VISIBLE_DEVICES": ""}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", "2",
           "--master_addr", "127.0.0.1", "--master_port", str(free_port()), *args]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            process_group=0)  # its own group, killed whole on a timeout
    try:
        log, _ = proc.communicate(timeout=TORCHRUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        log, _ = proc.communicate()
        pytest.fail(f"torchrun did not finish in {TORCHRUN_TIMEOUT_S} s:\n{log[-3000:]}")
    assert proc.returncode == 0, log[-3000:]
    return log
