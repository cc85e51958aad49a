"""Classifier training (M2/M4): one-vs-all W initialised from the label embeddings and trained on positives plus the hardest mined negatives, with sparse updates."""

from assets._stage import stage_asset

build = stage_asset("classifier", "classifiers", deps=["negative_shortlist"],
                    group="training", kinds={"pytorch"}, description=__doc__)
