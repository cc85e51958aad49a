"""Hyperparameters of every stage: one dataclass per stage, with the ``quick`` preset's values as defaults.

The classifier stage's parameters are composed of the parts each trainer reads (``HardNegativeTrainerParams``,
``EndToEndTrainerParams``); its user-facing names ``classifier.<field>`` are all of them.
"""

from __future__ import annotations

from dataclasses import dataclass

from xc_dagster.config.choices import (
    AmpMode,
    AnnSource,
    ClassifierLoss,
    EncoderNegatives,
    FitOn,
    FusionMethod,
    FusionSearch,
    GradCacheMode,
    IndexKind,
    IngestText,
    LabelRepr,
    LabelText,
    LexicalSolver,
    Negatives,
    PairLoss,
    Pooling,
    PretrainSampler,
    RowOptimizer,
    SamplerIndexKind,
    Source,
)


@dataclass
class TrainParams:
    """The training budget (``xc_dagster.training.budget``): the encoder's epochs planned from this machine's
    measured speed so that the training stages fill ``budget_minutes``; epochs set explicitly win."""

    # minutes for the training stages together (the evaluation's stage_seconds.training_total); 0 = no budget
    budget_minutes: float = 30.0
    calibration_steps: int = 3  # timed steps (after one warm-up step) of the trainer on a copy of the encoder
    # ... and steps timed until they took this long, at most 2% of the budget (decisions.md#calibration-warm-up)
    calibration_seconds: float = 10.0
    reserve: float = 0.15  # share of the budget kept for the stages after the encoder's training
    max_epochs: float = 0.0  # at most this many planned encoder epochs; 0 = no cap
    # share of the planned training seconds between re-plans as trained; 0 = never (decisions.md#replan-as-trained)
    replan_every: float = 0.1


@dataclass
class IngestParams:
    """Dataset ingest: which text fields make a point's text, and the validation split carved from train."""

    text: IngestText = "auto"  # "title" | "title+content" | "auto" (by dataset name: "Titles" -> title)
    label_text: LabelText = "title"  # label text fields; "same" = as points
    valid_fraction: float = 0.05  # fraction of training points held out for fusion fitting
    valid_max: int = 5000  # at most this many validation points
    # a split that would hold fewer points than this is not carved: every training point trains the models and the
    # fusion is cross-fitted over folds of the training set (fusion.fit_on); 0 = always carve (fusion-cross-fitting)
    valid_min: int = 0
    split: int = 0  # bow-single layout: which column of the <name>_trSplit/_tstSplit tables
    seed: int = 0
    verify_counts: bool = True  # a known public dataset's parsed counts must equal the published ones


@dataclass
class TokenizeParams:
    """Tokenization with the encoder's fast tokenizer."""

    encoder: str = "minilm"  # "minilm" = the packaged all-MiniLM-L6-v2; "bag" / "bag:<dim>" = bag of embeddings
    # (SiameseXML/Astec; CPU-fast, MiniLM's tokenizer; train it with pretrain.lr=0.01); else an HF path or hub name
    max_len: int = 32  # 32 for titles, 128 full text, 256 Wikipedia (NGAME)
    label_max_len: int = 0  # 0 = same as max_len


