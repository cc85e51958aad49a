"""One-vs-all classifiers W (NGAME M2/M4, SiameseXML Module IV) on a frozen encoder.

w_l starts from the label representation the caller passes (Module III transfer: E(z_l), or
normalise(E(z_l) + v_l) with ``classifier.init``) and is trained on each point's positives
plus the hardest negatives under the current W, re-ranked every step, from one of two candidate pools:
the point's mined ANNS shortlist (SiameseXML Module IV), or NGAME M2's in-batch negatives -- the positives
of the other points of the batch, where a batch is a union of clusters of the (frozen) point embeddings so
those are hard negatives -- or both. W is a ``ShardedClassifier`` (one shard) updated with SparseAdam (or SGD,
``classifier.w_optimizer``): a step touches only the rows it scored, so memory and time per step do not grow
with L.

SiameseXML Module IV also fine-tunes the bag encoder's residual block with W (``classifier.train_residual``):
the points' intermediate embeddings f_E(x) stay frozen and x = N(R(f_E(x))) is recomputed every step.
"""

from __future__ import annotations

import math
import time
from typing import Callable

import numpy as np
import scipy.sparse as sp
import torch
import torch.nn.functional as F

from xc_dagster.config import ClassifierParams
from xc_dagster.encoders.bag import BagOfEmbeddingsEncoder
from xc_dagster.errors import XCConfigError
from xc_dagster.sampling.clustering import balanced_clusters, cluster_batches
from xc_dagster.sampling.labels import positive_mask, sample_positives
from xc_dagster.training.checkpoint import Checkpointer, restore_rng
from xc_dagster.training.losses import masked_bce_loss, multi_positive_triplet_loss, siamesexml_classifier_loss
from xc_dagster.training.sharded import ShardedClassifier, ShardedOptimizer

MetricsFn = Callable[[int, dict[str, float]], None]
LOSSES = ("bce", "triplet", "siamesexml")
NEGATIVES = ("shortlist", "in-batch", "both")


def classifier_batches(rows: np.ndarray, params: ClassifierParams,
                       rng: np.random.Generator, clusters: np.ndarray | None) -> list[np.ndarray]:
    """One epoch of batches: random, or unions of random clusters (``clusters``: cluster id per point)."""
    if clusters is None:
        perm = rng.permutation(rows)
        return [perm[s:s + params.batch_size] for s in range(0, len(perm), params.batch_size)]
    return cluster_batches(clusters, rows, params.batch_size, rng)


def hardest_negatives(x: torch.Tensor, W: torch.Tensor, batch: np.ndarray, pos: np.ndarray,
                      shortlist: np.ndarray, Y: sp.csr_matrix, mode: str, num: int) -> torch.Tensor:
    """The ``num`` hardest negatives (highest w_l.x under the current W) per point of ``batch``, -1 padded.

    Candidate pools: ``shortlist`` = the point's mined labels; ``in-batch`` = every label sampled as a positive
    by a point of the batch (NGAME M2: with cluster batches these are labels of similar points), scored with
    one (B x U) matmul; ``both`` = their union (a label in both pools counts once). True positives of the
    point are never negatives.
    """
    ids, scores = [], []
    with torch.no_grad():
        if mode in ("shortlist", "both"):
            c = shortlist[batch].astype(np.int64)
            c = np.where(positive_mask(Y, batch, c), -1, c)
            ct = torch.from_numpy(c).to(x.device)
            ids.append(ct)
            scores.append(torch.einsum("bd,bkd->bk", x, W[ct.clamp_min(0)]).masked_fill(ct < 0, float("-inf")))
        if mode in ("in-batch", "both"):
            u = np.unique(pos[pos >= 0])
            ub = np.broadcast_to(u, (len(batch), len(u)))
            drop = positive_mask(Y, batch, ub)
            if mode == "both":  # already a candidate from the shortlist
                c = shortlist[batch]
                r = np.repeat(np.arange(len(batch)), c.shape[1])[c.ravel() >= 0]
                S = sp.csr_matrix((np.ones(len(r), dtype=np.int8), (r, c.ravel()[c.ravel() >= 0])),
                                  shape=(len(batch), W.shape[0]))
                drop |= positive_mask(S, np.arange(len(batch)), ub)
            ut = torch.from_numpy(u).to(x.device)
            drop_t = torch.from_numpy(drop).to(x.device)
            ids.append(ut.expand(len(batch), -1).masked_fill(drop_t, -1))
            scores.append((x @ W[ut].T).masked_fill(drop_t, float("-inf")))
        cand, sc = torch.cat(ids, 1), torch.cat(scores, 1)
        top = sc.topk(min(num, sc.shape[1]), dim=1)
        return torch.gather(cand, 1, top.indices).masked_fill(torch.isinf(top.values), -1)


