"""Siamese pretraining (NGAME M1, SiameseXML Module I): the shared encoder trained so E(x).E(z) is high for
positive pairs.

The batch sampler is pluggable. Over points: each step takes a batch of training points and one sampled
positive label per point; the other points' labels are in-batch negatives (true positives masked). ``random``
batches, or ``ngame`` (Algorithm 1: batches are unions of clusters of the points' embeddings, kept in a memory
bank filled by the training forward passes, re-clustered every tau epochs, with a curriculum that starts at
cluster size 1 and doubles it on a schedule). Over labels: ``siamesexml`` (Module I) draws distinct labels with
probability ~ freq^0.45 and one random positive point per label; each label's in-batch negatives are the
other labels' points, and a second label representation, the centroid of ``centroid_points`` more sampled
positives (encoded in the same forward pass), gets the same loss, weighted 1 - beta. The loss is NGAME's
OHNM triplet (``loss=triplet``) or SiameseXML's probabilistic contrastive loss (``loss=siamesexml``). Texts are
run through the encoder in length-sorted chunks with per-chunk padding, under bf16/fp16 autocast where it pays.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import numpy as np
import scipy.sparse as sp
import torch
import torch.nn.functional as F

from xc_dagster.config import PretrainParams
from xc_dagster.device import adamw, autocast
from xc_dagster.encoders.encode import embed_rows, encode_tokens
from xc_dagster.encoders.transformer import SiameseEncoder
from xc_dagster.errors import XCConfigError
from xc_dagster.sampling.clustering import balanced_clusters, cluster_batches
from xc_dagster.sampling.labels import (
    label_sampling_probs,
    positive_mask,
    sample_label_batch,
    sample_label_points,
    sample_positives,
)
from xc_dagster.training.checkpoint import Checkpointer, restore_rng
from xc_dagster.training.losses import infonce_loss, ohnm_triplet_loss, siamesexml_loss

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

    def state(self) -> dict[str, Any]:
        """Memory bank and current clustering, as tensors (for checkpoints)."""
        labels = torch.from_numpy(self.labels) if self.labels is not None else torch.zeros(0, dtype=torch.int64)
        return {"bank": torch.from_numpy(self.bank.copy()), "labels": labels, "has_labels": self.labels is not None,
                "size": self.size, "reclusterings": self.reclusterings}

    def load_state(self, st: dict[str, Any]) -> None:
        self.bank = st["bank"].numpy().copy()
        self.labels = st["labels"].numpy().copy() if st["has_labels"] else None
        self.size, self.reclusterings = int(st["size"]), int(st["reclusterings"])

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


@dataclass
class LabelBatch:
    """A batch over labels: ``labels`` (B,), one positive point each (``anchors``, B,), and ``centroid``
    (B, m) further positives whose mean embedding is the label's centroid estimate v_l (m may be 0)."""

    labels: np.ndarray
    anchors: np.ndarray
    centroid: np.ndarray


class SiameseXMLSampler:
    """SiameseXML Module I batches over labels, drawn from the training rows' label frequencies.

    ``freq`` counts only ``rows`` (the training rows; validation rows never supply a positive), labels with
    freq 0 are never drawn. An epoch is ``ceil(#labels with freq > 0 / batch_size)`` batches, i.e. as many
    labels as there are labels with a point, though popular ones recur and rare ones may be skipped.
    """

    def __init__(self, Y: sp.csr_matrix, rows: np.ndarray, params: PretrainParams):
        self.rows = np.asarray(rows, dtype=np.int64)
        self.Yc = Y.tocsr()[self.rows].tocsc()
        self.Yc.sort_indices()
        self.freq = np.diff(self.Yc.indptr)
        self.probs = label_sampling_probs(self.freq, params.label_power)
        self.n_labels = int(np.count_nonzero(self.freq))
        self.extra = params.centroid_points if params.centroid_weight > 0 else 0

    def steps_per_epoch(self, batch_size: int) -> int:
        return math.ceil(self.n_labels / max(batch_size, 1))

    def batch(self, batch_size: int, rng: np.random.Generator) -> LabelBatch:
        labels = sample_label_batch(self.probs, batch_size, rng)
        anchors, others = sample_label_points(self.Yc, labels, self.extra, rng)
        return LabelBatch(labels, self.rows[anchors], self.rows[others])

    def epoch(self, batch_size: int, rng: np.random.Generator) -> list[LabelBatch]:
        return [self.batch(batch_size, rng) for _ in range(self.steps_per_epoch(batch_size))]