@dataclass
class PretrainParams:
    """Siamese pretraining (NGAME M1 / SiameseXML Module I): shared encoder, in-batch hard negatives.

    ``sampler`` picks how batches are built (over points: random/ngame; over labels: siamesexml) and ``loss``
    the objective on the batch's similarity matrix; they are independent (the SiameseXML paper also reports
    Module I with the triplet loss), the ``siamesexml`` strategy sets both.
    """

    epochs: float = 1.0  # fractional epochs allowed (a budget on CPU)
    batch_size: int = 256  # points per step, each with one sampled positive label (siamesexml: labels per step)
    lr: float = 2e-4
    warmup_steps: int = 20
    weight_decay: float = 0.01
    margin: float = 0.3
    # top-k hardest in-batch negatives per point (siamesexml: kappa per label); NGAME's code takes 10 (the paper
    # preset), more teach more per step from a pretrained encoder (docs/decisions.md#pretrain-hard-negatives-k30)
    num_negatives: int = 30
    temperature: float = 0.1  # softmax weighting of violators (NGAME code's OHNM)
    pooling: Pooling = "mean"  # "mean" | "cls"
    # transformer encoders: keep the input embeddings and the lowest N layers as pretrained (backward stops
    # at layer N: faster steps); 0 trains every layer (docs/decisions.md#pretrain-freeze-layers-off)
    freeze_layers: int = 0
    # texts per forward chunk, sorted by length (per-chunk padding); the most: a smaller one is taken when the
    # step's predicted memory needs it (xc_dagster.training.memory)
    chunk_size: int = 128
    # gradient caching (GradCache): embed the batch without autograd, then re-run one chunk at a time for the
    # encoder's gradient, so activations are one chunk's, not the batch's; "auto" = on when the plain step's
    # predicted memory does not fit, "on", "off" (docs/decisions.md#grad-cache)
    grad_cache: GradCacheMode = "auto"
    # "auto" (CUDA: bf16, else fp16; CPU: bf16 where it pays, decisions.md#amp-auto-on-cpu) | "bf16" | "fp16" | "off"
    amp: AmpMode = "auto"
    encode_batch_size: int = 256
    sampler: PretrainSampler = "random"  # "random" batches | "ngame": unions of clusters of the memory-bank embeddings
    max_cluster_size: int = 64  # ngame: C doubles from 1 at each curriculum epoch, up to this
    # ngame: the epochs where C doubles (an epoch listed n times doubles it n times); the quick preset clusters
    # from epoch 1 with C = 8, after a first epoch of random batches fills the memory bank; the paper preset has
    # the paper's schedule (docs/decisions.md#ngame-cluster-batches-after-first-epoch)
    curriculum: tuple[int, ...] = (1, 1, 1)
    cluster_every: int = 5  # ngame: re-cluster every tau epochs (from the memory bank, no extra encoding)
    # ngame: fill the memory bank with the starting encoder's embeddings (one forward pass) before training, so a
    # curriculum starting at epoch 0 clusters from the first batch (decisions.md#pretrain-seed-bank-and-symmetric-off)
    seed_bank: bool = False
    # point batches: also the label-anchored direction (each sampled label against the batch's points, as
    # SiameseXML's Module I), from the same similarity matrix: a second loss term at no extra encoding
    symmetric: bool = False
    # every label's text also a point, positive for that label (Renee; samplers random, ngame) and, with a share > 0,
    # for the labels on at least that share of its label's training points (Gandalf)
    label_points: bool = False
    label_point_cooccurrence: float = 0.0
    # sampler "siamesexml" (SiameseXML Module I): each batch is `batch_size` distinct labels drawn with
    # probability ~ freq ** label_power (freq = training points of the label), one random positive point each;
    # one epoch = ceil(labels with freq > 0 / batch_size) batches.
    label_power: float = 0.45  # paper: 0 = uniform over labels, 1 = the label distribution of point batches
    centroid_points: int = 2  # positives per label averaged into the centroid v_l (paper: 2); 0 = no centroid term
    centroid_weight: float = 0.3  # 1 - beta: loss = beta * loss(E(z_l)) + (1 - beta) * loss(v_l); paper beta = 0.7
    # "triplet" (NGAME OHNM hinge) | "siamesexml" (probabilistic contrastive, no margin) | "infonce" | "dexml"
    # (DEXML's decoupled softmax: every in-batch positive a target, the other positives out of its denominator)
    loss: PairLoss = "triplet"
    contrastive_c: float = 0.9  # siamesexml loss: p(+1, v) = c * exp(d * v) / exp(d); code for Module I: c=0.9
    contrastive_d: float = 1.5  # ... d = 1.5 (Module IV's classifiers use c=0.75, d=3.0)
    infonce_temperature: float = 0.05  # loss "infonce": in-batch softmax at this temperature (MiniLM's: 0.05)
    # retrain from a previous model: "" = cold start from tokenize.encoder; "champion" = the dataset's
    # registered champion (cold when there is none yet); or a serving bundle folder. Encoder and classifiers
    # start from it; labels new to the data start from their text embeddings (xc_dagster.serving.warm_start).
    warm_start: str = ""
    seed: int = 0


