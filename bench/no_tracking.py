"""Run a bench script where MLflow and SQLAlchemy are not installed (a GPU machine with only torch, transformers and
faiss): the library imports them at module level (``xc_dagster.tracking``, ``xc_dagster.postgres``), but the stages
that ``run_all`` runs track nothing, so empty modules stand in for them.

  python bench/no_tracking.py bench/pipeline_bench.py --name ... --source ...
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import runpy
import sys
import types

STAND_INS = ("mlflow", "sqlalchemy", "psycopg2")


class _Meta(type):
    def __getattr__(cls, name: str):  # any attribute: another empty class (a base class, a decorator's owner)
        if name.startswith("__"):
            raise AttributeError(name)
        return _Meta(name, (), {"__init__": lambda self, *a, **k: None})


class _Empty(types.ModuleType):
    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Meta(name, (), {"__init__": lambda self, *a, **k: None})


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in STAND_INS:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        return _Empty(spec.name)

    def exec_module(self, module) -> None:
        module.__path__ = []


if __name__ == "__main__":
    sys.meta_path.insert(0, _Finder())
    sys.argv = sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")
