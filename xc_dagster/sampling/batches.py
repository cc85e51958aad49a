"""Batch samplers: which training rows (or labels) make up each mini-batch of an epoch.

Pretraining picks one by ``pretrain.sampler`` from ``BATCH_SAMPLERS``: ``random`` batches over points,
``ngame`` (NGAME Algorithm 1: unions of clusters of the points' embeddings, kept in a memory bank filled by the
training forward passes, re-clustered every tau epochs, with a curriculum that starts at cluster size 1 and
doubles it on a schedule) or ``siamesexml`` (SiameseXML Module I: batches over labels drawn with probability
~ freq^power, one positive point each plus ``centroid_points`` more for the label's centroid). The classifier
stage's batches (``classifier_batches``) are random, or unions of clusters of its frozen point embeddings.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Protocol

import numpy as np
import scipy.sparse as sp
import torch

from xc_dagster.config import HardNegativeTrainerParams, PretrainParams
from xc_dagster.errors import XCConfigError
from xc_dagster.sampling.clustering import balanced_clusters, cluster_batches
from xc_dagster.sampling.labels import label_sampling_probs, sample_label_batch, sample_label_points


class BatchSampler(Protocol):
    """What a trainer calls on its batch sampler (a new sampler: one class and one ``BATCH_SAMPLERS`` line)."""

    reclusterings: int  # times the batches' clusters were recomputed (0 for samplers that do not cluster)

    @classmethod
    def from_params(cls, Y: sp.csr_matrix, rows: np.ndarray, params: PretrainParams, dim: int) -> BatchSampler:
        """The sampler over the training ``rows`` (each with a positive) of ``Y``, embeddings of ``dim``."""

    def steps_per_epoch(self) -> int:
        """Batches in an epoch (what the LR schedule is sized by); 0 when no batch can be formed."""

    def prepare(self, encode: Callable[[np.ndarray], np.ndarray]) -> dict[str, float]:
        """Called once before a fresh (not resumed) run with the starting encoder; returns metrics to log."""

    def epoch(self, epoch: int, rng: np.random.Generator) -> list[Any]:
        """The batches of ``epoch``: arrays of point rows, or ``LabelBatch``es."""

    def observe(self, rows: np.ndarray, emb: torch.Tensor) -> None:
        """The training forward pass's embeddings of ``rows`` (a memory bank keeps them)."""

    def state(self) -> dict[str, Any]:
        """Tensors, numbers and strings a checkpoint keeps."""

    def load_state(self, st: dict[str, Any]) -> None:
        """Restore ``state()``."""


def random_batches(rows: np.ndarray, batch_size: int, rng: np.random.Generator,
                   min_size: int = 2) -> Iterator[np.ndarray]:
    """Plain random mini-batches over ``rows`` (one pass; the last partial batch kept if >= ``min_size`` rows)."""
    perm = rng.permutation(rows)
    for s in range(0, len(perm), batch_size):
        b = perm[s:s + batch_size]
        if len(b) >= min_size:
            yield b


class Stateless:
    """The sampler methods of a sampler that learns nothing from the training (no memory bank, no state)."""

    def prepare(self, encode: Callable[[np.ndarray], np.ndarray]) -> dict[str, float]:
        return {}

    def observe(self, rows: np.ndarray, emb: torch.Tensor) -> None:
        pass

    def state(self) -> dict[str, Any]:
        return {}

    def load_state(self, st: dict[str, Any]) -> None:
        pass


class RandomBatches(Stateless):
    """Random batches over the training points (pretraining keeps batches of >= 2 points, the classifier all)."""

    reclusterings = 0
    n_clusters = 0

    def __init__(self, rows: np.ndarray, batch_size: int, min_size: int = 2):
        self.rows, self.batch_size, self.min_size = np.asarray(rows), batch_size, min_size

    @classmethod
    def from_params(cls, Y: sp.csr_matrix, rows: np.ndarray, params: PretrainParams, dim: int) -> RandomBatches:
        return cls(rows, params.batch_size)

    def steps_per_epoch(self) -> int:
        return math.ceil(len(self.rows) / self.batch_size) if len(self.rows) >= self.min_size else 0

    def epoch(self, epoch: int, rng: np.random.Generator) -> list[np.ndarray]:
        return list(random_batches(self.rows, self.batch_size, rng, self.min_size))