@dataclass
class MiningParams:
    """Negative mining: a shortlist of candidate labels per training point from ANNS over label embeddings."""

    shortlist_size: int = 100
    # where candidates come from (xc_dagster.retrieval.shortlist.SOURCES): "label" (label text embeddings), "centroid"
    # (label centroids), "knn" (labels of the nearest training points); SiameseXML Module II uses all three
    sources: tuple[AnnSource, ...] = ("label",)
    knn_weight: float = 0.025  # g: candidates ranked by (1 - g)(s_label + s_centroid) + g * s_knn (SiameseXML)
    # "auto" (exact up to 2^18 vectors, 2^19 with bf16 scoring, HNSW above: decisions.md#index-auto) | "hnsw" | "exact"
    # (blocked matmul in torch) | "ivf"
    index: IndexKind = "auto"
    hnsw_m: int = 32
    hnsw_ef_construction: int = 200
    hnsw_ef_search: int = 200


@dataclass
class ClassifierCommonParams:
    """What both classifier trainers read: the schedule, W's start and optimizer, the positives, the loss scale."""

    epochs: float = 5  # fractions only with sampled negatives (uniform/astra/mips): a CPU budget
    batch_size: int = 1024
    lr: float = 1e-3  # W's learning rate (SparseAdam, NGAME code: 1e-3)
    # w_l starts from the label representation (index.label_repr's values) at unit norm: "text": E(z_l) (NGAME
    # M2, SiameseXML Module III) | "text+centroid": normalise(E(z_l) + v_l) with Module II's centroid v_l (a
    # label's training points; unseen labels keep E(z_l))
    init: LabelRepr = "text"
    # which negatives, and so which trainer: the hardest of "shortlist" (mined ANNS) | "in-batch" (NGAME M2) |
    # "both" (xc_dagster.training.classifier); or sampled over all labels with BCE: "uniform" | "astra" (stale W
    # index + uniform) | "mips" (MIPS-s) (xc_dagster.training.end_to_end)
    negatives: Negatives = "shortlist"
    num_positives: int = 3  # positives sampled per point per step
    # gamma >= 0: a positive of label l weighs (1/p_l)^gamma in the loss (mean 1 over the training positives;
    # propensity-scored loss, Jain et al. 2016). ngame and siamesexml set 1 (strategies.py)
    propensity_weight: float = 0.0
    scale: float = 10.0  # bce only: logit = scale * w.x
    normalize: bool = True  # keep every w_l at unit norm (NGAME M2), same scale as embedding scores
    # W's optimizer: "sgd" (ASTRA: SGD for the classifiers) | "sparse-adam" (NGAME); lr = classifier.lr
    w_optimizer: RowOptimizer = "sparse-adam"
    weight_decay: float = 0.0  # classifiers, on the rows a step touches (ASTRA: 1e-4; sampled negatives only)
    label_points: bool = False  # every label also a training point, its one positive itself (ASTRA, Renee)
    # > 0 (Gandalf): a label point's positives also hold the labels on >= this share of its label's training points
    label_point_cooccurrence: float = 0.0
    seed: int = 0


@dataclass
class HardNegativeParams:
    """The hardest-negative trainer (NGAME M2/M4, SiameseXML Module IV; ``xc_dagster.training.classifier``)."""

    # "triplet" (NGAME M2: multi-positive hinge) | "bce" | "siamesexml" (Module IV); the sampled negatives
    # (uniform/astra/mips) always train with BCE
    loss: ClassifierLoss = "triplet"
    num_negatives: int = 50  # hardest negatives (under the current W) per point per step
    cluster_size: int = 0  # >1: batches are unions of clusters of this many points (NGAME); 0/1: random
    margin: float = 0.2  # triplet loss only
    contrastive_c: float = 0.75  # siamesexml loss only (SiameseXML Module IV, reference code: c 0.75, d 3.0)
    contrastive_d: float = 3.0
    neg_threshold: float = 0.05  # siamesexml loss only: negative terms below this are ignored (easy negatives)
    # SiameseXML Module IV: also fine-tune the bag encoder's residual block (on its frozen intermediate
    # embeddings) with the classifiers; the updated encoder is deployed downstream. Applies to encoders with a
    # residual block (tokenize.encoder=bag); a transformer stays frozen (recorded in the stage summary).
    train_residual: bool = False
    residual_lr: float = 2e-4  # Adam, the residual block (SiameseXML code, Module IV: 2e-4)


