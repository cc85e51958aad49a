"""Classifier training with BCE over positives + sampled negatives (ASTRA, MIPS-s), encoder optionally end to end.

Training examples are the training points (validation rows held out) and, with ``label_points``, every label's
text as a point whose one positive is that label (ASTRA, following Renee). Per step: embed the batch (the
encoder in train mode when ``train_encoder``, else the frozen embeddings), take up to ``num_positives`` (k_p)
positives, draw negatives from the ``classifier.negatives`` sampler of
``xc_dagster.sampling.negatives.SAMPLED_NEGATIVES``, and minimise
``sum_pos log(1 + e^-s) + sum_neg weight * log(1 + e^s)`` (mean over the batch), s = scale * w.x + b with b one
learned bias shared by all labels (``logit_bias``). W lives in a ``ShardedClassifier`` (one shard per GPU) and
only the scored rows are touched: SGD (ASTRA) or SparseAdam for W, AdamW for the encoder, one
cosine-with-warm-up schedule for both, dropout on the query embedding before the classifiers; the encoder's
chunks gradient-cached when the batch's activations would not fit (``classifier.grad_cache``,
``xc_dagster.training.grad_cache``). With ``checkpoint`` the whole state is saved after every epoch and
resumed from. Under a budget the run's end may move as it trains (``replanner``, xc_dagster.training.replan): the
schedule decays to the new end from where it is, ASTRA builds its tables up to it, and the sampler's intervals
that the budget's plan scaled (``follow_intervals``) move with it.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import scipy.sparse as sp
import torch
import torch.nn.functional as F

from xc_dagster.config import EndToEndTrainerParams
from xc_dagster.device import adamw
from xc_dagster.encoders.encode import encode_tokens
from xc_dagster.errors import XCConfigError
from xc_dagster.progress import Progress, Report
from xc_dagster.sampling.batches import RandomBatches
from xc_dagster.sampling.labels import sample_positives
from xc_dagster.sampling.negatives import SAMPLED_NEGATIVES, NegativeSample
from xc_dagster.training.checkpoint import Checkpointer, Resumable, Resumed, restore_rng, to_arrays, to_tensors
from xc_dagster.training.data_parallel import average_gradients, broadcast_module, embed_global, past
from xc_dagster.training.distributed import DistEnv
from xc_dagster.training.grad_cache import StepEmbedder, embed_examples
from xc_dagster.training.label_points import check_label_point_share, examples
from xc_dagster.training.label_sharded import RankShardedClassifier, RankShardedOptimizer
from xc_dagster.training.losses import masked_bce_loss
from xc_dagster.training.memory import GRAD_CACHE_MODES, end_to_end_memory_plan
from xc_dagster.training.replan import Replannable, Replanner
from xc_dagster.training.schedules import cosine_with_warmup
from xc_dagster.training.sharded import ShardedClassifier, ShardedOptimizer, shard_devices
from xc_dagster.training.window import MetricsWindow

MetricsFn = Callable[[int, dict[str, float]], None]
Tokens = tuple[np.ndarray, np.ndarray]  # token ids (N, T), lengths (N,)
ENCODER_NEGATIVES = ("all", "hard")


def check_end_to_end_params(params: EndToEndTrainerParams, has_encoder: bool) -> None:
    """Raise XCConfigError naming the first ``classifier.*`` field this trainer cannot take; ``has_encoder``:
    the encoder and the tokens were given."""
    if params.negatives not in SAMPLED_NEGATIVES:
        raise XCConfigError(f"classifier.negatives: the BCE trainer takes one of {sorted(SAMPLED_NEGATIVES)}, "
                            f"got {params.negatives!r}")
    if params.train_encoder and not has_encoder:
        raise XCConfigError("classifier.train_encoder needs the encoder and the tokens")
    if params.encoder_negatives not in ENCODER_NEGATIVES:
        raise XCConfigError(f"classifier.encoder_negatives: expected one of {ENCODER_NEGATIVES}, "
                            f"got {params.encoder_negatives!r}")
    if not 0.0 <= params.dropout < 1.0:
        raise XCConfigError(f"classifier.dropout: expected in [0, 1), got {params.dropout}")
    if params.refresh_every < 0:
        raise XCConfigError(f"classifier.refresh_every: expected >= 0 epochs, got {params.refresh_every}")
    if params.grad_cache not in GRAD_CACHE_MODES:
        raise XCConfigError(f"classifier.grad_cache: expected one of {GRAD_CACHE_MODES}, got {params.grad_cache!r}")
    if params.chunk_size < 1:
        raise XCConfigError(f"classifier.chunk_size: expected an int >= 1, got {params.chunk_size!r}")
    check_label_point_share(params.label_points, params.label_point_cooccurrence)


def sampled_bce(clf: ShardedClassifier, x: torch.Tensor, pos: np.ndarray, neg: NegativeSample,
                params: EndToEndTrainerParams, bias: torch.Tensor | float = 0.0,
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


@dataclass
class EndToEndResult:
    W: np.ndarray | None  # None on ranks other than 0 when W's label ranges are on several
    point_emb: np.ndarray | None  # re-encoded with the trained encoder (train_encoder), else None
    label_emb: np.ndarray | None
    summary: dict[str, Any] = field(default_factory=dict)


class EndToEndTrainer(Replannable, Resumable):
    """The BCE trainer's state -- W and its optimizer, the shared logit bias, the encoder and its AdamW
    (``train_encoder``), the negative sampler, the embedding bank of the examples, numpy generator -- and its step.

    ``step(batch)`` is ``update(batch_loss(batch))``: ``batch_loss`` lets the sampler refresh, embeds the batch,
    samples positives and negatives and returns the BCE; ``update`` runs backward and the optimizer steps, and
    hands the batch's embeddings to the sampler. Call ``close`` when done (the sampler's background builds).
    """

    def __init__(self, point_emb: np.ndarray, label_emb: np.ndarray, W0: np.ndarray, Y: sp.csr_matrix,
                 train_rows: np.ndarray, params: EndToEndTrainerParams, device: torch.device, *,
                 encoder: torch.nn.Module | None = None, point_tokens: Tokens | None = None,
                 label_tokens: Tokens | None = None, dtype: torch.dtype | None = None,
                 shortlist: np.ndarray | None = None, label_weight: np.ndarray | None = None,
                 env: DistEnv | None = None, follow_intervals: tuple[str, ...] = ()):
        check_end_to_end_params(params, encoder is not None and point_tokens is not None and label_tokens is not None)
        self.env = DistEnv() if env is None else env
        if self.env.world_size > 1:  # the table's merge over the ranks is a collective: on the training thread
            params = dataclasses.replace(params, refresh_async=False)
        self.params, self.device, self.dtype, self.label_weight = params, device, dtype, label_weight
        self.encoder, self.point_tokens, self.label_tokens = encoder, point_tokens, label_tokens
        self.src, self.Yex = examples(Y, train_rows, params.label_points, params.label_point_cooccurrence)
        n = len(self.src)
        is_label = self.src < 0
        self.n_label_points = int(is_label.sum())
        self.bank = np.empty((n, point_emb.shape[1]), dtype=np.float32)  # row i: example i's latest embedding
        self.bank[~is_label] = point_emb[self.src[~is_label]]
        self.bank[is_label] = label_emb[-1 - self.src[is_label]]
        initial = None
        if shortlist is not None:
            initial = np.full((n, shortlist.shape[1]), -1, dtype=np.int64)
            initial[~is_label] = shortlist[self.src[~is_label]]
        self.steps_per_epoch = max(1, math.ceil(n / params.batch_size))
        self.total_steps = self.planned_steps = max(1, math.ceil(params.epochs * self.steps_per_epoch))
        self.n_epochs = math.ceil(params.epochs)
        self.replanned = False  # the total steps were re-planned (retotal): the run ends at them
        self.batches = RandomBatches(np.arange(n), params.batch_size, min_size=1)
        self.sampler = SAMPLED_NEGATIVES[params.negatives].from_params(params, self.Yex, self.bank,
                                                                       self.steps_per_epoch, initial,
                                                                       self.total_steps)
        # the sampler's intervals ("hard_start", "refresh_every") that are shares of the planned run: a re-plan
        # moves them with the end, from the first plan's steps
        self.follow_intervals = follow_intervals
        self._intervals = (getattr(self.sampler, "start", None), getattr(self.sampler, "every", None))
        if self.env.world_size > 1 and hasattr(self.sampler, "index"):  # each rank indexes its own rows of W
            self.sampler.index = dataclasses.replace(self.sampler.index, env=self.env)
        self.rng = np.random.default_rng(params.seed)
        torch.manual_seed(params.seed)
        if self.env.world_size > 1:  # this rank's label range of W (xc_dagster/training/label_sharded.py)
            self.clf = RankShardedClassifier(np.asarray(W0, dtype=np.float32), device, self.env)
            self.w_opt = RankShardedOptimizer(self.clf, params.w_optimizer, params.lr, params.weight_decay)
        else:
            self.clf = ShardedClassifier(W0, shard_devices(params.shards, device))
            self.w_opt = ShardedOptimizer(self.clf, params.w_optimizer, params.lr, params.weight_decay)
        self.lr_factor = cosine_with_warmup(params.warmup_steps, self.total_steps)
        self.enc_opt = self.enc_sched = self.memory = self.embedder = None
        if params.train_encoder:
            self.enc_opt = adamw(encoder.parameters(), params.encoder_lr, 0.01)
            self.enc_sched = torch.optim.lr_scheduler.LambdaLR(self.enc_opt, self.lr_factor)
            encoder.train()
            broadcast_module(encoder, self.env)  # several ranks: one encoder, rank 0's (a checkpoint loads on each)
            self.memory = end_to_end_memory_plan(encoder, point_tokens, label_tokens, params, self.src, device,
                                                 dtype)
            self.embedder = StepEmbedder(encoder, device, dtype, self.memory.chunk_size, self.memory.grad_cache)
        prior = min(max(self.Yex.nnz / max(n, 1) / max(self.Yex.shape[1], 1), 1e-9), 0.5)
        self.bias = torch.tensor(math.log(prior / (1 - prior)) if params.logit_bias else 0.0, device=device,
                                 requires_grad=params.logit_bias)
        self.bias_opt = torch.optim.Adam([self.bias], lr=1e-2) if params.logit_bias else None
        self.steps, self.last = 0, float("nan")
        self.stopped_at_deadline = False  # train_end_to_end's deadline ended the training
        self._observed: tuple[np.ndarray, np.ndarray] | None = None  # the last batch's rows and embeddings

    def epoch_batches(self, epoch: int, cut: bool = True) -> list[np.ndarray]:
        """Random batches of examples; with ``cut``, the fractional last epoch of ``classifier.epochs`` cut short
        (``batches_in``)."""
        batches = self.batches.epoch(epoch, self.rng)
        return batches[:self.batches_in(epoch, len(batches))] if cut else batches

    def _schedule(self) -> Any:
        return self.lr_factor

    def _epoch_steps(self) -> int:
        return self.steps_per_epoch

    def overhead_period(self) -> int:
        """Steps between two of the sampler's table builds (ASTRA, MIPS-s; 0: none)."""
        return int(getattr(self.sampler, "every", 0))

    def retotal(self, total: int) -> None:
        """``Replannable.retotal``, and the sampler's intervals named in ``follow_intervals`` scaled to a longer
        total as the first plan scaled them to its own (as many tables over the run); a shorter run keeps the
        first plan's (fewer tables: a run slower than planned cannot afford more builds per step)."""
        super().retotal(total)
        (start, every), ratio = self._intervals, max(1.0, total / self.planned_steps)
        if self.follow_intervals and hasattr(self.sampler, "reinterval"):
            self.sampler.reinterval(
                self.steps, every=round(every * ratio) if every and "refresh_every" in self.follow_intervals else None,
                start=round(start * ratio) if start is not None and "hard_start" in self.follow_intervals else None)

    def _set_total(self, total: int) -> None:
        super()._set_total(total)
        if getattr(self.sampler, "total", None) is not None:  # ASTRA builds no table for a step past the end
            self.sampler.total = self.total_steps

    def batch_loss(self, batch: np.ndarray) -> torch.Tensor:
        """The BCE of the examples ``batch`` against their positives and sampled negatives."""
        self.sampler.before_step(self.steps, self.clf.snapshot)
        pos = sample_positives(self.Yex, batch, self.params.num_positives, self.rng)
        if self.embedder is not None:
            self.embedder.discard()  # a step's chunks only
            # several ranks: each embeds its share of the examples, all-gathered with autograd (data parallel)
            x = embed_global(lambda b: embed_examples(self.embedder, self.src[b], self.point_tokens,
                                                       self.label_tokens), batch, self.encoder.dim, self.env)
        else:
            x = torch.from_numpy(self.bank[batch]).to(self.device)
        x_np = x.detach().float().cpu().numpy()
        neg = self.sampler.sample(batch, x_np, self.steps, self.rng)
        self._observed = (batch, x_np)
        return sampled_bce(self.clf, x, pos, neg, self.params, self.bias, self.label_weight)

    def update(self, loss: torch.Tensor) -> float:
        """Backward of the last ``batch_loss``; encoder (clipped at 1.0), W and bias steps; returns the loss."""
        if self.enc_opt is not None:
            self.enc_opt.zero_grad(set_to_none=True)
        if self.bias_opt is not None:
            self.bias_opt.zero_grad(set_to_none=True)
        if self.embedder is not None:
            self.embedder.backward(loss)  # grad caching: the encoder's chunks re-run here, one at a time
        else:
            loss.backward()
        if self.enc_opt is not None:
            # several ranks: each rank's rows got their whole gradient (the summed scores of every label range
            # reach them through the gather's backward), so the encoder's gradients are summed, not averaged
            average_gradients(list(self.encoder.parameters()), self.env, mean=False)
            torch.nn.utils.clip_grad_norm_(self.encoder.parameters(), 1.0)
            self.enc_opt.step()
            self.enc_sched.step()
            broadcast_module(self.encoder, self.env, parameters=False)  # buffers a forward updates, as DDP does
            self.sampler.observe(*self._observed)
        self.w_opt.step(self.lr_factor(self.steps))
        if self.bias_opt is not None:
            self.bias_opt.step()
        self.steps += 1
        self.last = float(loss.detach())
        return self.last

    def step(self, batch: np.ndarray) -> float:
        return self.update(self.batch_loss(batch))

    def state(self) -> dict[str, Any]:
        train_enc = self.enc_opt is not None
        W = self.clf.full()  # several ranks: gathered on rank 0, which alone writes the checkpoint
        return {"W": None if W is None else torch.from_numpy(W), "w_opt": self.w_opt.state_dict(), "step": self.steps,
                "last": self.last, "bias": self.bias.detach().clone(),
                "bias_opt": self.bias_opt.state_dict() if self.bias_opt else {},
                "encoder": self.encoder.state_dict() if train_enc else {},
                "enc_opt": self.enc_opt.state_dict() if train_enc else {},
                "enc_sched": self.enc_sched.state_dict() if train_enc else {},
                "sampler": to_tensors(self.sampler.state()), "total_steps": self.total_steps,
                "lr_factor": dict(vars(self.lr_factor))}

    def load_state(self, resumed: Resumed) -> None:
        st = resumed.state
        self._resume_total(st)
        vars(self.lr_factor).update(st.get("lr_factor", {}))
        self.clf.load_full(st["W"])
        if self.bias_opt is not None:
            with torch.no_grad():
                self.bias.copy_(st["bias"])
            self.bias_opt.load_state_dict(st["bias_opt"])
        self.w_opt.load_state_dict(st["w_opt"])
        if self.enc_opt is not None:
            self.encoder.load_state_dict(st["encoder"])
            self.enc_opt.load_state_dict(st["enc_opt"])
            self.enc_sched.load_state_dict(st["enc_sched"])
        self.sampler.load_state(to_arrays(st["sampler"]))
        restore_rng(self.rng, resumed)
        self.steps, self.last = int(st["step"]), float(st["last"])

    def close(self) -> None:
        self.sampler.close()

    def result(self, seconds: float, resumed_from_epoch: int, reencode: bool = True) -> EndToEndResult:
        """W (unit rows with ``classifier.normalize``), the re-encoded embeddings (``train_encoder`` and
        ``reencode``) and the summary of a run that took ``seconds``."""
        params, train_enc = self.params, self.enc_opt is not None
        W = self.clf.full()
        if W is not None and params.normalize:
            W = W / np.maximum(np.linalg.norm(W, axis=1, keepdims=True), 1e-12)
        p_emb = l_emb = None
        t1 = time.perf_counter()
        if train_enc:
            self.encoder.eval()
        if train_enc and reencode and self.env.is_main:  # rank 0 writes them
            p_emb = encode_tokens(self.encoder, *self.point_tokens, self.device, self.dtype, params.encode_batch_size)
            l_emb = encode_tokens(self.encoder, *self.label_tokens, self.device, self.dtype, params.encode_batch_size)
        builds = self.sampler.build_seconds
        summary = {"steps": self.steps, "seconds": seconds, "final_loss": self.last,
                   "steps_per_epoch": self.steps_per_epoch, "examples": int(len(self.src)),
                   "label_points": self.n_label_points, "negatives": params.negatives,
                   "train_encoder": bool(train_enc), "refreshes": int(self.sampler.refreshes),
                   "logit_bias": float(self.bias.detach()),
                   "index_build_seconds_mean": float(np.mean(builds)) if builds else 0.0,
                   "shards": len(self.clf.weights), "resumed_from_epoch": resumed_from_epoch,
                   "stopped_at_deadline": self.stopped_at_deadline, "planned_steps": self.planned_steps,
                   **({"replanned_epochs": params.epochs} if self.replanned else {}),
                   "examples_per_s": self.steps * params.batch_size / max(seconds, 1e-9),
                   "encode_seconds": time.perf_counter() - t1,
                   "memory": self.memory.summary() if self.memory is not None else {}}
        return EndToEndResult(None if W is None else W.astype(np.float32), p_emb, l_emb, summary)


