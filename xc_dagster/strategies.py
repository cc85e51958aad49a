"""Strategies: each seed method is a named set of component choices layered onto a preset.

A strategy chooses components by configuration (batch sampler, losses, negatives, fusion), never by copying a
stage. NGAME and SiameseXML train the encoder first (pretrain stage) and the classifiers on the frozen encoder;
ASTRA and MIPS-s train both end to end in the classifier stage with BCE over negatives sampled from a stale
index over W (``xc_dagster.sampling.negatives``), and the later stages use the encoder the classifier stage
wrote. ``xc-dagster strategies`` prints each one's help and settings; ``docs/strategies.md`` has more.
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Strategy:
    """``summary``: one line; ``description``: the user's help (components, and the options that change them);
    ``overrides``: the ``stage.field`` values it sets on top of the preset; ``quick``: values it sets on top of
    those under the quick preset only (the CPU budget's: the paper preset keeps the papers' values)."""

    name: str
    summary: str
    description: str
    overrides: dict[str, Any] = field(default_factory=dict)
    quick: dict[str, Any] = field(default_factory=dict)

    def settings(self, preset: str) -> dict[str, Any]:
        """Every ``stage.field`` value this strategy sets on top of ``preset``."""
        return {**self.overrides, **(self.quick if preset == "quick" else {})}


# ASTRA / MIPS-s in a CPU budget: end to end from the starting encoder in about one pass, BCE with k_p = 7
# positives, SGD with weight decay 1e-4 for W (docs/decisions.md#e2e-shared-logit-bias), logit scale 7 and W lr 3
# (docs/decisions.md#e2e-logit-scale-and-lr), the fusion fitted for P@1 as those papers tune
# (docs/decisions.md#fusion-objective-p1-end-to-end)
E2E_CPU = {"pretrain.epochs": 0, "classifier.train_encoder": True, "classifier.loss": "bce",
           "classifier.num_positives": 7, "classifier.w_optimizer": "sgd", "classifier.weight_decay": 1e-4,
           "fusion.method": "alpha", "classifier.batch_size": 128, "classifier.normalize": False,
           "classifier.encoder_lr": 2e-4, "classifier.warmup_steps": 20,
           "classifier.dropout": 0.0, "classifier.logit_bias": True,
           "classifier.scale": 7.0, "classifier.lr": 3.0,
           "fusion.objective": "precision_at_1"}

# every strategy: SiameseXML's kNN index over the training points adds candidates and a third fusion input
# (docs/decisions.md#knn-inference-source)
KNN_INFERENCE = {"index.sources": ("W", "label", "knn")}

# the default strategy also shortlists and scores with the lexical (TF-IDF) channel, a fusion input whose weight
# validation may set to 0 (docs/decisions.md#lexical-source); each kNN vote, dense or lexical, is its similarity
# squared (docs/decisions.md#knn-vote-power); the labels co-occurring with the query's nearest labels add
# candidates and a fusion input (docs/decisions.md#label-cooccurrence), which made fusion.vote_grid's 50:4 lose to
# 10:2 on every dataset (docs/decisions.md#vote-grid)
LEXICAL_INFERENCE = {"index.sources": ("W", "label", "knn", "lexical", "cooccurrence"), "index.knn_power": 2.0,
                     "index.lexical_power": 2.0}

# the hardest-negative trainer's positives weigh (1/p_l) (docs/decisions.md#classifier-propensity-weight)
PROPENSITY_SCORED = {"classifier.propensity_weight": 1.0}

STRATEGIES: dict[str, Strategy] = {
    "ngame": Strategy(
        "ngame",
        "NGAME: Siamese pretraining on cluster batches, then classifiers on the hardest negatives; dual MIPS.",
        "Module M1: the Siamese encoder trained with the OHNM triplet loss (margin 0.3) on in-batch hard "
        "negatives; batches come from Algorithm 1's sampler (pretrain.sampler=ngame: clusters of the memory-bank "
        "embeddings, the cluster size C doubling on the curriculum, re-clustered every tau epochs), with every label's "
        "text a training point too, positive for its label and the labels on half its label's points (Gandalf; "
        "pretrain.label_points=false for the paper's points alone, and where labels have no names). The quick "
        "preset clusters from epoch 1 (C = 8), so its single epoch is random batches that fill the memory bank "
        "and pretrain.epochs >= 2 adds cluster batches. M2/M4: one-vs-all classifiers initialised from the label "
        "embeddings and trained with the multi-positive triplet loss on the hardest mined negatives "
        "(classifier.negatives=in-batch|both with classifier.cluster_size for M2's cluster-batched in-batch "
        "negatives); positives weigh (1/p_l) (classifier.propensity_weight=0 for the paper's unweighted loss), "
        "for ten epochs under the quick preset (the paper preset keeps its 100). "
        "Inference: ANNS over W and over the label embeddings, plus SiameseXML's kNN index over the training "
        "points and the lexical channel (TF-IDF similarity to the label text and a sparse kNN over the training "
        "points; index.sources=W,label for the paper's dual MIPS alone); the embedding score adds the label "
        "centroid (index.label_repr=text for E(z_l) alone); scores fused by a blend fitted on validation, "
        "the kNN votes divided by a power of their labels' counts where validation prefers it "
        "(fusion.method=tree for the paper's depth-7 tree).",
        {"pretrain.sampler": "ngame", "fusion.method": "alpha",
         "index.label_repr": "text+centroid",  # docs/decisions.md#ngame-label-centroid-score
         # Gandalf's label points in the Siamese pretraining: docs/decisions.md#gandalf-label-points
         "pretrain.label_points": True, "pretrain.label_point_cooccurrence": 0.5,
         # the kNN votes divided by their labels' counts ** f: docs/decisions.md#fusion-knn-discount
         "fusion.knn_discount_grid": (0.0, 0.125, 0.25, 0.5, 1.0),
         **LEXICAL_INFERENCE, **PROPENSITY_SCORED},
        # ten classifier epochs, not five, under the quick preset: docs/decisions.md#classifier-epochs-ten
        quick={"classifier.epochs": 10},
    ),
    "siamesexml": Strategy(
        "siamesexml",
        "SiameseXML: label-batched Siamese pretraining with label centroids (Modules I-IV).",
        "Module I: mini-batches over labels drawn with probability ~ freq^0.45, one random positive point per "
        "label; the triplet loss over the kappa = 30 hardest in-batch points per label (the paper's alternative "
        "objective; its probabilistic contrastive loss is pretrain.loss=siamesexml) on the label text embedding "
        "(beta = 0.7) and on a 2-point label centroid (0.3). Module II: shortlists merged from three ANNS indexes "
        "(label text embeddings, label centroids v_l, labels of the nearest training points), ranked by "
        "(1 - g)(s_text + s_centroid) + g s_knn with g = 0.025, for training negatives and at inference. "
        "Module III: w_l starts from the label text embedding plus its centroid, normalised (classifier.init=text "
        "for E(z_l) alone). Module IV: one-vs-all classifiers on positives + the hardest Module II shortlist "
        "negatives with the triplet loss (the paper's probabilistic contrastive loss is "
        "classifier.loss=siamesexml), positives weighing (1/p_l); with the bag encoder (tokenize.encoder=bag, "
        "the paper's encoder) its residual block is fine-tuned with W on the frozen intermediate embeddings "
        "(classifier.train_residual; a transformer stays frozen). Fusion: a * w_l.e + (1 - a) * (E(z_l) + v_l).e "
        "with a fitted on validation.",
        {
            "pretrain.sampler": "siamesexml",
            "pretrain.loss": "triplet",  # docs/decisions.md#siamesexml-module1-triplet-loss
            "pretrain.num_negatives": 30,
            "pretrain.epochs": 3,  # label epochs (docs/decisions.md#siamesexml-module1-three-epochs)
            "mining.sources": ("label", "centroid", "knn"),
            "index.sources": ("label", "centroid", "knn"),
            "index.label_repr": "text+centroid",
            # Module IV's loss stays triplet: docs/decisions.md#siamesexml-module4-triplet-loss
            "fusion.method": "alpha",
            "classifier.train_residual": True,
            "classifier.init": "text+centroid",  # docs/decisions.md#classifier-init
            **PROPENSITY_SCORED,
        },
    ),
    "astra": Strategy(
        "astra",
        "ASTRA: encoder and classifiers end to end with BCE over stale ANNS hard negatives + uniform draws.",
        "Encoder and one-vs-all classifiers trained end to end with BCE; per query k_p = 7 positives, "
        "k_h = 50 stale hard negatives = its nearest labels in an HNSW index over the classifier vectors W "
        "(positives excluded) and k_r = 400 uniform draws weighted L / k_r, so the loss is an unbiased estimate "
        "of the full BCE; uniform-only warm-up for tau_s, index rebuilt every tau_r in a background thread from "
        "W and the query embeddings of the interval before; label texts added as training points; AdamW for the "
        "encoder, SGD with weight decay 1e-4 for W, cosine schedule with warm-up. The paper runs 75 epochs with "
        "tau_s = tau_r = 5; the quick preset trains 0.75 epoch with tau_s = tau_r = 0.25 epoch "
        "(classifier.hard_start / refresh_every). The pretrain stage only embeds with the starting encoder "
        "(pretrain.epochs 0): the packaged MiniLM is already a sentence encoder.",
        {
            **E2E_CPU, **KNN_INFERENCE,
            "classifier.negatives": "astra", "classifier.label_points": True, "classifier.num_hard": 50,
            "classifier.num_random": 400, "classifier.hard_start": 0.25, "classifier.refresh_every": 0.25,
            "classifier.epochs": 0.75, "classifier.sampler_index": "hnsw",
        },
    ),
    "mips": Strategy(
        "mips",
        "MIPS-s: end to end with BCE over negatives from a clustering MIPS over stale W + uniform draws.",
        "Meta-classifier free negative sampling: encoder and classifiers trained end to end with plain BCE over "
        "all positives, k = 5 negatives from a clustering-based MIPS over a stale snapshot of W (faiss IVF, "
        "inner product, ~sqrt(L) partitions, tau = 64 probed, fresh query embeddings, positives removed) and "
        "R - k = 95 uniform negatives; W re-clustered every P = 1/8 epoch (8 pre-processings per epoch as in "
        "the paper's Fig. 2). Same optimisers and schedule as astra; no label texts as points.",
        {
            **E2E_CPU, **KNN_INFERENCE,
            "classifier.negatives": "mips", "classifier.label_points": False, "classifier.num_hard": 5,
            "classifier.num_random": 95, "classifier.refresh_every": 0.125, "classifier.sampler_index": "ivf",
            "classifier.mips_probe": 64, "classifier.epochs": 1,
        },
    ),
}


def strategy_help(name: str | None = None) -> str:
    """The help of one strategy (its description and every setting it changes), or a line per strategy."""
    if name is None:
        width = max(map(len, STRATEGIES))
        return "\n".join(f"{n:<{width}}  {s.summary}" for n, s in STRATEGIES.items())
    s = STRATEGIES[name]
    text = textwrap.fill(s.description, width=110)

    def lines(d: dict[str, Any]) -> str:
        return "\n".join(f"  {k} = {','.join(map(str, v)) if isinstance(v, tuple) else v}"
                         for k, v in sorted(d.items()))

    quick = f"\n\nOn top of those, under the quick preset only:\n{lines(s.quick)}" if s.quick else ""
    return f"{s.name}: {s.summary}\n\n{text}\n\nSettings on top of the preset:\n{lines(s.overrides)}{quick}"
