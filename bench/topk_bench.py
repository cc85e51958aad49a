"""Exact search's selection of each query's candidates: ``ann.row_topk`` (the maxima of groups of 16 keys first)
against one ``torch.topk`` over every key, inside ``exact_topk`` on a trained model's own vectors, interleaved in
one process (so the machine's drift hits both alike): ms per query and whether the ids agree.

  python bench/topk_bench.py --queries Q.npy --vectors W=$A/classifier/W.npy \\
      --vectors label_emb=$A/pretrain/label_emb.npy --vectors points=$A/pretrain/train_emb.npy \\
      --precision int8 --out topk_131k.json
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import numpy as np
import torch

from xc_dagster.retrieval import ann

RESULTS = Path(__file__).parent / "results"


def _whole_row_topk(sim: torch.Tensor, k: int, sorted: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.topk(sim, k, dim=1, sorted=sorted)


def _time(queries: np.ndarray, keys: np.ndarray, k: int, precision: str, cache: dict,
          select) -> tuple[float, np.ndarray, np.ndarray]:
    """ms per query of ``exact_topk`` with ``select`` as its selection over every key; its scores and ids."""
    grouped, ann.row_topk = ann.row_topk, select
    try:
        t = time.perf_counter()
        scores, ids = ann.exact_topk(queries, keys, k, precision=precision, cache=cache)
        return 1e3 * (time.perf_counter() - t) / len(queries), scores, ids
    finally:
        ann.row_topk = grouped


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--queries", required=True)
    ap.add_argument("--vectors", action="append", required=True, help="NAME=PATH.npy, repeatable")
    ap.add_argument("--n-queries", type=int, default=8192)
    ap.add_argument("--k", type=int, default=100)
    ap.add_argument("--precision", default="auto", choices=("auto", "fp32", "bf16", "int8"))
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out")
    a = ap.parse_args()
    q_all = np.load(a.queries, mmap_mode="r")
    rows = np.sort(np.random.default_rng(a.seed).choice(len(q_all), min(a.n_queries, len(q_all)), replace=False))
    q = np.ascontiguousarray(q_all[rows], dtype=np.float32)
    out = {"queries": len(q), "k": a.k, "precision": a.precision, "threads": torch.get_num_threads(),
           "machine": platform.platform(), "keys": {}}
    grouped = ann.row_topk
    for spec in a.vectors:
        name, path = spec.split("=", 1)
        keys = np.ascontiguousarray(np.load(path), dtype=np.float32)
        cache: dict = {}
        ann.exact_topk(q[:256], keys, a.k, precision=a.precision, cache=cache)  # keys' tensors and buffers made
        res = {"n_keys": len(keys), "torch_topk_ms": [], "row_topk_ms": [], "rows_with_other_ids": [],
               "max_score_difference": 0.0}
        for _ in range(a.reps):
            t_whole, s_whole, i_whole = _time(q, keys, a.k, a.precision, cache, _whole_row_topk)
            t_grouped, s_grouped, i_grouped = _time(q, keys, a.k, a.precision, cache, grouped)
            res["torch_topk_ms"].append(round(t_whole, 4))
            res["row_topk_ms"].append(round(t_grouped, 4))
            res["rows_with_other_ids"].append(int((i_whole != i_grouped).any(axis=1).sum()))
            res["max_score_difference"] = max(res["max_score_difference"], float(np.abs(s_whole - s_grouped).max()))
        out["keys"][name] = res
        print(name, json.dumps(res))
    if a.out:
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / a.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
