"""Stage ``pretrain``: Siamese pretraining of the shared encoder (NGAME M1, SiameseXML Module I), then the
embeddings of every training point and label with the trained encoder.

Data parallel with a ``DistEnv`` of several ranks (``python -m xc_dagster.training.launch`` under torchrun): every
rank trains (xc_dagster.training.siamese), rank 0 alone encodes and writes the stage's artifacts and clears the
checkpoint; the other ranks write nothing.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import numpy as np

from xc_dagster.artifacts import CLASSIFIER_INIT, ENCODER, LABEL_EMB, SUMMARY, TRAIN_EMB
from xc_dagster.config import PretrainParams
from xc_dagster.data.companions import has_label_names
from xc_dagster.device import amp_dtype, seed_everything
from xc_dagster.encoders.encode import encode_tokens
from xc_dagster.encoders.loading import load_encoder, save_encoder
from xc_dagster.encoders.names import parse_bag_name
from xc_dagster.encoders.tokenizer import load_tokenizer
from xc_dagster.errors import XCConfigError
from xc_dagster.pipeline.context import StageContext
from xc_dagster.serving.warm_start import check_same_vocabulary, classifier_init, resolve_warm_start
from xc_dagster.storage import save_json
from xc_dagster.training.budget import (
    BUDGET_PLAN,
    BudgetPlan,
    calibrate_stage,
    check_train_params,
    plan_epochs,
)
from xc_dagster.training.checkpoint import Checkpointer, fingerprint, fingerprint_files
from xc_dagster.training.distributed import DistEnv
from xc_dagster.training.replan import replanner_for
from xc_dagster.training.siamese import SiameseTrainer, train_siamese


def plan_pretraining(ctx: StageContext, p: PretrainParams, encoder: Any, pt: Any, lt: Any, Y: Any,
                     rows: np.ndarray, dtype: Any, key: str) -> BudgetPlan:
    """``pretrain.epochs`` planned from ``train.budget_minutes`` (xc_dagster.training.budget): a few timed steps
    of the Siamese trainer on a copy of the encoder and the timed encoding of a sample of points. A plan kept
    by an interrupted run of the same configuration (``key``) is reused."""
    t0 = time.perf_counter()
    b = ctx.cfg.train
    check_train_params(b)
    explicit = "pretrain.epochs" in ctx.cfg.explicit
    if b.budget_minutes <= 0 or explicit or p.epochs <= 0:
        return plan_epochs("pretrain.epochs", b.budget_minutes, p.epochs, True, 0.0, 0.0, 0, 0.0, 0.0, b.reserve)
    kept = BudgetPlan.load(ctx.checkpoint_dir() / BUDGET_PLAN, key)
    if kept is not None:
        return kept
    one = dataclasses.replace(p, epochs=1.0, seed_bank=False)
    sec, pts, spe, encode_s = calibrate_stage(lambda enc: SiameseTrainer(enc, pt, lt, Y, rows, one, ctx.device, dtype),
                                              encoder, b, pt, lt, ctx.device, dtype, p.encode_batch_size, p.seed)
    plan = plan_epochs("pretrain.epochs", b.budget_minutes, p.epochs, False, sec, pts, spe, encode_s,
                       time.perf_counter() - t0, b.reserve, b.max_epochs)
    plan.save(ctx.checkpoint_dir() / BUDGET_PLAN, key)
    if sec <= 0 < len(rows):  # calibrate_stage timed no step: nothing fits
        ctx.info(f"pretrain {ctx.name}: budget {b.budget_minutes} min: encoding ~{encode_s:.0f} s and the stages "
                 f"after it leave no time to train; no epoch planned (train.budget_minutes more, or 0 for none)")
        return plan
    ctx.info(f"pretrain {ctx.name}: budget {b.budget_minutes} min, {sec:.2f} s/step ({plan.points_per_second:.0f} "
             f"points/s), {spe} steps/epoch, encoding ~{encode_s:.0f} s: {plan.planned_epochs:.4g} epochs "
             f"({int(np.ceil(plan.planned_epochs * spe))} steps) planned")
    return plan


def label_points_named(ctx: StageContext, p: PretrainParams) -> PretrainParams:
    """``p`` without the strategy's label points where they cannot serve: labels with placeholder names alone (a
    layout without ``Y.txt``: "label 17" says nothing of the label), or the ``siamesexml`` sampler (label batches,
    which refuses them). ``pretrain.label_points`` set by the user still wins (and is checked)."""
    if not p.label_points or "pretrain.label_points" in ctx.cfg.explicit:
        return p
    if p.sampler == "siamesexml":
        why = "the siamesexml sampler draws its points from the training points"
    else:
        if labels_named(ctx):
            return p
        why = "the labels have placeholder names, no Y.txt"
    ctx.info(f"pretrain {ctx.name}: no label points ({why})")
    return dataclasses.replace(p, label_points=False, label_point_cooccurrence=0.0)


def labels_named(ctx: StageContext) -> bool:
    """Whether the dataset's labels have names (``Y.txt``): the ingest summary's ``label_names``, or, for an ingest
    from before it recorded that, the label texts compared with the placeholders."""
    named = (ctx.read.summary("ingest", missing_ok=True) or {}).get("label_names")
    return has_label_names(ctx.read.label_texts()) if named is None else bool(named)


def check_data_parallel(ctx: StageContext, env: DistEnv) -> None:
    """Refuse what several ranks cannot share yet: a warm start (resolved and copied per process) and a training
    budget (calibrated on one process; the ranks would plan different epochs)."""
    if env.world_size == 1:
        return
    p, b = ctx.cfg.pretrain, ctx.cfg.train
    if p.warm_start:
        raise XCConfigError(f"pretrain.warm_start: expected '' with WORLD_SIZE={env.world_size} (several training "
                            f"processes start from the configured encoder only), got {p.warm_start!r}")
    if b.budget_minutes > 0 and "pretrain.epochs" not in ctx.cfg.explicit and p.epochs > 0:
        raise XCConfigError(f"train.budget_minutes: expected 0, or pretrain.epochs set explicitly, with WORLD_SIZE="
                            f"{env.world_size} (the budget's epochs are planned from one process's timed steps), "
                            f"got {b.budget_minutes}")


def run(ctx: StageContext, env: DistEnv | None = None) -> dict[str, Any]:
    """Siamese pretraining (M1); then embeddings of every training point and label with the trained encoder.

    With ``pretrain.warm_start`` the encoder starts from a previous model's, and the classifiers' start
    (``classifier_init.npy``) takes that model's W for the labels it knows. ``env``: this rank of a data-parallel
    world (default: one process); a rank other than 0 returns the training's numbers and writes nothing."""
    started = time.perf_counter()
    env = DistEnv() if env is None else env
    check_data_parallel(ctx, env)
    p = label_points_named(ctx, ctx.cfg.pretrain)
    if p.epochs > 0 and not ctx.points_have_text():  # every point the same empty input: nothing to learn
        ctx.info(f"pretrain {ctx.name}: no training point has text; the encoder is kept as loaded, not trained")
        p = dataclasses.replace(p, epochs=0.0)
    seed_everything(p.seed)
    ds = ctx.read.labels()
    train_rows = ctx.read.train_rows(ds.num_train)
    warm = resolve_warm_start(p.warm_start, ctx.name, ctx.tracking_uri, ctx.store.root / ctx.name / "_warm_start")
    tokenizer = load_tokenizer(ctx.cfg.tokenize.encoder)
    if warm is not None:
        check_same_vocabulary(warm, tokenizer)
        ctx.info(f"pretrain {ctx.name}: warm start from {warm}")
    encoder = load_encoder(str(warm / ENCODER) if warm else ctx.cfg.tokenize.encoder, p.pooling).to(ctx.device)
    dtype = amp_dtype(ctx.device, p.amp)
    pt, lt = ctx.read.tokens("train"), ctx.read.tokens("label")
    if warm is None and parse_bag_name(ctx.cfg.tokenize.encoder) is not None:  # fresh bag: IDF of the texts
        encoder.fit_idf(pt, lt)
    # "sampler_state": the checkpoint's layout (the batch sampler's state under "sampler"): an older one is
    # never resumed from
    key = fingerprint({**dataclasses.asdict(p), "encoder": ctx.cfg.tokenize.encoder,
                       "warm": fingerprint_files(warm / ENCODER) if warm else "", "sampler_state": "registry",
                       "budget": dataclasses.asdict(ctx.cfg.train)}, pt[0], lt[0], train_rows, ds.Y_train.indices)
    plan = plan_pretraining(ctx, p, encoder, pt, lt, ds.Y_train, train_rows, dtype, key)
    if not plan.explicit:
        p = dataclasses.replace(p, epochs=plan.planned_epochs)
        key = fingerprint({"configured": key, "planned_epochs": plan.planned_epochs})
    ckpt = Checkpointer(ctx.checkpoint_dir(), key)
    t_train = time.perf_counter()
    replanner = (replanner_for(plan, t_train, ctx.cfg.train, encoder, pt, lt, ctx.device, dtype, p.encode_batch_size,
                               p.seed) if env.world_size == 1 else None)
    res = train_siamese(encoder, pt, lt, ds.Y_train, train_rows, p, ctx.device, dtype, ctx.log_metrics,
                        checkpoint=ckpt, deadline=plan.deadline(t_train), report=ctx.info, env=env,
                        replanner=replanner)
    ctx.info(f"pretrain {ctx.name}: {res.steps} steps, {res.points} points in {res.seconds:.0f}s"
             + (f" (rank {env.rank} of {env.world_size})" if env.world_size > 1 else ""))
    if not env.is_main:
        return {"steps": res.steps, "points": res.points, "train_seconds": res.seconds, "final_loss": res.final_loss,
                "rank": env.rank, "world_size": env.world_size}
    t1 = time.perf_counter()
    with ctx.progress("encode train", len(pt[1]), "texts") as prog:
        point_emb = encode_tokens(encoder, *pt, ctx.device, dtype, p.encode_batch_size, prog.update)
    with ctx.progress("encode label", len(lt[1]), "texts") as prog:
        label_emb = encode_tokens(encoder, *lt, ctx.device, dtype, p.encode_batch_size, prog.update)
    encode_s = time.perf_counter() - t1
    W0, warm_labels = None, 0
    if warm is not None:
        W0, warm_labels = classifier_init(warm, ctx.read.label_texts(), label_emb)
    summary = {"warm_start": str(warm) if warm else "", "warm_start_labels": warm_labels, "steps": res.steps,
               "points": res.points, "train_seconds": res.seconds, "reclusterings": res.reclusterings,
               "resumed_from_epoch": res.resumed_from_epoch, "points_per_s": res.points / max(res.seconds, 1e-9),
               "final_loss": res.final_loss, "encode_seconds": encode_s,
               "texts_per_s": (len(pt[1]) + len(lt[1])) / max(encode_s, 1e-9), "device": str(ctx.device),
               "amp": str(dtype), "dim": encoder.dim, "encoder_type": type(encoder).__name__,
               "stopped_at_deadline": res.stopped_at_deadline, "label_points": p.label_points, "budget": plan.summary(),
               "planned_steps": res.planned_steps, "replans": replanner.history if replanner else [],
               "memory": res.memory,
               "seconds": time.perf_counter() - started}  # the stage's wall time (budgeted)
    if env.world_size > 1:
        summary["world_size"] = env.world_size
    with ctx.writing() as out:
        save_encoder(encoder, tokenizer, out / ENCODER)
        np.save(out / TRAIN_EMB, point_emb)
        np.save(out / LABEL_EMB, label_emb)
        if W0 is not None:  # the classifier stage starts from it instead of the label embeddings
            np.save(out / CLASSIFIER_INIT, W0)
        save_json(out / SUMMARY, {**summary, "pooling": p.pooling})
    ckpt.clear()
    return summary
