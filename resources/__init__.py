"""Dagster resources, one module each, imported from the module that defines them (``from resources.home import
XCHomeResource``): importing the package loads none of them, so the process ``xc-dagster datasets add`` starts to
register a partition (``resources.partitions``) imports Dagster only, not torch and MLflow
(docs/decisions.md#add-imports).

==============  ==================================================================================================
``home``        ``XCHomeResource`` (storage root + catalog), ``dataset_partitions``, and the catalog's datasets
                registered with the instance when the definitions load (``sync_catalog``, ``sync_on_load``)
``partitions``  the dataset partitions (``DATASETS``) and their keys in the instance (``register``, ``registered``)
``pools``       the training assets' concurrency pool: its row, and the slots of killed runs freed
``tracking``    ``MLflowResource``: MLflow tracking
``compute``     ``ComputeResource``: compute device, and where a training stage runs
``clicklogs``   ``ClickLogFeedResource``: the click-log feed the retraining sensor watches
==============  ==================================================================================================
"""
