"""The one home folder that holds all state: catalog, artifacts, MLflow store, Dagster instance.

``XC_HOME`` when set, else ``~/.xc-dagster``. Dagster's own instance lives in ``$XC_HOME/dagster`` (the
``DAGSTER_HOME`` the CLI wrappers export), so runs from the CLI and from the UI share one history.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


def xc_home() -> Path:
    return Path(os.environ.get("XC_HOME") or Path.home() / ".xc-dagster").expanduser().resolve()


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

    def ensure(self) -> "Home":
        """Create the folders; write an empty dagster.yaml so ``DAGSTER_HOME`` is a valid instance."""
        for p in (self.root, self.artifacts, self.cache, self.dagster_home, self.mlflow_artifacts):
            p.mkdir(parents=True, exist_ok=True)
        cfg = self.dagster_home / "dagster.yaml"
        if not cfg.exists():
            cfg.write_text("# Dagster instance of xc-dagster (runs, event logs, schedules) under XC_HOME\n"
                           "telemetry:\n  enabled: false\n")
        return self
