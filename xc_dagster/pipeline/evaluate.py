"""Stage ``evaluate``: the test texts encoded with the deployed encoder, top-k predictions through the indexes
and the fusion, the XC metrics (filter pairs removed), reports and plots."""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

import numpy as np

from xc_dagster.artifacts import ENCODER, METRICS, PLOTS, PREDICTIONS, REPORTS, STAGE_ORDER, SUMMARY, TRAINING_STAGES
from xc_dagster.device import amp_dtype
from xc_dagster.encoders.encode import encode_tokens
from xc_dagster.encoders.loading import load_encoder
from xc_dagster.evaluation.metrics import evaluate, recall_at, remove_filtered
from xc_dagster.evaluation.reports import decile_contributions, decile_plot, pk_plot, recall_by_frequency, recall_plot
from xc_dagster.pipeline.context import StageContext
from xc_dagster.pipeline.encoded import EncodedCache
from xc_dagster.pipeline.kept import KeptWork
from xc_dagster.retrieval.shortlist import STREAM_ROWS, retrieve, topk_from_scores
from xc_dagster.sampling.labels import positive_mask
from xc_dagster.storage import save_json

log = logging.getLogger("xc_dagster")
RANKING = "ranking_"  # a kept block's ranking arrays: ranking_<name>
ABLATION_METRICS = ("precision_at_1", "precision_at_5", "psprecision_at_1", "psprecision_at_5")


def encode_split(ctx: StageContext, split: str) -> np.ndarray:
    """Embeddings of a tokenized split ("train", "test", "label") with the deployed encoder, as trained."""
    pooling = ctx.read.model_summary()["pooling"]  # as trained, whatever this run says
    encoder = load_encoder(str(ctx.read.model_dir() / ENCODER), pooling).to(ctx.device)
    dtype = amp_dtype(ctx.device, ctx.cfg.pretrain.amp)
    ids, lens = ctx.read.tokens(split)
    with ctx.progress(f"encode {split}", len(lens), "texts") as prog:
        return encode_tokens(encoder, ids, lens, ctx.device, dtype, ctx.cfg.pretrain.encode_batch_size, prog.update)


def encode_split_reused(ctx: StageContext, split: str) -> tuple[np.ndarray, bool]:
    """``encode_split``, read back instead when an earlier run encoded the same tokens with the same encoder and
    settings (``xc_dagster.pipeline.encoded``), else kept for the next run; and whether it was read back."""
    versions = ctx.read.versions()
    settings = {"encoder": versions.get(ctx.read.model_dir().name), "tokenize": versions.get("tokenize"),
                "pooling": ctx.read.model_summary()["pooling"], "device": ctx.device.type,
                "dtype": str(amp_dtype(ctx.device, ctx.cfg.pretrain.amp)),
                "batch_size": ctx.cfg.pretrain.encode_batch_size}
    if not (settings["encoder"] and settings["tokenize"]):  # not both local folders: no version to key on
        return encode_split(ctx, split), False
    cache = EncodedCache(ctx.encoded_dir(), split, settings)
    kept = cache.load(len(ctx.read.tokens(split)[1]))
    if kept is not None:
        log.info("%s: %s embeddings read back from %s (same encoder and tokens)", ctx.name, split, cache.path)
        return kept, True
    emb = encode_split(ctx, split)
    cache.save(emb)
    return emb, False


def upstream_seconds(ctx: StageContext) -> dict[str, float]:
    """Wall seconds of every stage before evaluation, from the summaries they recorded (model comparison)."""
    seconds = {stage: ctx.read.stage_seconds(stage) for stage in STAGE_ORDER[:-1]}
    return {stage: s for stage, s in seconds.items() if s is not None}


def _rankings(sl: Any) -> list[tuple[str, np.ndarray]]:
    """Each ranking on its own, as the papers' ablations report them (classifier only, embedding only; lexical
    only and co-occurrence only with those sources)."""
    out = [("classifier_only", sl.clf), ("embedding_only", sl.emb)]
    for name, scores in (("lexical_only", sl.lex), ("cooccurrence_only", sl.cooc)):
        if scores is not None:
            out.append((name, np.where(sl.ids < 0, -np.inf, scores).astype(np.float32)))
    return out


