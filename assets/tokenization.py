"""Tokenization: token-id arrays (memmap .npy) of training points, test points and labels, with the encoder's fast tokenizer and the dataset's max_len."""


import dagster as dg

from assets._stage import materialize_stage
from assets.config import CONFIG_CLASSES
from resources import ComputeResource, MLflowResource, XCHomeResource

STAGE = "tokenize"
Config = CONFIG_CLASSES[STAGE]


def build(partitions: dg.PartitionsDefinition) -> dg.AssetsDefinition:
    @dg.asset(name="tokens", deps=["dataset"], partitions_def=partitions, group_name="data", kinds={"python", "numpy"},
              description=__doc__)
    def _asset(context: dg.AssetExecutionContext, config: Config, home: XCHomeResource,  # type: ignore[valid-type]
               mlflow: MLflowResource, compute: ComputeResource) -> dg.MaterializeResult:
        return materialize_stage(context, STAGE, config, home, mlflow, compute)

    return _asset
