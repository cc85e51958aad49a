"""Dagster software-defined assets, one module per pipeline stage, all partitioned by dataset.

Lineage: dataset -> tokens -> siamese_encoder -> negative_shortlist -> classifiers -> ann_index -> fusion
-> evaluation. ``build_assets(partitions)`` creates them for the catalog's partitions.
"""

from __future__ import annotations

import dagster as dg

from assets import (classifier, evaluation, fusion, index, ingest, negative_mining, pretraining,
                    tokenization)

STAGE_MODULES = (ingest, tokenization, pretraining, negative_mining, classifier, index, fusion, evaluation)


def build_assets(partitions: dg.PartitionsDefinition) -> list[dg.AssetsDefinition]:
    return [m.build(partitions) for m in STAGE_MODULES]
