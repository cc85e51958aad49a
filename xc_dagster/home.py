"""The one home folder that holds all state: catalog, artifacts, MLflow store, Dagster instance.

``XC_HOME`` when set, else ``~/.xc-dagster``. Dagster's own instance lives in ``$XC_HOME/dagster`` (the
``DAGSTER_HOME`` the CLI wrappers export), so runs from the CLI and from the UI share one history.

First use of a home creates its stores (``dagster.yaml``, the MLflow database and its schema migrations, the
Dagster instance's SQLite storages) once, under an exclusive ``flock`` on ``.home.lock``, and records what it made
in ``.home-ready.json``: processes that start together on a fresh home would otherwise race on the migrations and
fail, or leave the MLflow store broken for good (docs/decisions.md#home-first-use-lock).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from xc_dagster.errors import XCError
from xc_dagster.storage import atomic_write_text, file_lock
from xc_dagster.tracking import is_sqlite_uri, prepare_tracking_store

READY = ".home-ready.json"  # what the first use made: {"made": ["dagster.yaml", "mlflow:<uri>", "dagster-instance"]}
LOCK = ".home.lock"  # held exclusively while the home's first use creates its stores
DAGSTER_YAML = ("# Dagster instance of xc-dagster (runs, event logs, schedules) under XC_HOME\n"
                "telemetry:\n  enabled: false\n")
INSTANCE = "dagster-instance"


def xc_home() -> Path:
    return Path(os.environ.get("XC_HOME") or Path.home() / ".xc-dagster").expanduser().resolve()


def venv_executable(name: str) -> str:
    """An executable next to this interpreter (the venv), else on PATH."""
    cand = Path(sys.executable).parent / name
    return str(cand) if cand.exists() else (shutil.which(name) or name)


@dataclass(frozen=True)
class Home:
    root: Path

    @classmethod
    def from_env(cls) -> "Home":
        return cls(xc_home())

    @property
    def catalog(self) -> Path:
        return self.root / "catalog.yaml"

    @property
    def artifacts(self) -> Path:
        return self.root / "artifacts"

    @property
    def cache(self) -> Path:
        return self.root / "cache"

    @property
    def dagster_home(self) -> Path:
        return self.root / "dagster"

    @property
    def mlflow_db(self) -> Path:
        return self.root / "mlflow.db"

    @property
    def mlflow_artifacts(self) -> Path:
        return self.root / "mlartifacts"

    @property
    def mlflow_uri(self) -> str:
        return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{self.mlflow_db}"

    def ensure(self, instance: bool = False, tracking_uri: str | None = None) -> "Home":
        """Create the folders, ``dagster.yaml``, the MLflow store of ``tracking_uri`` (default :attr:`mlflow_uri`)
        and with ``instance`` the Dagster instance's storages (every CLI command asks for them), each once per home,
        under the home's first-use lock. A home whose marker lists them takes no lock: a stat and a small read."""
        uri = tracking_uri or self.mlflow_uri
        for p in (self.root, self.artifacts, self.cache, self.dagster_home, self.mlflow_artifacts):
            p.mkdir(parents=True, exist_ok=True)
        if self.is_prepared(instance, uri):
            return self
        with file_lock(self.root / LOCK):
            made = self._made()
            if not (self.dagster_home / "dagster.yaml").exists():
                atomic_write_text(self.dagster_home / "dagster.yaml", DAGSTER_YAML)
            if not _has_store(made, uri):
                prepare_tracking_store(uri)
                made.add(f"mlflow:{uri}")
            if instance and INSTANCE not in made:
                self._prepare_instance()
                made.add(INSTANCE)
            atomic_write_text(self.root / READY, json.dumps({"made": sorted(made)}, indent=1) + "\n")
        return self

    def is_prepared(self, instance: bool = False, tracking_uri: str | None = None) -> bool:
        """Whether the first use is done: ``dagster.yaml``, the tracking URI's store (and the Dagster instance)."""
        made = self._made()
        return ((self.dagster_home / "dagster.yaml").exists() and _has_store(made, tracking_uri or self.mlflow_uri)
                and (not instance or INSTANCE in made))

    def _made(self) -> set[str]:
        try:
            return set(json.loads((self.root / READY).read_text()).get("made", []))
        except (FileNotFoundError, ValueError, AttributeError):  # none yet, or not ours: made again (idempotent)
            return set()

    def _prepare_instance(self) -> None:
        """Create (and migrate) the Dagster instance's storages by ``dagster instance migrate``: a process, since the
        library does not import Dagster."""
        env = {**os.environ, "DAGSTER_HOME": str(self.dagster_home)}
        out = subprocess.run([venv_executable("dagster"), "instance", "migrate"], env=env, cwd=self.root,
                             capture_output=True, text=True)
        if out.returncode != 0:
            raise XCError(f"could not create the Dagster instance in {self.dagster_home} "
                          f"(dagster instance migrate, exit {out.returncode}): {out.stderr.strip()[-2000:]}")


def _has_store(made: set[str], uri: str) -> bool:
    """Whether the URI's store is made: always for a store not made here (server, database: nor is its URI, which
    may hold a password, written down); for a SQLite file, when the marker lists it and the file is still there."""
    if not is_sqlite_uri(uri):
        return True
    path = urlsplit(uri).path[1:]  # sqlite:///rel.db -> rel.db, sqlite:////abs.db -> /abs.db
    return path in ("", ":memory:") or (f"mlflow:{uri}" in made and Path(path).exists())
