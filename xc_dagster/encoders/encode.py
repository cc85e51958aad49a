"""Running an encoder over token-id arrays: length-sorted chunks padded to their longest row, inference
(``encode_tokens``, under autocast) and training (``embed_rows``, with gradients) alike."""

from __future__ import annotations

import threading
from typing import Callable

import numpy as np
import torch

from xc_dagster.device import autocast, one_torch_thread_each

CHUNKS_PER_THREAD = 4  # a CPU encoding of fewer chunks than this per thread runs them on one thread (intra-op)


def length_sorted_chunks(lengths: np.ndarray, chunk_size: int, max_tokens: int | None = None) -> list[np.ndarray]:
    """Row indices grouped into chunks of similar length (longest first), so each chunk pads little; with
    ``max_tokens``, a chunk also holds at most that many padded tokens (rows x its longest row, at least one row)."""
    if chunk_size < 1:  # a chunk of no rows never moves on
        raise ValueError(f"chunks of at least one row, got chunk_size={chunk_size}")
    order = np.argsort(-lengths, kind="stable")
    if max_tokens is None:
        return [order[i:i + chunk_size] for i in range(0, len(order), chunk_size)]
    chunks, i = [], 0
    while i < len(order):  # one step per chunk; the chunk's first row is its longest
        rows = min(chunk_size, max(1, max_tokens // max(int(lengths[order[i]]), 1)))
        chunks.append(order[i:i + rows])
        i += rows
    return chunks


def chunk_tensors(ids: np.ndarray, lengths: np.ndarray, rows: np.ndarray,
                  device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and attention mask of ``rows``, padded only to the longest of them."""
    width = max(int(lengths[rows].max()), 1)
    t_ids = torch.from_numpy(np.ascontiguousarray(ids[rows, :width]).astype(np.int64)).to(device)
    mask = (torch.arange(width).unsqueeze(0) < torch.from_numpy(lengths[rows].astype(np.int64)).unsqueeze(1))
    return t_ids, mask.to(device=device, dtype=torch.long)


def encode_plan(encoder: torch.nn.Module, lengths: np.ndarray, device: torch.device,
                batch_size: int) -> tuple[list[np.ndarray], int]:
    """How :func:`encode_tokens` runs rows of these lengths: their chunks, and the threads that share them (1: the
    chunks in turn, each on the process's intra-op threads; a CPU encoding of at least ``CHUNKS_PER_THREAD``
    chunks per thread runs them on one torch thread each)."""
    tokens = getattr(encoder, "cpu_batch_tokens", None) if device.type == "cpu" else None
    chunks = length_sorted_chunks(np.asarray(lengths), batch_size, tokens)
    threads = torch.get_num_threads() if tokens is not None else 1
    return chunks, (threads if threads > 1 and len(chunks) >= CHUNKS_PER_THREAD * threads else 1)


def padded_tokens(encoder: torch.nn.Module, lengths: np.ndarray, device: torch.device, batch_size: int) -> int:
    """The tokens :func:`encode_tokens` runs over rows of these lengths, padding included: each chunk of
    :func:`encode_plan` times its longest row (its first), at least one token a row."""
    lengths = np.asarray(lengths)
    chunks = encode_plan(encoder, lengths, device, batch_size)[0]
    if not chunks:
        return 0
    sizes = np.fromiter((len(c) for c in chunks), dtype=np.int64, count=len(chunks))
    longest = np.maximum(lengths[np.fromiter((c[0] for c in chunks), dtype=np.int64, count=len(chunks))], 1)
    return int(sizes @ longest.astype(np.int64))


def encoded_as(encoder: torch.nn.Module, lengths: np.ndarray, device: torch.device,
               batch_size: int) -> Callable[[np.ndarray], bool]:
    """Whether rows (indices into ``lengths``) are encoded as all of them would be: the same number of threads
    sharing their chunks (:func:`encode_plan`), the condition under which a sample's rate stands for the set's."""
    threads = encode_plan(encoder, lengths, device, batch_size)[1]
    return lambda rows: encode_plan(encoder, lengths[rows], device, batch_size)[1] == threads


SAME_CHECK_ROWS = 65536  # rows compared at a time by one_input: it stops at the first block that differs


def one_input(ids: np.ndarray, lengths: np.ndarray) -> bool:
    """Whether every row is the same token sequence (a dataset without text: every point the empty text). Rows of
    different lengths answer at once; equal ones are compared a block at a time, stopping at the first that
    differs, so a memmap is read only as far as needed."""
    lengths = np.asarray(lengths)
    if len(lengths) < 2 or lengths.min() != lengths.max():
        return False
    width = max(int(lengths[0]), 1)
    first = np.asarray(ids[0, :width])
    return all((np.asarray(ids[s:s + SAME_CHECK_ROWS, :width]) == first).all()
               for s in range(0, len(lengths), SAME_CHECK_ROWS))


def encode_tokens(encoder: torch.nn.Module, ids: np.ndarray, lengths: np.ndarray, device: torch.device,
                  dtype: torch.dtype | None, batch_size: int = 256, progress: Callable[[int], None] | None = None,
                  forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None) -> np.ndarray:
    """Embed every row of a token-id array (memmap ok): (N, D) float32, unit rows, input order kept.

    On a CPU a chunk also holds at most the encoder's ``cpu_batch_tokens`` padded tokens (where it has one), so a
    transformer's activations stay in cache: MiniLM at 28 tokens per text ran 1.25x faster in chunks of 64 than of
    256, at 128 tokens 1.3x in chunks of 16; and the chunks run on the process's threads with one torch thread
    each, 1.02-1.14x over two intra-op threads on two cores (docs/decisions.md#encode-token-budget).
    ``forward`` replaces ``encoder(ids, mask)``, e.g. the bag encoder's ``intermediate`` embeddings;
    ``progress(rows)`` follows each chunk (``xc_dagster.progress.Progress.update``)."""
    n = len(lengths)
    out = np.zeros((n, encoder.dim), dtype=np.float32)
    encoder.eval()
    fn = encoder if forward is None else forward
    if one_input(ids, lengths):  # one forward pass for them all (e.g. a BoW set's points without their words)
        with torch.inference_mode(), autocast(device, dtype):
            out[:] = fn(*chunk_tensors(ids, lengths, np.zeros(1, dtype=np.int64), device)).float().cpu().numpy()
        if progress is not None:
            progress(n)
        return out
    chunks, threads = encode_plan(encoder, lengths, device, batch_size)
    lock = threading.Lock()

    def run(part: list[np.ndarray]) -> None:
        with torch.inference_mode(), autocast(device, dtype):  # both thread-local: entered on each thread
            for rows in part:
                t_ids, mask = chunk_tensors(ids, lengths, rows, device)
                out[rows] = fn(t_ids, mask).float().cpu().numpy()
                if progress is not None:
                    with lock:
                        progress(len(rows))

    if threads > 1:  # chunks dealt round-robin: similar widths
        one_torch_thread_each(run, [chunks[i::threads] for i in range(threads)])
    else:
        run(chunks)
    return out


def embed_rows(encoder: torch.nn.Module, ids: np.ndarray, lens: np.ndarray, rows: np.ndarray, chunk_size: int,
               device: torch.device,
               forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """Embeddings (with grad) of ``rows``, encoded in length-sorted chunks, returned in ``rows`` order.

    ``forward`` replaces ``encoder(ids, mask)`` per chunk (``xc_dagster.training.grad_cache`` records chunks)."""
    fn = encoder if forward is None else forward
    sub_lens = lens[rows]
    pieces, where = [], []
    for local in length_sorted_chunks(sub_lens, chunk_size):
        t_ids, mask = chunk_tensors(ids, lens, rows[local], device)
        pieces.append(fn(t_ids, mask))
        where.append(local)
    emb = torch.cat(pieces)
    order = torch.from_numpy(np.argsort(np.concatenate(where), kind="stable")).to(device)
    return emb[order]
