"""Siamese pretraining (NGAME M1, SiameseXML Module I): the shared encoder (a transformer with mean pooling, or
the bag-of-embeddings encoder), L2-normalised, trained on in-batch hard negatives of point batches (random or NGAME's
cluster batches) or label batches (SiameseXML); writes the encoder (safetensors) and the embeddings of every training
point and label. Reads the dataset's labels and validation split and the tokens."""

from assets._stage import stage_asset
from xc_dagster.home import TRAINING_POOL  # the instance's dagster.yaml limits its steps over all runs

build = stage_asset("pretrain", group="training", kinds={"pytorch", "huggingface"}, description=__doc__,
                    pool=TRAINING_POOL)
