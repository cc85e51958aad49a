"""Load and save either kind of encoder: ``load_encoder(name)`` for a name (``xc_dagster.encoders.names``) or a
saved folder, ``save_encoder`` without pickle (safetensors + tokenizer files). Both kinds share
``forward(ids, mask)`` -> unit vectors and ``dim``.
"""

from __future__ import annotations

import os
from pathlib import Path

from transformers import AutoModel

from xc_dagster.encoders.bag import BagOfEmbeddingsEncoder, create_bag_encoder, is_bag_folder, load_bag_encoder
from xc_dagster.encoders.names import parse_bag_name, resolve_encoder_path
from xc_dagster.encoders.tokenizer import load_tokenizer
from xc_dagster.encoders.transformer import SiameseEncoder
from xc_dagster.errors import XCConfigError

TextEncoder = SiameseEncoder | BagOfEmbeddingsEncoder


def load_encoder(name: str, pooling: str = "mean") -> TextEncoder:
    """Load a transformer from the packaged default, a local folder (e.g. a checkpoint) or a hub name.

    ``bag`` / ``bag-of-embeddings`` / ``bag:<dim>`` create a fresh bag-of-embeddings encoder over MiniLM's
    vocabulary (uniform IDF: fit it with ``encoder.fit_idf`` before training); a folder holding
    ``bag_encoder.json`` restores a saved one. ``pooling`` applies to transformers only.
    """
    dim = parse_bag_name(name)
    if dim is not None:
        tok = load_tokenizer(name)
        return create_bag_encoder(len(tok), dim, special_ids=tok.all_special_ids)
    if is_bag_folder(name):
        return load_bag_encoder(name)
    path = resolve_encoder_path(name)
    try:
        model = AutoModel.from_pretrained(path, local_files_only=os.path.isdir(path))
    except (OSError, ValueError) as exc:
        raise XCConfigError(f"encoder {name!r}: cannot load a transformer from {path!r} ({exc})") from exc
    return SiameseEncoder(model, pooling)


def save_encoder(encoder: TextEncoder, tokenizer, out_dir: Path) -> None:
    """Write the encoder (safetensors, no pickle) and tokenizer so ``load_encoder(out_dir)`` restores it."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if isinstance(encoder, BagOfEmbeddingsEncoder):
        encoder.save(out_dir)
    else:
        encoder.transformer.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