def curriculum_cluster_size(epoch: int, schedule: tuple[int, ...], max_size: int) -> int:
    """NGAME's curriculum: C = 1 (random batches) before the first scheduled epoch, doubling at each one."""
    return min(2 ** sum(1 for e in schedule if epoch >= e), max(max_size, 1))


class NGAMESampler:
    """Batches as unions of random clusters of the memory-bank embeddings (NGAME Algorithm 1).

    ``with_bank``: allocate the (N x D) memory bank; without it (no epoch of the run clusters) every epoch is
    the random sampler's, with the same generator draws.
    """

    def __init__(self, n_points: int, dim: int, params: PretrainParams, rows: np.ndarray, with_bank: bool = True):
        self.params, self.rows = params, np.asarray(rows)
        self.n_points, self.dim = n_points, dim
        self.bank = np.zeros((n_points, dim), dtype=np.float32) if with_bank else None
        self.labels: np.ndarray | None = None
        self.size = 1
        self.reclusterings = 0

    @classmethod
    def from_params(cls, Y: sp.csr_matrix, rows: np.ndarray, params: PretrainParams, dim: int) -> NGAMESampler:
        """Refuses a curriculum that clusters an empty bank; the bank only where some epoch of the run clusters."""
        first = curriculum_cluster_size(0, params.curriculum, params.max_cluster_size)
        if first > 1 and not params.seed_bank:
            raise XCConfigError(f"pretrain.curriculum: {params.curriculum!r} clusters from epoch 0, when the "
                                "memory bank is still empty; set pretrain.seed_bank=true (fill it with the "
                                "starting encoder's embeddings) or start the curriculum at epoch 1 or later")
        clusters = any(curriculum_cluster_size(e, params.curriculum, params.max_cluster_size) > 1
                       for e in range(math.ceil(params.epochs)))
        return cls(Y.shape[0], dim, params, rows, with_bank=clusters)

    def steps_per_epoch(self) -> int:
        """Exact for random batches; cluster batches vary a little in count per epoch."""
        return math.ceil(len(self.rows) / self.params.batch_size) if len(self.rows) >= 2 else 0

    def prepare(self, encode: Callable[[np.ndarray], np.ndarray]) -> dict[str, float]:
        """``pretrain.seed_bank``: the bank starts as the starting encoder's embeddings of the training points."""
        if self.bank is None or not self.params.seed_bank:
            return {}
        t = time.perf_counter()
        self.bank[self.rows] = encode(self.rows)
        return {"pretrain_seed_bank_seconds": time.perf_counter() - t}

    def fill_bank(self, epoch: int, encode: Callable[[np.ndarray], np.ndarray]) -> None:
        """Before ``epoch``: a run planned without a clustering epoch (no bank) but re-planned into one clusters the
        training points' embeddings by the encoder as it is now."""
        p = self.params
        if self.bank is None and curriculum_cluster_size(epoch, p.curriculum, p.max_cluster_size) > 1:
            self.bank = np.zeros((self.n_points, self.dim), dtype=np.float32)
            self.bank[self.rows] = encode(self.rows)

    def observe(self, rows: np.ndarray, emb: torch.Tensor) -> None:
        if self.bank is not None:
            self.bank[rows] = emb.detach().float().cpu().numpy()

    def state(self) -> dict[str, Any]:
        """Memory bank and current clustering, as tensors (for checkpoints)."""
        if self.bank is None:
            return {}
        labels = torch.from_numpy(self.labels) if self.labels is not None else torch.zeros(0, dtype=torch.int64)
        return {"bank": torch.from_numpy(self.bank.copy()), "labels": labels, "has_labels": self.labels is not None,
                "size": self.size, "reclusterings": self.reclusterings}

    def load_state(self, st: dict[str, Any]) -> None:
        if not st:
            return
        self.bank = st["bank"].numpy().copy()
        self.labels = st["labels"].numpy().copy() if st["has_labels"] else None
        self.size, self.reclusterings = int(st["size"]), int(st["reclusterings"])

    def epoch(self, epoch: int, rng: np.random.Generator) -> list[np.ndarray]:
        p = self.params
        size = curriculum_cluster_size(epoch, p.curriculum, p.max_cluster_size)
        if size <= 1:
            return list(random_batches(self.rows, p.batch_size, rng))
        if self.labels is None or size != self.size or epoch % max(p.cluster_every, 1) == 0:
            lab = balanced_clusters(self.bank[self.rows], size, seed=p.seed + epoch)
            self.labels = np.full(len(self.bank), -1, dtype=np.int64)
            self.labels[self.rows] = lab
            self.size = size
            self.reclusterings += 1
        return [b for b in cluster_batches(self.labels, self.rows, p.batch_size, rng) if len(b) >= 2]


