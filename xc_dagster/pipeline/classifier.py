"""Stage ``classifier`` (NGAME M2/M4, SiameseXML Modules III/IV, ASTRA, MIPS-s): one-vs-all W from the label
representations, trained by the hardest-negative trainer or by BCE over sampled negatives, optionally with the
encoder (end to end) or the bag encoder's residual block; a fine-tuned encoder and its embeddings are written
here and deployed by every later stage."""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable

import numpy as np

from xc_dagster.artifacts import CLASSIFIER_INIT, ENCODER, LABEL_EMB, SUMMARY, TRAIN_EMB, W
from xc_dagster.device import amp_dtype, seed_everything
from xc_dagster.encoders.bag import BagOfEmbeddingsEncoder, embed_from_intermediate
from xc_dagster.encoders.encode import encode_tokens
from xc_dagster.encoders.loading import load_encoder, save_encoder
from xc_dagster.encoders.tokenizer import load_tokenizer
from xc_dagster.errors import XCConfigError
from xc_dagster.pipeline.context import StageContext
from xc_dagster.retrieval.shortlist import check_label_repr, label_representation
from xc_dagster.sampling.negatives import SAMPLERS
from xc_dagster.storage import save_json
from xc_dagster.training.budget import (
    BUDGET_PLAN,
    BudgetPlan,
    calibrate_stage,
    check_train_params,
    plan_epochs,
    reserved_after_pretraining,
    stage_deadline,
)
from xc_dagster.training.checkpoint import Checkpointer, fingerprint, fingerprint_files
from xc_dagster.training.classifier import (
    propensity_label_weights,
    train_classifiers,
)
from xc_dagster.training.distributed import DistEnv
from xc_dagster.training.end_to_end import EndToEndTrainer, train_end_to_end
from xc_dagster.training.replan import Replanner, replanner_for

# of the pretraining's reserve (its share or the encoding, whichever is more): what the index and fusion stages
# keep after this stage, as `xc-dagster plan` models it (docs/decisions.md#end-to-end-reserve)
TAIL_RESERVE = 1 / 3
SCALED_INTERVALS = ("hard_start", "refresh_every")  # ASTRA's / MIPS-s' intervals: shares of a planned run


def plan_classifiers(ctx: StageContext, sampled: bool, make_trainer: Any, encoder: Any, key: str,
                     started: float) -> tuple[Any, BudgetPlan, float | None]:
    """The classifier stage's part of ``train.budget_minutes``: what the earlier stages left minus the index and
    fusion's share. End to end (``classifier.train_encoder``), ``classifier.epochs`` is planned from timed steps
    on a copy of the encoder and ASTRA's ``hard_start`` / ``refresh_every`` scale with it; the hardest-negative
    and frozen-encoder trainers keep their epochs and stop at the deadline. Returns (params, plan, deadline)."""
    p, b = ctx.cfg.classifier, ctx.cfg.train
    check_train_params(b)
    explicit = "classifier.epochs" in ctx.cfg.explicit
    spent = ctx.read.spent_before("classifier")
    if b.budget_minutes <= 0 or explicit or p.epochs <= 0:
        return p, plan_epochs("classifier.epochs", b.budget_minutes, p.epochs, True, 0.0, 0.0, 0, 0.0, spent,
                              b.reserve), None
    if not (sampled and p.train_encoder):
        keep = TAIL_RESERVE * reserved_after_pretraining(ctx.read.summary("pretrain", missing_ok=True), b)
        plan = plan_epochs("classifier.epochs", b.budget_minutes, p.epochs, True, 0.0, 0.0, 0, 0.0, spent,
                           keep / (60.0 * b.budget_minutes))
        return p, plan, stage_deadline(b, spent, started, keep)
    kept = BudgetPlan.load(ctx.checkpoint_dir() / BUDGET_PLAN, key)
    if kept is None:
        sec, pts, spe, encode_s = calibrate_stage(make_trainer, encoder, b, ctx.read.tokens("train"),
                                                  ctx.read.tokens("label"), ctx.device, None, p.encode_batch_size,
                                                  p.seed, spent + time.perf_counter() - started, b.reserve,
                                                  TAIL_RESERVE)
        kept = plan_epochs("classifier.epochs", b.budget_minutes, p.epochs, False, sec, pts, spe, encode_s,
                           spent + time.perf_counter() - started, b.reserve, b.max_epochs, TAIL_RESERVE)
        kept.save(ctx.checkpoint_dir() / BUDGET_PLAN, key)
    scale = kept.planned_epochs / p.epochs
    changes: dict[str, float] = {"epochs": kept.planned_epochs}
    for name in SCALED_INTERVALS:
        if f"classifier.{name}" not in ctx.cfg.explicit:
            changes[name] = getattr(p, name) * scale
    ctx.info(f"classifier {ctx.name}: budget {b.budget_minutes} min, {kept.seconds_per_step:.2f} s/step, "
             f"{kept.planned_epochs:.4g} epochs planned")
    return dataclasses.replace(p, **changes), kept, None


