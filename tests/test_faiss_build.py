"""One faiss module: the `cpu` and `gpu` extras each bring one build, nothing else brings either, the set-up
commands take the `cpu` one, and a missing or doubled faiss is named clearly (xc_dagster/faiss_module.py)."""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import re
import subprocess
import sys
from pathlib import Path

import pytest

from xc_dagster import faiss_module

ROOT = Path(__file__).resolve().parent.parent
tomllib = pytest.importorskip("tomllib")  # Python 3.11+


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~\[; ]", requirement, maxsplit=1)[0].lower()


def test_each_build_of_faiss_comes_from_its_own_extra_only():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert not [r for r in project["dependencies"] if "faiss" in _name(r)]  # the base install picks no build
    extras = {k: [_name(r) for r in v if "faiss" in _name(r)] for k, v in project["optional-dependencies"].items()}
    assert extras.pop("cpu") == ["faiss-cpu"] and extras.pop("gpu") == ["faiss-gpu-cu12"]
    assert not any(extras.values()), extras  # dev, bench, ... would put a second build beside the gpu one


def test_the_set_up_commands_install_the_cpu_build():
    readme, ci = (ROOT / "README.md").read_text(), (ROOT / ".ci" / "run").read_text()
    commands = [line for line in readme.splitlines() if line.startswith("python3 -m venv")]
    assert len(commands) == 2 and all("-e '.[cpu,dev]'" in c for c in commands)
    assert commands[1] in ci  # .ci/run is the README's test command


def test_a_missing_faiss_says_which_extra_to_install():
    code = ("import sys, importlib.abc\n"
            "class NoFaiss(importlib.abc.MetaPathFinder):\n"
            "    def find_spec(self, name, path, target=None):\n"
            "        if name.split('.')[0] == 'faiss':\n"
            "            raise ImportError(f'No module named {name!r}')\n"
            "sys.meta_path.insert(0, NoFaiss())\n"
            "import xc_dagster.retrieval.ann\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert res.returncode != 0
    assert "ImportError: faiss is not installed: pip install 'xc-dagster[cpu]' (faiss-cpu) or" in res.stderr
    assert "'xc-dagster[gpu]' (faiss-gpu-cu12)" in res.stderr


def test_two_builds_installed_are_named_in_a_warning(monkeypatch, caplog):
    assert faiss_module.installed_faiss() == ["faiss-cpu"]  # this environment: the set-up's cpu build
    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version",
                        lambda d: "1.14.1" if d == "faiss-gpu-cu12" else real(d))
    assert faiss_module.installed_faiss() == ["faiss-cpu", "faiss-gpu-cu12"]
    with caplog.at_level(logging.WARNING, logger="xc_dagster.faiss_module"):
        importlib.reload(faiss_module)
    assert "both faiss-cpu and faiss-gpu-cu12 are installed: they write the same module faiss" in caplog.text
    monkeypatch.undo()
    importlib.reload(faiss_module)
    assert faiss_module.faiss.__name__ == "faiss" and faiss_module.has_gpu_build() is False