def _shortlist_hits(ids: np.ndarray, Y: Any) -> np.ndarray:
    """The shortlist's positives of each row packed left (-1 after): all that its recall needs, a few columns where
    the shortlist has hundreds."""
    kept = np.where(positive_mask(Y, np.arange(len(ids)), ids), ids, -1)
    width = max(int((kept >= 0).sum(1).max(initial=0)), 1)
    return -np.sort(-kept, axis=1)[:, :width]


def _predict_block(ctx: StageContext, q: np.ndarray, lex_q: Any, m: Any, fz: Any, inv: np.ndarray, Y: Any,
                   filter_pairs: np.ndarray | None, k_ablation: int, progress: Any) -> dict[str, Any]:
    """One block of test queries: shortlisted, fused, top-k with the filter pairs removed; each ranking's own top
    ``k_ablation`` and the shortlist's hits (block-local rows)."""
    sl = retrieve(q, m, ctx.cfg.index.shortlist_size, lexical_queries=lex_q, progress=progress)
    ids, scores = topk_from_scores(sl.ids, fz.score(sl, inv), ctx.cfg.evaluate.top_k)
    ids, scores = remove_filtered(ids, scores, filter_pairs)  # reciprocal/self pairs never predicted
    return {"ids": ids, "scores": scores, "hits": _shortlist_hits(sl.ids, Y),
            "rankings": {name: topk_from_scores(sl.ids, s, k_ablation)[0].astype(np.int32)
                         for name, s in _rankings(sl)}}


def _stack(parts: list[np.ndarray], fill: int = -1) -> np.ndarray:
    """Row blocks of possibly different widths, right-padded with ``fill``."""
    width = max(p.shape[1] for p in parts)
    return np.concatenate([np.pad(p, ((0, 0), (0, width - p.shape[1])), constant_values=fill) for p in parts])


def predict(ctx: StageContext, q: np.ndarray, lex_q: Any, m: Any, fz: Any, inv: np.ndarray, ds: Any,
            k_ablation: int, kept: KeptWork | None = None) -> dict[str, Any]:
    """:func:`_predict_block` over STREAM_ROWS blocks of the test queries, joined: memory bounded by a block's
    shortlists plus the kept top-k, at any number of test points. ``kept``: blocks finished by a killed run are
    read back from it, and each new one is kept in it."""
    n, parts = len(q), []
    fp = None if ds.filter_test is None else np.asarray(ds.filter_test, dtype=np.int64).reshape(-1, 2)
    kept = kept or KeptWork(None, "")
    searched = [0.0]  # seconds spent on the blocks this run searched (not those read back)
    with ctx.progress("retrieve test", n, "queries") as prog:
        def block(s: int, e: int) -> dict[str, np.ndarray]:
            t0 = time.perf_counter()
            block_fp = None if fp is None else fp[(fp[:, 0] >= s) & (fp[:, 0] < e)] - [s, 0]
            out = _predict_block(ctx, q[s:e], None if lex_q is None else lex_q[s:e], m, fz, inv, ds.Y_test[s:e],
                                 block_fp, k_ablation, prog.update)
            searched[0] += time.perf_counter() - t0
            return {"ids": out["ids"], "scores": out["scores"], "hits": out["hits"],
                    **{f"{RANKING}{name}": r for name, r in out["rankings"].items()}}

        parts = [arrays for _, _, arrays in kept.blocks(n, STREAM_ROWS, block, prog.update)]
    names = [k[len(RANKING):] for k in (parts[0] if parts else {}) if k.startswith(RANKING)]
    return {"search_seconds": searched[0],
            "ids": np.concatenate([p["ids"] for p in parts]), "scores": np.concatenate([p["scores"] for p in parts]),
            "hits": _stack([p["hits"] for p in parts]),
            "rankings": {name: np.concatenate([p[RANKING + name] for p in parts]) for name in names}}