BATCH_SAMPLERS = ("random", "ngame", "siamesexml")
PRETRAIN_LOSSES = ("triplet", "siamesexml", "infonce")


def check_pretrain_params(params: PretrainParams) -> None:
    """Raise XCConfigError naming the first ``pretrain.*`` field with an invalid value."""
    checks = [
        (params.sampler in BATCH_SAMPLERS, "sampler", f"one of {BATCH_SAMPLERS}"),
        (params.loss in PRETRAIN_LOSSES, "loss", f"one of {PRETRAIN_LOSSES}"),
        (params.batch_size >= 2, "batch_size", "an int >= 2"),
        (params.num_negatives >= 1, "num_negatives", "an int >= 1"),
        (0.0 < params.contrastive_c < 1.0, "contrastive_c", "a value in (0, 1)"),
        (params.contrastive_d > 0.0, "contrastive_d", "a value > 0"),
        (params.label_power >= 0.0, "label_power", "a value >= 0"),
        (params.centroid_points >= 0, "centroid_points", "an int >= 0"),
        (0.0 <= params.centroid_weight <= 1.0, "centroid_weight", "a value in [0, 1]"),
        (isinstance(params.freeze_layers, int) and params.freeze_layers >= 0, "freeze_layers", "an int >= 0"),
    ]
    for ok, name, expected in checks:
        if not ok:
            raise XCConfigError(f"pretrain.{name}: expected {expected}, got {getattr(params, name)!r}")
    if (params.sampler == "ngame" and not params.seed_bank
            and curriculum_cluster_size(0, params.curriculum, params.max_cluster_size) > 1):
        raise XCConfigError(f"pretrain.curriculum: {params.curriculum!r} clusters from epoch 0, when the memory "
                            "bank is still empty; set pretrain.seed_bank=true (fill it with the starting "
                            "encoder's embeddings) or start the curriculum at epoch 1 or later")


def pair_loss(sim: torch.Tensor, mask: torch.Tensor, params: PretrainParams) -> torch.Tensor:
    """The configured loss on a similarity matrix whose diagonal holds each row's sampled positive."""
    if params.loss == "siamesexml":
        return siamesexml_loss(sim, mask, params.contrastive_c, params.contrastive_d, params.num_negatives)
    if params.loss == "infonce":
        return infonce_loss(sim, mask, params.infonce_temperature)
    return ohnm_triplet_loss(sim, mask, params.margin, params.num_negatives, params.temperature)


def point_batch_loss(sim: torch.Tensor, mask: torch.Tensor, params: PretrainParams) -> torch.Tensor:
    """Loss of a point batch: rows are the points, columns their sampled labels (the diagonal); with
    ``symmetric`` also the label-anchored direction on the transposed matrix, the two averaged."""
    loss = pair_loss(sim, mask, params)
    if params.symmetric:
        loss = 0.5 * (loss + pair_loss(sim.T, mask.T, params))
    return loss


def lr_lambda(warmup: int, total: int) -> Callable[[int], float]:
    """Linear warm-up then linear decay to zero."""
    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / max(warmup, 1)
        return max(0.0, (total - step) / max(total - warmup, 1))
    return f


