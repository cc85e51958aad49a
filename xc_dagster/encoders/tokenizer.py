"""Tokenization: the encoder's fast tokenizer, texts -> fixed-width token-id arrays (memmap ``.npy``) plus
true lengths.

The arrays are padded to ``max_len`` on disk; the encoder pads each chunk only to its longest row, so the
disk width does not cost compute. ``tokenize_texts`` does the same for a batch of request texts (serving).
"""

from __future__ import annotations

import os
from itertools import chain
from pathlib import Path
from typing import Sequence

import numpy as np
from numpy.lib.format import open_memmap
from tokenizers import Tokenizer
from transformers import AutoTokenizer

from xc_dagster.encoders.bag import is_bag_folder
from xc_dagster.encoders.names import parse_bag_name, resolve_encoder_path
from xc_dagster.errors import XCConfigError


def load_tokenizer(name: str):
    """The encoder's fast tokenizer (local files only for local paths)."""
    path = resolve_encoder_path(name)
    try:
        return AutoTokenizer.from_pretrained(path, use_fast=True, local_files_only=os.path.isdir(path))
    except (OSError, ValueError) as exc:
        raise XCConfigError(f"tokenize.encoder={name!r}: cannot load a tokenizer from {path!r} ({exc})") from exc




def check_positions(name: str, tokenizer, lengths: dict[str, int]) -> None:
    """Refuse token lengths (field -> tokens) past the transformer ``name``'s positions, its tokenizer's
    ``model_max_length`` (MiniLM: 512): its position table has no row for them, and the first step would fail with
    an index error minutes into the run. A bag encoder reads any length."""
    most = getattr(tokenizer, "model_max_length", 0) or 0
    if parse_bag_name(name) is not None or is_bag_folder(name) or not 0 < most < 1 << 20:  # huge: not declared
        return
    most = int(most)
    for field, n in lengths.items():
        if n > most:
            raise XCConfigError(f"{field}: {n} tokens, past the {most} positions of the encoder {name!r} "
                                f"(its tokenizer's model_max_length); set at most {most}")


def _backend(tokenizer, max_len: int):
    """A copy of a fast tokenizer's Rust backend that truncates to ``max_len`` (special tokens included) and does
    not pad, or None for a slow tokenizer. Its ``encode_batch`` runs on every core and skips the Python
    ``BatchEncoding``: 1.65x the tokenizer's call on 2 cores (docs/decisions.md#tokenize-backend)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    backend = Tokenizer.from_str(backend.to_str())
    backend.no_padding()
    backend.enable_truncation(max_len)
    return backend


def _encode_rows(tokenizer, backend, batch: list[str], max_len: int, pad: int) -> tuple[np.ndarray, np.ndarray]:
    """(rows x max_len) int32 ids right-padded with ``pad`` and the rows' true lengths."""
    if backend is None:
        enc = tokenizer(batch, truncation=True, max_length=max_len, padding="max_length",
                        return_attention_mask=True, return_tensors="np")
        block, lens = enc["input_ids"].astype(np.int32), enc["attention_mask"].sum(1).astype(np.int32)
        block[np.arange(max_len) >= lens[:, None]] = pad
        return block, lens
    encs = backend.encode_batch(batch)
    lens = np.fromiter((len(e.ids) for e in encs), dtype=np.int32, count=len(encs))
    block = np.full((len(encs), max_len), pad, dtype=np.int32)
    block[np.arange(max_len) < lens[:, None]] = np.fromiter(chain.from_iterable(e.ids for e in encs),
                                                             dtype=np.int32, count=int(lens.sum()))
    return block, lens


def tokenize_to_npy(tokenizer, texts: Sequence[str], max_len: int, ids_path: Path, lens_path: Path,
                    chunk: int = 8192) -> dict[str, float]:
    """Stream ``texts`` through the fast tokenizer in chunks into ``ids_path`` (int32, N x max_len) and
    ``lens_path`` (int32, N); returns length statistics."""
    n = len(texts)
    ids = open_memmap(ids_path, mode="w+", dtype=np.int32, shape=(n, max_len))
    lens = np.zeros(n, dtype=np.int32)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    backend = _backend(tokenizer, max_len)
    truncated = 0
    for start in range(0, n, chunk):
        batch = [t if t else " " for t in texts[start:start + chunk]]
        block, block_lens = _encode_rows(tokenizer, backend, batch, max_len, pad)
        ids[start:start + len(batch)] = block
        lens[start:start + len(batch)] = block_lens
        truncated += int((block_lens == max_len).sum())
    ids.flush()
    del ids
    np.save(lens_path, lens)
    return {"rows": float(n), "mean_len": float(lens.mean()) if n else 0.0,
            "max_len_seen": float(lens.max()) if n else 0.0, "truncated_fraction": truncated / max(n, 1)}


def load_tokens(ids_path: Path, lens_path: Path) -> tuple[np.ndarray, np.ndarray]:
    """Memory-map the ids and load the lengths."""
    return np.load(ids_path, mmap_mode="r"), np.load(lens_path)


def save_pretokenized(input_ids: np.ndarray, attention_mask: np.ndarray, max_len: int, ids_path: Path,
                      lens_path: Path, chunk: int = 65536) -> dict[str, float]:
    """Write token ids shipped with a dataset (the XC ``*_input_ids.npy`` layout) in the same on-disk form
    as ``tokenize_to_npy``: right-padded rows cut to ``max_len``, lengths from the attention mask."""
    n, width = input_ids.shape
    w = min(width, max_len)
    ids = open_memmap(ids_path, mode="w+", dtype=np.int32, shape=(n, w))
    lens = np.zeros(n, dtype=np.int32)
    for s in range(0, n, chunk):
        m = np.asarray(attention_mask[s:s + chunk, :w]) > 0
        ids[s:s + chunk] = np.where(m, np.asarray(input_ids[s:s + chunk, :w]), 0)
        lens[s:s + chunk] = m.sum(1)
    ids.flush()
    del ids
    np.save(lens_path, lens)
    return {"rows": float(n), "mean_len": float(lens.mean()) if n else 0.0,
            "max_len_seen": float(lens.max()) if n else 0.0, "pretokenized": 1.0}


def tokenize_texts(tokenizer, texts: Sequence[str], max_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Token ids (n, longest) int32 and lengths, as the tokenize stage writes them (empty text -> " ")."""
    batch = [t if isinstance(t, str) and t else " " for t in texts]
    if not batch:
        return np.zeros((0, 1), dtype=np.int32), np.zeros(0, dtype=np.int32)
    enc = tokenizer(batch, truncation=True, max_length=max_len, padding="longest", return_attention_mask=True,
                    return_tensors="np")
    ids = enc["input_ids"].astype(np.int32)
    mask = enc["attention_mask"]
    ids[mask == 0] = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    return ids, mask.sum(1).astype(np.int32)
