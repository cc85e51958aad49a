"""Serving and the model lifecycle.

==================  =================================================================================
``bundle``          the serving bundle (plain files), the inference path (text -> top-k labels), the pyfunc
``registry``        logging the pyfunc, registering it as ``xc-<dataset>``, the champion/challenger gate
``warm_start``      retraining from the dataset's champion instead of the base encoder; new labels start
                    from E(z_l) as in a cold start (SiameseXML Module III / NGAME M2 initialisation)
``retraining``      the click-log feed: listing, the sensor's cursor, drops built into datasets
``source_changes``  the source fingerprints and the datasets whose source changed since their last ingest
==================  =================================================================================
"""

import importlib
from typing import Any


def __getattr__(name: str) -> Any:
    # models logged before the bundle had its own module import ``xc_dagster.serving.XCModel``; resolved on
    # first use so that importing ``xc_dagster.serving.retraining`` does not load torch and MLflow
    if name == "XCModel":
        return importlib.import_module("xc_dagster.serving.bundle").XCModel
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
