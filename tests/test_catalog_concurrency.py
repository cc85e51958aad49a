"""Concurrent writers of one catalog lose nothing: real processes started together on one home (issue 27, item 1)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from xc_dagster.catalog import Catalog, DatasetSpec

N = 10
# each child imports first, then waits for the go file, so the ten read-modify-writes overlap
BARRIER = ("import os, sys, time\n"
           "{imports}\n"
           "open(sys.argv[1] + '.ready-' + str(os.getpid()), 'w').close()\n"
           "while not os.path.exists(sys.argv[1]):\n"
           "    time.sleep(0.001)\n"
           "{call}\n")


def _run_together(tmp_path: Path, code: str, argvs: list[list[str]]) -> list[tuple[int, str]]:
    """Start one child per argv, release them at once, and return (exit code, output) of each."""
    env = {**os.environ, "XC_HOME": str(tmp_path), "OMP_NUM_THREADS": "1"}
    go = tmp_path / "go"
    procs = [subprocess.Popen([sys.executable, "-c", code, str(go), *argv], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for argv in argvs]
    deadline = time.monotonic() + 240
    while len(list(tmp_path.glob("go.ready-*"))) < len(procs):
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "a child did not start"
        time.sleep(0.02)
    go.touch()
    return [(p.wait(timeout=240), p.stdout.read()) for p in procs]


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
