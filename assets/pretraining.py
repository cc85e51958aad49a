"""Siamese pretraining (NGAME M1): the shared transformer encoder (mean pooling, L2-normalised) trained with the triplet loss on in-batch hard negatives; writes the encoder checkpoint (safetensors) and the embeddings of every training point and label."""

from assets._stage import stage_asset

build = stage_asset("pretrain", "siamese_encoder", deps=["tokens"],
                    group="training", kinds={"pytorch", "huggingface"}, description=__doc__)
