"""Classifier training with BCE over positives + sampled negatives (ASTRA, MIPS-s), encoder optionally end to end.

Training examples are the training points (validation rows held out) and, with ``label_points``, every label's
text as a point whose one positive is that label (ASTRA, following Renee). Per step: embed the batch (the
encoder in train mode when ``train_encoder``, else the frozen embeddings), take up to ``num_positives`` (k_p)
positives, draw negatives from the sampler (``xc_dagster.sampling.negatives``), and minimise
``sum_pos log(1 + e^-s) + sum_neg weight * log(1 + e^s)`` (mean over the batch), s = scale * w.x + b with b one
learned bias shared by all labels (``logit_bias``). W lives in a
``ShardedClassifier`` (one shard per GPU) and only the scored rows are touched: SGD (ASTRA) or SparseAdam for W,
AdamW for the encoder, one cosine-with-warm-up schedule for both, dropout on the query embedding before the
classifiers. With ``checkpoint`` the whole state is saved after every epoch and resumed from.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import scipy.sparse as sp
import torch
import torch.nn.functional as F

from xc_dagster.config import ClassifierParams
from xc_dagster.device import adamw, autocast
from xc_dagster.encoders.encode import embed_rows, encode_tokens
from xc_dagster.errors import XCConfigError
from xc_dagster.sampling.labels import sample_positives
from xc_dagster.sampling.negatives import (
    SAMPLERS,
    AstraNegatives,
    IndexSettings,
    MipsNegatives,
    NegativeSample,
    UniformNegatives,
)
from xc_dagster.training.checkpoint import Checkpointer, restore_rng
from xc_dagster.training.losses import masked_bce_loss
from xc_dagster.training.sharded import ShardedClassifier, ShardedOptimizer, shard_devices

MetricsFn = Callable[[int, dict[str, float]], None]


ENCODER_NEGATIVES = ("all", "hard")


def cosine_with_warmup(warmup: int, total: int) -> Callable[[int], float]:
    """Linear warm-up to 1 over ``warmup`` steps, then cosine decay to 0 at ``total``."""
    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / max(warmup, 1)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, (step - warmup) / max(total - warmup, 1))))
    return f


def examples(Y: sp.csr_matrix, train_rows: np.ndarray, label_points: bool) -> tuple[np.ndarray, sp.csr_matrix]:
    """The training examples' source rows (>= 0: point row; < 0: label -1 - id) and their label matrix."""
    Y = Y.tocsr()
    rows = np.asarray(train_rows, dtype=np.int64)
    rows = rows[np.diff(Y.indptr)[rows] > 0]
    parts = [Y[rows].astype(np.float32)]
    src = [rows]
    if label_points:
        L = Y.shape[1]
        parts.append(sp.identity(L, dtype=np.float32, format="csr"))
        src.append(-1 - np.arange(L, dtype=np.int64))
    Yex = sp.vstack(parts, format="csr")
    Yex.sort_indices()
    return np.concatenate(src), Yex


def make_sampler(params: ClassifierParams, Yex: sp.csr_matrix, bank: np.ndarray, steps_per_epoch: int,
                 initial_table: np.ndarray | None, total_steps: int | None = None):
    """The ``classifier.negatives`` sampler, its epoch-valued intervals turned into steps."""
    def steps(epochs: float, what: str) -> int:
        if epochs < 0:
            raise XCConfigError(f"classifier.{what}: expected >= 0 epochs, got {epochs}")
        return int(round(epochs * steps_per_epoch))

    idx = IndexSettings(params.sampler_index, params.sampler_hnsw_m, params.sampler_hnsw_ef_construction,
                        params.sampler_hnsw_ef,
                        params.mips_partitions, params.mips_probe, params.seed)
    every = max(1, steps(params.refresh_every, "refresh_every"))
    if params.negatives == "uniform":
        return UniformNegatives(Yex, params.num_hard + params.num_random)
    if params.negatives == "astra":
        return AstraNegatives(Yex, bank, params.num_hard, params.num_random, steps(params.hard_start, "hard_start"),
                              every, min(steps_per_epoch, every), idx, params.refresh_async, initial_table,
                              total_steps)
    return MipsNegatives(Yex, params.num_hard, params.num_hard + params.num_random, every, idx)


