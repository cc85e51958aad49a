"""Time ``knn_label_scores`` (the kNN source's label votes) on a block of queries at a given shape: the (training
points x labels) matrix as the index stage saves it (float32) and as the sources now hold it (float64), with the
shortlist's top-k through the sort and through the packed partition.

    python bench/knn_votes_bench.py --points 2248619 --labels 1305265 --per-point 22 --queries 1024 --neighbours 100

Neighbours are drawn uniformly (every neighbour's labels distinct: the most label entries per query)."""

from __future__ import annotations

import argparse
import json

import numpy as np
import scipy.sparse as sp

from xc_dagster.planning.calibration import best_seconds
from xc_dagster.retrieval import shortlist, sparse_rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--points", type=int, default=2_248_619)
    ap.add_argument("--labels", type=int, default=1_305_265)
    ap.add_argument("--per-point", type=int, default=22)
    ap.add_argument("--queries", type=int, default=1024)
    ap.add_argument("--neighbours", type=int, default=100)
    ap.add_argument("--k", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    rng = np.random.default_rng(a.seed)
    nnz = a.points * a.per_point
    Y = sp.csr_matrix((np.ones(nnz, np.float32), rng.integers(0, a.labels, nnz, dtype=np.int32),
                       np.arange(0, nnz + 1, a.per_point)), shape=(a.points, a.labels))
    nbrs = rng.integers(0, a.points, (a.queries, a.neighbours))
    sims = rng.random((a.queries, a.neighbours), dtype=np.float32)
    Y64 = Y.astype(np.float64)
    votes = sp.csr_matrix((sims.ravel().astype(np.float64), (np.repeat(np.arange(a.queries), a.neighbours),
                                                             nbrs.ravel())), shape=(a.queries, a.points)) @ Y64
    out = {"args": vars(a), "entries_per_query": votes.nnz / a.queries,
           "float32_matrix_s": best_seconds(lambda: shortlist.knn_label_scores(nbrs, sims, Y, a.k), a.repeats),
           "float64_matrix_s": best_seconds(lambda: shortlist.knn_label_scores(nbrs, sims, Y64, a.k), a.repeats),
           "topk_sort_s": best_seconds(lambda: sparse_rows.sparse_topk(votes, a.k, packed_share=np.inf), a.repeats),
           "topk_packed_s": best_seconds(lambda: sparse_rows.sparse_topk(votes, a.k, packed_share=0.0), a.repeats)}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
