"""Serving and the model lifecycle.

=================  ==================================================================================
``bundle``         the serving bundle (plain files) and the inference path: text -> top-k labels
``registry``       the registered MLflow model (pyfunc) and the champion/challenger gate
``warm_start``     retraining from the dataset's champion instead of the base encoder
``retraining``     the click-log feed and the source fingerprints that trigger retraining
=================  ==================================================================================
"""

import importlib
from typing import Any


def __getattr__(name: str) -> Any:
    # models logged before the bundle had its own module import ``xc_dagster.serving.XCModel``; resolved on
    # first use so that importing ``xc_dagster.serving.retraining`` does not load torch and MLflow
    if name == "XCModel":
        return importlib.import_module("xc_dagster.serving.bundle").XCModel
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
