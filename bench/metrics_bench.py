"""Benchmark of :func:`xc_dagster.evaluation.metrics.evaluate` against a straightforward scipy-sparse reference.

Generates a seeded extreme-classification test problem (power-law label frequencies, ~2.5 positives per
row with some empty rows, K predictions per row with float32 scores that tie now and then, duplicate
predictions, one filter pair per row), evaluates it with ``evaluate`` (indices + scores + filter pairs +
inverse propensities) and with :func:`reference_evaluate` (the same definitions written the pyxclib way:
a global sort for the ranking, sparse top-k prediction matrices multiplied elementwise with Y, row sums),
checks that every metric agrees to 1e-9 and reports wall times, peak memory and the speed ratio.

    .venv/bin/python bench/metrics_bench.py --rows 1000000 --labels 1000000 --topk 100 --ks 1,3,5
    .venv/bin/python bench/metrics_bench.py --rows 100000 --labels 100000     # a smaller version
    .venv/bin/python bench/metrics_bench.py --rows 1000000 --no-reference     # ours only
"""

from __future__ import annotations

import argparse
import gc
import os
import resource
import sys
import time
import tracemalloc
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import scipy.sparse as sp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from xc_dagster.evaluation.metrics import evaluate  # noqa: E402

# ------------------------------------------------------------------------------------------ problem


def power_law_labels(rng: np.random.Generator, size: int | tuple[int, ...], L: int, a: float,
                     perm: np.ndarray) -> np.ndarray:
    """Label ids with P(rank r) ~ r^-a (continuous inverse CDF), ranks mapped to ids by ``perm``."""
    u = rng.random(size)
    hi = (L + 1.0) ** (1.0 - a)
    x = ((hi - 1.0) * u + 1.0) ** (1.0 / (1.0 - a))  # in [1, L + 1)
    r = np.minimum(x.astype(np.int64) - 1, L - 1)
    return perm[r]


def make_problem(n: int, L: int, K: int, seed: int = 0, a: float = 0.9, mean_pos: float = 2.5,
                 chunk: int = 100_000) -> dict[str, Any]:
    """A seeded test problem: Y (CSR), indices (int32, n x K), scores (float32), filter pairs, inv_prop."""
    rng = np.random.default_rng(seed)
    perm = rng.permutation(L).astype(np.int32)
    # positives: Poisson(mean_pos) per row (about 8% of rows empty), power-law labels
    npos = rng.poisson(mean_pos, n)
    cols = power_law_labels(rng, int(npos.sum()), L, a, perm)
    rows = np.repeat(np.arange(n), npos)
    Y = sp.csr_matrix((np.ones(cols.size, dtype=np.float32), (rows, cols)), shape=(n, L))
    Y.sum_duplicates()
    Y.data[:] = 1.0
    # predictions: per row, its true labels at random slots with probability 0.7, the rest power-law
    # labels (so duplicates happen) scored lower on average; scores rounded to 1e-3 so that ties happen,
    # also at the top-k boundary
    indices = np.empty((n, K), dtype=np.int32)
    scores = np.empty((n, K), dtype=np.float32)
    for r0 in range(0, n, chunk):
        r1 = min(n, r0 + chunk)
        nb = r1 - r0
        indices[r0:r1] = power_law_labels(rng, (nb, K), L, a, perm)
        scores[r0:r1] = np.round(0.9 * rng.random((nb, K), dtype=np.float32), 3)
    # plant true labels: the j-th positive of row i goes to a random column with a boosted score
    Yc = Y.tocoo()
    plant = rng.random(Yc.nnz) < 0.7
    pr, pc = Yc.row[plant], Yc.col[plant]
    slot = rng.integers(0, K, pr.size)
    indices[pr, slot] = pc
    scores[pr, slot] = np.round(0.7 + 0.3 * rng.random(pr.size, dtype=np.float32), 3)
    # padding in 1% of rows: the last 10 predictions missing
    pad_rows = rng.random(n) < 0.01
    indices[pad_rows, K - 10:] = -1
    scores[pad_rows, K - 10:] = -np.inf
    # one filter pair per row: half of them one of the row's top-scored predictions, half a random label
    best = indices[np.arange(n), np.argmax(scores, axis=1)].astype(np.int64)
    rand = rng.integers(0, L, n)
    flab = np.where(rng.random(n) < 0.5, best, rand)
    flab = np.where(flab < 0, rand, flab)
    filter_pairs = np.stack([np.arange(n, dtype=np.int64), flab], axis=1)
    # inverse propensities from a synthetic training set 3x larger with the same label distribution
    n_train = 3 * n
    freq = np.bincount(Y.indices, minlength=L).astype(np.float64) * 3.0
    counts = rng.poisson(freq)
    A, B = 0.55, 1.5
    C = (np.log(n_train) - 1.0) * (B + 1.0) ** A
    inv_prop = 1.0 + C * np.power(counts + B, -A)
    return {"Y": Y, "indices": indices, "scores": scores, "filter_pairs": filter_pairs, "inv_prop": inv_prop}


