"""The fixed sets of values of the enum-like config fields, and their ``typing.Literal`` types.

Each tuple is the set of names a component registry holds (the comment says which), so that a value outside it
fails when the config is resolved (``--set``, the catalog, the run config) with the field and the allowed values
named, not when the stage reaches the registry. The registries live beside their components (they import this
package's dataclasses, so this package cannot import them); ``tests/test_config_typed.py`` checks that each
registry holds exactly the names here: a new component is one class, one registry line and one name here.
"""

from __future__ import annotations

import typing
from typing import Any, Literal

# pretrain.sampler: xc_dagster.sampling.batches.BATCH_SAMPLERS
PRETRAIN_SAMPLERS = ("random", "ngame", "siamesexml")
# pretrain.loss: xc_dagster.training.losses.PAIR_LOSSES
PAIR_LOSSES = ("triplet", "siamesexml", "infonce", "dexml")
# classifier.loss: xc_dagster.training.losses.CLASSIFIER_LOSSES
CLASSIFIER_LOSSES = ("triplet", "bce", "siamesexml")
# classifier.negatives: xc_dagster.sampling.hard_negatives.HARD_NEGATIVE_POOLS (the hardest-negative trainer)
# and xc_dagster.sampling.negatives.SAMPLED_NEGATIVES (the BCE trainer over sampled negatives)
HARD_NEGATIVE_POOLS = ("shortlist", "in-batch", "both")
SAMPLED_NEGATIVES = ("uniform", "astra", "mips")
NEGATIVES = HARD_NEGATIVE_POOLS + SAMPLED_NEGATIVES
# classifier.w_optimizer: xc_dagster.training.sharded.ROW_OPTIMIZERS
ROW_OPTIMIZERS = ("sgd", "sparse-adam")
# classifier.encoder_negatives: xc_dagster.training.end_to_end.ENCODER_NEGATIVES
ENCODER_NEGATIVES = ("all", "hard")
# pretrain.grad_cache, classifier.grad_cache: xc_dagster.training.memory.GRAD_CACHE_MODES
GRAD_CACHE_MODES = ("auto", "on", "off")
# pretrain.amp: xc_dagster.device.amp_dtype
AMP_MODES = ("auto", "bf16", "fp16", "off")
# pretrain.pooling: xc_dagster.encoders.transformer
POOLINGS = ("mean", "cls")
# mining.index, index.kind: xc_dagster.retrieval.exact_settings.KINDS; classifier.sampler_index: the stale index of
# xc_dagster.sampling.stale_index, its kinds without "auto" (a checkpoint restores the index by the kind set)
INDEX_KINDS = ("auto", "hnsw", "exact", "ivf")
SAMPLER_INDEX_KINDS = ("hnsw", "exact", "ivf")
# index.sources: xc_dagster.retrieval.shortlist.SOURCES; mining.sources: its ANN_SOURCES (lexical and
# cooccurrence are inference sources only)
SOURCES = ("W", "label", "centroid", "knn", "lexical", "cooccurrence")
ANN_SOURCES = ("W", "label", "centroid", "knn")
# index.label_repr, classifier.init: xc_dagster.retrieval.shortlist.LABEL_REPRS
LABEL_REPRS = ("text", "text+centroid")
# fusion.method: xc_dagster.retrieval.fusion.FUSIONS
FUSION_METHODS = ("alpha", "tree")
# fusion.fit_on: xc_dagster.pipeline.cross_fit.FIT_ON
FIT_ON = ("auto", "validation", "cross_fit")
# fusion.search: xc_dagster.retrieval.fusion.alpha.fit_alpha
FUSION_SEARCHES = ("coordinate", "grid")
# index.lexical_classifier_solver: xc_dagster.retrieval.lexical_exact.SOLVERS
LEXICAL_SOLVERS = ("auto", "sgd", "liblinear", "liblinear_sampled")
# ingest.text: xc_dagster.catalog.TEXT_CHOICES or "auto" (by the dataset); ingest.label_text: the same fields
# or "same" (as the points)
INGEST_TEXTS = ("auto", "title", "title+content")
LABEL_TEXTS = ("title", "title+content", "same")

PretrainSampler = Literal[PRETRAIN_SAMPLERS]  # type: ignore[valid-type]
PairLoss = Literal[PAIR_LOSSES]  # type: ignore[valid-type]
ClassifierLoss = Literal[CLASSIFIER_LOSSES]  # type: ignore[valid-type]
Negatives = Literal[NEGATIVES]  # type: ignore[valid-type]
RowOptimizer = Literal[ROW_OPTIMIZERS]  # type: ignore[valid-type]
EncoderNegatives = Literal[ENCODER_NEGATIVES]  # type: ignore[valid-type]
GradCacheMode = Literal[GRAD_CACHE_MODES]  # type: ignore[valid-type]
AmpMode = Literal[AMP_MODES]  # type: ignore[valid-type]
Pooling = Literal[POOLINGS]  # type: ignore[valid-type]
IndexKind = Literal[INDEX_KINDS]  # type: ignore[valid-type]
SamplerIndexKind = Literal[SAMPLER_INDEX_KINDS]  # type: ignore[valid-type]
Source = Literal[SOURCES]  # type: ignore[valid-type]
AnnSource = Literal[ANN_SOURCES]  # type: ignore[valid-type]
LabelRepr = Literal[LABEL_REPRS]  # type: ignore[valid-type]
FusionMethod = Literal[FUSION_METHODS]  # type: ignore[valid-type]
FitOn = Literal[FIT_ON]  # type: ignore[valid-type]
FusionSearch = Literal[FUSION_SEARCHES]  # type: ignore[valid-type]
IngestText = Literal[INGEST_TEXTS]  # type: ignore[valid-type]
LabelText = Literal[LABEL_TEXTS]  # type: ignore[valid-type]
LexicalSolver = Literal[LEXICAL_SOLVERS]  # type: ignore[valid-type]


def literal_choices(typ: Any) -> tuple[str, ...] | None:
    """The allowed values of a ``Literal`` field type, or of the items of a ``tuple[Literal[...], ...]`` one;
    None for any other type."""
    if typing.get_origin(typ) is tuple:
        typ = typing.get_args(typ)[0]
    if typing.get_origin(typ) is Literal:
        return typing.get_args(typ)
    return None