def kept_blocks(ctx: StageContext, q: np.ndarray, k_ablation: int) -> KeptWork:
    """Where the finished blocks of the test queries are kept, keyed by the settings that shape a prediction,
    the versions of every upstream artifact and the queries themselves (docs/decisions.md#kept-work)."""
    return ctx.kept_work({"index": dataclasses.asdict(ctx.cfg.index), "evaluate": dataclasses.asdict(ctx.cfg.evaluate),
                          "k_ablation": k_ablation, "rows": STREAM_ROWS}, q)


def _ablation(rankings: dict[str, np.ndarray], ds: Any, inv: np.ndarray) -> dict[str, float]:
    """The metrics of each ranking on its own (:func:`_rankings`)."""
    out = {}
    for name, ids in rankings.items():
        for k, v in evaluate(ids, ds.Y_test, ks=(1, 5), inv_prop=inv, filter_pairs=ds.filter_test).items():
            if k in ABLATION_METRICS:
                out[f"{name}_{k}"] = v
    return out


def run(ctx: StageContext) -> dict[str, Any]:
    """Encode the test texts with the trained encoder, predict top-k, compute the XC metrics."""
    p = ctx.cfg.evaluate
    t0 = time.perf_counter()
    ds = ctx.read.labels()
    q, reused = encode_split_reused(ctx, "test")
    t_enc = time.perf_counter() - t0
    m = ctx.read.deployed_sources(ctx.cfg.index.hnsw_ef_search)  # with the kNN votes the fusion chose
    fz = ctx.read.fusion()
    t1 = time.perf_counter()
    inv = ctx.inv_prop(ds.Y_train)
    ks = tuple(sorted(set(p.ks) | set(range(1, 11))))  # k = 1..10 for the P@k / PSP@k curves
    with kept_blocks(ctx, q, max(ks) + 20) as kept:  # one run at a time keeps blocks (xc_dagster/pipeline/kept.py)
        pred = predict(ctx, q, ctx.read.lexical_queries(m, "test"), m, fz, inv, ds, max(ks) + 20, kept)
        ids, scores = pred["ids"], pred["scores"]
        t_pred = time.perf_counter() - t1
        metrics = evaluate(ids, ds.Y_test, ks=ks, inv_prop=inv, filter_pairs=ds.filter_test)
        metrics["shortlist_recall"] = recall_at(pred["hits"], ds.Y_test)
        metrics.update(_ablation(pred["rankings"], ds, inv))
        freq = ctx.read.label_freq()
        deciles = decile_contributions(ids, ds.Y_test, freq, inv, metrics, k=5)
        by_freq = recall_by_frequency(ids, ds.Y_test, freq, k=5, shortlist=pred["hits"])
        stage_seconds = upstream_seconds(ctx)
        stage_seconds["training_total"] = sum(stage_seconds.get(s, 0.0) for s in TRAINING_STAGES)
        searched = len(q) - kept.resumed_rows  # the queries this run searched (the rest: a killed run's kept blocks)
        per_query = 1000 * pred["search_seconds"] / searched if searched else None  # none searched: not measured
        summary = {"metrics": metrics, "fusion": fz.summary(), "n_test": int(len(q)), "encode_seconds": t_enc,
                   "encoding_reused": reused,
                   "predict_seconds": t_pred, "ms_per_query_index_fusion": per_query,
                   "stage_seconds": stage_seconds, "resumed_queries": kept.resumed_rows,
                   "seconds": time.perf_counter() - t0}
        title = f"{ctx.name} ({ctx.cfg.strategy}, {ctx.cfg.preset})"
        with ctx.writing() as out:
            np.savez(out / PREDICTIONS, ids=ids.astype(np.int32), scores=scores)
            save_json(out / METRICS, metrics)
            save_json(out / REPORTS, {"deciles": deciles, "recall_by_frequency": by_freq})
            pk_plot(metrics, out / PLOTS["pk_plot"], title)
            decile_plot(deciles, out / PLOTS["decile_plot"], title)
            recall_plot(by_freq, out / PLOTS["recall_plot"], title)
            save_json(out / SUMMARY, summary)
        kept.clear()
        return summary