def classifier_loss(scores: torch.Tensor, is_pos: torch.Tensor, valid: torch.Tensor,
                    params: ClassifierParams, pos_weight: torch.Tensor | None = None) -> torch.Tensor:
    """``classifier.loss`` on a batch's (B, C) candidate scores: bce (on scale * score), the SiameseXML Module IV
    contrastive loss, or NGAME M2's multi-positive triplet; ``pos_weight`` (B, C) weights the positives' terms
    (its other entries are ignored)."""
    if params.loss == "bce":
        w = None if pos_weight is None else torch.where(is_pos, pos_weight, torch.ones_like(pos_weight))
        return masked_bce_loss(params.scale * scores, is_pos, valid, w)
    if params.loss == "siamesexml":
        return siamesexml_classifier_loss(scores, is_pos, valid, params.contrastive_c, params.contrastive_d,
                                          params.neg_threshold, pos_weight=pos_weight)
    return multi_positive_triplet_loss(scores, is_pos, valid, params.margin, pos_weight)


def propensity_label_weights(inv_prop: np.ndarray, Y: sp.csr_matrix, rows: np.ndarray,
                             gamma: float) -> np.ndarray | None:
    """``classifier.propensity_weight``: label l's positives weigh (1/p_l)^gamma, scaled so that their mean over
    the training positives (``Y[rows]``) is 1 -- the propensity-scored loss of Jain et al. (2016), which
    estimates the propensity-scored metrics (PSP@k) without bias; gamma 0 is the unweighted loss (None)."""
    if not (isinstance(gamma, (int, float)) and gamma >= 0):
        raise XCConfigError(f"classifier.propensity_weight: expected a number >= 0, got {gamma!r}")
    if gamma == 0:
        return None
    w = np.power(np.asarray(inv_prop, dtype=np.float64), gamma)
    counts = np.bincount(Y[rows].indices, minlength=len(w))
    total = counts.sum()
    if total == 0:
        return None
    return (w * total / float(counts @ w)).astype(np.float32)


def _w_optimizer(clf: ShardedClassifier, params: ClassifierParams) -> ShardedOptimizer:
    """``classifier.w_optimizer`` over the rows of W a step scored: SparseAdam (NGAME code) or plain SGD, whose
    step is proportional to the gradient, so rows touched rarely move little (LF-WordNetNounsTitles: no better
    fused, bench/RESULTS.md thirteenth session)."""
    if params.w_optimizer == "sgd" and params.weight_decay:  # ShardedOptimizer checks the name itself
        raise XCConfigError("classifier.weight_decay: the hardest-negative trainer takes no weight decay "
                            f"(got {params.weight_decay}); it applies to negatives=uniform|astra|mips")
    return ShardedOptimizer(clf, params.w_optimizer, params.lr)