def _initial_W(ctx: StageContext, label_emb: np.ndarray) -> np.ndarray:
    """W's start: a warm start's W, else the label representation ``classifier.init`` (Module III)."""
    init = ctx.read.path("pretrain", CLASSIFIER_INIT)
    if init.exists():
        return np.load(init)
    return _label_init(ctx, label_emb)


def _label_init(ctx: StageContext, label_emb: np.ndarray) -> np.ndarray:
    """The label representation ``classifier.init`` as W's start (Module III)."""
    p = ctx.cfg.classifier
    check_label_repr(p.init, "classifier.init")
    if p.init == "text":
        return label_emb
    W0 = label_representation(label_emb, ctx.read.mining_centroids(), p.init)  # at unit norm
    W0 /= np.maximum(np.linalg.norm(W0, axis=1, keepdims=True), 1e-12)
    return W0


def _check_trainer(p: Any) -> bool:
    """Whether ``classifier.negatives`` samples over all labels (the BCE trainer), checking the options that
    only one of the two trainers takes."""
    sampled = p.negatives in SAMPLERS
    if p.train_encoder and not sampled:
        raise XCConfigError(f"classifier.train_encoder: end-to-end training needs sampled negatives "
                            f"(classifier.negatives = {' | '.join(SAMPLERS)}), got {p.negatives!r}")
    if p.train_residual and sampled:
        raise XCConfigError("classifier.train_residual: the residual block is fine-tuned by the hardest-negative "
                            "trainer (negatives = shortlist | in-batch | both); with sampled negatives use "
                            "classifier.train_encoder to fine-tune the whole encoder")
    return sampled


def _pretrained_encoder(ctx: StageContext, pooling: str | None) -> tuple[Any, Any]:
    """The pretrain stage's encoder (on the stage's device) and its tokenizer, to fine-tune here."""
    enc_dir = str(ctx.read.path("pretrain", ENCODER))
    return load_encoder(enc_dir, pooling).to(ctx.device), load_tokenizer(enc_dir)


def _residual_encoder(ctx: StageContext, pooling: str | None) -> tuple[Any, Any, str]:
    """SiameseXML Module IV's encoder (``classifier.train_residual``): the bag encoder, whose residual block trains
    with W; a transformer has none and stays frozen. Returns (encoder or None, its tokenizer, a note)."""
    if not ctx.cfg.classifier.train_residual:
        return None, None, "off"
    encoder, tokenizer = _pretrained_encoder(ctx, pooling)
    if isinstance(encoder, BagOfEmbeddingsEncoder):
        return encoder, tokenizer, "trained"
    ctx.info("classifier.train_residual: the encoder has no residual block (tokenize.encoder=bag has one); it "
             "stays frozen")
    return None, None, "n/a: the encoder has no residual block"


def fold_trainer(ctx: StageContext, ds: Any, label_emb: np.ndarray) -> Callable[[np.ndarray], np.ndarray]:
    """A trainer of W on the training points ``rows`` only, as this stage trains it but on the deployed embeddings
    with the encoder frozen, for the epochs the stage planned (re-planned, where it was): cross-fitting's fold
    classifiers (``fusion.fit_on``). Its inputs are read once for every fold."""
    p = ctx.cfg.classifier
    point_emb, shortlist = ctx.read.embeddings("train"), ctx.read.shortlist()
    stage = ctx.read.summary("classifier") or {}
    epochs = stage.get("replanned_epochs", (stage.get("budget") or {}).get("planned_epochs", p.epochs))
    q = dataclasses.replace(p, epochs=float(epochs), train_encoder=False,
                            train_residual=False)
    W0 = _label_init(ctx, label_emb)  # not a warm start's W: it has seen every point
    inv_prop, sampled = ctx.inv_prop(ds.Y_train), _check_trainer(p)

    def train(rows: np.ndarray) -> np.ndarray:
        seed_everything(p.seed)
        lw = (propensity_label_weights(inv_prop, ds.Y_train, rows, p.propensity_weight)
              if p.propensity_weight else None)
        if sampled:
            return train_end_to_end(point_emb, label_emb, W0, ds.Y_train, rows, q, ctx.device, shortlist=shortlist,
                                    label_weight=lw, reencode=False).W
        return train_classifiers(point_emb, W0, ds.Y_train, shortlist, rows, q, ctx.device, label_weight=lw,
                                 label_point_emb=label_emb)[0]

    return train


