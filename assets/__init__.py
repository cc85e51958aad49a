"""Dagster software-defined assets, one module per pipeline stage, all partitioned by dataset.

Stages in order: dataset -> tokens -> siamese_encoder -> negative_shortlist -> classifiers -> ann_index -> fusion
-> evaluation -> registered_model (MLflow model, champion/challenger gate). Each asset depends on every asset whose
artifacts it reads, as the artifact contract declares (``xc_dagster.artifacts``): re-materializing one marks every
reader stale. ``build_assets(partitions)`` creates the stage assets for the catalog's partitions,
``build_lifecycle_assets(partitions)`` the model lifecycle ones after them.
"""

from __future__ import annotations

import dagster as dg

from assets import (
    classifier,
    evaluation,
    fusion,
    index,
    ingest,
    model_registry,
    negative_mining,
    pretraining,
    tokenization,
)

STAGE_MODULES = (ingest, tokenization, pretraining, negative_mining, classifier, index, fusion, evaluation)
LIFECYCLE_MODULES = (model_registry,)  # after evaluation: the registered model and its promotion gate


def build_assets(partitions: dg.PartitionsDefinition) -> list[dg.AssetsDefinition]:
    return [m.build(partitions) for m in STAGE_MODULES]


def build_lifecycle_assets(partitions: dg.PartitionsDefinition) -> list[dg.AssetsDefinition]:
    return [m.build(partitions) for m in LIFECYCLE_MODULES]
