"""Exact search in fp32 against bf16 or int8 scoring with an fp32 re-rank (``xc_dagster.retrieval.ann.exact_topk``,
``--low``, repeatable), and HNSW, on a trained model's own vectors: time per query in batches and for one query, and recall of the top k
against fp32 exact search.

``--vectors NAME=PATH.npy`` (repeatable) are the key sets (W, label embeddings, training-point embeddings of a
run's stage folders); ``--queries PATH.npy`` the query rows, of which ``--n-queries`` are drawn (seeded).
``--hnsw NAME=PATH.index`` adds a faiss index already built over a key set (its search time; its build time is
in the index stage's log). ``--build hnsw:M:efC:efS`` / ``--build ivf:NLIST:NPROBE[,NPROBE...]`` build
``LabelIndex`` kinds over every key set here and time the build and the search (``--max-keys`` draws a seeded
subset of each key set first).

  python bench/exact_search_bench.py --queries $A/.pretrain.v-*/train_emb.npy \\
      --vectors W=$A/.classifier.v-*/W.npy --vectors label_emb=$A/.pretrain.v-*/label_emb.npy \\
      --vectors points=$A/.pretrain.v-*/train_emb.npy --hnsw points=$A/.index.v-*/knn.index \\
      --out bench/results/exact_search_131k.json
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import faiss
import numpy as np
import torch

from xc_dagster.retrieval.ann import LabelIndex, exact_topk


def _pairs(values: list[str]) -> dict[str, str]:
    return dict(v.split("=", 1) for v in values)


def _recall(got: np.ndarray, want: np.ndarray) -> float:
    """Mean share of each row's reference ids (``want``, -1 ignored) that ``got`` also returns."""
    hits = [len(set(g[g >= 0]) & set(w[w >= 0])) / max((w >= 0).sum(), 1) for g, w in zip(got, want)]
    return float(np.mean(hits))


def _timed(fn, reps: int = 1):
    t = time.perf_counter()
    for _ in range(reps):
        out = fn()
    return out, (time.perf_counter() - t) / reps


def _built(spec: str, keys: np.ndarray, q: np.ndarray, k: int, want: np.ndarray) -> dict:
    """Build the ``LabelIndex`` that ``spec`` names over ``keys``; its build seconds, and per search setting the
    ms per query and the recall of the top k (and of the top 10) against fp32 exact search."""
    kind, *vals = spec.split(":")
    t = time.perf_counter()
    if kind == "hnsw":
        m, efc, efs = (int(v) for v in vals)
        index, settings = LabelIndex("hnsw", keys, m=m, ef_construction=efc, ef_search=efs), [efs]
    else:
        index = LabelIndex("ivf", keys, nlist=int(vals[0]), seed=0)
        settings = [int(v) for v in vals[1].split(",")]
    out = {"spec": spec, "build_s": time.perf_counter() - t, "search": []}
    for v in settings:
        if kind == "hnsw":
            index.ef_search = v
        else:
            index.nprobe = v
        (_, ids), ts = _timed(lambda: index.search(q, k))
        out["search"].append({"setting": v, "ms_per_query": 1e3 * ts / len(q), "recall": _recall(ids, want),
                              "recall_at_10": _recall(ids[:, :10], want[:, :10])})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--queries", required=True)
    ap.add_argument("--vectors", action="append", default=[], required=True)
    ap.add_argument("--hnsw", action="append", default=[])
    ap.add_argument("--n-queries", type=int, default=8192)
    ap.add_argument("--k", type=int, default=100)
    ap.add_argument("--ef-search", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--build", action="append", default=[])
    ap.add_argument("--max-keys", type=int, default=0)
    ap.add_argument("--low", action="append", choices=("bf16", "int8"), help="low precisions to time (bf16)")
    ap.add_argument("--out")
    args = ap.parse_args()
    pool = np.load(args.queries, mmap_mode="r")
    rows = np.sort(np.random.default_rng(args.seed).choice(len(pool), min(args.n_queries, len(pool)), replace=False))
    q = np.ascontiguousarray(pool[rows], dtype=np.float32)
    hnsw = _pairs(args.hnsw)
    results = []
    for name, path in _pairs(args.vectors).items():
        keys = np.load(path, mmap_mode="r")
        if args.max_keys and len(keys) > args.max_keys:
            pick = np.random.default_rng(args.seed + 1).choice(len(keys), args.max_keys, replace=False)
            keys = keys[np.sort(pick)]
        keys = np.ascontiguousarray(keys, dtype=np.float32)
        cache32 = {}
        (_, want), t32 = _timed(lambda: exact_topk(q, keys, args.k, precision="fp32", cache=cache32))
        one32 = _timed(lambda: exact_topk(q[:1], keys, 10, precision="fp32", cache=cache32), 20)[1]
        row = {"vectors": name, "n": len(keys), "dim": keys.shape[1], "queries": len(q), "k": args.k,
               "fp32_ms_per_query": 1e3 * t32 / len(q), "fp32_single_query_ms": 1e3 * one32}
        for low in args.low or ["bf16"]:
            cache = {}
            (_, got), t = _timed(lambda: exact_topk(q, keys, args.k, precision=low, cache=cache))
            one = _timed(lambda: exact_topk(q[:1], keys, 10, precision=low, cache=cache), 20)[1]
            row.update({f"{low}_ms_per_query": 1e3 * t / len(q), f"{low}_recall": _recall(got, want),
                        f"{low}_single_query_ms": 1e3 * one,
                        f"{low}_searched_again": cache.get("low_redone", 0) / max(cache.get("low_searched", 1), 1)})
        if name in hnsw:
            index = faiss.read_index(hnsw[name])
            index.hnsw.efSearch = max(args.ef_search, args.k)
            (_, ids), th = _timed(lambda: index.search(q, args.k))
            row.update(hnsw_ms_per_query=1e3 * th / len(q), hnsw_recall=_recall(ids, want),
                       hnsw_single_query_ms=1e3 * _timed(lambda: index.search(q[:1], 10), 20)[1])
        row["built"] = [_built(spec, keys, q, args.k, want) for spec in args.build]
        print(json.dumps(row), flush=True)
        results.append(row)
    if args.out:
        meta = {"machine": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
                "torch": torch.__version__, "date": time.strftime("%Y-%m-%d")}
        with open(args.out, "w") as fh:
            json.dump({"meta": meta, "results": results}, fh, indent=1)


if __name__ == "__main__":
    main()
