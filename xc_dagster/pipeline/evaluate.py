"""Stage ``evaluate``: the test texts encoded with the deployed encoder, top-k predictions through the indexes
and the fusion, the XC metrics (filter pairs removed), reports and plots."""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from xc_dagster.artifacts import ENCODER, METRICS, PLOTS, PREDICTIONS, REPORTS, STAGE_ORDER, SUMMARY
from xc_dagster.device import amp_dtype
from xc_dagster.encoders.encode import encode_tokens
from xc_dagster.encoders.loading import load_encoder
from xc_dagster.evaluation.metrics import evaluate, recall_at, remove_filtered
from xc_dagster.evaluation.reports import decile_contributions, decile_plot, pk_plot, recall_by_frequency, recall_plot
from xc_dagster.pipeline.context import StageContext
from xc_dagster.retrieval.shortlist import retrieve, topk_from_scores
from xc_dagster.storage import save_json

TRAINING_STAGES = ("pretrain", "mining", "classifier", "index", "fusion")
ABLATION_METRICS = ("precision_at_1", "precision_at_5", "psprecision_at_1", "psprecision_at_5")


def encode_split(ctx: StageContext, split: str) -> np.ndarray:
    """Embeddings of a tokenized split ("train", "test", "label") with the deployed encoder, as trained."""
    pooling = ctx.read.model_summary()["pooling"]  # as trained, whatever this run says
    encoder = load_encoder(str(ctx.read.model_dir() / ENCODER), pooling).to(ctx.device)
    dtype = amp_dtype(ctx.device, ctx.cfg.pretrain.amp)
    return encode_tokens(encoder, *ctx.read.tokens(split), ctx.device, dtype, ctx.cfg.pretrain.encode_batch_size)


def upstream_seconds(ctx: StageContext) -> dict[str, float]:
    """Wall seconds of every stage before evaluation, from the summaries they recorded (model comparison)."""
    out: dict[str, float] = {}
    for stage in STAGE_ORDER[:-1]:
        s = ctx.read.summary(stage, missing_ok=True)
        if s is not None:
            out[stage] = float(s.get("seconds", s.get("train_seconds", 0.0) + s.get("encode_seconds", 0.0)))
    return out


def _ablation(sl: Any, ds: Any, inv: np.ndarray, k_max: int) -> dict[str, float]:
    """Each ranking on its own, as the papers' ablations report them (classifier only, embedding only; lexical
    only with the lexical source)."""
    out = {}
    rankings = [("classifier_only", sl.clf), ("embedding_only", sl.emb)]
    if sl.lex is not None:
        rankings.append(("lexical_only", np.where(sl.ids < 0, -np.inf, sl.lex).astype(np.float32)))
    for name, s in rankings:
        i2, _ = topk_from_scores(sl.ids, s, k_max + 20)
        for k, v in evaluate(i2, ds.Y_test, ks=(1, 5), inv_prop=inv, filter_pairs=ds.filter_test).items():
            if k in ABLATION_METRICS:
                out[f"{name}_{k}"] = v
    return out


def run(ctx: StageContext) -> dict[str, Any]:
    """Encode the test texts with the trained encoder, predict top-k, compute the XC metrics."""
    p = ctx.cfg.evaluate
    t0 = time.perf_counter()
    ds = ctx.read.labels()
    q = encode_split(ctx, "test")
    t_enc = time.perf_counter() - t0
    m = ctx.read.shortlist_sources(ctx.cfg.index.hnsw_ef_search)
    fz = ctx.read.fusion()
    t1 = time.perf_counter()
    sl = retrieve(q, m, ctx.cfg.index.shortlist_size, lexical_queries=ctx.read.lexical_queries(m, "test"))
    inv = ctx.inv_prop(ds.Y_train)
    ids, scores = topk_from_scores(sl.ids, fz.score(sl, inv), p.top_k)
    ids, scores = remove_filtered(ids, scores, ds.filter_test)  # reciprocal/self pairs never predicted
    t_pred = time.perf_counter() - t1
    ks = tuple(sorted(set(p.ks) | set(range(1, 11))))  # k = 1..10 for the P@k / PSP@k curves
    metrics = evaluate(ids, ds.Y_test, ks=ks, inv_prop=inv, filter_pairs=ds.filter_test)
    metrics["shortlist_recall"] = recall_at(sl.ids, ds.Y_test)
    metrics.update(_ablation(sl, ds, inv, max(ks)))
    freq = ctx.read.label_freq()
    deciles = decile_contributions(ids, ds.Y_test, freq, inv, metrics, k=5)
    by_freq = recall_by_frequency(ids, ds.Y_test, freq, k=5, shortlist=sl.ids)
    stage_seconds = upstream_seconds(ctx)
    stage_seconds["training_total"] = sum(stage_seconds.get(s, 0.0) for s in TRAINING_STAGES)
    summary = {"metrics": metrics, "fusion": fz.summary(), "n_test": int(len(q)), "encode_seconds": t_enc,
               "predict_seconds": t_pred, "ms_per_query_index_fusion": 1000 * t_pred / max(len(q), 1),
               "stage_seconds": stage_seconds, "seconds": time.perf_counter() - t0}
    title = f"{ctx.name} ({ctx.cfg.strategy}, {ctx.cfg.preset})"
    with ctx.writing() as out:
        np.savez(out / PREDICTIONS, ids=ids.astype(np.int32), scores=scores)
        save_json(out / METRICS, metrics)
        save_json(out / REPORTS, {"deciles": deciles, "recall_by_frequency": by_freq})
        pk_plot(metrics, out / PLOTS["pk_plot"], title)
        decile_plot(deciles, out / PLOTS["decile_plot"], title)
        recall_plot(by_freq, out / PLOTS["recall_plot"], title)
        save_json(out / SUMMARY, summary)
    return summary
