"""Benchmark of the alpha fusion's grid search: ``fit_alpha`` with the prepared objective and the in-place blend
against ``fit_alpha`` on ``validation_objective`` and ``fuse`` themselves (the grid before them).

Generates a seeded validation problem (``--points`` x ``--candidates`` shortlists over ``--labels`` labels, about
2.3 positives per point, power-law label frequencies and their inverse propensities, classifier, embedding, kNN
and lexical scores, padding, one filter pair per point), fits the default ``FusionParams`` both ways, checks that
every field of the two fits is equal and prints the wall times, the objective evaluations and the speed ratio,
after the fastest of ``--repeats`` single calls of the objective and of the blend, before and after.

    .venv/bin/python bench/fusion_grid_bench.py                      # 5,000 x 400 x 131,072
    .venv/bin/python bench/fusion_grid_bench.py --points 1000        # a smaller version
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from functools import partial

import numpy as np
import scipy.sparse as sp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from xc_dagster.config import FusionParams  # noqa: E402
from xc_dagster.planning.calibration import best_seconds  # noqa: E402
from xc_dagster.retrieval.fusion import alpha  # noqa: E402
from xc_dagster.retrieval.fusion.objective import ObjectiveOnShortlist  # noqa: E402
from xc_dagster.retrieval.shortlist import Shortlist, fuse  # noqa: E402


def make_problem(n: int, C: int, L: int, seed: int = 0, mean_pos: float = 2.3):
    """A seeded validation problem: the shortlist, its targets, the labels' inverse propensities, filter pairs."""
    rng = np.random.default_rng(seed)
    freq = np.minimum(rng.zipf(1.6, L), 10_000)  # training points per label (power law) of 200,000
    inv_prop = 1.0 + (np.log(200_000) - 1.0) * 2.5 ** 0.55 * np.power(freq + 1.5, -0.55)  # Jain et al., A 0.55
    ids = rng.integers(0, L, (n, C))
    while True:  # redraw the later copies of a label within a row
        order = np.argsort(ids, axis=1, kind="stable")
        s = np.take_along_axis(ids, order, axis=1)
        dup_sorted = np.zeros(ids.shape, dtype=bool)
        dup_sorted[:, 1:] = s[:, 1:] == s[:, :-1]
        if not dup_sorted.any():
            break
        dup = np.zeros(ids.shape, dtype=bool)
        np.put_along_axis(dup, order, dup_sorted, axis=1)
        ids[dup] = rng.integers(0, L, int(dup.sum()))
    npos = rng.poisson(mean_pos, n)
    rows = np.repeat(np.arange(n), npos)
    shortlisted = rng.random(rows.size) < 0.6
    slot = rng.integers(0, C, rows.size)
    cols = np.where(shortlisted, ids[rows, slot], rng.integers(0, L, rows.size))
    Y = sp.csr_matrix((np.ones(rows.size), (rows, cols)), shape=(n, L))
    Y.sum_duplicates()
    Y.data[:] = 1.0
    rel = np.zeros((n, C), dtype=bool)
    rel[rows[shortlisted], slot[shortlisted]] = True
    tail = np.log(inv_prop[ids]) > 0.8
    clf = (rng.normal(0.3, 0.2, (n, C)) + rel * np.where(tail, 0.15, 0.4)).astype(np.float32)
    emb = (rng.normal(0.3, 0.2, (n, C)) + rel * np.where(tail, 0.35, 0.15)).astype(np.float32)
    knn = np.where(rng.random((n, C)) < 0.3, rng.random((n, C)) * 0.5 + rel * 0.3, 0.0).astype(np.float32)
    lex = (rng.random((n, C)) * 0.3 + rel * rng.random((n, C)) * 0.05).astype(np.float32)
    width = C - rng.integers(0, C // 6, n)  # union of the sources: rows end in padding
    pad = np.arange(C)[None, :] >= width[:, None]
    ids[pad] = -1
    clf[pad] = emb[pad] = -np.inf
    knn[pad] = lex[pad] = 0.0
    fr = np.arange(n)
    filter_pairs = np.stack([fr, ids[fr, rng.integers(0, C // 2, n)]], axis=1)
    return Shortlist(ids.astype(np.int64), clf, emb, knn, lex), Y, inv_prop, filter_pairs


def timed_fit(sl: Shortlist, Y: sp.csr_matrix, inv_prop: np.ndarray, filter_pairs: np.ndarray,
              params: FusionParams, slow: bool) -> tuple[dict, float, int]:
    """``fit_alpha``'s fit, its wall time and its objective evaluations; ``slow``: the grid before the
    prepared objective (``validation_objective`` and ``fuse`` at every grid point)."""
    saved = alpha.ObjectiveOnShortlist, alpha.Blend
    calls = [0]

    def counted(*args, **kwargs):
        obj = partial(ObjectiveOnShortlist, prepared=not slow)(*args, **kwargs)
        value = obj.value
        obj.value = lambda s: (calls.__setitem__(0, calls[0] + 1), value(s))[1]
        return obj

    alpha.ObjectiveOnShortlist = counted
    if slow:
        alpha.Blend = lambda shortlist: partial(fuse, shortlist)
    try:
        t0 = time.perf_counter()
        fit = alpha.fit_alpha(sl, Y, params, inv_prop, filter_pairs)
        return fit.to_dict(), time.perf_counter() - t0, calls[0]
    finally:
        alpha.ObjectiveOnShortlist, alpha.Blend = saved


def best_ms(f, repeats: int) -> float:
    """The fastest of ``repeats`` calls of ``f`` in ms (the least disturbed by other work on the machine)."""
    return 1e3 * best_seconds(f, repeats)


def per_call(sl: Shortlist, Y: sp.csr_matrix, inv_prop: np.ndarray, filter_pairs: np.ndarray,
             params: FusionParams, repeats: int) -> dict[str, float]:
    """Fastest single calls at one grid point (a 0.35, c 0.25, d 0.5, b 0.04): the objective and the blend,
    before and after; checks that they agree."""
    blend, boost = alpha.Blend(sl), alpha.propensity_boost(sl.ids, inv_prop)
    s = blend(0.35, 0.25, 0.5) + np.float32(0.04) * boost
    prepared = ObjectiveOnShortlist(sl.ids, Y, params.objective, inv_prop, filter_pairs, 10)
    slow = ObjectiveOnShortlist(sl.ids, Y, params.objective, inv_prop, filter_pairs, 10, prepared=False)
    assert prepared.value(s) == slow.value(s)
    assert np.array_equal(blend(0.35, 0.25, 0.5).view(np.int32), fuse(sl, 0.35, 0.25, 0.5).view(np.int32))
    return {"objective_before_ms": best_ms(lambda: slow.value(s), repeats),
            "objective_ms": best_ms(lambda: prepared.value(s), repeats),
            "fuse_ms": best_ms(lambda: fuse(sl, 0.35, 0.25, 0.5), repeats),
            "blend_ms": best_ms(lambda: blend(0.35, 0.25, 0.5), repeats)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--points", type=int, default=5000)
    ap.add_argument("--candidates", type=int, default=400)
    ap.add_argument("--labels", type=int, default=131_072)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=20, help="single calls timed (the fastest is reported)")
    ap.add_argument("--skip-slow", action="store_true", help="time the prepared grid only")
    args = ap.parse_args()
    t0 = time.perf_counter()
    sl, Y, inv_prop, fp = make_problem(args.points, args.candidates, args.labels, args.seed)
    print(f"problem: {args.points} x {args.candidates} x {args.labels}, {Y.nnz / args.points:.2f} positives per "
          f"point, {(sl.ids >= 0).mean():.3f} of the slots filled, built in {time.perf_counter() - t0:.1f} s")
    params = FusionParams()
    calls = per_call(sl, Y, inv_prop, fp, params, args.repeats)
    print("fastest of {} calls: objective {objective_before_ms:.2f} -> {objective_ms:.2f} ms, fuse {fuse_ms:.2f} -> "
          "blend {blend_ms:.2f} ms".format(args.repeats, **calls))
    fast, t_fast, n_fast = timed_fit(sl, Y, inv_prop, fp, params, slow=False)
    print(f"prepared: {t_fast:.1f} s, {n_fast} evaluations, {1e3 * t_fast / n_fast:.2f} ms each")
    out = {"points": args.points, "candidates": args.candidates, "labels": args.labels, "fast_s": t_fast,
           "evaluations": n_fast, **calls}
    if not args.skip_slow:
        slow, t_slow, n_slow = timed_fit(sl, Y, inv_prop, fp, params, slow=True)
        print(f"before:   {t_slow:.1f} s, {n_slow} evaluations, {1e3 * t_slow / n_slow:.2f} ms each")
        print(f"speed-up {t_slow / t_fast:.2f}x; fits equal in every field: {slow == fast}")
        out.update(slow_s=t_slow, speedup=t_slow / t_fast, equal=slow == fast)
        if slow != fast:
            raise SystemExit("the two fits differ")
    print("fit: " + json.dumps({k: fast[k] for k in ("alpha", "knn_weight", "lexical_weight", "propensity_weight",
                                                     "objective_value")}))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
