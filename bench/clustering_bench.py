"""Time NGAME's balanced hierarchical 2-means against N (unit vectors, D=384, clusters of 16 points).

  python bench/clustering_bench.py [--sizes 50000 100000 300000] [--dim 384] [--cluster-size 16]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from xc_dagster.sampling.clustering import balanced_clusters


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", type=int, nargs="+", default=[50_000, 100_000, 300_000])
    ap.add_argument("--dim", type=int, default=384)
    ap.add_argument("--cluster-size", type=int, default=16)
    args = ap.parse_args()
    print(f"torch threads {torch.get_num_threads()}")
    for n in args.sizes:
        X = np.random.default_rng(0).standard_normal((n, args.dim)).astype(np.float32)
        X /= np.linalg.norm(X, axis=1, keepdims=True)
        t = time.perf_counter()
        lab = balanced_clusters(X, args.cluster_size)
        dt = time.perf_counter() - t
        sizes = np.bincount(lab)
        print(f"N={n:>8} D={args.dim} C={args.cluster_size}: {dt:6.1f} s, {len(sizes)} clusters, "
              f"sizes {sizes.min()}-{sizes.max()}")


if __name__ == "__main__":
    main()