@dataclass
class SampledNegativeParams:
    """Negatives sampled over all labels (``xc_dagster.sampling.negatives``: uniform, ASTRA, MIPS-s)."""

    num_hard: int = 50  # astra: k_h stale hard negatives; mips: k negatives from the MIPS
    num_random: int = 400  # astra: k_r uniform negatives (weight L / k_r); mips: R - k uniform negatives
    hard_start: float = 5.0  # astra: tau_s, epochs of uniform-only warm-up (fractions allowed)
    refresh_every: float = 5.0  # astra: tau_r, epochs between index refreshes; mips: P (MIPS-s: 8 per epoch)
    refresh_async: bool = True  # astra: build the next index in the background during the interval before it
    # index over W: "hnsw" (astra) | "ivf" (mips: ~sqrt(L) k-means partitions) | "exact"
    sampler_index: SamplerIndexKind = "hnsw"
    sampler_hnsw_m: int = 32
    sampler_hnsw_ef: int = 100  # efSearch of the stale hard-negative index
    sampler_hnsw_ef_construction: int = 100
    mips_partitions: int = 0  # ivf partitions K; 0 = round(sqrt(L)) (MIPS-s)
    mips_probe: int = 64  # ivf partitions probed per query (MIPS-s: tau = 64)


@dataclass
class EndToEndParams:
    """The BCE trainer over sampled negatives, the encoder optionally trained with W (ASTRA, MIPS-s;
    ``xc_dagster.training.end_to_end``)."""

    train_encoder: bool = False  # fine-tune the encoder end to end with the classifiers (ASTRA, MIPS-s)
    # one learned logit bias shared by all labels, initialised at the log prior odds of a positive: it absorbs
    # "almost every label is negative" at once, so that neither the encoder nor W has to (a shared constant:
    # rankings, indexes and serving are unchanged)
    logit_bias: bool = True
    encoder_lr: float = 1e-5  # AdamW, encoder (ASTRA: 1e-5)
    dropout: float = 0.0  # on the query embedding before the classifiers (ASTRA tunes 0.5-0.9)
    # which negatives send gradient to the encoder: "all" (the papers) | "hard" (the uniform draws train W only;
    # the encoder learns from positives and the index's hard negatives, so the many uniform terms -- weighted
    # L / k_r in ASTRA -- cannot push every query away from every classifier)
    encoder_negatives: EncoderNegatives = "all"
    warmup_steps: int = 0  # cosine schedule with linear warm-up, for encoder and classifiers
    shards: int = 0  # W sharded by label: 0 = one shard per visible GPU (1 on CPU), n = n shards
    chunk_size: int = 128  # texts per encoder forward chunk (train_encoder); the most, as pretrain.chunk_size
    grad_cache: GradCacheMode = "auto"  # train_encoder: gradient caching, as pretrain.grad_cache (auto | on | off)
    encode_batch_size: int = 256  # re-encoding after training (train_encoder)


@dataclass
class HardNegativeTrainerParams(HardNegativeParams, ClassifierCommonParams):
    """Everything ``xc_dagster.training.classifier.train_classifiers`` reads."""


@dataclass
class EndToEndTrainerParams(EndToEndParams, SampledNegativeParams, ClassifierCommonParams):
    """Everything ``xc_dagster.training.end_to_end.train_end_to_end`` reads."""


@dataclass
class ClassifierParams(EndToEndParams, SampledNegativeParams, HardNegativeParams, ClassifierCommonParams):
    """The classifier stage (M2/M4): one-vs-all W initialised from label representations, trained by the
    hardest-negative trainer or the sampled-negative BCE trainer (``classifier.negatives`` chooses). Each
    trainer reads its own part (``HardNegativeTrainerParams``, ``EndToEndTrainerParams``); the stage's
    ``classifier.*`` names are all of them."""


