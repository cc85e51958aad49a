"""Negative mining: a shortlist of candidate labels per training point, from ANNS over the label embeddings (hard negatives for the classifiers)."""


import dagster as dg

from assets._stage import materialize_stage
from assets.config import CONFIG_CLASSES
from resources import ComputeResource, MLflowResource, XCHomeResource

STAGE = "mining"
Config = CONFIG_CLASSES[STAGE]


def build(partitions: dg.PartitionsDefinition) -> dg.AssetsDefinition:
    @dg.asset(name="negative_shortlist", deps=["siamese_encoder"], partitions_def=partitions, group_name="training", kinds={"faiss", "numpy"},
              description=__doc__)
    def _asset(context: dg.AssetExecutionContext, config: Config, home: XCHomeResource,  # type: ignore[valid-type]
               mlflow: MLflowResource, compute: ComputeResource) -> dg.MaterializeResult:
        return materialize_stage(context, STAGE, config, home, mlflow, compute)

    return _asset