def train_end_to_end(point_emb: np.ndarray, label_emb: np.ndarray, W0: np.ndarray, Y: sp.csr_matrix,
                     train_rows: np.ndarray, params: EndToEndTrainerParams, device: torch.device, *,
                     encoder: torch.nn.Module | None = None, point_tokens: Tokens | None = None,
                     label_tokens: Tokens | None = None, dtype: torch.dtype | None = None,
                     shortlist: np.ndarray | None = None, log_metrics: MetricsFn | None = None,
                     checkpoint: Checkpointer | None = None, log_every: int = 10, reencode: bool = True,
                     label_weight: np.ndarray | None = None, deadline: float | None = None,
                     report: Report | None = None, env: DistEnv | None = None,
                     replanner: Replanner | None = None, follow_intervals: tuple[str, ...] = ()) -> EndToEndResult:
    """Train W (and ``encoder`` in place when ``params.train_encoder``) with the ``params.negatives`` sampler.

    ``point_emb``/``label_emb``: the current encoder's embeddings (the stale queries ASTRA starts from, and the
    frozen inputs otherwise); ``W0``: initial classifiers; ``shortlist``: the mining stage's shortlist per
    training point (ASTRA's first hard-negative table when ``hard_start`` is 0). ``reencode``: embed every
    training point and label with the trained encoder afterwards (what the later stages need).
    ``label_weight`` (L,): a weight on each label's positive terms (``propensity_label_weights``).
    ``deadline`` (``time.perf_counter()``): no step starts after it (the training budget's guard).
    ``report``: where the progress lines go (steps of the planned total; ``xc_dagster.progress``). ``env``: this
    rank of several holding W's label ranges (the encoder, when trained, data parallel over them): rank 0 alone logs,
    reports, checkpoints and gets W. ``replanner``: the budget's plan corrected as the run trains (one process;
    xc_dagster.training.replan), its end and ``deadline`` moved with it, and the sampler's intervals named in
    ``follow_intervals`` (those the budget's plan scaled: ``hard_start``, ``refresh_every``).
    """
    trainer = EndToEndTrainer(point_emb, label_emb, W0, Y, train_rows, params, device, encoder=encoder,
                              point_tokens=point_tokens, label_tokens=label_tokens, dtype=dtype, shortlist=shortlist,
                              label_weight=label_weight, env=env, follow_intervals=follow_intervals)
    if not trainer.env.is_main:
        log_metrics = report = None
    t0 = time.perf_counter()
    try:
        start = trainer.start(checkpoint)
        window = MetricsWindow()
        prog = Progress("classifier", trainer.total_steps, "steps", report, log_metrics, initial=trainer.steps)
        if replanner is not None:
            replanner.start(trainer.steps, trainer.overhead_period())  # rates span a table build's period
        epoch = start
        while epoch < trainer.n_epochs and not trainer.stopped_at_deadline and not trainer.replanned_end():
            batches, i = trainer.epoch_batches(epoch, cut=False), 0
            while i < trainer.batches_in(epoch, len(batches)) and not trainer.replanned_end():
                if past(replanner.moved(deadline) if replanner is not None else deadline, trainer.env):
                    trainer.stopped_at_deadline = True
                    break
                window.add(trainer.step(batches[i]), params.batch_size)
                i += 1
                prog.update(1)
                if log_metrics is not None and trainer.steps % log_every == 0:
                    loss, rate = window.flush()
                    log_metrics(trainer.steps, {"classifier_loss": loss, "classifier_examples_per_s": rate,
                                                "classifier_lr_factor": trainer.lr_factor(trainer.steps)})
                trainer.follow(replanner, prog, report, "classifier")
            epoch += 1
            if checkpoint is not None and epoch < trainer.n_epochs and not trainer.stopped_at_deadline \
                    and not trainer.replanned_end():
                state = trainer.state()  # every rank: W's label ranges are gathered
                if trainer.env.is_main:
                    checkpoint.save(epoch, state, trainer.rng)
    finally:
        trainer.close()
    prog.close()
    res = trainer.result(time.perf_counter() - t0, start, reencode)
    res.summary["replans"] = replanner.history if replanner is not None else []
    return res
