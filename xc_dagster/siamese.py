"""Siamese pretraining (NGAME M1): the shared encoder trained so E(x).E(z) is high for positive pairs.

Each step takes a batch of training points and one sampled positive label per point; the other points'
labels are in-batch negatives (true positives masked), and the loss is NGAME's OHNM triplet loss. The batch
sampler is pluggable (``random`` here; NGAME's cluster batching is a later sampler). Texts are run through
the encoder in length-sorted chunks with per-chunk padding, under bf16/fp16 autocast where it pays.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np
import scipy.sparse as sp
import torch

from xc_dagster.config import PretrainParams
from xc_dagster.device import autocast
from xc_dagster.encoder import SiameseEncoder, chunk_tensors, length_sorted_chunks
from xc_dagster.errors import XCConfigError
from xc_dagster.losses import ohnm_triplet_loss
from xc_dagster.sampling import positive_mask, sample_positives

MetricsFn = Callable[[int, dict[str, float]], None]


def random_batches(rows: np.ndarray, batch_size: int, rng: np.random.Generator) -> Iterator[np.ndarray]:
    """Plain random mini-batches over ``rows`` (one pass; the last partial batch kept if >= 2 rows)."""
    perm = rng.permutation(rows)
    for s in range(0, len(perm), batch_size):
        b = perm[s:s + batch_size]
        if len(b) >= 2:
            yield b


BATCH_SAMPLERS = {"random": random_batches}


def embed_rows(encoder: SiameseEncoder, ids: np.ndarray, lens: np.ndarray, rows: np.ndarray, chunk_size: int,
               device: torch.device) -> torch.Tensor:
    """Embeddings (with grad) of ``rows``, encoded in length-sorted chunks, returned in ``rows`` order."""
    sub_lens = lens[rows]
    pieces, where = [], []
    for local in length_sorted_chunks(sub_lens, chunk_size):
        t_ids, mask = chunk_tensors(ids, lens, rows[local], device)
        pieces.append(encoder(t_ids, mask))
        where.append(local)
    emb = torch.cat(pieces)
    order = torch.from_numpy(np.argsort(np.concatenate(where), kind="stable")).to(device)
    return emb[order]


def lr_lambda(warmup: int, total: int) -> Callable[[int], float]:
    """Linear warm-up then linear decay to zero."""
    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / max(warmup, 1)
        return max(0.0, (total - step) / max(total - warmup, 1))
    return f


@dataclass
class PretrainResult:
    steps: int
    points: int
    seconds: float
    final_loss: float


def train_siamese(encoder: SiameseEncoder, point_tokens: tuple[np.ndarray, np.ndarray],
                  label_tokens: tuple[np.ndarray, np.ndarray], Y: sp.csr_matrix, train_rows: np.ndarray,
                  params: PretrainParams, device: torch.device, dtype: torch.dtype | None,
                  log_metrics: MetricsFn | None = None, log_every: int = 10) -> PretrainResult:
    """Train ``encoder`` in place for ``params.epochs`` (fractional allowed) over ``train_rows`` with labels."""
    if params.sampler not in BATCH_SAMPLERS:
        raise XCConfigError(f"pretrain.sampler: expected one of {sorted(BATCH_SAMPLERS)}, got {params.sampler!r}")
    Y = Y.tocsr()
    rows = np.asarray(train_rows, dtype=np.int64)
    rows = rows[np.diff(Y.indptr)[rows] > 0]  # points without labels have no positive pair
    rng = np.random.default_rng(params.seed)
    steps_per_epoch = math.ceil(len(rows) / params.batch_size)
    total_steps = max(1, math.ceil(params.epochs * steps_per_epoch))
    if params.epochs <= 0 or len(rows) < 2:
        return PretrainResult(0, 0, 0.0, float("nan"))
    p_ids, p_lens = point_tokens
    l_ids, l_lens = label_tokens
    opt = torch.optim.AdamW(encoder.parameters(), lr=params.lr, weight_decay=params.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(params.warmup_steps, total_steps))
    encoder.train()
    step, points, t0, loss_val = 0, 0, time.perf_counter(), float("nan")
    window_t, window_pts, window_loss = time.perf_counter(), 0, []
    sampler = BATCH_SAMPLERS[params.sampler]
    while step < total_steps:
        for batch in sampler(rows, params.batch_size, rng):
            labels = sample_positives(Y, batch, 1, rng)[:, 0]
            mask = torch.from_numpy(positive_mask(Y, batch, np.broadcast_to(labels, (len(batch), len(labels)))))
            with autocast(device, dtype):
                p = embed_rows(encoder, p_ids, p_lens, batch, params.chunk_size, device)
                z = embed_rows(encoder, l_ids, l_lens, labels, params.chunk_size, device)
            sim = p.float() @ z.float().T
            loss = ohnm_triplet_loss(sim, mask.to(device), params.margin, params.num_negatives, params.temperature)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(encoder.parameters(), 1.0)
            opt.step()
            sched.step()
            step += 1
            points += len(batch)
            window_pts += len(batch)
            loss_val = float(loss.detach())
            window_loss.append(loss_val)
            if log_metrics is not None and (step % log_every == 0 or step == total_steps):
                now = time.perf_counter()
                log_metrics(step, {"pretrain_loss": float(np.mean(window_loss)),
                                   "pretrain_points_per_s": window_pts / max(now - window_t, 1e-9),
                                   "pretrain_lr": float(sched.get_last_lr()[0])})
                window_t, window_pts, window_loss = now, 0, []
            if step >= total_steps:
                break
    encoder.eval()
    return PretrainResult(step, points, time.perf_counter() - t0, loss_val)