def _replanner(ctx: StageContext, plan: BudgetPlan, started: float, p: Any,
               kw: dict[str, Any]) -> tuple[Replanner | None, tuple[str, ...]]:
    """The end-to-end run's plan corrected as it trains (one process; xc_dagster.training.replan), and the
    sampler's intervals that follow its end (those the plan scaled, not set explicitly): (None, ()) unless it trains
    the encoder (``kw``: the encoder and its tokens) on a planned budget."""
    if "encoder" not in kw:
        return None, ()
    replanner = replanner_for(plan, started, ctx.cfg.train, kw["encoder"], kw["point_tokens"], kw["label_tokens"],
                              ctx.device, None, p.encode_batch_size, p.seed)
    return replanner, tuple(n for n in SCALED_INTERVALS if f"classifier.{n}" not in ctx.cfg.explicit)


def _check_ranks(ctx: StageContext, env: DistEnv, sampled: bool) -> None:
    """Refuse a budget-planned end-to-end run with several ranks: each would time its own steps and plan its own
    epochs, then wait for the others at a collective (pretraining refuses it alike)."""
    p = ctx.cfg.classifier
    if env.world_size > 1 and sampled and p.train_encoder and ctx.cfg.train.budget_minutes > 0 \
            and "classifier.epochs" not in ctx.cfg.explicit and p.epochs > 0:
        raise XCConfigError(f"train.budget_minutes: expected 0, or classifier.epochs set explicitly, with WORLD_SIZE="
                            f"{env.world_size} (the budget's epochs are planned from one process's timed steps), "
                            f"got {ctx.cfg.train.budget_minutes}")


def _untrained(ctx: StageContext, W0: np.ndarray, env: DistEnv, started: float) -> dict[str, Any]:
    """The stage when the model is the lexical source alone (``StageContext.lexical_only``): no point has text, so
    W would learn a constant per label on the one empty input; W is written as it starts, its scores left out
    downstream (the index's ``dense``), and the budget kept for the lexical classifiers, whose biases are the
    labels' prior."""
    b = ctx.cfg.train
    plan = plan_epochs("classifier.epochs", b.budget_minutes, 0.0, True, 0.0, 0.0, 0, 0.0,
                       ctx.read.spent_before("classifier"), b.reserve)
    summary: dict[str, Any] = {"steps": 0, "train_seconds": 0.0, "budget": plan.summary(), "residual": "off",
                               "untrained": "no training point has text: the lexical source alone scores labels"}
    if not env.is_main:
        return {"steps": 0, "train_seconds": 0.0, "rank": env.rank, "world_size": env.world_size}
    summary["seconds"] = time.perf_counter() - started
    with ctx.writing() as out:
        np.save(out / W, np.asarray(W0, dtype=np.float32))
        save_json(out / SUMMARY, summary)
    ctx.info(f"classifier {ctx.name}: no training point has text: W not trained (the lexical source alone scores "
             f"labels)")
    return summary


