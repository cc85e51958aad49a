"""Negative mining (SiameseXML Module II): a shortlist of candidate labels per training point from ANNS over
the label embeddings, label centroids and training-point neighbours (hard negatives for the classifiers), and the
label centroids. Reads the dataset and the encoder's embeddings."""

from assets._stage import stage_asset

build = stage_asset("mining", group="training", kinds={"faiss", "numpy"}, description=__doc__)
