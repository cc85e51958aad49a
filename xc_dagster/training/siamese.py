"""Siamese pretraining (NGAME M1, SiameseXML Module I): the shared encoder trained so E(x).E(z) is high for
positive pairs.

Batches come from the ``pretrain.sampler`` of ``xc_dagster.sampling.batches.BATCH_SAMPLERS``. A batch over points
(random, ngame) takes one sampled positive label per point; the other points' labels are in-batch negatives
(true positives masked). A batch over labels (siamesexml, Module I) has one positive point per label; each
label's in-batch negatives are the other labels' points, and a second label representation, the centroid of
``centroid_points`` more sampled positives (encoded in the same forward pass), gets the same loss, weighted
``centroid_weight``. The loss on the similarity matrix is the ``pretrain.loss`` of
``xc_dagster.training.losses.PAIR_LOSSES``. Texts are run through the encoder in length-sorted chunks with
per-chunk padding, under bf16/fp16 autocast where it pays, gradient-cached when the batch's activations would
not fit (``pretrain.grad_cache``, ``xc_dagster.training.grad_cache``). With ``pretrain.label_points`` every
label's text is also a training point whose one positive is that label (``xc_dagster.training.label_points``;
point samplers).

With a ``DistEnv`` of several ranks (torchrun) the step is data parallel (xc_dagster.training.data_parallel):
every rank draws the same global batches from the same seeded generator and sampler state (checked each epoch),
embeds its ``rank_rows`` share of the batch's texts (point batches: its points and their sampled labels; label
batches: its labels and its share of the batch's distinct anchor and centroid points), all-gathers them with
autograd, computes the loss of the global batch (in-batch negatives across ranks) and applies the gradients
averaged over the ranks: the one-process update of the global batch. Rank 0 writes the checkpoints (world-size
independent: the whole state), every rank reads them.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import scipy.sparse as sp
import torch

from xc_dagster.config import PretrainParams
from xc_dagster.device import adamw
from xc_dagster.encoders.encode import encode_tokens
from xc_dagster.encoders.transformer import SiameseEncoder
from xc_dagster.errors import XCConfigError
from xc_dagster.progress import Progress, Report
from xc_dagster.sampling.batches import BATCH_SAMPLERS, LabelBatch
from xc_dagster.sampling.labels import positive_mask, sample_positives
from xc_dagster.training.checkpoint import Checkpointer, Resumed, restore_rng
from xc_dagster.training.data_parallel import (
    average_gradients,
    broadcast_module,
    check_group,
    check_same,
    digest,
    embed_global,
    past,
)
from xc_dagster.training.distributed import DistEnv, gather_rows, rank_rows
from xc_dagster.training.grad_cache import StepEmbedder
from xc_dagster.training.label_points import check_label_point_share, siamese_label_points
from xc_dagster.training.losses import PAIR_LOSSES, label_batch_pair_loss, point_batch_loss
from xc_dagster.training.memory import (
    GRAD_CACHE_MODES,
    EncoderShape,
    MemoryPlan,
    available_memory,
    plan_step_memory,
    step_loss_bytes,
    text_lengths,
)
from xc_dagster.training.replan import Replannable, Replanner
from xc_dagster.training.schedules import linear_with_warmup
from xc_dagster.training.window import MetricsWindow

MetricsFn = Callable[[int, dict[str, float]], None]
Tokens = tuple[np.ndarray, np.ndarray]  # token ids (N, T), lengths (N,)
ENCODE_ROWS = 65_536  # rows the memory bank encodes at once: their token ids are the only copy read into memory


def check_pretrain_params(params: PretrainParams) -> None:
    """Raise XCConfigError naming the first ``pretrain.*`` field with an invalid value."""
    checks = [
        (params.sampler in BATCH_SAMPLERS, "sampler", f"one of {sorted(BATCH_SAMPLERS)}"),
        (params.loss in PAIR_LOSSES, "loss", f"one of {sorted(PAIR_LOSSES)}"),
        (params.batch_size >= 2, "batch_size", "an int >= 2"),
        (params.num_negatives >= 1, "num_negatives", "an int >= 1"),
        (0.0 < params.contrastive_c < 1.0, "contrastive_c", "a value in (0, 1)"),
        (params.contrastive_d > 0.0, "contrastive_d", "a value > 0"),
        (params.label_power >= 0.0, "label_power", "a value >= 0"),
        (params.centroid_points >= 0, "centroid_points", "an int >= 0"),
        (0.0 <= params.centroid_weight <= 1.0, "centroid_weight", "a value in [0, 1]"),
        (isinstance(params.freeze_layers, int) and params.freeze_layers >= 0, "freeze_layers", "an int >= 0"),
        (not (params.label_points and params.sampler == "siamesexml"), "label_points",
         "false with sampler siamesexml (its label batches draw their points from the training points)"),
        (params.grad_cache in GRAD_CACHE_MODES, "grad_cache", f"one of {GRAD_CACHE_MODES}"),
        (params.chunk_size >= 1, "chunk_size", "an int >= 1"),
    ]
    for ok, name, expected in checks:
        if not ok:
            raise XCConfigError(f"pretrain.{name}: expected {expected}, got {getattr(params, name)!r}")
    check_label_point_share(params.label_points, params.label_point_cooccurrence, "pretrain")


def pretrain_memory_plan(encoder: torch.nn.Module, point_tokens: Tokens, label_tokens: Tokens, n_points: int,
                         n_labels: int, params: PretrainParams, device: torch.device,
                         dtype: torch.dtype | None, world: int = 1) -> MemoryPlan:
    """Grad caching and the chunk size of this pretraining's steps, from their predicted memory
    (``xc_dagster.training.memory``): a step encodes B points and their B labels (siamesexml: B labels, their
    B anchors and B x centroid_points centroid points), a rank of ``world`` its share of them; the loss is the
    global batch's on every rank."""
    label_batches = params.sampler == "siamesexml"
    B = min(params.batch_size, n_labels if label_batches else n_points)
    n_point_texts = B * (1 + params.centroid_points) if label_batches else B
    groups = [(math.ceil(n_point_texts / world), *text_lengths(point_tokens)),
              (math.ceil(B / world), *text_lengths(label_tokens))]
    fields = {"pretrain.chunk_size": params.chunk_size, "pretrain.batch_size": params.batch_size,
              "tokenize.max_len": point_tokens[0].shape[1]}
    if label_tokens[0].shape[1] != point_tokens[0].shape[1]:
        fields["tokenize.label_max_len"] = label_tokens[0].shape[1]
    loss = step_loss_bytes(n_point_texts + B, B * B * (2 if label_batches else 1), encoder.dim)
    return plan_step_memory(EncoderShape.of(encoder), groups, dtype, params.grad_cache, params.chunk_size,
                            available_memory(device), fields, loss, "pretrain.grad_cache")


