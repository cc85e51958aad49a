"""Losses of the seed methods, on score matrices (no model code here), and the registries the trainers pick
them from: ``PAIR_LOSSES`` (``pretrain.loss``, on a batch's similarity matrix) and ``CLASSIFIER_LOSSES``
(``classifier.loss``, on each point's candidate scores). A new loss: its function, one small class that
builds it from the params, and one registry line."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F

from xc_dagster.config import HardNegativeTrainerParams, PretrainParams


def ohnm_triplet_loss(sim: torch.Tensor, pos_mask: torch.Tensor, margin: float = 0.3, num_negatives: int = 10,
                      temperature: float = 0.1) -> torch.Tensor:
    """NGAME's triplet loss with online hard negative mining over in-batch negatives.

    ``sim[i, j]`` = E(x_i).E(z_j) where z_i is point i's sampled positive (the diagonal); ``pos_mask[i, j]``
    is True where label j is a true positive of point i (diagonal included), so those are never negatives.
    Per point: the ``num_negatives`` hardest negatives, hinge ``[s_neg - s_pos + margin]_+``, violators
    weighted by ``softmax(s_neg / temperature)`` over those negatives; mean over points.
    """
    pos = sim.diagonal().unsqueeze(1)
    neg = sim.masked_fill(pos_mask, float("-inf"))
    k = min(num_negatives, sim.shape[1] - 1)
    if k <= 0:
        return sim.sum() * 0.0
    top, _ = neg.topk(k, dim=1)
    valid = torch.isfinite(top)
    hinge = F.relu(top - pos + margin).masked_fill(~valid, 0.0)
    weights = torch.softmax((top / temperature).masked_fill(~valid, float("-inf")), dim=1)
    weights = torch.nan_to_num(weights, nan=0.0)  # rows whose negatives are all masked
    return (weights * hinge).sum(1).mean()


def infonce_loss(sim: torch.Tensor, pos_mask: torch.Tensor, temperature: float = 0.05) -> torch.Tensor:
    """In-batch softmax cross-entropy (InfoNCE; the loss all-MiniLM-L6-v2 was trained with, scale 20).

    Row i's target is its sampled positive ``sim[i, i]``; every other column is a negative unless
    ``pos_mask`` marks it a true positive of row i, in which case it leaves the denominator (it is not a
    negative). Unlike the top-k hinge, every in-batch negative gets gradient in proportion to its softmax
    weight, and no margin stops the gradient once the positive leads. Mean over rows.
    """
    n = min(sim.shape[0], sim.shape[1])
    logits = (sim[:n] / temperature).masked_fill(pos_mask[:n], float("-inf"))
    diag = torch.arange(n, device=sim.device)
    logits[diag, diag] = sim[diag, diag] / temperature
    return F.cross_entropy(logits, diag)


def dexml_loss(sim: torch.Tensor, pos_mask: torch.Tensor, temperature: float = 0.05) -> torch.Tensor:
    """DEXML's decoupled softmax (Gupta et al., ICLR 2024) over the batch's labels.

    Row i's positives are its sampled label ``sim[i, i]`` and every other column ``pos_mask`` marks a true
    positive of row i; each positive p is a target of its own softmax over {p} and the row's negatives
    (``-log(e^{s_p/t} / (e^{s_p/t} + sum_neg e^{s_n/t}))``), so positives never compete with each other. The
    row's terms are averaged over its positives (as DEXML's code divides by the row's positive count), then the
    rows. With the diagonal the only positive of every row this is ``infonce_loss``, which drops the other true
    positives from the denominator but does not train them (DEXML's one-sampled-positive mode).
    """
    n = min(sim.shape[0], sim.shape[1])
    logits = sim[:n] / temperature
    diag = torch.arange(n, device=sim.device)
    pos = pos_mask[:n].clone()
    pos[diag, diag] = True
    neg = logits.masked_fill(pos, float("-inf")).logsumexp(1, keepdim=True)  # -inf: a row without negatives
    nll = (torch.logaddexp(logits, neg) - logits).masked_fill(~pos, 0.0)
    return (nll.sum(1) / pos.sum(1)).mean()


def siamesexml_loss(sim: torch.Tensor, pos_mask: torch.Tensor, c: float = 0.9, d: float = 1.5,
                    num_negatives: int = 1, eps: float = 1e-6) -> torch.Tensor:
    """SiameseXML's probabilistic contrastive loss (paper eq. 5/6) with in-batch hard negative mining.

    Point likelihood on a cosine similarity v: ``p(+1, v) = c * exp(d * v) / exp(d)``, ``p(-1, v) = 1 - p(+1, v)``.
    ``sim`` is (B, C), C >= B; row r's positive is the diagonal ``sim[r, r]`` (its own sampled pair), term
    ``-ln p(+1, v) = -ln c + d(1 - v)``; its ``num_negatives`` (kappa) hardest columns not marked in ``pos_mask``
    (true positives, diagonal included, are never negatives) each add ``-ln(1 - c * exp(d (v - 1)))``. No
    margin. Per row the terms are averaged over kappa + 1 as in the paper's eq. 6 (the reference code sums
    them: a constant factor, which Adam's per-parameter normalisation largely absorbs); mean over rows.
    ``1 - p`` is clamped at ``eps`` so a similarity rounded above 1 (low-precision autocast) stays finite.
    """
    if not 0.0 < c < 1.0 or d <= 0.0:
        raise ValueError(f"siamesexml_loss: need 0 < c < 1 and d > 0, got c={c}, d={d}")
    n = min(sim.shape[0], sim.shape[1])
    pos = sim.diagonal()[:n]
    pos_term = -math.log(c) + d * (1.0 - pos)
    k = min(num_negatives, sim.shape[1] - 1)
    if k <= 0:
        return pos_term.mean()
    top, _ = sim[:n].masked_fill(pos_mask[:n], float("-inf")).topk(k, dim=1)
    valid = torch.isfinite(top)
    p_plus = c * torch.exp(d * (torch.where(valid, top, torch.zeros_like(top)) - 1.0))
    neg_term = -torch.log((1.0 - p_plus).clamp_min(eps))
    neg_term = neg_term.masked_fill(~valid, 0.0)
    return ((pos_term + neg_term.sum(1)) / (k + 1)).mean()


def siamesexml_classifier_loss(scores: torch.Tensor, is_pos: torch.Tensor, valid: torch.Tensor, c: float = 0.75,
                               d: float = 3.0, neg_threshold: float = 0.05, eps: float = 1e-6,
                               pos_weight: torch.Tensor | None = None) -> torch.Tensor:
    """SiameseXML Module IV: the probabilistic contrastive loss over each point's positives + shortlist negatives.

    Positive term ``-ln c + d(1 - v)``, negative term ``-ln(1 - c * exp(d (v - 1)))`` (reference code: c = 0.75,
    d = 3.0). Negative terms below ``neg_threshold`` (easy negatives, v below about 0.1 at the defaults) are
    dropped, as the reference code ignores them. Per row the kept terms are averaged; mean over rows that keep
    any term. ``scores``/``is_pos``/``valid``: (B, C); padding is not valid. ``pos_weight`` (B, C) scales the
    positive terms (the count is not weighted).
    """
    if not 0.0 < c < 1.0 or d <= 0.0:
        raise ValueError(f"siamesexml_classifier_loss: need 0 < c < 1 and d > 0, got c={c}, d={d}")
    v = torch.where(valid, scores, torch.zeros_like(scores))
    pos_term = -math.log(c) + d * (1.0 - v)
    if pos_weight is not None:
        pos_term = pos_term * pos_weight
    neg_term = -torch.log((1.0 - c * torch.exp(d * (v - 1.0))).clamp_min(eps))
    pos = is_pos & valid
    neg = (~is_pos) & valid & (neg_term.detach() >= neg_threshold)
    terms = torch.where(pos, pos_term, torch.zeros_like(v)) + torch.where(neg, neg_term, torch.zeros_like(v))
    count = (pos | neg).sum(1)
    keep = count > 0
    if not bool(keep.any()):
        return scores.sum() * 0.0
    return (terms.sum(1)[keep] / count[keep]).mean()


def multi_positive_triplet_loss(scores: torch.Tensor, is_pos: torch.Tensor, valid: torch.Tensor,
                                margin: float = 0.2, pos_weight: torch.Tensor | None = None) -> torch.Tensor:
    """NGAME M2: every (positive, negative) pair of a row gets ``[s_neg - s_pos + margin]_+``; mean over pairs.

    ``scores``: (B, C) candidate scores; ``is_pos``/``valid``: (B, C) bool masks (padding is not valid).
    ``pos_weight`` (B, C): a weight on each positive's pairs (e.g. its label's inverse propensity); the sum is
    still divided by the number of pairs.
    """
    p = is_pos & valid
    n = (~is_pos) & valid
    diff = scores.unsqueeze(1) - scores.unsqueeze(2) + margin  # [b, pos j, neg k] = s_k - s_j + m
    pair = p.unsqueeze(2) & n.unsqueeze(1)
    hinge = F.relu(diff).masked_fill(~pair, 0.0)
    if pos_weight is not None:
        hinge = hinge * pos_weight.unsqueeze(2)
    return hinge.sum() / pair.sum().clamp_min(1)


def masked_bce_loss(logits: torch.Tensor, is_pos: torch.Tensor, valid: torch.Tensor,
                    weights: torch.Tensor | None = None) -> torch.Tensor:
    """Binary cross-entropy over the valid candidates of each row, summed per row, mean over rows
    (ASTRA/MIPS-s form: positives + sampled negatives; ``weights`` e.g. importance weights of negatives)."""
    loss = F.binary_cross_entropy_with_logits(logits, is_pos.to(logits.dtype), reduction="none")
    if weights is not None:
        loss = loss * weights
    loss = loss.masked_fill(~valid, 0.0)
    return loss.sum(1).mean()


# ------------------------------------------------------------------------------- pretraining pair losses

class PairLoss(Protocol):
    """``pretrain.loss``: a loss on a (B, C) similarity matrix whose diagonal holds each row's sampled
    positive; ``mask`` marks every true positive (never a negative)."""

    @classmethod
    def from_params(cls, params: PretrainParams) -> PairLoss:
        """The loss with its ``pretrain.*`` hyperparameters."""

    def __call__(self, sim: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The loss (a scalar)."""