def sampled_bce(clf: ShardedClassifier, x: torch.Tensor, pos: np.ndarray, neg: NegativeSample,
                params: ClassifierParams, bias: torch.Tensor | float = 0.0,
                label_weight: np.ndarray | None = None) -> torch.Tensor:
    """One step's loss: BCE of (dropout) query embeddings ``x`` against their positives (weight 1, or
    ``label_weight`` of their label: ``classifier.propensity_weight``) and sampled negatives (the sampler's
    weights); s = scale * w.x + bias; only the rows in ``pos``/``neg`` are read."""
    ids = torch.from_numpy(np.concatenate([pos, neg.ids], 1)).to(x.device)
    pos_w = (np.ones(pos.shape, np.float32) if label_weight is None
             else np.where(pos >= 0, label_weight[np.maximum(pos, 0)], 0.0).astype(np.float32))
    weights = torch.from_numpy(np.concatenate([pos_w, neg.weights], 1)).to(x.device)
    valid = ids >= 0
    is_pos = torch.zeros_like(valid)
    is_pos[:, :pos.shape[1]] = True
    xd = F.dropout(x.float(), params.dropout, training=True) if params.dropout > 0 else x.float()
    query_grad = None
    if params.encoder_negatives == "hard":
        query_grad = (torch.arange(ids.shape[1], device=x.device) < pos.shape[1] + neg.hard).expand_as(ids)
    scores = clf.scores(xd, ids, normalize=params.normalize, query_grad=query_grad)
    return masked_bce_loss(params.scale * scores + bias, is_pos, valid & (weights > 0), weights)


