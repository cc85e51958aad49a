"""Concurrent writers of one catalog lose nothing: real processes started together on one home (issue 27, item 1)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from xc_dagster.catalog import Catalog, DatasetSpec

N = 10
# one process imports once and forks the children (each a process of its own, as ten CLI runs are: the catalog's
# flock is taken per open of its lock file), so ten interpreters do not each spend seconds importing; each child
# waits for the go file, so the ten read-modify-writes overlap
BARRIER = ("import json, os, sys, time, traceback\n"
           "{imports}\n"
           "CALL = {call!r}\n"
           "go, pids = sys.argv[1], []\n"
           "for i, argv in enumerate(json.loads(sys.argv[2])):\n"
           "    pid = os.fork()\n"
           "    if pid == 0:\n"
           "        out = os.open(go + '.out-' + str(i), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)\n"
           "        os.dup2(out, 1)\n"
           "        os.dup2(out, 2)\n"
           "        sys.argv = [sys.argv[0], go, *argv]  # what a child started on its own would see\n"
           "        code = 1\n"
           "        try:\n"
           "            open(go + '.ready-' + str(os.getpid()), 'w').close()\n"
           "            while not os.path.exists(go):\n"
           "                time.sleep(0.001)\n"
           "            exec(CALL)\n"
           "            code = 0\n"
           "        except SystemExit as e:\n"
           "            code = e.code if isinstance(e.code, int) else 1\n"
           "        except BaseException:\n"
           "            traceback.print_exc()\n"
           "        finally:\n"
           "            sys.stdout.flush()\n"
           "            sys.stderr.flush()\n"
           "            os._exit(code)\n"
           "    pids.append(pid)\n"
           "print(json.dumps([os.waitstatus_to_exitcode(os.waitpid(p, 0)[1]) for p in pids]))\n")


def _run_together(tmp_path: Path, code: str, argvs: list[list[str]]) -> list[tuple[int, str]]:
    """Start one child process per argv, release them at once, and return (exit code, output) of each."""
    env = {**os.environ, "XC_HOME": str(tmp_path), "OMP_NUM_THREADS": "1"}
    go = tmp_path / "go"
    parent = subprocess.Popen([sys.executable, "-c", code, str(go), json.dumps(argvs)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 240
    while len(list(tmp_path.glob("go.ready-*"))) < len(argvs):
        assert time.monotonic() < deadline and parent.poll() is None, "a child did not start"
        time.sleep(0.02)
    go.touch()
    out, _ = parent.communicate(timeout=240)
    assert parent.returncode == 0, out
    codes = json.loads(out.strip().splitlines()[-1])
    return [(rc, (tmp_path / f"go.out-{i}").read_text()) for i, rc in enumerate(codes)]


def test_ten_concurrent_cli_adds_keep_every_entry(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    code = BARRIER.format(imports="from xc_dagster.cli import main", call="sys.exit(main(sys.argv[2:]))")
    names = [f"Data{i}" for i in range(N)]
    got = _run_together(tmp_path, code, [["datasets", "add", n, "--source", str(src)] for n in names])
    assert [rc for rc, _ in got] == [0] * N, [out for _, out in got]
    assert all("added dataset" in out for _, out in got)
    assert Catalog(tmp_path / "catalog.yaml").names() == names  # every process's entry is there
    assert [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name] == []  # no temp file left


def test_concurrent_updates_of_one_entry_each_see_the_last(tmp_path):
    """``Catalog.update`` reads and writes under the lock: ten increments of one entry give +10, none lost."""
    cat = Catalog(tmp_path / "catalog.yaml")
    cat.add(DatasetSpec("Shared", str(tmp_path), max_len=100))
    code = BARRIER.format(
        imports="import dataclasses\nfrom pathlib import Path\nfrom xc_dagster.catalog import Catalog",
        call="Catalog(Path(os.environ['XC_HOME']) / 'catalog.yaml').update(\n"
             "    'Shared', lambda s: dataclasses.replace(s, max_len=s.max_len + 1))")
    got = _run_together(tmp_path, code, [[] for _ in range(N)])
    assert [rc for rc, _ in got] == [0] * N, [out for _, out in got]
    assert cat.get("Shared").max_len == 100 + N


def test_update_derives_the_entry_and_an_error_saves_nothing(tmp_path):
    cat = Catalog(tmp_path / "catalog.yaml")
    made = cat.update("New", lambda old: DatasetSpec("New", str(tmp_path)) if old is None else old)
    assert cat.get("New") == made
    before = (tmp_path / "catalog.yaml").read_text()

    def broken(old):
        raise RuntimeError("killed mid-change")

    with pytest.raises(RuntimeError, match="killed mid-change"):
        cat.update("New", broken)
    assert (tmp_path / "catalog.yaml").read_text() == before