# ---------------------------------------------------------------------------------------- reference


def reference_evaluate(indices: np.ndarray, scores: np.ndarray, Y: sp.csr_matrix, ks: Sequence[int],
                       inv_prop: np.ndarray, filter_pairs: np.ndarray) -> dict[str, float]:
    """The same definitions as ``evaluate`` (scores given), written plainly with numpy + scipy.sparse.

    Ranking: one global ``np.lexsort`` of all (row, -score, label) entries after dropping padding and
    filtered pairs; later copies of a label in a row are misses. Metrics: sparse 0/1 top-k matrices
    multiplied elementwise with Y (and with the discounts / propensities), summed per row.
    """
    n, K = indices.shape
    L = Y.shape[1]
    kmax = max(ks)
    rows = np.repeat(np.arange(n, dtype=np.int64), K)
    cols = indices.ravel().astype(np.int64)
    negv = -scores.ravel().astype(np.float64)
    keep = cols >= 0
    keys = rows * L + np.maximum(cols, 0)
    keep &= ~np.isin(keys, filter_pairs[:, 0] * L + filter_pairs[:, 1])
    rows, cols, negv, keys = rows[keep], cols[keep], negv[keep], keys[keep]
    order = np.lexsort((cols, negv, rows))
    rows, cols, keys = rows[order], cols[order], keys[order]
    cnt = np.bincount(rows, minlength=n)
    rank = np.arange(rows.size) - (np.cumsum(cnt) - cnt)[rows]
    top = rank < kmax
    rows, cols, keys, rank = rows[top], cols[top], keys[top], rank[top]
    _, first = np.unique(keys, return_index=True)  # first copy (best rank) of each (row, label)
    rows, cols, rank = rows[first], cols[first], rank[first]

    Yb = Y.copy().tocsr()
    Yb.data = (Yb.data != 0).astype(np.float64)
    Yb.eliminate_zeros()
    npos = np.diff(Yb.indptr)
    disc = 1.0 / np.log2(np.arange(2, kmax + 2, dtype=np.float64))
    # ideal propensity-weighted ranking of each row's true labels
    Yw = Yb.multiply(inv_prop[None, :]).tocsr()
    yr = np.repeat(np.arange(n), np.diff(Yw.indptr))
    o = np.lexsort((-Yw.data, yr))
    ydata, yr = Yw.data[o], yr[o]
    yrank = np.arange(yr.size) - (np.cumsum(npos) - npos)[yr]
    ip_total = np.asarray(Yw.sum(axis=1)).ravel()
    has_pos_labels = np.count_nonzero(Yb.getnnz(axis=0))

    out: dict[str, float] = {}
    for k in ks:
        m = rank < k
        Pk = sp.csr_matrix((np.ones(int(m.sum())), (rows[m], cols[m])), shape=(n, L))
        Dk = sp.csr_matrix((disc[rank[m]], (rows[m], cols[m])), shape=(n, L))
        H = Pk.multiply(Yb).tocsr()
        H.eliminate_zeros()
        hits = np.asarray(H.sum(axis=1)).ravel()
        dcg = np.asarray(Dk.multiply(Yb).sum(axis=1)).ravel()
        nid = np.minimum(npos, k)
        idcg = np.cumsum(disc)[np.maximum(nid, 1) - 1]
        ps_hits = np.asarray(H.multiply(inv_prop[None, :]).sum(axis=1)).ravel()
        ps_dcg = np.asarray(Dk.multiply(Yb).multiply(inv_prop[None, :]).sum(axis=1)).ravel()
        im = yrank < k
        ideal = np.bincount(yr[im], weights=ydata[im], minlength=n)
        ideal_dcg = np.bincount(yr[im], weights=ydata[im] * disc[yrank[im]], minlength=n)
        out[f"precision_at_{k}"] = hits.sum() / (n * k)
        out[f"ndcg_at_{k}"] = np.where(npos > 0, dcg / idcg, 0.0).sum() / n
        out[f"recall_at_{k}"] = np.where(npos > 0, hits / np.maximum(npos, 1), 0.0).sum() / n
        out[f"psprecision_at_{k}"] = (ps_hits.sum() / k) / (ideal.sum() / k)
        out[f"psndcg_at_{k}"] = ps_dcg.sum() / ideal_dcg.sum()
        out[f"psrecall_at_{k}"] = np.where(ip_total > 0, ps_hits / np.where(ip_total > 0, ip_total, 1),
                                           0.0).sum() / n
        out[f"coverage_at_{k}"] = np.count_nonzero(Pk.getnnz(axis=0)) / L
        out[f"correct_coverage_at_{k}"] = np.count_nonzero(H.getnnz(axis=0)) / has_pos_labels
    return {key: float(v) for key, v in out.items()}


