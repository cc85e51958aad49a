"""Strategies: each seed method is a named set of component choices layered onto a preset.

A strategy chooses components by configuration (batch sampler, losses, fusion), never by copying a stage.
Only strategies whose components exist are registered; the NGAME, SiameseXML, ASTRA and MIPS-s samplers
arrive as their components land.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Strategy:
    name: str
    description: str
    overrides: dict[str, Any] = field(default_factory=dict)


STRATEGIES: dict[str, Strategy] = {
    "ngame": Strategy(
        "ngame",
        "NGAME: Siamese encoder trained with the OHNM triplet loss (margin 0.3) on in-batch hard negatives, "
        "classifiers initialised from label embeddings and trained with the multi-positive triplet loss on "
        "the hardest negatives, dual-MIPS shortlist (ANNS over W and over label embeddings) with score "
        "fusion. The paper's components are all selectable: pretrain.sampler=ngame (Algorithm 1: cluster "
        "batches from the memory bank, curriculum doubling C, re-clustering every tau epochs), "
        "classifier.negatives=in-batch|both with classifier.cluster_size (M2's cluster-batched in-batch "
        "negatives), fusion.method=tree (the depth-7 decision tree). The quick preset keeps random batches "
        "(its one epoch ends before the curriculum's first clustering epoch).",
        {"pretrain.sampler": "random", "fusion.method": "alpha"},
    ),
    "siamesexml": Strategy(
        "siamesexml",
        "SiameseXML. Module I: mini-batches over labels drawn with probability ~ freq^0.45, one random "
        "positive point per label, kappa = 1 hardest in-batch negative points per label, the probabilistic "
        "contrastive loss with c = 0.9, d = 1.5 on the label text embedding (beta = 0.7) and on a 2-point "
        "label centroid (0.3). Module II: shortlists merged from three ANNS indexes (label text embeddings, "
        "label centroids v_l, labels of the nearest training points), ranked by (1 - g)(s_text + s_centroid) "
        "+ g s_knn with g = 0.025, for training negatives and at inference. Module III: w_l initialised from "
        "the label embedding. Module IV: one-vs-all classifiers on positives + the hardest Module II shortlist "
        "negatives; the paper's probabilistic contrastive loss (c = 0.75, d = 3.0, easy negatives ignored) is "
        "classifier.loss=siamesexml, but the default here is the triplet loss, which measured better (see "
        "below); the encoder stays frozen (the paper also fine-tunes the bag encoder's residual layer here). "
        "Fusion "
        "a * w_l.e + (1 - a) * (E(z_l) + v_l).e with a fitted on validation. Use tokenize.encoder=bag for "
        "the paper's bag-of-embeddings encoder.",
        {
            "pretrain.sampler": "siamesexml",
            "pretrain.loss": "siamesexml",
            # kappa = 1 (reference code for Module I; paper: 1 to 5); c, d, beta, power, 2 centroid points are
            # the PretrainParams defaults (paper/code values).
            "pretrain.num_negatives": 1,
            # CPU budget, quick preset on LF-WordNetNounsTitles (54,606 training points after the validation
            # split, 21,035 labels with a point, ~8 tokens per point or label title): ngame's 1 epoch of
            # 256-point batches encodes 54.6K points + 54.6K label texts = 109K texts in 214 steps. A
            # siamesexml batch of 256 labels encodes 256 label texts + ~598 distinct points (anchors and
            # 2 centroid points per label, repeats encoded once), ~854 texts; an epoch is ceil(21,035 / 256)
            # = 83 batches = ~71K texts. 1.5 epochs = 125 steps = ~106K texts: the same encoder work.
            "pretrain.epochs": 1.5,
            "mining.sources": ("label", "centroid", "knn"),
            "index.sources": ("label", "centroid", "knn"),
            "index.label_repr": "text+centroid",
            # Module IV's loss (classifier.loss=siamesexml, c 0.75, d 3.0) measured worse than the triplet loss
            # on LF-WordNetNounsTitles with the same Module I encoder and Module II shortlists (validation
            # classifier-only P@1 after 3 epochs: 18.3 vs 24.5; bench/RESULTS.md), so it is an option, not the
            # default.
            "fusion.method": "alpha",
        },
    ),
}
