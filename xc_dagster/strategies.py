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
        "Siamese encoder with in-batch hard negatives (triplet, margin 0.3), classifiers initialised from "
        "label embeddings and trained on ANNS-mined negatives, dual-MIPS shortlist with score fusion "
        "(baseline form: random batches; cluster batching and tree fusion are later components).",
        {"pretrain.sampler": "random", "fusion.method": "alpha"},
    ),
}