# -------------------------------------------------------------------------------------------- timing


def timed(fn: Callable[[], dict[str, float]], repeats: int) -> tuple[dict[str, float], list[float], float]:
    """Run ``fn`` ``repeats`` times (wall seconds each), then once under tracemalloc for its peak (MiB)."""
    times = []
    res: dict[str, float] = {}
    for _ in range(repeats):
        gc.collect()
        t0 = time.perf_counter()
        res = fn()
        times.append(time.perf_counter() - t0)
    gc.collect()
    tracemalloc.start()
    fn()
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return res, times, peak / 2**20


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=1_000_000, help="test points n (default 1M)")
    ap.add_argument("--labels", type=int, default=1_000_000, help="labels L (default 1M)")
    ap.add_argument("--topk", type=int, default=100, help="predictions per row K (default 100)")
    ap.add_argument("--ks", default="1,3,5", help="comma-separated k values (default 1,3,5)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=3, help="timed runs of ours (best reported)")
    ap.add_argument("--ref-repeats", type=int, default=1, help="timed runs of the reference")
    ap.add_argument("--block-rows", type=int, default=65536)
    ap.add_argument("--no-reference", action="store_true", help="time ours only")
    args = ap.parse_args(argv)
    ks = tuple(int(k) for k in args.ks.split(","))

    t0 = time.perf_counter()
    prob = make_problem(args.rows, args.labels, args.topk, args.seed)
    print(f"problem: n={args.rows:,} L={args.labels:,} K={args.topk} ks={ks} nnz(Y)={prob['Y'].nnz:,} "
          f"filter pairs={len(prob['filter_pairs']):,} (generated in {time.perf_counter() - t0:.1f} s)")
    print(f"load: {os.getloadavg()}")

    def ours() -> dict[str, float]:
        return evaluate(prob["indices"], prob["Y"], ks=ks, inv_prop=prob["inv_prop"],
                        filter_pairs=prob["filter_pairs"], scores=prob["scores"], block_rows=args.block_rows)

    res, times, peak = timed(ours, args.repeats)
    print(f"ours:      best {min(times):.2f} s  (runs: {', '.join(f'{t:.2f}' for t in times)})  "
          f"peak extra memory {peak:.0f} MiB (tracemalloc)")
    print(f"load: {os.getloadavg()}")
    if not args.no_reference:
        def ref() -> dict[str, float]:
            return reference_evaluate(prob["indices"], prob["scores"], prob["Y"], ks, prob["inv_prop"],
                                      prob["filter_pairs"])

        ref_res, ref_times, ref_peak = timed(ref, args.ref_repeats)
        print(f"reference: best {min(ref_times):.2f} s  (runs: {', '.join(f'{t:.2f}' for t in ref_times)})  "
              f"peak extra memory {ref_peak:.0f} MiB (tracemalloc)")
        worst = max(abs(res[key] - ref_res[key]) for key in ref_res)
        missing = set(ref_res) ^ set(res)
        print(f"speed ratio reference/ours: {min(ref_times) / min(times):.1f}x; max |difference| over "
              f"{len(ref_res)} metrics: {worst:.2e}")
        if missing or worst > 1e-9:
            print(f"MISMATCH: keys differing {sorted(missing)}; worst difference {worst:.3e}")
            return 1
    print(f"process max RSS: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10:.0f} MiB "
          f"(inputs included)")
    for key in sorted(res):
        print(f"  {key:28s} {res[key]:.6f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
