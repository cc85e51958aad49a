"""Stage ``mining`` (SiameseXML Module II): a shortlist of candidate labels per training point, the hard
negatives of the classifier stage, and the label centroids of the training points."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import numpy as np

from xc_dagster.artifacts import LABEL_EMB, MINING_LABEL_INDEX, SHORTLIST, SHORTLIST_SCORES, SUMMARY, TRAIN_EMB
from xc_dagster.evaluation.metrics import recall_at
from xc_dagster.pipeline.context import StageContext
from xc_dagster.retrieval.ann import LabelIndex
from xc_dagster.retrieval.exact_settings import resolve_kind
from xc_dagster.retrieval.shortlist import (
    ANN_SOURCES,
    CENTROID_FILE,
    INDEX_FILES,
    STREAM_ROWS,
    build_sources,
    check_sources,
    label_centroids,
    label_index_settings,
    retrieve,
    topk_from_scores,
)
from xc_dagster.storage import link, save_json


def run(ctx: StageContext) -> dict[str, Any]:
    """Negative mining (SiameseXML Module II): a shortlist of candidate labels per training point.

    Candidates come from ``mining.sources`` (label text embeddings; label centroids; labels of the point's
    nearest other training points), ranked by (1 - g)(s_label + s_centroid) + g * s_knn with exact scores.
    The label centroids (of the non-validation training points) are written here for later stages.
    """
    p = ctx.cfg.mining
    check_sources(p.sources, "mining.sources", ANN_SOURCES)  # lexical: an inference source (index.sources)
    t0 = time.perf_counter()
    point_emb, label_emb = ctx.read.pretrained(TRAIN_EMB), ctx.read.pretrained(LABEL_EMB)
    ds = ctx.read.labels()
    rows = ctx.read.train_rows(ds.num_train)
    centroids = label_centroids(point_emb, ds.Y_train, rows)
    # the model is the lexical source alone: every point is the empty input's embedding, so one point's shortlist
    # (an exact search, not a label graph) is every point's, and only the index stage's summary reads it
    same = ctx.lexical_only()
    with ctx.kept_work({"mining": dataclasses.asdict(p), "rows": STREAM_ROWS}) as kept:
        sizes = {"W": len(label_emb), "label": len(label_emb), "centroid": len(centroids), "knn": len(rows)}
        built = {name: LabelIndex.load(path, resolve_kind(p.index, sizes[name], label_emb.shape[1]), p.hnsw_ef_search)
                 for name in p.sources if (path := kept.path(INDEX_FILES[name])) is not None}
        if built:
            ctx.info(f"mining {ctx.name}: the {', '.join(built)} index(es) a killed run of this stage built, kept")

        def keep(name: str, index: LabelIndex) -> None:  # as soon as built: a graph of 1.3M labels takes ~30 min
            if index.kind != "exact":  # on 2 cores; an exact index is its vectors, rebuilt at no cost
                kept.keep(INDEX_FILES[name], index.save)
            kept.drop(INDEX_FILES[name])  # the graph kept as it was built (KeptWork.graph)

        src = build_sources(p.sources, label_emb, label_emb, centroids, point_emb[rows], ds.Y_train[rows],
                            "text+centroid" if "centroid" in p.sources else "text", "exact" if same else p.index,
                            p.hnsw_m, p.hnsw_ef_construction, p.hnsw_ef_search, report=ctx.info, built=built,
                            on_built=keep, checkpoints=lambda name: kept.graph(INDEX_FILES[name]))
        k = min(p.shortlist_size, len(label_emb))
        own = np.full(ds.num_train, -1, dtype=np.int64)
        own[rows] = np.arange(len(rows))  # a training point is not its own neighbour
        n = len(point_emb)
        ids, scores = np.empty((n, k), dtype=np.int32), np.empty((n, k), dtype=np.float32)

        def block(s: int, e: int) -> dict[str, np.ndarray]:  # a block's whole shortlists at once, only its top k kept
            q = s + 1 if same else e  # the rows searched
            sl = retrieve(np.asarray(point_emb[s:q]), src, k, exclude_knn=own[s:q], progress=prog.update,
                          classifier_scores=False)  # ranked by the embedding (and kNN) scores only
            merged = sl.emb if sl.knn is None else (1.0 - p.knn_weight) * sl.emb + p.knn_weight * sl.knn
            top = topk_from_scores(sl.ids, np.where(sl.ids < 0, -np.inf, merged).astype(np.float32), k)
            if same:  # the block's other points
                prog.update(e - q)
                return {"ids": np.repeat(top[0], e - s, axis=0), "scores": np.repeat(top[1], e - s, axis=0)}
            return {"ids": top[0], "scores": top[1]}

        with ctx.progress("retrieve train", n, "points") as prog:
            for s, e, got in kept.blocks(n, STREAM_ROWS, block, prog.update):
                ids[s:e], scores[s:e] = got["ids"], got["scores"]
        recall = recall_at(ids, ds.Y_train)
        summary = {"shortlist_size": k, "sources": list(p.sources), "train_recall": recall,
                   "resumed_points": kept.resumed_rows, "kinds": {n: ix.kind for n, ix in src.indexes.items()}}
        label = src.indexes.get("label")
        with ctx.writing() as out:
            if label is not None and label.kind != "exact":  # a graph the index stage reuses while the encoder is
                graph = kept.path(INDEX_FILES["label"])  # the pretrained one (nothing to reuse in an exact one)
                if graph is not None:  # the kept graph (none: another run of this stage holds the kept work)
                    link(graph, out / MINING_LABEL_INDEX)
                else:
                    label.save(out / MINING_LABEL_INDEX)
                summary["label_index"] = label_index_settings(label.kind, p.hnsw_m, p.hnsw_ef_construction)
            summary["seconds"] = time.perf_counter() - t0
            np.save(out / SHORTLIST, ids)
            np.save(out / SHORTLIST_SCORES, scores)
            np.save(out / CENTROID_FILE, centroids)
            save_json(out / SUMMARY, summary)
        kept.clear()
        ctx.info(f"mining {ctx.name}: shortlist of {k} from {'+'.join(p.sources)}, recall on train {recall:.3f}")
        return summary
