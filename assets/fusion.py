"""Fusion fitting: the blend a * classifier + (1 - a) * embedding score, with a fitted on the shortlists of the validation points carved from train."""


import dagster as dg

from assets._stage import materialize_stage
from assets.config import CONFIG_CLASSES
from resources import ComputeResource, MLflowResource, XCHomeResource

STAGE = "fusion"
Config = CONFIG_CLASSES[STAGE]


def build(partitions: dg.PartitionsDefinition) -> dg.AssetsDefinition:
    @dg.asset(name="fusion", deps=["ann_index"], partitions_def=partitions, group_name="inference", kinds={"scikitlearn"},
              description=__doc__)
    def _asset(context: dg.AssetExecutionContext, config: Config, home: XCHomeResource,  # type: ignore[valid-type]
               mlflow: MLflowResource, compute: ComputeResource) -> dg.MaterializeResult:
        return materialize_stage(context, STAGE, config, home, mlflow, compute)

    return _asset
