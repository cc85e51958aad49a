"""Dataset ingest: the source (local, file://, http(s)://, fsspec) parsed from its XC layout into canonical tables -- point and label texts, train/test label matrices (CSR), filter pairs, BoW features -- plus the validation split carved from train."""


import dagster as dg

from assets._stage import materialize_stage
from assets.config import CONFIG_CLASSES
from resources import ComputeResource, MLflowResource, XCHomeResource


STAGE = "ingest"
Config = CONFIG_CLASSES[STAGE]


def build(partitions: dg.PartitionsDefinition) -> dg.AssetsDefinition:
    @dg.asset(name="dataset", deps=[], partitions_def=partitions, group_name="data", kinds={"python", "parquet"},
              description=__doc__)
    def _asset(context: dg.AssetExecutionContext, config: Config, home: XCHomeResource,  # type: ignore[valid-type]
               mlflow: MLflowResource, compute: ComputeResource) -> dg.MaterializeResult:
        return materialize_stage(context, STAGE, config, home, mlflow, compute)

    return _asset
