"""Negative mining: a shortlist of candidate labels per training point, from ANNS over the label embeddings (hard negatives for the classifiers)."""

from assets._stage import stage_asset

build = stage_asset("mining", "negative_shortlist", deps=["siamese_encoder"],
                    group="training", kinds={"faiss", "numpy"}, description=__doc__)
