"""Stage ``classifier`` (NGAME M2/M4, SiameseXML Modules III/IV, ASTRA, MIPS-s): one-vs-all W from the label
representations, trained by the hardest-negative trainer or by BCE over sampled negatives, optionally with the
encoder (end to end) or the bag encoder's residual block; a fine-tuned encoder and its embeddings are written
here and deployed by every later stage."""

from __future__ import annotations

import dataclasses
from typing import Any

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
from xc_dagster.training.checkpoint import Checkpointer, fingerprint, fingerprint_files
from xc_dagster.training.classifier import propensity_label_weights, train_classifiers
from xc_dagster.training.end_to_end import train_end_to_end


def _initial_W(ctx: StageContext, label_emb: np.ndarray) -> np.ndarray:
    """W's start: a warm start's W, else the label representation ``classifier.init`` (Module III)."""
    p = ctx.cfg.classifier
    init = ctx.read.path("pretrain", CLASSIFIER_INIT)
    check_label_repr(p.init, "classifier.init")
    if init.exists():
        return np.load(init)
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


def run(ctx: StageContext) -> dict[str, Any]:
    """Train one-vs-all W from label embeddings (validation rows held out): on positives + the hardest mined
    negatives (NGAME, SiameseXML), or with BCE over sampled negatives (ASTRA, MIPS-s), optionally fine-tuning
    the encoder with them (end to end: ``classifier.train_encoder``; the bag encoder's residual block, SiameseXML
    Module IV: ``classifier.train_residual``); that encoder and its re-computed embeddings are written here and
    every later stage uses them (``ArtifactReader.model_dir``)."""
    p = ctx.cfg.classifier
    seed_everything(p.seed)
    point_emb = ctx.read.pretrained(TRAIN_EMB)
    label_emb = ctx.read.pretrained(LABEL_EMB)
    W0 = _initial_W(ctx, label_emb)
    sl = ctx.read.shortlist()
    ds = ctx.read.labels()
    rows = ctx.read.train_rows(ds.num_train)
    sampled = _check_trainer(p)
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
    key = fingerprint({**dataclasses.asdict(p), "warm": warm, "w_state": "sharded"}, point_emb, W0, sl, rows,
                      *([] if lw is None else [lw]))
    ckpt = Checkpointer(ctx.checkpoint_dir(), key)
    emb = None
    if sampled:
        kw: dict[str, Any] = {}
        if p.train_encoder:
            encoder, tokenizer = _pretrained_encoder(ctx, pooling)
            kw = {"encoder": encoder, "point_tokens": ctx.read.tokens("train"),
                  "label_tokens": ctx.read.tokens("label"), "dtype": amp_dtype(ctx.device, ctx.cfg.pretrain.amp)}
        res = train_end_to_end(point_emb, label_emb, W0, ds.Y_train, rows, p, ctx.device,
                               shortlist=sl, log_metrics=ctx.log_metrics, checkpoint=ckpt, label_weight=lw, **kw)
        W_out, summary, emb = res.W, res.summary, (res.point_emb, res.label_emb)
    else:
        W_out, summary = train_classifiers(point_emb if inter is None else inter, W0, ds.Y_train, sl, rows, p,
                                           ctx.device, ctx.log_metrics, ckpt, encoder=encoder, label_weight=lw)
        summary["residual"] = residual_note
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
