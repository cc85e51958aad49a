"""Strategies: each seed method is a named set of component choices layered onto a preset.

A strategy chooses components by configuration (batch sampler, losses, fusion), never by copying a stage.
NGAME and SiameseXML train the encoder first (pretrain stage) and the classifiers on the frozen encoder; ASTRA
and MIPS-s train both end to end in the classifier stage with BCE over negatives sampled from a stale index over
W (``xc_dagster.sampling.negatives``), and the later stages use the encoder the classifier stage wrote.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Strategy:
    name: str
    description: str
    overrides: dict[str, Any] = field(default_factory=dict)


# ASTRA / MIPS-s shared settings: end to end from the starting encoder, BCE, k_p = 7, SGD with weight decay 1e-4
# for W; and the CPU budget (about one pass over the data; the papers run 75 epochs on GPUs with
# encoder lr 1e-5, classifier lr 0.05, dropout 0.5-0.9). Measured on LF-WordNetNounsTitles from MiniLM, 0.1 epoch
# of astra, validation classifier-only P@1 (start: 12.7): W lr 0.05 -> 15.1, 1.0 -> 18.9 (encoder lr 1e-4);
# encoder lr 3e-4 -> 20.9; without the shared logit bias the encoder collapsed (P@1 2.6-3.4). Unnormalised W
# (BCE needs free logit scale), no dropout (too few epochs for it to pay).
E2E_CPU = {"pretrain.epochs": 0, "classifier.train_encoder": True, "classifier.loss": "bce",
           "classifier.num_positives": 7, "classifier.w_optimizer": "sgd", "classifier.weight_decay": 1e-4,
           "fusion.method": "alpha", "classifier.batch_size": 128, "classifier.normalize": False,
           "classifier.encoder_lr": 2e-4, "classifier.warmup_steps": 20,
           "classifier.dropout": 0.0, "classifier.logit_bias": True,
           # logit scale 7 and W lr 3 (SGD; the scale multiplies W's effective step by 49): at scale 1 the
           # classifiers start with logits within +-1 of the bias, the uniform negatives push every row the same
           # way, and after one pass the frequent labels win every query (frozen ngame encoder, mips sampler,
           # validation classifier-only P@1 13.1 at the start -> 5.7 after one epoch, PSP@1 1.4; astra's sampler
           # 6.4). Scale 5-7 with lr 3-10 gave 29.3-31.9 (ngame's triplet-trained W: 26.4). End to end on
           # LF-WordNetNounsTitles from MiniLM: mips 37.07 / 20.74 (scale 1: 33.66 / 17.77), astra 35.12 / 18.41
           # (scale 1: 34.35 / 20.14, an earlier session's fusion); bench/RESULTS.md, tenth session.
           "classifier.scale": 7.0, "classifier.lr": 3.0,
           # fusion fitted for P@1 as the ASTRA / MIPS-s papers tune: after one CPU pass their classifiers are
           # weak, and the default P@1 + PSP@1 objective drops them (a = 0). mips from the ngame encoder on
           # LF-WordNetNounsTitles: P@1 34.10 / PSP@1 18.25 fitted for P@1, 33.30 / 18.74 for the sum.
           "fusion.objective": "precision_at_1"}

# Inference for every strategy: besides the paper's own indexes, SiameseXML's kNN index over the training points
# (ANNS^x) adds candidates and a third fusion input, the mean similarity of the 10 nearest training points that
# carry the label, with its weight fitted on validation jointly with alpha (0 allowed: it can only help there).
# Measured on LF-WordNetNounsTitles (test split, bench/RESULTS.md): kNN alone P@1 34.0 with ngame's encoder
# (classifiers 32.1, label embeddings 16.6); ngame fused 37.5 with it vs 34.4 without; astra 34.4 vs 22.6,
# mips 33.7 vs 19.6 (one end-to-end pass on CPU); PSP@1 moves little (ngame 23.4 vs 23.2).
# Set index.sources=W,label for NGAME's dual MIPS alone.
KNN_INFERENCE = {"index.sources": ("W", "label", "knn")}

# The hardest-negative trainer's positives weighted (1/p_l)^1, the propensity-scored loss of Jain et al. (2016),
# for ngame and siamesexml (the papers' unweighted loss: classifier.propensity_weight=0). Measured against 0 with
# the same encoders and shortlists (test P@1 / PSP@1, validation objective; bench/RESULTS.md, fourteenth and
# fifteenth sessions): LF-WordNetNounsTitles ngame 36.86 / 26.75 vs 36.68 / 26.67 (66.33 vs 66.11), siamesexml
# 35.18 / 27.32 vs 35.31 / 26.41 (64.51 vs 64.53; PSP@5 +1.8, coverage@5 +9.8); Bibtex siamesexml + bag
# 63.02 / 52.02 vs 63.02 / 51.89 (117.74 vs 117.30). Never worse than 0.2 P@1 on test, never worse on validation
# beyond 0.02.
PROPENSITY_SCORED = {"classifier.propensity_weight": 1.0}

STRATEGIES: dict[str, Strategy] = {
    "ngame": Strategy(
        "ngame",
        "NGAME: Siamese encoder trained with the OHNM triplet loss (margin 0.3) on in-batch hard negatives, "
        "classifiers initialised from label embeddings and trained with the multi-positive triplet loss on "
        "the hardest negatives, dual-MIPS shortlist (ANNS over W and over label embeddings) with score "
        "fusion. The paper's components are all selectable: pretrain.sampler=ngame (Algorithm 1: cluster "
        "batches from the memory bank, curriculum doubling C, re-clustering every tau epochs), "
        "classifier.negatives=in-batch|both with classifier.cluster_size (M2's cluster-batched in-batch "
        "negatives), fusion.method=tree (the depth-7 decision tree). Pretraining batches come from "
        "Algorithm 1's sampler; in the quick preset its curriculum clusters from epoch 1 (C = 8), so the default "
        "single epoch is random batches that fill the memory bank and pretrain.epochs >= 2 adds cluster "
        "batches. Inference adds SiameseXML's kNN index over "
        "the training points as a third fusion input (index.sources=W,label for the paper's dual MIPS only), and "
        "the embedding score adds SiameseXML's label centroid (index.label_repr=text for the paper's E(z_l) alone). "
        "The classifiers' positives weigh (1/p_l) (propensity-scored loss; classifier.propensity_weight=0 for the "
        "paper's unweighted loss).",
        # index.label_repr text+centroid: the embedding score is (E(z_l) + v_l).e with SiameseXML's label
        # centroid v_l, which carries a tail label's few training points (LF-WordNetNounsTitles, same artifacts,
        # balanced fusion objective: PSP@1 25.1 with E(z_l) alone, 25.9 with the centroid; bench/RESULTS.md)
        {"pretrain.sampler": "ngame", "fusion.method": "alpha", "index.label_repr": "text+centroid",
         **KNN_INFERENCE, **PROPENSITY_SCORED},
    ),
    "siamesexml": Strategy(
        "siamesexml",
        "SiameseXML. Module I: mini-batches over labels drawn with probability ~ freq^0.45, one random "
        "positive point per label, kappa = 30 hardest in-batch negative points per label, the triplet loss "
        "(margin 0.3; the paper's alternative Module I objective, measured better here; its probabilistic "
        "contrastive loss with c = 0.9, d = 1.5, kappa = 1 is pretrain.loss=siamesexml) on the label text "
        "embedding (beta = 0.7) and on a 2-point label centroid (0.3). Module II: shortlists merged from three "
        "ANNS indexes (label text embeddings, "
        "label centroids v_l, labels of the nearest training points), ranked by (1 - g)(s_text + s_centroid) "
        "+ g s_knn with g = 0.025, for training negatives and at inference. Module III: w_l initialised from "
        "the label text embedding plus its centroid, normalised (classifier.init=text for E(z_l) alone). "
        "Module IV: one-vs-all classifiers on positives + the hardest Module II shortlist "
        "negatives; the paper's probabilistic contrastive loss (c = 0.75, d = 3.0, easy negatives ignored) is "
        "classifier.loss=siamesexml, but the default here is the triplet loss, which measured better (see "
        "below); with the bag encoder its residual block is fine-tuned with W on the frozen intermediate "
        "embeddings (classifier.train_residual; a transformer encoder stays frozen). "
        "Fusion "
        "a * w_l.e + (1 - a) * (E(z_l) + v_l).e with a fitted on validation. Use tokenize.encoder=bag for "
        "the paper's bag-of-embeddings encoder. Module IV's positives weigh (1/p_l) (propensity-scored loss; "
        "classifier.propensity_weight=0 for the paper's unweighted loss).",
        {
            "pretrain.sampler": "siamesexml",
            # Module I's loss: the triplet loss (the paper: "the incomplete NLL L^1 or else the triplet loss")
            # over the kappa = 30 hardest in-batch points (the paper's kappa, 1 to 5, is its probabilistic loss's).
            # Probes from MiniLM on LF-WordNetNounsTitles, 42 label batches, validation (E(z_l) + v_l).e P@1 /
            # PSP@1: probabilistic loss (c 0.9, d 1.5) kappa 1 22.89 / 23.01, kappa 5 20.81 / 21.76, triplet
            # kappa 5 23.90 / 24.20 (twelfth session); one label epoch, triplet kappa 5 23.66 / 23.79, kappa 30
            # 25.02 / 25.13, test 24.16 / 24.48 vs 25.14 / 25.13 at the same cost (seventeenth session; the
            # softmax weighting over more violators, as ngame's k 10 -> 30; bench/RESULTS.md).
            # beta, power, 2 centroid points are the PretrainParams defaults (paper/code values).
            "pretrain.loss": "triplet",
            "pretrain.num_negatives": 30,
            # CPU budget, quick preset on LF-WordNetNounsTitles (54,606 training points after the validation
            # split, 21,035 labels with a point, ~8 tokens per point or label title): a batch of 256 labels
            # encodes 256 label texts + ~598 distinct points (anchors and 2 centroid points per label, repeats
            # encoded once), ~854 texts; an epoch is ceil(21,035 / 256) = 83 batches = ~71K texts, and pairs
            # each label with one point (ngame's point epoch: 54.6K pairs). 3 epochs = 249 steps = ~213K
            # texts, twice ngame's one epoch: 1,063 s of Module I on the 2-core Xeon (140 points/s), 23 min of
            # training in all; 1.5 epochs gave 32.51 / 25.27 with the probabilistic loss, 3 with the triplet
            # loss 34.95 / 26.34 (bench/RESULTS.md).
            "pretrain.epochs": 3,
            "mining.sources": ("label", "centroid", "knn"),
            "index.sources": ("label", "centroid", "knn"),
            "index.label_repr": "text+centroid",
            # Module IV's loss (classifier.loss=siamesexml, c 0.75, d 3.0) measured worse than the triplet loss
            # on LF-WordNetNounsTitles with the same Module I encoder and Module II shortlists (validation
            # classifier-only P@1 after 3 epochs: 18.3 vs 24.5; bench/RESULTS.md), so it is an option, not the
            # default.
            "fusion.method": "alpha",
            "classifier.train_residual": True,
            # Module III: w_l from normalise(E(z_l) + v_l): same Module I encoder and shortlists, 35.32 / 26.41
            # vs 34.95 / 26.34 from E(z_l) (classifier-only 31.75 / 22.56 vs 29.54 / 22.21; bench/RESULTS.md)
            "classifier.init": "text+centroid",
            **PROPENSITY_SCORED,
        },
    ),
    "astra": Strategy(
        "astra",
        "ASTRA: encoder and one-vs-all classifiers trained end to end with BCE; per query k_p = 7 positives, "
        "k_h = 50 stale hard negatives = its nearest labels in an HNSW index over the classifier vectors W "
        "(positives excluded) and k_r = 400 uniform draws weighted L / k_r, so the loss is an "
        "unbiased estimate of the full BCE; uniform-only warm-up for tau_s, index rebuilt every tau_r in a "
        "background thread from W and the query embeddings saved during the interval before; label texts "
        "added as training points; AdamW for the encoder, SGD with weight decay 1e-4 for W, cosine schedule "
        "with warm-up, dropout on the query embedding. The paper runs 75 epochs with tau_s = tau_r = 5; the "
        "CPU quick preset trains 0.75 epoch, so tau_s = tau_r = 0.25 epoch (classifier.hard_start / "
        "refresh_every). The pretrain stage only embeds with the starting encoder (pretrain.epochs 0): the "
        "packaged MiniLM is already a pretrained sentence encoder, and the end-to-end stage trains it.",
        {
            **E2E_CPU, **KNN_INFERENCE,
            "classifier.negatives": "astra", "classifier.label_points": True, "classifier.num_hard": 50,
            "classifier.num_random": 400, "classifier.hard_start": 0.25, "classifier.refresh_every": 0.25,
            "classifier.epochs": 0.75, "classifier.sampler_index": "hnsw",
        },
    ),
    "mips": Strategy(
        "mips",
        "MIPS-s (meta-classifier free negative sampling): encoder and classifiers trained end to end with plain "
        "BCE over all positives, k = 5 negatives from a clustering-based MIPS over a stale snapshot of W "
        "(faiss IVF, inner product, ~sqrt(L) partitions, tau = 64 probed, fresh query embeddings, positives "
        "removed) and R - k = 95 uniform negatives; W re-clustered every P = 1/8 epoch (8 pre-processings per "
        "epoch as in the paper's Fig. 2). Same optimiser and schedule as astra; no label texts as points.",
        {
            **E2E_CPU, **KNN_INFERENCE,
            "classifier.negatives": "mips", "classifier.label_points": False, "classifier.num_hard": 5,
            "classifier.num_random": 95, "classifier.refresh_every": 0.125, "classifier.sampler_index": "ivf",
            "classifier.mips_probe": 64, "classifier.epochs": 1,
        },
    ),
}