def train_classifiers(point_emb: np.ndarray, label_emb: np.ndarray, Y: sp.csr_matrix, shortlist: np.ndarray,
                      train_rows: np.ndarray, params: ClassifierParams, device: torch.device,
                      log_metrics: MetricsFn | None = None,
                      checkpoint: Checkpointer | None = None,
                      encoder: BagOfEmbeddingsEncoder | None = None,
                      label_weight: np.ndarray | None = None) -> tuple[np.ndarray, dict[str, float]]:
    """Return W (L x D float32) and a summary; ``shortlist[i]`` are point i's mined candidate labels (-1 pad).

    ``label_weight`` (L,): a weight on each label's positive terms in the loss (``propensity_label_weights``).

    With ``encoder`` (SiameseXML Module IV), ``point_emb`` are its intermediate embeddings f_E(x) and its
    residual block is trained with W (Adam, ``classifier.residual_lr``; the token table stays frozen): a point
    scores as ``encoder.from_intermediate(f_E(x))``. The encoder is updated in place and left in eval mode.

    With ``checkpoint``, the state is saved after every epoch and a matching checkpoint is resumed from: the
    result equals an uninterrupted run's (same seed).
    """
    if params.loss not in LOSSES:
        raise XCConfigError(f"classifier.loss: expected one of {LOSSES}, got {params.loss!r}")
    if params.negatives not in NEGATIVES:
        raise XCConfigError(f"classifier.negatives: expected one of {NEGATIVES}, got {params.negatives!r}")
    if params.epochs != int(params.epochs) or params.epochs < 0:
        raise XCConfigError(f"classifier.epochs: the hardest-negative trainer takes whole epochs >= 0, got "
                            f"{params.epochs} (fractions work with classifier.negatives=uniform|astra|mips)")
    epochs = int(params.epochs)
    Y = Y.tocsr()
    rows = np.asarray(train_rows, dtype=np.int64)
    rows = rows[np.diff(Y.indptr)[rows] > 0]
    rng = np.random.default_rng(params.seed)
    torch.manual_seed(params.seed)
    clf = ShardedClassifier(np.asarray(label_emb, dtype=np.float32), [device])
    W = clf.weights[0]
    opt = _w_optimizer(clf, params)
    residual_opt = None
    if encoder is not None:
        encoder.to(device).train()  # dropout of the residual block, as in the pretraining
        residual_opt = torch.optim.Adam(encoder.residual.parameters(), lr=params.residual_lr)
    X = torch.from_numpy(np.ascontiguousarray(point_emb, dtype=np.float32))
    lw = None if label_weight is None else torch.from_numpy(np.asarray(label_weight, dtype=np.float32)).to(device)
    steps, t0, last = 0, time.perf_counter(), float("nan")
    steps_per_epoch = math.ceil(len(rows) / params.batch_size)
    # the encoder is frozen, so the point embeddings and hence their clusters are fixed: cluster once
    clusters = None
    if params.cluster_size > 1:
        clusters = np.full(len(point_emb), -1, dtype=np.int64)
        clusters[rows] = balanced_clusters(point_emb[rows], params.cluster_size, seed=params.seed)
    start = 0
    resumed = checkpoint.load() if checkpoint is not None else None
    if resumed is not None:
        clf.load_full(resumed.state["W"])
        opt.load_state_dict(resumed.state["opt"])
        if encoder is not None:
            encoder.residual.load_state_dict(resumed.state["residual"])
            residual_opt.load_state_dict(resumed.state["residual_opt"])
        restore_rng(rng, resumed)
        start, steps, last = resumed.epoch, int(resumed.state["steps"]), float(resumed.state["last"])
    for epoch in range(start, epochs):
        ep_loss = []
        for batch in classifier_batches(rows, params, rng, clusters):
            pos = sample_positives(Y, batch, params.num_positives, rng)
            x = X[batch].to(device)
            if encoder is not None:
                x = encoder.from_intermediate(x)
            neg = hardest_negatives(x, W, batch, pos, shortlist, Y, params.negatives, params.num_negatives)
            ids = torch.cat([torch.from_numpy(pos).to(device), neg], dim=1)
            valid = ids >= 0
            is_pos = torch.zeros_like(valid)
            is_pos[:, :pos.shape[1]] = True
            scores = clf.scores(x, ids, normalize=params.normalize)  # gradients reach only the rows scored
            loss = classifier_loss(scores, is_pos, valid, params, None if lw is None else lw[ids.clamp_min(0)])
            if residual_opt is not None:
                residual_opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if residual_opt is not None:
                residual_opt.step()
            steps += 1
            ep_loss.append(float(loss.detach()))
        last = float(np.mean(ep_loss)) if ep_loss else float("nan")
        if checkpoint is not None:
            state = {"W": W.detach().cpu(), "opt": opt.state_dict(), "steps": steps, "last": last}
            if encoder is not None:
                state.update(residual={k: v.detach().cpu() for k, v in encoder.residual.state_dict().items()},
                             residual_opt=residual_opt.state_dict())
            checkpoint.save(epoch + 1, state, rng)
        if log_metrics is not None:
            log_metrics(epoch + 1, {"classifier_loss": last})
    if encoder is not None:
        encoder.eval()
    Wn = W.detach()
    if params.normalize:
        Wn = F.normalize(Wn, dim=-1)
    return Wn.cpu().numpy().astype(np.float32), {"steps": steps, "seconds": time.perf_counter() - t0,
                                                 "final_loss": last, "steps_per_epoch": steps_per_epoch,
                                                 "negatives": params.negatives, "resumed_from_epoch": start,
                                                 "clusters": 0 if clusters is None else int(clusters.max() + 1)}