@dataclass
class FusionParams:
    """Score fusion fitted on the validation split's shortlists (see ``xc_dagster.retrieval.fusion``).

    ``alpha``: a * classifier + (1 - a) * embedding, a grid-searched. ``tree`` (NGAME): T(d) + embedding +
    classifier, T a depth-7 tree on d = (embedding score, classifier score, inverse propensity).
    """

    method: FusionMethod = "alpha"  # "alpha" | "tree"
    # what the fusion is fitted on: "validation" = the held-out validation points; "cross_fit" = every training
    # point, each scored by classifiers, kNN and lexical neighbours fitted without its fold (the encoder is
    # shared); "auto" = validation when ingest carved a split, else cross-fitting
    # (docs/decisions.md#fusion-cross-fitting)
    fit_on: FitOn = "auto"
    cross_fit_folds: int = 5  # folds of the training points (cross-fitting)
    cross_fit_max_points: int = 20_000  # at most this many out-of-fold points scored (seeded sample)
    # alpha: grid-search target; tree: reported validation objective. A metric of evaluation.metrics.evaluate or
    # several joined by "+" (summed); head and tail weigh equally, as in the champion gate
    # (docs/decisions.md#fusion-objective-four-metrics)
    objective: str = "precision_at_1+precision_at_5+psprecision_at_1+psprecision_at_5"
    grid_step: float = 0.05  # alpha only
    # alpha only: how the weights (c, d, e, b below) are searched, alpha's whole grid with each: "coordinate" = one at
    # a time, in rounds until none moves, then two at once; "grid" = all (docs/decisions.md#fusion-coordinate-search)
    search: FusionSearch = "coordinate"
    # alpha only: average the validation objective over this many neighbouring grid points per axis (a, c, b)
    # before the argmax; 1 = the raw argmax (docs/decisions.md#fusion-smoothing-off)
    smoothing: int = 1
    # alpha only, when the shortlist has kNN scores (index.sources with knn): weights c tried jointly with alpha
    # for a * classifier + (1 - a) * embedding + c * kNN; 0 = the two-score blend
    knn_grid: tuple[float, ...] = (0.0, 0.125, 0.25, 0.5, 1.0)
    knn_grid_extend: int = 6  # a best c on the grid's edge doubles up to this many times while validation improves
    # alpha only, with lexical scores (index.sources with lexical): weights d of + d * lexical; 0 always tried
    lexical_grid: tuple[float, ...] = (0.0, 0.125, 0.25, 0.5, 1.0)
    lexical_grid_extend: int = 6  # as knn_grid_extend, for the lexical weight
    # alpha only, with co-occurrence votes: weights e tried jointly for + e * votes (0 always tried; (0,) = none)
    cooccurrence_grid: tuple[float, ...] = (0.0, 0.25, 0.5, 1.0)
    cooccurrence_grid_extend: int = 6  # as knn_grid_extend, for the co-occurrence weight
    # alpha only, with kNN scores: exponents f tried for c * kNN / n_l ** f, n_l the kNN index's points carrying
    # label l; f = 0 always tried; (0,) = off (docs/decisions.md#fusion-knn-discount)
    knn_discount_grid: tuple[float, ...] = (0.0,)
    # alpha only: weights b tried jointly for + b * log(1 / p_l), the labels' inverse propensity: ranking by
    # P(y_l) / p_l maximises PSP; b = 0 always tried; (0,) = no term (docs/decisions.md#fusion-propensity-term)
    propensity_grid: tuple[float, ...] = (0.0, 0.01, 0.02, 0.04, 0.08)
    propensity_grid_extend: int = 6  # as knn_grid_extend, for the propensity weight
    # candidates "K:p" for the kNN votes of the knn and lexical sources (K nearest training points, each voting its
    # similarity ** p), each fitted, the best deployed; () = index.knn_* / index.lexical_* (decisions.md#vote-grid)
    vote_grid: tuple[str, ...] = ()
    # also fit without the lexical classifiers' part, the better kept (docs/decisions.md#lexical-classifiers-optional)
    try_without_lexical_classifiers: bool = True
    tree_depth: int = 7  # NGAME: a depth-7 tree
    tree_min_samples_leaf: int = 1  # sklearn's default (the paper: "a standard regression tree")
    tree_max_samples: int = 500_000  # candidates subsampled (seeded) to fit the tree; 0 = all
    tree_add_positives: bool = True  # NGAME paper: fit on shortlist u positives (code: shortlist only)
    seed: int = 0


