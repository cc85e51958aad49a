"""Siamese pretraining (NGAME M1): the shared encoder trained so E(x).E(z) is high for positive pairs.

Each step takes a batch of training points and one sampled positive label per point; the other points'
labels are in-batch negatives (true positives masked), and the loss is NGAME's OHNM triplet loss. The batch
sampler is pluggable: ``random`` batches, or ``ngame`` (Algorithm 1: batches are unions of clusters of the
points' embeddings, kept in a memory bank filled by the training forward passes, re-clustered every tau
epochs, with a curriculum that starts at cluster size 1 and doubles it on a schedule). Texts are run through
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

from xc_dagster.clustering import balanced_clusters, cluster_batches
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


def curriculum_cluster_size(epoch: int, schedule: tuple[int, ...], max_size: int) -> int:
    """NGAME's curriculum: C = 1 (random batches) before the first scheduled epoch, doubling at each one."""
    return min(2 ** sum(1 for e in schedule if epoch >= e), max(max_size, 1))


class NGAMESampler:
    """Batches as unions of random clusters of the memory-bank embeddings (NGAME Algorithm 1)."""

    def __init__(self, n_points: int, dim: int, params: PretrainParams):
        self.params = params
        self.bank = np.zeros((n_points, dim), dtype=np.float32)
        self.labels: np.ndarray | None = None
        self.size = 1
        self.reclusterings = 0

    def observe(self, rows: np.ndarray, emb: torch.Tensor) -> None:
        self.bank[rows] = emb.detach().float().cpu().numpy()

    def epoch(self, epoch: int, rows: np.ndarray, batch_size: int, rng: np.random.Generator) -> Iterator[np.ndarray]:
        p = self.params
        size = curriculum_cluster_size(epoch, p.curriculum, p.max_cluster_size)
        if size <= 1:
            yield from random_batches(rows, batch_size, rng)
            return
        if self.labels is None or size != self.size or epoch % max(p.cluster_every, 1) == 0:
            lab = balanced_clusters(self.bank[rows], size, seed=p.seed + epoch)
            self.labels = np.full(len(self.bank), -1, dtype=np.int64)
            self.labels[rows] = lab
            self.size = size
            self.reclusterings += 1
        for b in cluster_batches(self.labels, rows, batch_size, rng):
            if len(b) >= 2:
                yield b


BATCH_SAMPLERS = ("random", "ngame")


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
    reclusterings: int = 0


def train_siamese(encoder: SiameseEncoder, point_tokens: tuple[np.ndarray, np.ndarray],
                  label_tokens: tuple[np.ndarray, np.ndarray], Y: sp.csr_matrix, train_rows: np.ndarray,
                  params: PretrainParams, device: torch.device, dtype: torch.dtype | None,
                  log_metrics: MetricsFn | None = None, log_every: int = 10) -> PretrainResult:
    """Train ``encoder`` in place for ``params.epochs`` (fractional allowed) over ``train_rows`` with labels."""
    if params.sampler not in BATCH_SAMPLERS:
        raise XCConfigError(f"pretrain.sampler: expected one of {BATCH_SAMPLERS}, got {params.sampler!r}")
    Y = Y.tocsr()
    rows = np.asarray(train_rows, dtype=np.int64)
    rows = rows[np.diff(Y.indptr)[rows] > 0]  # points without labels have no positive pair
    rng = np.random.default_rng(params.seed)
    steps_per_epoch = math.ceil(len(rows) / params.batch_size)
    # LR schedule length: exact for random batches; cluster batches vary a little in count per epoch
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

    def log_window() -> None:
        """Step metrics averaged since the last log: loss, points/s, learning rate."""
        nonlocal window_t, window_pts, window_loss
        now = time.perf_counter()
        log_metrics(step, {"pretrain_loss": float(np.mean(window_loss)),
                           "pretrain_points_per_s": window_pts / max(now - window_t, 1e-9),
                           "pretrain_lr": float(sched.get_last_lr()[0])})
        window_t, window_pts, window_loss = now, 0, []

    ngame = NGAMESampler(Y.shape[0], encoder.dim, params) if params.sampler == "ngame" else None
    n_epochs = math.ceil(params.epochs)
    for epoch in range(n_epochs):
        batches = list(ngame.epoch(epoch, rows, params.batch_size, rng) if ngame is not None
                       else random_batches(rows, params.batch_size, rng))
        if epoch == n_epochs - 1 and params.epochs < n_epochs:  # fractional last epoch
            batches = batches[:max(1, math.ceil((params.epochs - epoch) * len(batches)))]
        for batch in batches:
            labels = sample_positives(Y, batch, 1, rng)[:, 0]
            mask = torch.from_numpy(positive_mask(Y, batch, np.broadcast_to(labels, (len(batch), len(labels)))))
            with autocast(device, dtype):
                p = embed_rows(encoder, p_ids, p_lens, batch, params.chunk_size, device)
                z = embed_rows(encoder, l_ids, l_lens, labels, params.chunk_size, device)
            if ngame is not None:
                ngame.observe(batch, p)
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
            if log_metrics is not None and step % log_every == 0:
                log_window()
    if log_metrics is not None and window_loss:
        log_window()
    encoder.eval()
    return PretrainResult(step, points, time.perf_counter() - t0, loss_val,
                          ngame.reclusterings if ngame is not None else 0)
