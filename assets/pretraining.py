"""Siamese pretraining (NGAME M1): the shared transformer encoder (mean pooling, L2-normalised) trained with the triplet loss on in-batch hard negatives; writes the encoder checkpoint (safetensors) and the embeddings of every training point and label."""


import dagster as dg

from assets._stage import materialize_stage
from assets.config import CONFIG_CLASSES
from resources import ComputeResource, MLflowResource, XCHomeResource

STAGE = "pretrain"
Config = CONFIG_CLASSES[STAGE]


def build(partitions: dg.PartitionsDefinition) -> dg.AssetsDefinition:
    @dg.asset(name="siamese_encoder", deps=["tokens"], partitions_def=partitions, group_name="training", kinds={"pytorch", "huggingface"},
              description=__doc__)
    def _asset(context: dg.AssetExecutionContext, config: Config, home: XCHomeResource,  # type: ignore[valid-type]
               mlflow: MLflowResource, compute: ComputeResource) -> dg.MaterializeResult:
        return materialize_stage(context, STAGE, config, home, mlflow, compute)

    return _asset