def _label_batch_loss(encoder: SiameseEncoder, batch: LabelBatch, Y: sp.csr_matrix,
                      point_tokens: tuple[np.ndarray, np.ndarray], label_tokens: tuple[np.ndarray, np.ndarray],
                      params: PretrainParams, device: torch.device,
                      dtype: torch.dtype | None) -> tuple[torch.Tensor, int]:
    """SiameseXML Module I on one label batch: beta * loss(E(z_l) vs points) + (1 - beta) * loss(v_l vs points).

    Rows of the similarity matrices are the labels, columns the anchors (negatives are mined per label among
    the other labels' points, as in the paper); ``mask[l, j]`` marks anchor j as a true positive of label l.
    Anchors and centroid points go through the encoder in one pass; gradients flow through the centroid too
    (the paper trains both representations towards related points). Each representation mines its own kappa
    hardest negatives. Returns the loss and the number of point texts encoded.
    """
    B, m = len(batch.labels), batch.centroid.shape[1]
    mask = positive_mask(Y, batch.anchors, np.broadcast_to(batch.labels, (B, B))).T  # [label l, anchor j]
    mask_t = torch.from_numpy(np.ascontiguousarray(mask)).to(device)
    # a point can be drawn several times (anchor of two labels, centroid of a label with < m + 1 positives):
    # encode each once and gather, gradients accumulate over its uses
    pts, where = np.unique(np.concatenate([batch.anchors, batch.centroid.ravel()]), return_inverse=True)
    with autocast(device, dtype):
        p = embed_rows(encoder, *point_tokens, pts, params.chunk_size, device).float()
        z = embed_rows(encoder, *label_tokens, batch.labels, params.chunk_size, device).float()
    return label_batch_pair_loss(p, z, where, m, mask_t, params), len(pts)


def label_batch_pair_loss(p: torch.Tensor, z: torch.Tensor, where: np.ndarray, m: int, mask_t: torch.Tensor,
                          params: PretrainParams) -> torch.Tensor:
    """Module I's loss from a label batch's embeddings: ``p`` of the distinct points (``where`` maps the B
    anchors then the B x m centroid points to them), ``z`` of the B labels; beta-weighted text and centroid terms."""
    B = len(z)
    p = p[torch.from_numpy(where.reshape(-1)).to(p.device)]
    anchors = p[:B]
    loss = pair_loss(z @ anchors.T, mask_t, params)
    if m > 0 and params.centroid_weight > 0:
        v = F.normalize(p[B:].view(B, m, -1).mean(1), dim=-1)
        w = params.centroid_weight
        loss = (1.0 - w) * loss + w * pair_loss(v @ anchors.T, mask_t, params)
    return loss


@dataclass
class PretrainResult:
    steps: int
    points: int  # point texts encoded for training (siamesexml: anchors + centroid points)
    seconds: float
    final_loss: float
    reclusterings: int = 0
    resumed_from_epoch: int = 0