def _to_torch(x: Any) -> Any:
    """numpy arrays inside a state -> tensors (checkpoints load with weights_only=True)."""
    if isinstance(x, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(x))
    if isinstance(x, dict):
        return {k: _to_torch(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_to_torch(v) for v in x]
    return x


def _to_numpy(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.numpy()
    if isinstance(x, dict):
        return {k: _to_numpy(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_to_numpy(v) for v in x]
    return x


@dataclass
class EndToEndResult:
    W: np.ndarray
    point_emb: np.ndarray | None  # re-encoded with the trained encoder (train_encoder), else None
    label_emb: np.ndarray | None
    summary: dict[str, Any] = field(default_factory=dict)


def train_end_to_end(point_emb: np.ndarray, label_emb: np.ndarray, W0: np.ndarray, Y: sp.csr_matrix,
                     train_rows: np.ndarray, params: ClassifierParams, device: torch.device, *,
                     encoder: torch.nn.Module | None = None,
                     point_tokens: tuple[np.ndarray, np.ndarray] | None = None,
                     label_tokens: tuple[np.ndarray, np.ndarray] | None = None,
                     dtype: torch.dtype | None = None, shortlist: np.ndarray | None = None,
                     log_metrics: MetricsFn | None = None, checkpoint: Checkpointer | None = None,
                     log_every: int = 10, reencode: bool = True,
                     label_weight: np.ndarray | None = None) -> EndToEndResult:
    """Train W (and ``encoder`` in place when ``params.train_encoder``) with the ``params.negatives`` sampler.

    ``point_emb``/``label_emb``: the current encoder's embeddings (the stale queries ASTRA starts from, and the
    frozen inputs otherwise); ``W0``: initial classifiers; ``shortlist``: the mining stage's shortlist per
    training point (ASTRA's first hard-negative table when ``hard_start`` is 0). ``reencode``: embed every
    training point and label with the trained encoder afterwards (what the later stages need).
    ``label_weight`` (L,): a weight on each label's positive terms (``propensity_label_weights``).
    """
    if params.negatives not in SAMPLERS:
        raise XCConfigError(f"classifier.negatives: the BCE trainer takes {SAMPLERS}, got {params.negatives!r}")
    if params.train_encoder and (encoder is None or point_tokens is None or label_tokens is None):
        raise XCConfigError("classifier.train_encoder needs the encoder and the tokens")
    if params.encoder_negatives not in ENCODER_NEGATIVES:
        raise XCConfigError(f"classifier.encoder_negatives: expected one of {ENCODER_NEGATIVES}, "
                            f"got {params.encoder_negatives!r}")
    if not 0.0 <= params.dropout < 1.0:
        raise XCConfigError(f"classifier.dropout: expected in [0, 1), got {params.dropout}")
    src, Yex = examples(Y, train_rows, params.label_points)
    n = len(src)
    is_label = src < 0
    bank = np.empty((n, point_emb.shape[1]), dtype=np.float32)  # row i: example i's latest embedding
    bank[~is_label] = point_emb[src[~is_label]]
    bank[is_label] = label_emb[-1 - src[is_label]]
    initial = None
    if shortlist is not None:
        initial = np.full((n, shortlist.shape[1]), -1, dtype=np.int64)
        initial[~is_label] = shortlist[src[~is_label]]
    spe = max(1, math.ceil(n / params.batch_size))
    total = max(1, math.ceil(params.epochs * spe))
    sampler = make_sampler(params, Yex, bank, spe, initial, total)
    rng = np.random.default_rng(params.seed)
    torch.manual_seed(params.seed)
    clf = ShardedClassifier(W0, shard_devices(params.shards, device))
    w_opt = ShardedOptimizer(clf, params.w_optimizer, params.lr, params.weight_decay)
    sched_f = cosine_with_warmup(params.warmup_steps, total)
    enc_opt = enc_sched = None
    train_enc = params.train_encoder
    if train_enc:
        enc_opt = adamw(encoder.parameters(), params.encoder_lr, 0.01)
        enc_sched = torch.optim.lr_scheduler.LambdaLR(enc_opt, sched_f)
        encoder.train()
    prior = min(max(Yex.nnz / max(n, 1) / max(Yex.shape[1], 1), 1e-9), 0.5)
    bias = torch.tensor(math.log(prior / (1 - prior)) if params.logit_bias else 0.0, device=device,
                        requires_grad=params.logit_bias)
    bias_opt = torch.optim.Adam([bias], lr=1e-2) if params.logit_bias else None
    step, start, t0, last = 0, 0, time.perf_counter(), float("nan")
    resumed = checkpoint.load() if checkpoint is not None else None
    if resumed is not None:
        st = resumed.state
        clf.load_full(st["W"])
        if bias_opt is not None:
            with torch.no_grad():
                bias.copy_(st["bias"])
            bias_opt.load_state_dict(st["bias_opt"])
        w_opt.load_state_dict(st["w_opt"])
        if train_enc:
            encoder.load_state_dict(st["encoder"])
            enc_opt.load_state_dict(st["enc_opt"])
            enc_sched.load_state_dict(st["enc_sched"])
        sampler.load_state(_to_numpy(st["sampler"]))
        restore_rng(rng, resumed)
        start, step, last = resumed.epoch, int(st["step"]), float(st["last"])
    window: list[float] = []
    window_t = time.perf_counter()
    n_epochs = math.ceil(params.epochs)
    try:
        for epoch in range(start, n_epochs):
            perm = rng.permutation(n)
            batches = [perm[s:s + params.batch_size] for s in range(0, n, params.batch_size)]
            if epoch == n_epochs - 1 and params.epochs < n_epochs:  # fractional last epoch
                batches = batches[:max(1, math.ceil((params.epochs - epoch) * len(batches)))]
            ep_loss = []
            for batch in batches:
                sampler.before_step(step, clf.snapshot)
                pos = sample_positives(Yex, batch, params.num_positives, rng)
                if train_enc:
                    x = _embed_examples(encoder, src[batch], point_tokens, label_tokens, params, device, dtype)
                else:
                    x = torch.from_numpy(bank[batch]).to(device)
                x_np = x.detach().float().cpu().numpy()
                neg = sampler.sample(batch, x_np, step, rng)
                loss = sampled_bce(clf, x, pos, neg, params, bias, label_weight)
                if train_enc:
                    enc_opt.zero_grad(set_to_none=True)
                if bias_opt is not None:
                    bias_opt.zero_grad(set_to_none=True)
                loss.backward()
                if train_enc:
                    torch.nn.utils.clip_grad_norm_(encoder.parameters(), 1.0)
                    enc_opt.step()
                    enc_sched.step()
                    sampler.observe(batch, x_np)
                w_opt.step(sched_f(step))
                if bias_opt is not None:
                    bias_opt.step()
                step += 1
                last = float(loss.detach())
                ep_loss.append(last)
                window.append(last)
                if log_metrics is not None and step % log_every == 0:
                    now = time.perf_counter()
                    log_metrics(step, {"classifier_loss": float(np.mean(window)),
                                       "classifier_examples_per_s": len(window) * params.batch_size
                                       / max(now - window_t, 1e-9),
                                       "classifier_lr_factor": sched_f(step)})
                    window, window_t = [], now
            if checkpoint is not None and epoch + 1 < n_epochs:
                checkpoint.save(epoch + 1, {
                    "W": torch.from_numpy(clf.full()), "w_opt": w_opt.state_dict(), "step": step, "last": last,
                    "bias": bias.detach().clone(), "bias_opt": bias_opt.state_dict() if bias_opt else {},
                    "encoder": encoder.state_dict() if train_enc else {},
                    "enc_opt": enc_opt.state_dict() if train_enc else {},
                    "enc_sched": enc_sched.state_dict() if train_enc else {},
                    "sampler": _to_torch(sampler.state())}, rng)
    finally:
        sampler.close()
    seconds = time.perf_counter() - t0
    W = clf.full()
    if params.normalize:
        W = W / np.maximum(np.linalg.norm(W, axis=1, keepdims=True), 1e-12)
    p_emb = l_emb = None
    t1 = time.perf_counter()
    if train_enc:
        encoder.eval()
    if train_enc and reencode:
        p_emb = encode_tokens(encoder, *point_tokens, device, dtype, params.encode_batch_size)
        l_emb = encode_tokens(encoder, *label_tokens, device, dtype, params.encode_batch_size)
    builds = getattr(sampler, "build_seconds", [])
    summary = {"steps": step, "seconds": seconds, "final_loss": last, "steps_per_epoch": spe,
               "examples": int(n), "label_points": int(is_label.sum()), "negatives": params.negatives,
               "train_encoder": bool(train_enc), "refreshes": int(sampler.refreshes),
               "logit_bias": float(bias.detach()),
               "index_build_seconds_mean": float(np.mean(builds)) if builds else 0.0,
               "shards": len(clf.weights), "resumed_from_epoch": start,
               "examples_per_s": step * params.batch_size / max(seconds, 1e-9),
               "encode_seconds": time.perf_counter() - t1}
    return EndToEndResult(W.astype(np.float32), p_emb, l_emb, summary)


def _embed_examples(encoder: torch.nn.Module, src: np.ndarray, point_tokens: tuple[np.ndarray, np.ndarray],
                    label_tokens: tuple[np.ndarray, np.ndarray], params: ClassifierParams, device: torch.device,
                    dtype: torch.dtype | None) -> torch.Tensor:
    """Embeddings (with grad) of a batch of examples: point texts and label texts, in batch order."""
    lab = src < 0
    parts, where = [], []
    with autocast(device, dtype):
        if (~lab).any():
            parts.append(embed_rows(encoder, *point_tokens, src[~lab], params.chunk_size, device).float())
            where.append(np.flatnonzero(~lab))
        if lab.any():
            parts.append(embed_rows(encoder, *label_tokens, -1 - src[lab], params.chunk_size, device).float())
            where.append(np.flatnonzero(lab))
    x = torch.cat(parts)
    back = torch.from_numpy(np.argsort(np.concatenate(where), kind="stable")).to(device)
    return x[back]
