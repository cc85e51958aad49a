"""Exact search (``xc_dagster.retrieval.ann.exact_topk``) on one device against the number of keys and the number of
query x key scores a block holds at once (``EXACT_BLOCK_ENTRIES``), and an HNSW graph on the host's cores beside it:
where exact search on a GPU stops paying against the graph, at the 131K and 1.3M shapes' label and point counts.

  python bench/no_tracking.py bench/exact_device_bench.py --keys 131072 524288 1305265 2248619 \\
      --entries 25 27 29 --queries 65536 --hnsw-keys 262144 --out bench/results/exact_device_h200.json
  python bench/no_tracking.py bench/exact_device_bench.py --keys 1305265 2248619 --entries 25 0 --mining \\
      --hnsw-keys 0 --out bench/results/exact_device_h200_library.json

Keys with the data's structure (random keys tie, and the low-precision pass would send most queries to fp32): up
to ``--labels`` unit label vectors are the keys themselves; more keys are points, each the normalised sum of
``--per-point`` random labels' vectors plus noise (the kNN index over training points). Queries are such points
drawn apart from the keys. Each (keys, entries) pair searches the same queries (a warm-up block first); every
pair's top k is checked against the first entries' (same ids; fp32 products of other block shapes may order
near-ties otherwise). ``--mining``: mining's ``retrieve`` over the label source with kind ``auto``. HNSW:
``LabelIndex("hnsw")`` (M 32, efC 200, efS 200, the stages' defaults) over the first ``--hnsw-keys`` keys of each
size, build seconds per vector and search ms per query with recall@k against exact search, on the host's threads.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import numpy as np
import torch

from xc_dagster.device import resolve_device
from xc_dagster.retrieval import ann
from xc_dagster.retrieval.ann import LabelIndex, exact_topk
from xc_dagster.retrieval.exact_settings import exact_block_entries
from xc_dagster.retrieval.shortlist import build_sources, retrieve


def points(labels: torch.Tensor, n: int, per_point: int, noise: float, gen: torch.Generator) -> torch.Tensor:
    """``n`` rows: the normalised sum of ``per_point`` random rows of ``labels`` plus Gaussian noise of norm
    ~``noise``, built in blocks on ``labels``' device."""
    out = torch.empty((n, labels.shape[1]), dtype=torch.float32)
    for s in range(0, n, 1 << 16):
        e = min(s + (1 << 16), n)
        ids = torch.randint(0, len(labels), (e - s, per_point), generator=gen, device="cpu").to(labels.device)
        x = labels[ids].sum(1)
        x += torch.randn(x.shape, device=x.device) * (noise / x.shape[1] ** .5)
        out[s:e] = torch.nn.functional.normalize(x, dim=1).cpu()
    return out


def recall(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.mean([len(np.intersect1d(a[a >= 0], b[b >= 0])) / max((b >= 0).sum(), 1)
                          for a, b in zip(got, want)]))


