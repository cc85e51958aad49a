"""Classifier training (M2/M4): one-vs-all W initialised from the label embeddings and trained on positives plus the hardest mined negatives, with sparse updates."""


import dagster as dg

from assets._stage import materialize_stage
from assets.config import CONFIG_CLASSES
from resources import ComputeResource, MLflowResource, XCHomeResource

STAGE = "classifier"
Config = CONFIG_CLASSES[STAGE]


def build(partitions: dg.PartitionsDefinition) -> dg.AssetsDefinition:
    @dg.asset(name="classifiers", deps=["negative_shortlist"], partitions_def=partitions, group_name="training", kinds={"pytorch"},
              description=__doc__)
    def _asset(context: dg.AssetExecutionContext, config: Config, home: XCHomeResource,  # type: ignore[valid-type]
               mlflow: MLflowResource, compute: ComputeResource) -> dg.MaterializeResult:
        return materialize_stage(context, STAGE, config, home, mlflow, compute)

    return _asset
