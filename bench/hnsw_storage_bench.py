"""HNSW graphs with their vectors stored in fp32, fp16 or 8 bits (faiss ``IndexHNSWFlat`` / ``IndexHNSWSQ``):
build seconds, ms per query and recall of the top k against fp32 exact search, also after re-ranking the top 2k
in fp32 (docs/decisions.md#hnsw-storage).

  python bench/hnsw_storage_bench.py --keys $A/pretrain/label_emb.npy --queries $A/pretrain/train_emb.npy \\
      --max-keys 262144 --n-queries 2000 --storage flat,fp16,sq8 --out bench/results/hnsw_storage_1p3m.json
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import faiss
import numpy as np
import torch

QT = {"fp16": faiss.ScalarQuantizer.QT_fp16, "sq8": faiss.ScalarQuantizer.QT_8bit}


def _draw(path: str, n: int, seed: int) -> np.ndarray:
    """``n`` rows of the .npy at ``path`` (all when fewer), a seeded draw in file order, as float32."""
    rows = np.load(path, mmap_mode="r")
    pick = np.sort(np.random.default_rng(seed).choice(len(rows), min(n, len(rows)), replace=False))
    return np.ascontiguousarray(rows[pick], dtype=np.float32)


def _recall(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.mean([len(np.intersect1d(g, w)) / len(w) for g, w in zip(got, want)]))


def _graph(storage: str, keys: np.ndarray, m: int, ef_construction: int):
    dim = keys.shape[1]
    if storage == "flat":
        index = faiss.IndexHNSWFlat(dim, m, faiss.METRIC_INNER_PRODUCT)
    else:
        index = faiss.IndexHNSWSQ(dim, QT[storage], m, faiss.METRIC_INNER_PRODUCT)
        index.train(keys)
    index.hnsw.efConstruction = ef_construction
    index.add(keys)
    return index


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--keys", required=True)
    ap.add_argument("--queries", required=True)
    ap.add_argument("--max-keys", type=int, default=262144)
    ap.add_argument("--n-queries", type=int, default=2000)
    ap.add_argument("--k", type=int, default=100)
    ap.add_argument("--m", type=int, default=32)
    ap.add_argument("--ef-construction", type=int, default=200)
    ap.add_argument("--ef-search", type=int, default=200)
    ap.add_argument("--storage", default="flat,fp16,sq8")
    ap.add_argument("--out")
    args = ap.parse_args()
    keys, q = _draw(args.keys, args.max_keys, 0), _draw(args.queries, args.n_queries, 1)
    want = torch.topk(torch.from_numpy(q) @ torch.from_numpy(keys).T, args.k).indices.numpy()
    results = []
    for storage in args.storage.split(","):
        t = time.perf_counter()
        index = _graph(storage, keys, args.m, args.ef_construction)
        build = time.perf_counter() - t
        index.hnsw.efSearch = max(args.ef_search, 2 * args.k)
        t = time.perf_counter()
        _, ids = index.search(q, args.k)
        search = time.perf_counter() - t
        t = time.perf_counter()
        _, wide = index.search(q, 2 * args.k)
        exact = np.einsum("qd,qkd->qk", q, keys[np.maximum(wide, 0)])
        reranked = np.take_along_axis(wide, np.argsort(-exact, axis=1)[:, :args.k], 1)
        rerank = time.perf_counter() - t
        row = {"storage": storage, "keys": len(keys), "build_s": build, "build_ms_per_vector": 1e3 * build / len(keys),
               "ms_per_query": 1e3 * search / len(q), "recall": _recall(ids, want),
               "rerank_ms_per_query": 1e3 * rerank / len(q), "rerank_recall": _recall(reranked, want)}
        print(json.dumps(row), flush=True)
        results.append(row)
        del index
    if args.out:
        meta = {"machine": platform.processor() or platform.machine(), "faiss": faiss.__version__,
                "threads": faiss.omp_get_max_threads(), "date": time.strftime("%Y-%m-%d"), "args": vars(args)}
        with open(args.out, "w") as fh:
            json.dump({"meta": meta, "results": results}, fh, indent=1)


if __name__ == "__main__":
    main()