class SiameseTrainer(Replannable):
    """The pretraining state -- encoder, AdamW, LR schedule, batch sampler, numpy generator -- and its step.

    ``step(batch)`` is ``update(batch_loss(batch))``: the batch's forward pass and loss, then backward, gradient
    clipping at 1.0 and the optimizer and schedule steps. ``start`` (once, before the first step) resumes from a
    checkpoint or prepares the sampler; ``state`` is what a checkpoint keeps. ``env``: this rank of a data-parallel
    world (default: one process).
    """

    def __init__(self, encoder: torch.nn.Module, point_tokens: Tokens, label_tokens: Tokens, Y: sp.csr_matrix,
                 train_rows: np.ndarray, params: PretrainParams, device: torch.device, dtype: torch.dtype | None,
                 env: DistEnv | None = None):
        check_pretrain_params(params)
        self.env = DistEnv() if env is None else env
        check_group(self.env, "pretraining")
        self.encoder, self.params, self.device, self.dtype = encoder, params, device, dtype
        if params.label_points:  # Renee: label l's text is point N + l, positive for l (Gandalf: and co-occurring)
            point_tokens, Y, train_rows = siamese_label_points(point_tokens, label_tokens, Y, train_rows,
                                                               params.label_point_cooccurrence)
        self.point_tokens, self.label_tokens = point_tokens, label_tokens
        self.Y = Y.tocsr()
        rows = np.asarray(train_rows, dtype=np.int64)
        self.rows = rows[np.diff(self.Y.indptr)[rows] > 0]  # points without labels have no positive pair
        self.rng = np.random.default_rng(params.seed)
        self.sampler = BATCH_SAMPLERS[params.sampler].from_params(self.Y, self.rows, params, encoder.dim)
        self.pair_loss = PAIR_LOSSES[params.loss].from_params(params)
        spe = self.sampler.steps_per_epoch()
        trains = params.epochs > 0 and len(self.rows) >= 2 and spe > 0
        self.total_steps = max(1, math.ceil(params.epochs * spe)) if trains else 0  # 0: nothing to train
        self.n_epochs = math.ceil(params.epochs)
        if trains and params.freeze_layers:
            if not isinstance(encoder, SiameseEncoder):
                raise XCConfigError(f"pretrain.freeze_layers: {type(encoder).__name__} has no transformer layers "
                                    f"to freeze; set it to 0")
            encoder.freeze_bottom(params.freeze_layers)
        self.trainable = [p for p in encoder.parameters() if p.requires_grad]
        self.opt = adamw(self.trainable, params.lr, params.weight_decay)
        self.sched = torch.optim.lr_scheduler.LambdaLR(
            self.opt, linear_with_warmup(params.warmup_steps, max(self.total_steps, 1)))
        self.steps = self.points = 0
        self.replanned = False  # the total steps were re-planned (retotal): the run ends at them
        self._batch_points = 0  # point texts the last batch_loss encoded
        self.memory = MemoryPlan(False, params.chunk_size, 0.0, 0.0, None)  # grad caching, chunk size
        if trains:
            self.memory = pretrain_memory_plan(encoder, point_tokens, label_tokens, len(self.rows), self.Y.shape[1],
                                               params, device, dtype, self.env.world_size)
        self.embedder = StepEmbedder(encoder, device, dtype, self.memory.chunk_size, self.memory.grad_cache)

    def start(self, checkpoint: Checkpointer | None = None, log_metrics: MetricsFn | None = None) -> int:
        """Train mode; resume from a matching checkpoint (returns its next epoch), else prepare the sampler
        with the starting encoder (returns 0). Several ranks: each reads the checkpoint, they must agree on it, and
        every rank's encoder starts as rank 0's."""
        self.encoder.train()
        resumed = checkpoint.load() if checkpoint is not None else None
        where = checkpoint.folder if checkpoint is not None else None
        check_same(-1 if resumed is None else resumed.epoch, f"the checkpoint resumed from in {where} (its next "
                   "epoch; -1: none)", self.env)
        broadcast_module(self.encoder, self.env)
        if resumed is not None:
            self.load_state(resumed)
            return resumed.epoch
        metrics = self.sampler.prepare(self._encode_points)
        if metrics and log_metrics is not None:
            log_metrics(0, metrics)
        return 0

    def _encode_points(self, rows: np.ndarray) -> np.ndarray:
        """Embeddings of ``rows`` (no autograd); several ranks encode a share each and all-gather them, so every
        rank gets the same values."""
        ids, lens = self.point_tokens
        env = self.env
        mine = rank_rows(rows, env.rank, env.world_size)
        emb = np.zeros((len(mine), self.encoder.dim), dtype=np.float32)
        for start in range(0, len(mine), ENCODE_ROWS):  # blocks: a memory-mapped ids array is never read whole
            part = mine[start:start + ENCODE_ROWS]
            emb[start:start + len(part)] = encode_tokens(self.encoder, ids[part], lens[part], self.device,
                                                         self.dtype, self.params.encode_batch_size)
        self.encoder.train()
        if env.world_size > 1:
            emb = gather_rows(torch.from_numpy(np.ascontiguousarray(emb, dtype=np.float32)).to(env.device))[0]
            emb = emb.cpu().numpy()
        return emb

    def epoch_batches(self, epoch: int, cut: bool = True) -> list[Any]:
        """The sampler's batches of ``epoch``; with ``cut``, the fractional last epoch of ``pretrain.epochs`` cut
        short (``batches_in``)."""
        fill = getattr(self.sampler, "fill_bank", None)
        if fill is not None:  # a re-planned run reaching a clustering epoch its first plan did not hold
            fill(epoch, self._encode_points)
        batches = self.sampler.epoch(epoch, self.rng)
        if cut:
            batches = batches[:self.batches_in(epoch, len(batches))]
        if self.env.world_size > 1:  # the ranks' sampler states and generators must not have drifted apart
            arrays = [a for b in batches for a in ((b.labels, b.anchors, b.centroid) if isinstance(b, LabelBatch)
                                                   else (b,))]
            check_same(digest(arrays, self.rng.bit_generator.state), f"the batches of epoch {epoch}", self.env)
        return batches

    def _schedule(self) -> Any:
        return self.sched.lr_lambdas[0]

    def _epoch_steps(self) -> int:
        return self.sampler.steps_per_epoch()

    def _embed_global(self, tokens: Tokens, rows: np.ndarray) -> torch.Tensor:
        """Embeddings of ``rows`` of the global batch: this rank embeds its ``rank_rows``, gathered with autograd."""
        return embed_global(lambda r: self.embedder.embed(*tokens, r), rows, self.encoder.dim, self.env)

    def batch_loss(self, batch: np.ndarray | LabelBatch) -> torch.Tensor:
        """The loss of a batch of point rows or a ``LabelBatch`` (forward pass included)."""
        self.embedder.discard()  # a step's chunks only
        if isinstance(batch, LabelBatch):
            loss, self._batch_points = self._label_batch_loss(batch)
            return loss
        labels = sample_positives(self.Y, batch, 1, self.rng)[:, 0]
        mask = torch.from_numpy(positive_mask(self.Y, batch, np.broadcast_to(labels, (len(batch), len(labels)))))
        p = self._embed_global(self.point_tokens, batch)
        z = self._embed_global(self.label_tokens, labels)
        self.sampler.observe(batch, p)
        self._batch_points = len(batch)
        return point_batch_loss(p.float() @ z.float().T, mask.to(self.device), self.pair_loss, self.params.symmetric)

    def _label_batch_loss(self, batch: LabelBatch) -> tuple[torch.Tensor, int]:
        """SiameseXML Module I on one label batch: beta * loss(E(z_l) vs points) + (1 - beta) * loss(v_l vs points).

        Rows of the similarity matrices are the labels, columns the anchors (negatives are mined per label among
        the other labels' points, as in the paper); ``mask[l, j]`` marks anchor j as a true positive of label l.
        Anchors and centroid points go through the encoder in one pass; gradients flow through the centroid too
        (the paper trains both representations towards related points). Each representation mines its own kappa
        hardest negatives. Returns the loss and the number of point texts encoded.
        """
        B, m = len(batch.labels), batch.centroid.shape[1]
        mask = positive_mask(self.Y, batch.anchors, np.broadcast_to(batch.labels, (B, B))).T  # [label l, anchor j]
        mask_t = torch.from_numpy(np.ascontiguousarray(mask)).to(self.device)
        # a point can be drawn several times (anchor of two labels, centroid of a label with < m + 1 positives):
        # encode each once and gather, gradients accumulate over its uses
        pts, where = np.unique(np.concatenate([batch.anchors, batch.centroid.ravel()]), return_inverse=True)
        p = self._embed_global(self.point_tokens, pts).float()
        z = self._embed_global(self.label_tokens, batch.labels).float()
        loss = label_batch_pair_loss(p, z, where, m, mask_t, self.pair_loss, self.params.centroid_weight)
        return loss, len(pts)

    def update(self, loss: torch.Tensor) -> float:
        """Backward of the last ``batch_loss``, clip, AdamW and schedule steps; returns the loss value."""
        self.opt.zero_grad(set_to_none=True)
        self.embedder.backward(loss)  # grad caching: the chunks re-run here, one at a time
        average_gradients(self.trainable, self.env)  # several ranks: the global batch's gradient on each
        torch.nn.utils.clip_grad_norm_(self.trainable, 1.0)
        self.opt.step()
        self.sched.step()
        broadcast_module(self.encoder, self.env, parameters=False)  # buffers a forward updates (spectral norm)
        self.steps += 1
        self.points += self._batch_points
        return float(loss.detach())

    def step(self, batch: np.ndarray | LabelBatch) -> float:
        return self.update(self.batch_loss(batch))

    def state(self) -> dict[str, Any]:
        return {"encoder": self.encoder.state_dict(), "opt": self.opt.state_dict(), "sched": self.sched.state_dict(),
                "step": self.steps, "points": self.points, "sampler": self.sampler.state(),
                "total_steps": self.total_steps}

    def load_state(self, resumed: Resumed) -> None:
        st = resumed.state
        self._resume_total(st)
        self.encoder.load_state_dict(st["encoder"])
        self.opt.load_state_dict(st["opt"])
        self.sched.load_state_dict(st["sched"])
        self.sampler.load_state(st["sampler"])
        restore_rng(self.rng, resumed)
        self.steps, self.points = int(st["step"]), int(st["points"])


