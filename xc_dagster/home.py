"""The one home folder that holds all state: catalog, artifacts, MLflow store, Dagster instance.

``XC_HOME`` when set, else ``~/.xc-dagster``. Dagster's own instance lives in ``$XC_HOME/dagster`` (the
``DAGSTER_HOME`` the CLI wrappers export), so runs from the CLI and from the UI share one history.

First use of a home creates its stores (``dagster.yaml``, the MLflow database and its schema migrations, the
Dagster instance's storages) once, under an exclusive ``flock`` on ``.home.lock``, and records what it made
in ``.home-ready.json``: processes that start together on a fresh home would otherwise race on the migrations and
fail, or leave the MLflow store broken for good (docs/decisions.md#home-first-use-lock). Both stores are made by
child processes, so this module imports neither Dagster nor MLflow (the CLI's light commands start without them).
A PostgreSQL tracking store or Dagster database, which processes of other hosts share, is created under a PostgreSQL
advisory lock too.

``dagster.yaml`` is rendered from the environment (:func:`render_dagster_yaml`): SQLite storages under the home by
default, PostgreSQL when ``XC_DAGSTER_POSTGRES_URL`` is set (the file names the variable, not the password), and the
limit of the training assets' concurrency pool. A file that starts with one of our header lines is ours and is
rewritten when the environment renders it otherwise (a home made by an older release is migrated so); any other file
is the user's own and is left as it is.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from xc_dagster.config.env import env_positive
from xc_dagster.durable import atomic_write_text
from xc_dagster.errors import XCError
from xc_dagster.postgres import advisory_lock, check_url, is_postgres_uri, is_sqlite_uri, redact
from xc_dagster.storage import file_lock

READY = ".home-ready.json"  # what the first use made: {"made": ["dagster.yaml", "mlflow:<uri>", "dagster-instance"]}
LOCK = ".home.lock"  # held exclusively while the home's first use creates its stores
INSTANCE = "dagster-instance"
DAGSTER_POSTGRES_URL = "XC_DAGSTER_POSTGRES_URL"  # set: Dagster's storages in that PostgreSQL database
TRAINING_CONCURRENCY = "XC_TRAINING_CONCURRENCY"  # how many training steps may run at once, over all runs
TRAINING_POOL = "xc_training"  # the Dagster concurrency pool the training assets declare
DEFAULT_TRAINING_CONCURRENCY = 1
MAX_CONCURRENCY = 1000  # Dagster's largest pool limit (DAGSTER_MAX_GLOBAL_OP_CONCURRENCY_LIMIT's default)
YAML_HEADER = ("# Dagster instance of xc-dagster, written from XC_DAGSTER_POSTGRES_URL and XC_TRAINING_CONCURRENCY "
               "and rewritten when they change; remove this line to keep your own edits")
OLD_YAML_HEADERS = ("# Dagster instance of xc-dagster (runs, event logs, schedules) under XC_HOME",)  # rewritten too
MLFLOW_SCHEMA_LOCK = 0x78632D6D6C666C77  # advisory lock key of an MLflow database's first use ("xc-mlflw")
DAGSTER_SCHEMA_LOCK = 0x78632D6461677374  # and of a Dagster database's ("xc-dagst")
# the tracking store's first use, run in a child process; the URI, which may hold a password, goes by the environment
TRACKING_STORE_CMD = ("import os; from xc_dagster.tracking import prepare_tracking_store; "
                      "prepare_tracking_store(os.environ['MLFLOW_TRACKING_URI'])")


def training_concurrency(environ: Mapping[str, str] | None = None) -> int:
    """``XC_TRAINING_CONCURRENCY`` (default 1): a whole number from 1 to 1000, else XCConfigError."""
    return int(env_positive(TRAINING_CONCURRENCY, DEFAULT_TRAINING_CONCURRENCY, int, MAX_CONCURRENCY, environ))


def render_dagster_yaml(environ: Mapping[str, str] | None = None) -> str:
    """The home's ``dagster.yaml`` for an environment (default ``os.environ``): telemetry off; with
    ``XC_DAGSTER_POSTGRES_URL`` the ``dagster_postgres`` storages, read from that variable when Dagster loads the
    instance (the password is never written); the concurrency pools' default limit, ``XC_TRAINING_CONCURRENCY``,
    which applies to the training assets' pool ``xc_training`` (the only pool; a limit set for it by
    ``dagster instance concurrency set xc_training N`` takes precedence)."""
    env = os.environ if environ is None else environ
    lines = [YAML_HEADER, "telemetry:", "  enabled: false"]
    url = env.get(DAGSTER_POSTGRES_URL, "").strip()
    if url:
        check_url(DAGSTER_POSTGRES_URL, url)
        lines += ["storage:", "  postgres:", "    postgres_url:", f"      env: {DAGSTER_POSTGRES_URL}"]
    lines += ["concurrency:", "  pools:",
              f"    default_limit: {training_concurrency(env)}  # every pool without a limit of its own: "
              f"{TRAINING_POOL}, the training assets'"]
    return "\n".join(lines) + "\n"


def is_our_yaml(text: str) -> bool:
    """Whether a ``dagster.yaml`` was written by xc-dagster (this release or an older one): by its first line."""
    first = text.split("\n", 1)[0].rstrip()
    return first == YAML_HEADER or first in OLD_YAML_HEADERS


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

    def environ(self) -> dict[str, str]:
        """This process's environment with the home's ``XC_HOME``, ``DAGSTER_HOME`` and ``MLFLOW_TRACKING_URI``: what
        the Dagster processes the CLI starts run with."""
        return {**os.environ, "XC_HOME": str(self.root), "DAGSTER_HOME": str(self.dagster_home),
                "MLFLOW_TRACKING_URI": self.mlflow_uri}

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
            wanted = self._wanted_yaml()
            if wanted is not None:
                atomic_write_text(self.dagster_yaml, wanted)
            if not _has_store(made, uri):
                with _first_use_lock(uri):
                    self._prepare_tracking_store(uri)
                made.add(_store_key(uri))
            if instance and self._instance_key() not in made:
                with self._instance_lock():
                    self._prepare_instance()
                made.add(self._instance_key())
            atomic_write_text(self.root / READY, json.dumps({"made": sorted(made)}, indent=1) + "\n")
        return self

    def is_prepared(self, instance: bool = False, tracking_uri: str | None = None) -> bool:
        """Whether the first use is done: ``dagster.yaml`` as the environment renders it (or the user's own), the
        tracking URI's store (and the Dagster instance of the yaml's storage)."""
        made = self._made()
        return (self._wanted_yaml() is None and _has_store(made, tracking_uri or self.mlflow_uri)
                and (not instance or self._instance_key() in made))

    @property
    def dagster_yaml(self) -> Path:
        return self.dagster_home / "dagster.yaml"

    def _wanted_yaml(self) -> str | None:
        """The ``dagster.yaml`` to write: the rendered one when there is none or ours says otherwise; None when the
        file is current or the user's own."""
        try:
            text = self.dagster_yaml.read_text()
        except FileNotFoundError:
            return render_dagster_yaml()
        if not is_our_yaml(text):
            return None
        wanted = render_dagster_yaml()
        return None if text == wanted else wanted

    def _instance_key(self) -> str:
        """What the marker calls the Dagster instance: ``dagster-instance`` (SQLite under the home, or the user's
        own yaml), ``dagster-instance:<URL without password>`` for our yaml on PostgreSQL (made again when the
        storage changes)."""
        url = os.environ.get(DAGSTER_POSTGRES_URL, "").strip()
        if not url or not self.dagster_yaml.exists() or not is_our_yaml(self.dagster_yaml.read_text()):
            return INSTANCE
        return f"{INSTANCE}:{redact(url)}"

    def _instance_lock(self) -> contextlib.AbstractContextManager:
        """For our yaml on PostgreSQL, the Dagster database's advisory lock while the instance is migrated (the
        code location, webserver and daemon of other hosts may start together)."""
        if self._instance_key() == INSTANCE:
            return contextlib.nullcontext()
        return advisory_lock(DAGSTER_POSTGRES_URL, os.environ[DAGSTER_POSTGRES_URL].strip(), DAGSTER_SCHEMA_LOCK)

    def _made(self) -> set[str]:
        try:
            return set(json.loads((self.root / READY).read_text()).get("made", []))
        except (FileNotFoundError, ValueError, AttributeError):  # none yet, or not ours: made again (idempotent)
            return set()

    def _prepare_tracking_store(self, uri: str) -> None:
        """Create (and migrate) the MLflow tracking store of ``uri`` (``tracking.prepare_tracking_store``) in a child
        process: MLflow's import alone takes a second, which the commands that log nothing need not pay."""
        env = {**os.environ, "MLFLOW_TRACKING_URI": uri}
        out = subprocess.run([sys.executable, "-c", TRACKING_STORE_CMD], env=env, cwd=self.root, capture_output=True,
                             text=True)
        if out.returncode != 0:
            shown = redact(uri) if is_postgres_uri(uri) else uri
            raise XCError(f"could not create the MLflow tracking store {shown} (exit {out.returncode}): "
                          f"{out.stderr.replace(uri, shown).strip()[-2000:]}")

    def _prepare_instance(self) -> None:
        """Create (and migrate) the Dagster instance's storages by ``dagster instance migrate``: a process, since the
        library does not import Dagster."""
        env = {**os.environ, "DAGSTER_HOME": str(self.dagster_home)}
        out = subprocess.run([venv_executable("dagster"), "instance", "migrate"], env=env, cwd=self.root,
                             capture_output=True, text=True)
        if out.returncode != 0:
            raise XCError(f"could not create the Dagster instance in {self.dagster_home} "
                          f"(dagster instance migrate, exit {out.returncode}): {out.stderr.strip()[-2000:]}")


def _store_key(uri: str) -> str:
    """What the marker calls a tracking store: ``mlflow:<URI>``, a PostgreSQL URI without its password."""
    return f"mlflow:{redact(uri) if is_postgres_uri(uri) else uri}"


def _has_store(made: set[str], uri: str) -> bool:
    """Whether the URI's store is made: always for a store not made here (tracking server, other databases); for
    PostgreSQL when the marker lists it; for a SQLite file, when the marker lists it and the file is still there."""
    if is_postgres_uri(uri):
        return _store_key(uri) in made
    if not is_sqlite_uri(uri):
        return True
    path = urlsplit(uri).path[1:]  # sqlite:///rel.db -> rel.db, sqlite:////abs.db -> /abs.db
    return path in ("", ":memory:") or (_store_key(uri) in made and Path(path).exists())


def _first_use_lock(uri: str) -> contextlib.AbstractContextManager:
    """Beside the home's flock: for a PostgreSQL store, its database's advisory lock (other hosts' processes share
    the store, and MLflow's check-then-create of its tables races)."""
    if is_postgres_uri(uri):
        return advisory_lock("MLFLOW_TRACKING_URI", uri, MLFLOW_SCHEMA_LOCK)
    return contextlib.nullcontext()