def search(queries: np.ndarray, keys: np.ndarray, k: int, entries: int, device: torch.device) -> dict:
    """One warm-up block, then every query: queries/s, the share searched again in fp32, peak device memory."""
    ann.exact_block_entries = (lambda d: 1 << entries) if entries else exact_block_entries  # 0: the library's
    cache: dict = {}
    exact_topk(queries[:256], keys, k, device=device, cache=cache)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    cache.update(low_searched=0, low_redone=0)
    t = time.perf_counter()
    _, ids = exact_topk(queries, keys, k, device=device, cache=cache)
    sec = time.perf_counter() - t
    entries = entries or exact_block_entries(device).bit_length() - 1
    row = {"entries_log2": entries, "block_queries": max(1, min(4096, (1 << entries) // len(keys))),
           "seconds": round(sec, 3), "queries_per_second": round(len(queries) / sec, 1),
           "redone_share": round(cache.get("low_redone", 0) / max(cache.get("low_searched", 0), 1), 4),
           "fp32_only": bool(cache.get("fp32_only"))}
    if device.type == "cuda":
        row["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    return row, ids


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--keys", type=int, nargs="+", default=[131_072, 1_305_265, 2_248_619])
    ap.add_argument("--labels", type=int, default=1_305_265, help="label vectors; more keys than this are points")
    ap.add_argument("--entries", type=int, nargs="+", default=[25, 27, 29],
                    help="log2 of the scores a block holds (0: the library's choice on this device)")
    ap.add_argument("--queries", type=int, default=65_536)
    ap.add_argument("--per-point", type=int, default=4)
    ap.add_argument("--dim", type=int, default=384)
    ap.add_argument("--k", type=int, default=100)
    ap.add_argument("--hnsw-keys", type=int, default=262_144, help="0: no HNSW rows")
    ap.add_argument("--hnsw-queries", type=int, default=4096)
    ap.add_argument("--mining", action="store_true", help="also time mining's retrieve over each label-sized key set")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    device = resolve_device(a.device)
    gen = torch.Generator().manual_seed(a.seed)
    labels = torch.nn.functional.normalize(torch.randn((a.labels, a.dim), generator=gen), dim=1)
    on = labels.to(device)
    result = {"machine": {"platform": platform.platform(), "threads": torch.get_num_threads(), "device": str(device),
                          "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
                          "torch": torch.__version__, "exact_dtype": str(ann.exact_dtype(device))},
              "args": vars(a) | {"out": str(a.out)}, "rows": []}
    for n in a.keys:
        keys = (labels[:n] if n <= a.labels else points(on, n, a.per_point, 1.0, gen)).numpy()
        queries = points(on[:min(n, a.labels)], a.queries, a.per_point, 1.0, gen).numpy()
        first = None
        for entries in a.entries:
            row, ids = search(queries, keys, a.k, entries, device)
            first = ids if first is None else first
            row.update(keys=n, queries=len(queries), same_ids_as_first=bool((ids == first).all()),
                       rows_differing_from_first=int((ids != first).any(1).sum()),
                       recall_against_first=round(recall(ids, first), 6))
            result["rows"].append(row)
            print(json.dumps(row), flush=True)
            if a.out:
                a.out.write_text(json.dumps(result, indent=2))
        if a.mining and n <= a.labels:  # mining's path: retrieve over the label source, kind auto
            src = build_sources(("label",), keys, keys, None, None, None, "text", "auto", 32, 200, 200)
            retrieve(queries[:1024], src, a.k, classifier_scores=False)
            t = time.perf_counter()
            retrieve(queries, src, a.k, classifier_scores=False)
            sec = time.perf_counter() - t
            row = {"mining_keys": n, "kind": src.indexes["label"].kind,
                   "points_per_second": round(len(queries) / sec, 1)}
            result["rows"].append(row)
            print(json.dumps(row), flush=True)
        if a.hnsw_keys:
            m = min(n, a.hnsw_keys)
            t = time.perf_counter()
            index = LabelIndex("hnsw", keys[:m], m=32, ef_construction=200, ef_search=200)
            build = time.perf_counter() - t
            q = queries[:a.hnsw_queries]
            t = time.perf_counter()
            _, got = index.search(q, a.k)
            sec = time.perf_counter() - t
            _, want = exact_topk(q, keys[:m], a.k, device=device)
            row = {"hnsw_of_keys": n, "hnsw_keys": m, "build_seconds": round(build, 1),
                   "build_ms_per_vector": round(1e3 * build / m, 3),
                   "search_ms_per_query": round(1e3 * sec / len(q), 3),
                   "recall_at_k": round(recall(got, want), 4)}
            result["rows"].append(row)
            print(json.dumps(row), flush=True)
            if a.out:
                a.out.write_text(json.dumps(result, indent=2))
        del keys, queries


if __name__ == "__main__":
    main()
