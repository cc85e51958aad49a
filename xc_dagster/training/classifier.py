"""One-vs-all classifiers W (NGAME M2/M4, SiameseXML Module IV) on a frozen encoder.

w_l starts from the label representation the caller passes (Module III transfer: E(z_l), or
normalise(E(z_l) + v_l) with ``classifier.init``) and is trained on each point's positives plus the hardest
negatives under the current W, re-ranked every step, from the ``classifier.negatives`` pool of
``xc_dagster.sampling.hard_negatives.HARD_NEGATIVE_POOLS`` (the mined shortlist, NGAME M2's in-batch negatives
over cluster batches, or both), with the ``classifier.loss`` of ``xc_dagster.training.losses.CLASSIFIER_LOSSES``.
W is a ``ShardedClassifier`` (one shard) updated with SparseAdam (or SGD, ``classifier.w_optimizer``): a step
touches only the rows it scored, so memory and time per step do not grow with L.

SiameseXML Module IV also fine-tunes the bag encoder's residual block with W (``classifier.train_residual``):
the points' intermediate embeddings f_E(x) stay frozen and x = N(R(f_E(x))) is recomputed every step.

With ``classifier.label_points`` every label is also a training point (its embedding; Renee), whose one positive
is that label and whose shortlist is its nearest other labels by embedding (``xc_dagster.training.label_points``).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import scipy.sparse as sp
import torch
import torch.nn.functional as F

from xc_dagster.config import HardNegativeTrainerParams
from xc_dagster.encoders.bag import BagOfEmbeddingsEncoder
from xc_dagster.errors import XCConfigError
from xc_dagster.progress import Progress, Report
from xc_dagster.sampling.batches import classifier_batches
from xc_dagster.sampling.hard_negatives import HARD_NEGATIVE_POOLS, hardest
from xc_dagster.sampling.labels import sample_positives
from xc_dagster.sampling.negatives import SAMPLED_NEGATIVES
from xc_dagster.training.checkpoint import Checkpointer, Resumable, Resumed, restore_rng
from xc_dagster.training.data_parallel import average_gradients, past
from xc_dagster.training.distributed import DistEnv
from xc_dagster.training.label_points import check_label_point_share, classifier_label_points
from xc_dagster.training.label_sharded import RankShardedClassifier, RankShardedOptimizer
from xc_dagster.training.losses import CLASSIFIER_LOSSES
from xc_dagster.training.sharded import ShardedClassifier, ShardedOptimizer

MetricsFn = Callable[[int, dict[str, float]], None]
SAMPLED = "|".join(SAMPLED_NEGATIVES)


def check_hard_negative_params(params: HardNegativeTrainerParams) -> None:
    """Raise XCConfigError naming the first ``classifier.*`` field this trainer cannot take."""
    if params.loss not in CLASSIFIER_LOSSES:
        raise XCConfigError(f"classifier.loss: expected one of {sorted(CLASSIFIER_LOSSES)}, got {params.loss!r}")
    if params.negatives not in HARD_NEGATIVE_POOLS:
        raise XCConfigError(f"classifier.negatives: expected one of {sorted(HARD_NEGATIVE_POOLS)}, "
                            f"got {params.negatives!r}")
    if params.epochs != int(params.epochs) or params.epochs < 0:
        raise XCConfigError(f"classifier.epochs: the hardest-negative trainer takes whole epochs >= 0, got "
                            f"{params.epochs} (fractions work with classifier.negatives={SAMPLED})")
    check_label_point_share(params.label_points, params.label_point_cooccurrence)


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


def _w_optimizer(clf: ShardedClassifier, params: HardNegativeTrainerParams,
                 kind: type[ShardedOptimizer] = ShardedOptimizer) -> ShardedOptimizer:
    """``classifier.w_optimizer`` over the rows of W a step scored: SparseAdam (NGAME code, the default) or plain
    SGD, whose step is proportional to the gradient (docs/decisions.md#classifier-w-optimizer-sparse-adam)."""
    if params.w_optimizer == "sgd" and params.weight_decay:  # ShardedOptimizer checks the name itself
        raise XCConfigError("classifier.weight_decay: the hardest-negative trainer takes no weight decay "
                            f"(got {params.weight_decay}); it applies to negatives={SAMPLED}")
    return kind(clf, params.w_optimizer, params.lr)


@dataclass
class Candidates:
    """A batch's points (``x``, their embeddings) and the label ids each is scored against: the sampled
    positives first, then the hardest negatives (-1 padded)."""

    x: torch.Tensor
    ids: torch.Tensor
    is_pos: torch.Tensor
    valid: torch.Tensor


class ClassifierTrainer(Resumable):
    """The hardest-negative trainer's state -- W and its optimizer, the residual block and its Adam (Module IV),
    batches, negative pool, loss, numpy generator -- and its step.

    ``step(batch)`` is ``update(batch_loss(batch))``; ``batch_loss`` is ``candidate_loss(candidates(batch))``.
    """

    def __init__(self, point_emb: np.ndarray, label_emb: np.ndarray, Y: sp.csr_matrix, shortlist: np.ndarray,
                 train_rows: np.ndarray, params: HardNegativeTrainerParams, device: torch.device,
                 encoder: BagOfEmbeddingsEncoder | None = None, label_weight: np.ndarray | None = None,
                 label_point_emb: np.ndarray | None = None, env: DistEnv | None = None):
        check_hard_negative_params(params)
        self.env = DistEnv() if env is None else env
        self.params, self.device, self.encoder = params, device, encoder
        self.epochs = int(params.epochs)
        self.n_label_points = Y.shape[1] if params.label_points else 0
        if params.label_points:  # Renee: label l is point N + l, its candidates its nearest labels
            uses_shortlist = getattr(HARD_NEGATIVE_POOLS[params.negatives], "uses_shortlist", True)
            point_emb, Y, train_rows, shortlist = classifier_label_points(
                point_emb, label_point_emb, Y, train_rows, shortlist, device, encoder, uses_shortlist,
                params.label_point_cooccurrence)
        self.Y = Y.tocsr()
        rows = np.asarray(train_rows, dtype=np.int64)
        self.rows = rows[np.diff(self.Y.indptr)[rows] > 0]
        self.rng = np.random.default_rng(params.seed)
        torch.manual_seed(params.seed)
        W0 = np.asarray(label_emb, dtype=np.float32)
        if self.env.world_size > 1:  # this rank's label range of W (xc_dagster/training/label_sharded.py)
            self.clf = RankShardedClassifier(W0, device, self.env)
            self.opt = _w_optimizer(self.clf, params, RankShardedOptimizer)
        else:
            self.clf = ShardedClassifier(W0, [device])
            self.opt = _w_optimizer(self.clf, params)
        self.W = self.clf.weights[0]
        self.residual_opt = None
        if encoder is not None:
            encoder.to(device).train()  # dropout of the residual block, as in the pretraining
            self.residual_opt = torch.optim.Adam(encoder.residual.parameters(), lr=params.residual_lr)
        self.X = torch.from_numpy(np.ascontiguousarray(point_emb, dtype=np.float32))
        self.label_weight = (None if label_weight is None
                             else torch.from_numpy(np.asarray(label_weight, dtype=np.float32)).to(device))
        self.steps_per_epoch = math.ceil(len(self.rows) / params.batch_size)
        # the encoder is frozen, so the point embeddings and hence their clusters are fixed: cluster once
        self.batches = classifier_batches(point_emb, self.rows, params)
        self.pool = HARD_NEGATIVE_POOLS[params.negatives](self.Y, shortlist)
        self.loss = CLASSIFIER_LOSSES[params.loss].from_params(params)
        self.steps, self.last = 0, float("nan")

    def epoch_batches(self, epoch: int) -> list[np.ndarray]:
        return self.batches.epoch(epoch, self.rng)

    def candidates(self, batch: np.ndarray) -> Candidates:
        """Sampled positives and the hardest negatives under the current W of the points ``batch``."""
        pos = sample_positives(self.Y, batch, self.params.num_positives, self.rng)
        x = self.X[batch].to(self.device)
        if self.encoder is not None:
            x = self.encoder.from_intermediate(x)
        neg = hardest(self.pool, x, self.clf.rows(), batch, pos, self.params.num_negatives, self.clf.sum_scores)
        ids = torch.cat([torch.from_numpy(pos).to(self.device), neg], dim=1)
        valid = ids >= 0
        is_pos = torch.zeros_like(valid)
        is_pos[:, :pos.shape[1]] = True
        return Candidates(x, ids, is_pos, valid)

    def candidate_loss(self, c: Candidates) -> torch.Tensor:
        """The loss of the candidates' scores (gradients reach only the rows of W scored)."""
        scores = self.clf.scores(c.x, c.ids, normalize=self.params.normalize)
        lw = None if self.label_weight is None else self.label_weight[c.ids.clamp_min(0)]
        return self.loss(scores, c.is_pos, c.valid, lw)

    def batch_loss(self, batch: np.ndarray) -> torch.Tensor:
        return self.candidate_loss(self.candidates(batch))

    def update(self, loss: torch.Tensor) -> float:
        """Backward of the last ``batch_loss``, then the W (and residual) optimizer steps; returns the loss."""
        if self.residual_opt is not None:
            self.residual_opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()
        if self.residual_opt is not None:
            # several ranks: each one's scores cover its own labels, so R's gradient is the sum over the ranks
            average_gradients(list(self.encoder.residual.parameters()), self.env, mean=False)
            self.residual_opt.step()
        self.steps += 1
        return float(loss.detach())

    def step(self, batch: np.ndarray) -> float:
        return self.update(self.batch_loss(batch))

    def state(self) -> dict[str, Any]:
        W = self.clf.full_weights()  # several ranks: gathered on rank 0, which alone writes the checkpoint
        state = {"W": None if W is None else W.cpu(), "opt": self.opt.state_dict(), "steps": self.steps,
                 "last": self.last}
        if self.encoder is not None:
            state.update(residual={k: v.detach().cpu() for k, v in self.encoder.residual.state_dict().items()},
                         residual_opt=self.residual_opt.state_dict())
        return state

    def load_state(self, resumed: Resumed) -> None:
        st = resumed.state
        self.clf.load_full(st["W"])
        self.opt.load_state_dict(st["opt"])
        if self.encoder is not None:
            self.encoder.residual.load_state_dict(st["residual"])
            self.residual_opt.load_state_dict(st["residual_opt"])
        restore_rng(self.rng, resumed)
        self.steps, self.last = int(st["steps"]), float(st["last"])

    def weights(self) -> np.ndarray | None:
        """W (L x D float32), rows at unit norm with ``classifier.normalize``; W's label ranges on several ranks:
        on rank 0, None on the others (every rank must call it)."""
        Wn = self.clf.full_weights()
        if Wn is None:
            return None
        out = F.normalize(Wn, dim=-1) if self.params.normalize else Wn
        host = out.cpu()  # one L x D copy at the end, not two (2 GB each at 1.3M labels): a copy of W, not W
        return host.numpy().copy() if host.data_ptr() == self.W.data_ptr() else host.numpy()


def train_classifiers(point_emb: np.ndarray, label_emb: np.ndarray, Y: sp.csr_matrix, shortlist: np.ndarray,
                      train_rows: np.ndarray, params: HardNegativeTrainerParams, device: torch.device,
                      log_metrics: MetricsFn | None = None,
                      checkpoint: Checkpointer | None = None,
                      encoder: BagOfEmbeddingsEncoder | None = None,
                      label_weight: np.ndarray | None = None,
                      deadline: float | None = None,
                      label_point_emb: np.ndarray | None = None,
                      report: Report | None = None, env: DistEnv | None = None) -> tuple[np.ndarray, dict[str, float]]:
    """Return W (L x D float32) and a summary; ``shortlist[i]`` are point i's mined candidate labels (-1 pad).

    ``label_weight`` (L,): a weight on each label's positive terms in the loss (``propensity_label_weights``).
    ``label_point_emb`` (L, D): the labels' embeddings in ``point_emb``'s space, the extra points of
    ``classifier.label_points`` (read only then): label l is a point whose one positive is l and whose
    candidates are its nearest other labels by embedding (``xc_dagster.training.label_points``).

    With ``encoder`` (SiameseXML Module IV), ``point_emb`` are its intermediate embeddings f_E(x) and its
    residual block is trained with W (Adam, ``classifier.residual_lr``; the token table stays frozen): a point
    scores as ``encoder.from_intermediate(f_E(x))``. The encoder is updated in place and left in eval mode.

    With ``checkpoint``, the state is saved after every epoch and a matching checkpoint is resumed from: the
    result equals an uninterrupted run's (same seed). ``deadline`` (``time.perf_counter()``): no step starts
    after it (the training budget's guard; ``epochs_trained`` then counts the part epoch). ``report``: where the
    progress lines go (steps of the planned total, with the rate and ETA; ``xc_dagster.progress``). ``env``: this
    rank of several, each holding a label range of W (``xc_dagster.training.label_sharded``; every rank calls this
    with the same arguments): rank 0 alone logs, reports, writes the checkpoint and returns W (None elsewhere).
    """
    trainer = ClassifierTrainer(point_emb, label_emb, Y, shortlist, train_rows, params, device, encoder,
                                label_weight, label_point_emb, env)
    if not trainer.env.is_main:
        log_metrics = report = None
    t0 = time.perf_counter()
    start = trainer.start(checkpoint)
    per_epoch = trainer.steps_per_epoch
    prog = Progress("classifier", trainer.epochs * per_epoch, "steps", report, log_metrics, initial=start * per_epoch)
    done = float(trainer.epochs)
    for epoch in range(start, trainer.epochs):
        losses = []
        for i, batch in enumerate(trainer.epoch_batches(epoch)):
            if past(deadline, trainer.env):  # no step starts after it
                done = epoch + i / max(per_epoch, 1)
                break
            losses.append(trainer.step(batch))
            prog.update(1)
        trainer.last = float(np.mean(losses)) if losses else trainer.last
        if done < trainer.epochs:
            break  # a part epoch is not checkpointed: a resume redoes the epoch
        if checkpoint is not None:
            state = trainer.state()  # every rank: W's label ranges are gathered
            if trainer.env.is_main:
                checkpoint.save(epoch + 1, state, trainer.rng)
        if log_metrics is not None:
            log_metrics(epoch + 1, {"classifier_loss": trainer.last})
    prog.close()
    if encoder is not None:
        encoder.eval()
    return trainer.weights(), {"steps": trainer.steps, "seconds": time.perf_counter() - t0,
                               "final_loss": trainer.last, "steps_per_epoch": trainer.steps_per_epoch,
                               "negatives": params.negatives, "resumed_from_epoch": start,
                               "epochs_trained": round(done, 4), "stopped_at_deadline": done < trainer.epochs,
                               "clusters": trainer.batches.n_clusters, "label_points": trainer.n_label_points}
