"""NGAME's balanced hierarchical 2-means: balance, quality on planted clusters, batching."""

from __future__ import annotations

import numpy as np

from xc_dagster.clustering import balanced_clusters, cluster_batches


def _planted(n_clusters: int, per: int, dim: int = 16, noise: float = 0.05, seed: int = 0):
    rng = np.random.default_rng(seed)
    centers = rng.standard_normal((n_clusters, dim))
    truth = np.repeat(np.arange(n_clusters), per)
    X = centers[truth] + noise * rng.standard_normal((len(truth), dim))
    X /= np.linalg.norm(X, axis=1, keepdims=True)
    perm = rng.permutation(len(truth))
    return X[perm].astype(np.float32), truth[perm]


def test_sizes_within_one_and_every_point_assigned():
    X = np.random.default_rng(1).standard_normal((1003, 8)).astype(np.float32)
    lab = balanced_clusters(X, cluster_size=10, seed=0)
    sizes = np.bincount(lab)
    assert lab.shape == (1003,) and sizes.sum() == 1003
    assert sizes.max() <= 10 and sizes.max() - sizes.min() <= 1
    assert len(sizes) == 128  # 1003 -> 502/501 -> ... 7 levels down to 8 points per cluster


def test_recovers_planted_clusters():
    X, truth = _planted(n_clusters=16, per=32)
    lab = balanced_clusters(X, cluster_size=32, seed=0)
    # each found cluster is pure: all its points come from one planted cluster
    purity = np.mean([np.bincount(truth[lab == c]).max() / np.sum(lab == c) for c in np.unique(lab)])
    assert purity >= 0.95


def test_deterministic_and_trivial_sizes():
    X, _ = _planted(8, 20)
    assert np.array_equal(balanced_clusters(X, 16, seed=3), balanced_clusters(X, 16, seed=3))
    assert np.array_equal(balanced_clusters(X, 1), np.arange(len(X)))


def test_cluster_batches_cover_rows_once_in_whole_clusters():
    lab = np.repeat(np.arange(10), 5)  # 10 clusters of 5
    rows = np.arange(50)[np.arange(50) % 7 != 0]  # some rows held out
    batches = cluster_batches(lab, rows, batch_size=12, rng=np.random.default_rng(0))
    allrows = np.concatenate(batches)
    assert sorted(allrows.tolist()) == sorted(rows.tolist())
    for b in batches:  # a batch holds whole clusters (restricted to rows)
        for c in np.unique(lab[b]):
            assert set(b[lab[b] == c]) == set(rows[lab[rows] == c])