@dataclass
class TripletPairLoss:
    """NGAME's OHNM triplet loss (``ohnm_triplet_loss``)."""

    margin: float
    num_negatives: int
    temperature: float

    @classmethod
    def from_params(cls, params: PretrainParams) -> TripletPairLoss:
        return cls(params.margin, params.num_negatives, params.temperature)

    def __call__(self, sim: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return ohnm_triplet_loss(sim, mask, self.margin, self.num_negatives, self.temperature)


@dataclass
class SiameseXMLPairLoss:
    """SiameseXML's probabilistic contrastive loss, kappa hardest in-batch negatives (``siamesexml_loss``)."""

    c: float
    d: float
    num_negatives: int

    @classmethod
    def from_params(cls, params: PretrainParams) -> SiameseXMLPairLoss:
        return cls(params.contrastive_c, params.contrastive_d, params.num_negatives)

    def __call__(self, sim: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return siamesexml_loss(sim, mask, self.c, self.d, self.num_negatives)


@dataclass
class InfoNCEPairLoss:
    """In-batch softmax cross-entropy (``infonce_loss``)."""

    temperature: float

    @classmethod
    def from_params(cls, params: PretrainParams) -> InfoNCEPairLoss:
        return cls(params.infonce_temperature)

    def __call__(self, sim: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return infonce_loss(sim, mask, self.temperature)


@dataclass
class DEXMLPairLoss(InfoNCEPairLoss):
    """DEXML's decoupled softmax over the batch's labels (``dexml_loss``), at ``pretrain.infonce_temperature``."""

    def __call__(self, sim: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return dexml_loss(sim, mask, self.temperature)


PAIR_LOSSES: dict[str, type[PairLoss]] = {
    "triplet": TripletPairLoss,
    "siamesexml": SiameseXMLPairLoss,
    "infonce": InfoNCEPairLoss,
    "dexml": DEXMLPairLoss,
}


# ------------------------------------------------------------------------------------ classifier losses

class ClassifierLoss(Protocol):
    """``classifier.loss`` of the hardest-negative trainer, on a batch's (B, C) candidate scores."""

    @classmethod
    def from_params(cls, params: HardNegativeTrainerParams) -> ClassifierLoss:
        """The loss with its ``classifier.*`` hyperparameters."""

    def __call__(self, scores: torch.Tensor, is_pos: torch.Tensor, valid: torch.Tensor,
                 pos_weight: torch.Tensor | None = None) -> torch.Tensor:
        """The loss; ``pos_weight`` (B, C) weights the positives' terms (its other entries are ignored)."""


@dataclass
class TripletClassifierLoss:
    """NGAME M2's multi-positive triplet loss (``multi_positive_triplet_loss``)."""

    margin: float

    @classmethod
    def from_params(cls, params: HardNegativeTrainerParams) -> TripletClassifierLoss:
        return cls(params.margin)

    def __call__(self, scores: torch.Tensor, is_pos: torch.Tensor, valid: torch.Tensor,
                 pos_weight: torch.Tensor | None = None) -> torch.Tensor:
        return multi_positive_triplet_loss(scores, is_pos, valid, self.margin, pos_weight)


@dataclass
class BCEClassifierLoss:
    """BCE on ``scale`` * score over the candidates (``masked_bce_loss``)."""

    scale: float

    @classmethod
    def from_params(cls, params: HardNegativeTrainerParams) -> BCEClassifierLoss:
        return cls(params.scale)

    def __call__(self, scores: torch.Tensor, is_pos: torch.Tensor, valid: torch.Tensor,
                 pos_weight: torch.Tensor | None = None) -> torch.Tensor:
        w = None if pos_weight is None else torch.where(is_pos, pos_weight, torch.ones_like(pos_weight))
        return masked_bce_loss(self.scale * scores, is_pos, valid, w)


@dataclass
class SiameseXMLClassifierLoss:
    """SiameseXML Module IV's contrastive loss (``siamesexml_classifier_loss``)."""

    c: float
    d: float
    neg_threshold: float

    @classmethod
    def from_params(cls, params: HardNegativeTrainerParams) -> SiameseXMLClassifierLoss:
        return cls(params.contrastive_c, params.contrastive_d, params.neg_threshold)

    def __call__(self, scores: torch.Tensor, is_pos: torch.Tensor, valid: torch.Tensor,
                 pos_weight: torch.Tensor | None = None) -> torch.Tensor:
        return siamesexml_classifier_loss(scores, is_pos, valid, self.c, self.d, self.neg_threshold,
                                          pos_weight=pos_weight)


CLASSIFIER_LOSSES: dict[str, type[ClassifierLoss]] = {
    "triplet": TripletClassifierLoss,
    "bce": BCEClassifierLoss,
    "siamesexml": SiameseXMLClassifierLoss,
}


def point_batch_loss(sim: torch.Tensor, mask: torch.Tensor, loss: PairLoss, symmetric: bool) -> torch.Tensor:
    """Loss of a point batch: rows are the points, columns their sampled labels (the diagonal); with
    ``symmetric`` also the label-anchored direction on the transposed matrix, the two averaged."""
    value = loss(sim, mask)
    if symmetric:
        value = 0.5 * (value + loss(sim.T, mask.T))
    return value


def label_batch_pair_loss(p: torch.Tensor, z: torch.Tensor, where: np.ndarray, m: int, mask_t: torch.Tensor,
                          loss: PairLoss, centroid_weight: float) -> torch.Tensor:
    """Module I's loss from a label batch's embeddings: ``p`` of the distinct points (``where`` maps the B
    anchors then the B x m centroid points to them), ``z`` of the B labels; beta-weighted text and centroid terms."""
    B = len(z)
    p = p[torch.from_numpy(where.reshape(-1)).to(p.device)]
    anchors = p[:B]
    value = loss(z @ anchors.T, mask_t)
    if m > 0 and centroid_weight > 0:
        v = F.normalize(p[B:].view(B, m, -1).mean(1), dim=-1)
        w = centroid_weight
        value = (1.0 - w) * value + w * loss(v @ anchors.T, mask_t)
    return value
