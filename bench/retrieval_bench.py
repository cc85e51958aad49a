"""Time evaluation's retrieval (``retrieve``: every source's search, the union's scores, the lexical source) per
query on a generated dataset of a named shape, on this machine's threads and on one, with the union's scores
where exact search runs and on the host.

  python bench/retrieval_bench.py --shape 131k --queries 16384 --out retrieval_131k.json

The lexical source is fitted on the generated texts as the index stage fits it (``index.lexical_*`` defaults);
the dense sources (W, label embeddings, the kNN over training points) are exact indexes over vectors with the
data's structure: unit label vectors, each point the normalised sum of its labels' vectors plus noise, so a
query's nearest keys stand out as a trained encoder's do (random keys would tie and send exact search to its
fp32 second pass). Sources W, label, knn, lexical: those of the 131K runs in bench/SCALE.md.
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path

import numpy as np
import scipy.sparse as sp
import torch

from xc_dagster.config import resolve_config
from xc_dagster.data.lf_raw import read_lf_raw
from xc_dagster.data.synthetic import generate, shape_spec
from xc_dagster.device import resolve_device
from xc_dagster.retrieval.lexical import LexicalIndex
from xc_dagster.retrieval.shortlist import build_sources, retrieve

SOURCES = ("W", "label", "knn", "lexical")


def structured(Y: sp.csr_matrix, labels: np.ndarray, noise: float, rng: np.random.Generator) -> np.ndarray:
    """Rows: the normalised sum of their labels' vectors plus Gaussian noise of norm ~``noise``."""
    X = np.asarray(Y.astype(np.float32) @ labels)
    X += rng.standard_normal(X.shape, dtype=np.float32) * np.float32(noise / X.shape[1] ** .5)
    return X / np.maximum(np.linalg.norm(X, axis=1, keepdims=True), 1e-12)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="131k")
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--queries", type=int, default=16_384)
    ap.add_argument("--dim", type=int, default=384)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    p = resolve_config("quick", "ngame").index
    rng = np.random.default_rng(a.seed)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        generate(shape_spec(a.shape, a.scale, seed=a.seed), Path(tmp) / "data")
        ds = read_lf_raw(Path(tmp) / "data", ["title"], ["title"])
    t_read = time.perf_counter() - t0
    lex = LexicalIndex.fit(ds.train_texts, ds.label_texts, ds.Y_train, p.lexical_neighbours, p.lexical_min_df,
                           max_postings=p.lexical_max_postings if len(ds.train_texts) > p.lexical_exact_points else 0)
    t_fit = time.perf_counter() - t0 - t_read
    lv = rng.standard_normal((ds.Y_train.shape[1], a.dim), dtype=np.float32)
    lv /= np.linalg.norm(lv, axis=1, keepdims=True)
    points = structured(ds.Y_train, lv, 1.0, rng)
    n = min(a.queries, len(ds.test_texts))
    queries = structured(ds.Y_test[:n], lv, 1.0, rng)
    lex_q = lex.transform(ds.test_texts[:n])
    src = build_sources(SOURCES, lv, lv, None, points, ds.Y_train, "text", "exact", p.hnsw_m, p.hnsw_ef_construction,
                        p.hnsw_ef_search, lexical=lex)
    threads, auto = torch.get_num_threads(), resolve_device("auto")
    runs, configs = [], {(threads, auto.type), (threads, "cpu"), (1, auto.type)}  # a CPU machine: two
    first = None
    for t, dev in sorted(configs, key=lambda c: (-c[0], c[1] == "cpu")):
        dev = torch.device(dev)
        torch.set_num_threads(t)
        retrieve(queries[:1024], src, p.shortlist_size, lexical_queries=lex_q[:1024], device=dev)  # warm
        s = time.perf_counter()
        sl = retrieve(queries, src, p.shortlist_size, lexical_queries=lex_q, device=dev)
        sec = time.perf_counter() - s
        runs.append({"threads": t, "union_device": dev.type, "seconds": round(sec, 2),
                     "ms_per_query": round(1000 * sec / n, 3), "queries_per_second": round(n / sec, 1),
                     "candidates_per_query": round(float((sl.ids >= 0).sum(1).mean()), 1)})
        if first is None:  # each later run's shortlist against the first's
            first = sl
        ok = first.ids >= 0
        runs[-1].update({"same_ids_as_first": bool((sl.ids == first.ids).all()),
                         "max_score_difference": float(max(np.abs(sl.clf[ok] - first.clf[ok]).max(initial=0),
                                                           np.abs(sl.emb[ok] - first.emb[ok]).max(initial=0)))})
        print(runs[-1], flush=True)
    torch.set_num_threads(threads)
    result = {"shape": a.shape, "scale": a.scale, "points": len(ds.train_texts), "labels": int(ds.Y_train.shape[1]),
              "queries": n, "dim": a.dim, "sources": SOURCES, "k": p.shortlist_size,
              "read_seconds": round(t_read, 1), "lexical_fit_seconds": round(t_fit, 1), "runs": runs,
              "machine": {"platform": platform.platform(), "processor": platform.processor(), "threads": threads,
                          "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}}
    if a.out:
        a.out.write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