@dataclass
class LabelBatch:
    """A batch over labels: ``labels`` (B,), one positive point each (``anchors``, B,), and ``centroid``
    (B, m) further positives whose mean embedding is the label's centroid estimate v_l (m may be 0)."""

    labels: np.ndarray
    anchors: np.ndarray
    centroid: np.ndarray


class SiameseXMLSampler(Stateless):
    """SiameseXML Module I batches over labels, drawn from the training rows' label frequencies.

    ``freq`` counts only ``rows`` (the training rows; validation rows never supply a positive), labels with
    freq 0 are never drawn. An epoch is ``ceil(#labels with freq > 0 / batch_size)`` batches, i.e. as many
    labels as there are labels with a point, though popular ones recur and rare ones may be skipped.
    """

    reclusterings = 0

    def __init__(self, Y: sp.csr_matrix, rows: np.ndarray, params: PretrainParams):
        self.rows = np.asarray(rows, dtype=np.int64)
        self.Yc = Y.tocsr()[self.rows].tocsc()
        self.Yc.sort_indices()
        self.freq = np.diff(self.Yc.indptr)
        self.probs = label_sampling_probs(self.freq, params.label_power)
        self.n_labels = int(np.count_nonzero(self.freq))
        self.extra = params.centroid_points if params.centroid_weight > 0 else 0
        self.batch_size = params.batch_size

    @classmethod
    def from_params(cls, Y: sp.csr_matrix, rows: np.ndarray, params: PretrainParams, dim: int) -> SiameseXMLSampler:
        return cls(Y, rows, params)

    def steps_per_epoch(self) -> int:
        """0 below two labels with a training point (a label batch needs another label's points as negatives)."""
        return math.ceil(self.n_labels / max(self.batch_size, 1)) if self.n_labels >= 2 else 0

    def batch(self, batch_size: int, rng: np.random.Generator) -> LabelBatch:
        labels = sample_label_batch(self.probs, batch_size, rng)
        anchors, others = sample_label_points(self.Yc, labels, self.extra, rng)
        return LabelBatch(labels, self.rows[anchors], self.rows[others])

    def epoch(self, epoch: int, rng: np.random.Generator) -> list[LabelBatch]:
        n = math.ceil(self.n_labels / max(self.batch_size, 1))
        return [self.batch(self.batch_size, rng) for _ in range(n)]



BATCH_SAMPLERS: dict[str, type[BatchSampler]] = {
    "random": RandomBatches,
    "ngame": NGAMESampler,
    "siamesexml": SiameseXMLSampler,
}


class ClusterBatches(RandomBatches):
    """Unions of random clusters of fixed point embeddings (NGAME M2 on a frozen encoder: clustered once, so
    in-batch negatives are hard negatives)."""

    def __init__(self, emb: np.ndarray, rows: np.ndarray, batch_size: int, cluster_size: int, seed: int):
        super().__init__(rows, batch_size, min_size=1)
        self.labels = np.full(len(emb), -1, dtype=np.int64)
        self.labels[self.rows] = balanced_clusters(emb[self.rows], cluster_size, seed=seed)
        self.n_clusters = int(self.labels.max() + 1)

    def epoch(self, epoch: int, rng: np.random.Generator) -> list[np.ndarray]:
        return cluster_batches(self.labels, self.rows, self.batch_size, rng)


def classifier_batches(emb: np.ndarray, rows: np.ndarray, params: HardNegativeTrainerParams) -> RandomBatches:
    """The classifier stage's batches: unions of clusters of ``classifier.cluster_size`` points when > 1, else
    random (every batch kept)."""
    if params.cluster_size > 1:
        return ClusterBatches(emb, rows, params.batch_size, params.cluster_size, params.seed)
    return RandomBatches(rows, params.batch_size, min_size=1)
