"""MLflow tracking as a resource: ``MLFLOW_TRACKING_URI`` when set, else a SQLite store under XC_HOME."""

from __future__ import annotations

import dagster as dg

from xc_dagster.home import Home
from xc_dagster.tracking import Tracker


class MLflowResource(dg.ConfigurableResource):
    """``tracking_uri`` empty = ``MLFLOW_TRACKING_URI`` or ``sqlite:///$XC_HOME/mlflow.db``."""

    tracking_uri: str = ""

    def tracker(self, home: Home) -> Tracker:
        uri = self.tracking_uri or home.mlflow_uri
        home.ensure(tracking_uri=uri)  # a store of its own is created under the home's first-use lock too
        return Tracker(uri, home.mlflow_artifacts)
