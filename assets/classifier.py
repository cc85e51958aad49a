"""Classifier training (M2/M4): one-vs-all W initialised from the label embeddings, trained on positives plus the hardest mined negatives (NGAME, SiameseXML) or with BCE over sampled negatives from a stale index over W (ASTRA, MIPS-s), optionally fine-tuning the encoder end to end; sparse updates."""

from assets._stage import stage_asset

build = stage_asset("classifier", "classifiers", deps=["negative_shortlist", "tokens"],
                    group="training", kinds={"pytorch"}, description=__doc__)