def run(ctx: StageContext, env: DistEnv | None = None) -> dict[str, Any]:
    """Train one-vs-all W from label embeddings (validation rows held out): on positives + the hardest mined
    negatives (NGAME, SiameseXML), or with BCE over sampled negatives (ASTRA, MIPS-s), optionally fine-tuning
    the encoder with them (end to end: ``classifier.train_encoder``; the bag encoder's residual block, SiameseXML
    Module IV: ``classifier.train_residual``); that encoder and its re-computed embeddings are written here and
    every later stage uses them (``ArtifactReader.model_dir``)."""
    started = time.perf_counter()
    p = ctx.cfg.classifier
    env, sampled = DistEnv() if env is None else env, _check_trainer(p)
    _check_ranks(ctx, env, sampled)
    seed_everything(p.seed)
    point_emb, label_emb = ctx.read.pretrained(TRAIN_EMB), ctx.read.pretrained(LABEL_EMB)
    W0 = _initial_W(ctx, label_emb)
    if ctx.lexical_only():
        return _untrained(ctx, W0, env, started)
    sl, ds = ctx.read.shortlist(), ctx.read.labels()
    rows = ctx.read.train_rows(ds.num_train)
    pooling = ctx.read.summary("pretrain")["pooling"] if (p.train_encoder or p.train_residual) else None
    encoder, tokenizer, residual_note = _residual_encoder(ctx, pooling)
    inter = label_inter = None
    if encoder is not None:  # Module IV: train R on the frozen intermediate embeddings
        inter, label_inter = (encode_tokens(encoder, *ctx.read.tokens(split), ctx.device, None,
                                            ctx.cfg.pretrain.encode_batch_size, forward=encoder.intermediate)
                              for split in ("train", "label"))
    enc_dir = ctx.read.path("pretrain", ENCODER)
    warm = fingerprint_files(enc_dir) if (p.train_encoder or encoder is not None) else ""
    lw = (propensity_label_weights(ctx.inv_prop(ds.Y_train), ds.Y_train, rows, p.propensity_weight)
          if p.propensity_weight else None)
    # "w_state": the trainer's checkpoint layout (W and its optimizer as ShardedOptimizer state): an older layout
    # is never resumed from
    key = fingerprint({**dataclasses.asdict(p), "warm": warm, "w_state": "sharded",
                       "budget": dataclasses.asdict(ctx.cfg.train)}, point_emb, W0, sl, rows,
                      *([] if lw is None else [lw]))
    kw: dict[str, Any] = {}
    if sampled and p.train_encoder:
        encoder, tokenizer = _pretrained_encoder(ctx, pooling)
        kw = {"encoder": encoder, "point_tokens": ctx.read.tokens("train"),
              "label_tokens": ctx.read.tokens("label"), "dtype": amp_dtype(ctx.device, ctx.cfg.pretrain.amp)}
    p, plan, deadline = plan_classifiers(
        ctx, sampled, lambda enc: EndToEndTrainer(point_emb, label_emb, W0, ds.Y_train, rows,
                                                  dataclasses.replace(p, epochs=1.0), ctx.device,
                                                  **{**kw, "encoder": enc}, shortlist=sl, label_weight=lw),
        kw.get("encoder"), key, started)
    if not plan.explicit:
        key = fingerprint({"configured": key, "planned": dataclasses.asdict(p)})
    ckpt, emb = Checkpointer(ctx.checkpoint_dir(), key), None
    t_train = time.perf_counter()
    deadline = plan.deadline(t_train) if deadline is None else deadline
    replanner, follow = _replanner(ctx, plan, t_train, p, kw) if sampled and env.world_size == 1 else (None, ())
    if sampled:
        res = train_end_to_end(point_emb, label_emb, W0, ds.Y_train, rows, p, ctx.device, shortlist=sl, report=ctx.info,
                               log_metrics=ctx.log_metrics, checkpoint=ckpt, label_weight=lw, deadline=deadline,
                               env=env, replanner=replanner, follow_intervals=follow, **kw)
        W_out, summary, emb = res.W, res.summary, (res.point_emb, res.label_emb)
    else:
        W_out, summary = train_classifiers(point_emb if inter is None else inter, W0, ds.Y_train, sl, rows, p,
                                           ctx.device, ctx.log_metrics, ckpt, encoder=encoder, label_weight=lw,
                                           deadline=deadline, report=ctx.info, env=env,
                                           label_point_emb=label_emb if label_inter is None else label_inter)
        summary["residual"] = residual_note
    if not env.is_main:  # rank 0 holds W and writes the stage
        return {"steps": summary["steps"], "train_seconds": summary["seconds"], "rank": env.rank,
                "world_size": env.world_size}
    summary.update({"world_size": env.world_size} if env.world_size > 1 else {})
    summary["budget"] = plan.summary()
    summary["train_seconds"] = summary["seconds"]  # the trainer's loop; "seconds" is the stage's wall time
    summary["seconds"] = time.perf_counter() - started
    with ctx.writing() as out:
        np.save(out / W, W_out)
        if encoder is not None:  # the fine-tuned encoder replaces the pretrained one downstream
            save_encoder(encoder, tokenizer, out / ENCODER)
            if emb is None:
                emb = tuple(embed_from_intermediate(encoder, h, ctx.device) for h in (inter, label_inter))
            np.save(out / TRAIN_EMB, emb[0])
            np.save(out / LABEL_EMB, emb[1])
            summary.update({"pooling": pooling, "encoder_type": type(encoder).__name__})
        save_json(out / SUMMARY, summary)
    ckpt.clear()
    ctx.info(f"classifier {ctx.name}: {summary['steps']} steps in {summary['seconds']:.0f}s")
    return summary
