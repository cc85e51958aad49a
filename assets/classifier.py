"""Classifier training (NGAME M2/M4, SiameseXML Modules III/IV, ASTRA, MIPS-s): one-vs-all W initialised from the
label representations, trained on positives plus the hardest mined negatives, or with BCE over negatives sampled
from a stale index over W with the encoder fine-tuned end to end; sparse updates. Reads the dataset, the tokens
(end to end), the encoder and its embeddings, and the mined shortlist."""

from assets._stage import stage_asset
from xc_dagster.home import TRAINING_POOL

build = stage_asset("classifier", group="training", kinds={"pytorch"}, description=__doc__, pool=TRAINING_POOL)
