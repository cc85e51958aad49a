"""The artifact contract: what each stage writes and which upstream artifacts it reads."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from xc_dagster.pipeline import StageContext


def model_dir(ctx: "StageContext") -> Path:
    """Where the deployed encoder and its embeddings live: the classifier stage's when it fine-tuned the encoder
    (end to end: ASTRA, MIPS-s; its residual block: SiameseXML Module IV), else the pretrain stage's."""
    c = ctx.store.stage_dir(ctx.name, "classifier")
    return c if (c / "encoder").is_dir() else ctx.dir("pretrain")