@dataclass
class PretrainResult:
    steps: int
    points: int  # point texts encoded for training (siamesexml: anchors + centroid points)
    seconds: float
    final_loss: float
    reclusterings: int = 0
    resumed_from_epoch: int = 0
    stopped_at_deadline: bool = False  # the training budget's deadline ended it before its planned steps
    memory: dict[str, Any] = field(default_factory=dict)  # grad caching, chunk size, predicted / available GiB
    planned_steps: int = 0  # the run's total steps at its end (a re-plan moves them)


def train_siamese(encoder: torch.nn.Module, point_tokens: Tokens, label_tokens: Tokens, Y: sp.csr_matrix,
                  train_rows: np.ndarray, params: PretrainParams, device: torch.device, dtype: torch.dtype | None,
                  log_metrics: MetricsFn | None = None, log_every: int = 10,
                  checkpoint: Checkpointer | None = None, deadline: float | None = None,
                  report: Report | None = None, env: DistEnv | None = None,
                  replanner: Replanner | None = None) -> PretrainResult:
    """Train ``encoder`` in place for ``params.epochs`` (fractional allowed) over ``train_rows`` with labels.

    An epoch is the sampler's batches (one pass over the points; siamesexml: ``ceil(#labels with a training
    point / batch_size)`` label batches). With ``checkpoint``, the whole training state (encoder, optimizer,
    schedule, generators, the sampler's memory bank and clusters) is saved after every epoch and a matching
    checkpoint is resumed from, ending with the same weights as an uninterrupted run. ``deadline``
    (``time.perf_counter()``): no step starts after it (the training budget's guard, xc_dagster.training.budget).
    ``report``: where the progress lines go (steps of the planned total; ``xc_dagster.progress``). ``env``: this
    rank of a data-parallel world (every rank calls this with the same arguments): rank 0 alone logs, reports and
    writes the checkpoint, and the ranks stop at the deadline together. ``replanner``: a budgeted run's total
    steps corrected as it trains (xc_dagster.training.replan; one process).
    """
    trainer = SiameseTrainer(encoder, point_tokens, label_tokens, Y, train_rows, params, device, dtype, env)
    env = trainer.env
    if not env.is_main:
        log_metrics = report = None
    if trainer.total_steps == 0:
        return PretrainResult(0, 0, 0.0, float("nan"))
    t0, loss_val, window = time.perf_counter(), float("nan"), MetricsWindow()

    def log_window() -> None:
        loss, rate = window.flush()
        log_metrics(trainer.steps, {"pretrain_loss": loss, "pretrain_points_per_s": rate,
                                    "pretrain_lr": float(trainer.sched.get_last_lr()[0])})

    start = trainer.start(checkpoint, log_metrics)
    prog = Progress("pretrain", trainer.total_steps, "steps", report, log_metrics, initial=trainer.steps,
                    bar=None if env.is_main else False)
    stopped, epoch = False, start
    if replanner is not None:
        replanner.start(trainer.steps)
    while epoch < trainer.n_epochs and not stopped and not trainer.replanned_end():  # a re-plan moves them
        batches, i = trainer.epoch_batches(epoch, cut=False), 0
        while i < trainer.batches_in(epoch, len(batches)):
            if trainer.replanned_end():
                break
            if past(replanner.moved(deadline) if replanner is not None else deadline, env):
                stopped = True
                break
            before = trainer.points
            loss_val = trainer.step(batches[i])
            i += 1
            prog.update(1)
            window.add(loss_val, trainer.points - before)
            if log_metrics is not None and trainer.steps % log_every == 0:
                log_window()
            trainer.follow(replanner, prog, report, "pretrain")
        epoch += 1
        if checkpoint is not None and epoch < trainer.n_epochs and not stopped and env.is_main:  # the last
            checkpoint.save(epoch, trainer.state(), trainer.rng)  # epoch's state is the stage's result
    if log_metrics is not None and window.losses:
        log_window()
    prog.close()
    encoder.eval()
    return PretrainResult(trainer.steps, trainer.points, time.perf_counter() - t0, loss_val,
                          trainer.sampler.reclusterings, start, stopped, trainer.memory.summary(), trainer.total_steps)