def train_siamese(encoder: SiameseEncoder, point_tokens: tuple[np.ndarray, np.ndarray],
                  label_tokens: tuple[np.ndarray, np.ndarray], Y: sp.csr_matrix, train_rows: np.ndarray,
                  params: PretrainParams, device: torch.device, dtype: torch.dtype | None,
                  log_metrics: MetricsFn | None = None, log_every: int = 10,
                  checkpoint: Checkpointer | None = None) -> PretrainResult:
    """Train ``encoder`` in place for ``params.epochs`` (fractional allowed) over ``train_rows`` with labels.

    An epoch is one pass over the points (random/ngame) or ``ceil(#labels with a training point / batch_size)``
    label batches (siamesexml). With ``checkpoint``, the whole training state (encoder, optimizer, schedule,
    generators, NGAME memory bank and clusters) is saved after every epoch and a matching checkpoint is resumed
    from, ending with the same weights as an uninterrupted run.
    """
    check_pretrain_params(params)
    Y = Y.tocsr()
    rows = np.asarray(train_rows, dtype=np.int64)
    rows = rows[np.diff(Y.indptr)[rows] > 0]  # points without labels have no positive pair
    rng = np.random.default_rng(params.seed)
    labelwise = SiameseXMLSampler(Y, rows, params) if params.sampler == "siamesexml" else None
    steps_per_epoch = (labelwise.steps_per_epoch(params.batch_size) if labelwise is not None
                       else math.ceil(len(rows) / params.batch_size))
    # LR schedule length: exact for random and label batches; cluster batches vary a little in count per epoch
    total_steps = max(1, math.ceil(params.epochs * steps_per_epoch))
    if params.epochs <= 0 or len(rows) < 2 or (labelwise is not None and labelwise.n_labels < 2):
        return PretrainResult(0, 0, 0.0, float("nan"))
    p_ids, p_lens = point_tokens
    l_ids, l_lens = label_tokens
    if params.freeze_layers:
        if not isinstance(encoder, SiameseEncoder):
            raise XCConfigError(f"pretrain.freeze_layers: {type(encoder).__name__} has no transformer layers "
                                f"to freeze; set it to 0")
        encoder.freeze_bottom(params.freeze_layers)
    trainable = [p for p in encoder.parameters() if p.requires_grad]
    opt = adamw(trainable, params.lr, params.weight_decay)
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

    n_epochs = math.ceil(params.epochs)
    # the memory bank (N x D) only where some epoch of this run clusters: before the curriculum's first
    # clustering epoch the ngame sampler's batches are the random sampler's (same generator draws)
    clusters = any(curriculum_cluster_size(e, params.curriculum, params.max_cluster_size) > 1
                   for e in range(n_epochs))
    ngame = NGAMESampler(Y.shape[0], encoder.dim, params) if params.sampler == "ngame" and clusters else None
    start = 0
    resumed = checkpoint.load() if checkpoint is not None else None
    if resumed is not None:
        st = resumed.state
        encoder.load_state_dict(st["encoder"])
        opt.load_state_dict(st["opt"])
        sched.load_state_dict(st["sched"])
        if ngame is not None:
            ngame.load_state(st["ngame"])
        restore_rng(rng, resumed)
        start, step, points = resumed.epoch, int(st["step"]), int(st["points"])
    elif ngame is not None and params.seed_bank:
        t_bank = time.perf_counter()
        ngame.bank[rows] = encode_tokens(encoder, p_ids[rows], p_lens[rows], device, dtype, params.encode_batch_size)
        encoder.train()
        if log_metrics is not None:
            log_metrics(0, {"pretrain_seed_bank_seconds": time.perf_counter() - t_bank})
    for epoch in range(start, n_epochs):
        if labelwise is not None:
            batches = labelwise.epoch(params.batch_size, rng)
        else:
            batches = list(ngame.epoch(epoch, rows, params.batch_size, rng) if ngame is not None
                           else random_batches(rows, params.batch_size, rng))
        if epoch == n_epochs - 1 and params.epochs < n_epochs:  # fractional last epoch
            batches = batches[:max(1, math.ceil((params.epochs - epoch) * len(batches)))]
        for batch in batches:
            if isinstance(batch, LabelBatch):
                loss, n_points = _label_batch_loss(encoder, batch, Y, point_tokens, label_tokens, params, device,
                                                   dtype)
            else:
                labels = sample_positives(Y, batch, 1, rng)[:, 0]
                mask = torch.from_numpy(positive_mask(Y, batch, np.broadcast_to(labels, (len(batch), len(labels)))))
                with autocast(device, dtype):
                    p = embed_rows(encoder, p_ids, p_lens, batch, params.chunk_size, device)
                    z = embed_rows(encoder, l_ids, l_lens, labels, params.chunk_size, device)
                if ngame is not None:
                    ngame.observe(batch, p)
                loss, n_points = point_batch_loss(p.float() @ z.float().T, mask.to(device), params), len(batch)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(trainable, 1.0)
            opt.step()
            sched.step()
            step += 1
            points += n_points
            window_pts += n_points
            loss_val = float(loss.detach())
            window_loss.append(loss_val)
            if log_metrics is not None and step % log_every == 0:
                log_window()
        if checkpoint is not None and epoch + 1 < n_epochs:  # the last epoch's state is the stage's result
            checkpoint.save(epoch + 1, {"encoder": encoder.state_dict(), "opt": opt.state_dict(),
                                        "sched": sched.state_dict(), "step": step, "points": points,
                                        "ngame": ngame.state() if ngame is not None else {}}, rng)
    if log_metrics is not None and window_loss:
        log_window()
    encoder.eval()
    return PretrainResult(step, points, time.perf_counter() - t0, loss_val,
                          ngame.reclusterings if ngame is not None else 0, start)