@dataclass
class IndexParams:
    """ANNS indexes over W and over label embeddings used at inference."""

    kind: IndexKind = "auto"  # "auto" (exact up to 2^18 / 2^19 (bf16) vectors, else hnsw) | "hnsw" | "exact" | "ivf"
    sources: tuple[Source, ...] = ("W", "label")  # shortlist sources at inference (NGAME: dual MIPS over W and
    # label embeddings; SiameseXML: label, centroid, knn); see xc_dagster.retrieval.shortlist.SOURCES
    label_repr: LabelRepr = "text"  # embedding score r_l.e: "text" r_l = E(z_l) | "text+centroid" E(z_l) + v_l
    hnsw_m: int = 32
    hnsw_ef_construction: int = 200
    hnsw_ef_search: int = 200
    shortlist_size: int = 100  # neighbours retrieved from each index per query
    # knn source: the mean over the K nearest training points of their similarity where they carry the label
    knn_neighbours: int = 10
    knn_power: float = 1.0  # a neighbour's vote is max(similarity, 0) ** knn_power (docs/decisions.md#knn-vote-power)
    # the deployed kNN index and label centroids hold every training point, the validation ones too (the
    # fusion is still fitted on validation without them: index/heldout/ holds the other points' centroids and
    # the kNN rows to exclude); W and the encoder never see validation points. False: deploy what was fitted
    include_validation: bool = True
    # lexical source (TF-IDF, xc_dagster.retrieval.lexical): its kNN part is the mean over the K nearest training
    # points (TF-IDF cosine) of their similarity where they carry the label
    lexical_neighbours: int = 10
    lexical_power: float = 1.0  # as knn_power, for the lexical source's kNN votes
    lexical_min_df: int = 2  # lexical source: terms (word 1-2 grams) in fewer documents are dropped; 1 if none is left
    lexical_char_weight: float = 0.0  # > 0: texts' char 3-5 grams too, weighed so (decisions.md#lexical-char-ngrams)
    # lexical source over more than lexical_exact_points training points: each term's postings capped at the P
    # points (and P labels) where its weight is largest, so a query's cost is bounded by its terms x P at any N
    # (static index pruning; docs/decisions.md#lexical-postings-cap); 0 = every posting (exact cosines) at any N
    lexical_max_postings: int = 4096
    lexical_exact_points: int = 65_536
    # the lexical source's third part: a sparse linear model per label over the TF-IDF rows on its positives' terms
    # (xc_dagster.retrieval.lexical_classifier; decisions.md#lexical-classifier); none when the fusion is cross-fitted
    lexical_classifier: bool = True
    lexical_classifier_epochs: float = 10.0
    lexical_classifier_hard_negatives: int = 50
    lexical_classifier_random_negatives: int = 100
    lexical_classifier_max_terms: int = 1024
    lexical_classifier_max_pairs: int = 50_000_000
    lexical_classifier_candidates: int = 200  # per query: the classifiers score the other parts' top this many labels
    lexical_classifier_solver: LexicalSolver = "auto"  # liblinear's SVMs on every pair up to 2^25, else sampled pairs
    lexical_classifier_c: float = 0.25
    # g of g * classifier in the lexical score; several: chosen on validation (ties: the first; lexical_weight)
    lexical_classifier_weights: tuple[float, ...] = (1.0,)
    # cooccurrence source (xc_dagster.retrieval.cooccurrence, Gandalf's label points): the K nearest labels of the
    # label source's search vote max(similarity, 0) ** power each for the labels co-occurring with them in
    # training, P(l | h), each label keeping its max_entries most frequent co-occurring labels; not built when the
    # fusion is cross-fitted (docs/decisions.md#label-cooccurrence)
    cooccurrence_neighbours: int = 3
    cooccurrence_power: float = 4.0
    cooccurrence_max_entries: int = 100


@dataclass
class EvaluateParams:
    """Evaluation on the test split with the XC repository's metrics."""

    ks: tuple[int, ...] = (1, 3, 5)
    top_k: int = 100  # predictions kept per test point (>= max(ks) and 10, + room for filtered pairs)
    propensity_a: float = 0.0  # 0 = by dataset family (Amazon 0.6, Wikipedia 0.5, else 0.55)
    propensity_b: float = 0.0  # 0 = by dataset family (Amazon 2.6, Wikipedia 0.4, else 1.5)


STAGES: dict[str, type] = {
    "train": TrainParams,
    "ingest": IngestParams,
    "tokenize": TokenizeParams,
    "pretrain": PretrainParams,
    "mining": MiningParams,
    "classifier": ClassifierParams,
    "fusion": FusionParams,
    "index": IndexParams,
    "evaluate": EvaluateParams,
}
