"""Balanced hierarchical 2-means (NGAME Algorithm 1's clustering, as in its reference code).

Every cluster is split in two by 2-means whose assignment is balanced: points are ranked by the difference of
their similarity to the two centroids and the top half goes left, the rest right; centroids are re-estimated
until the mean similarity improves by less than ``tol``. Splitting recurses until clusters hold at most
``cluster_size`` points, so sizes end within one of each other. All clusters of one level are split at once
as a padded (groups x members x dim) tensor: the work per level is O(N * D * iterations), with no Python loop
over clusters.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F


def _split_level(X: torch.Tensor, idx: torch.Tensor, gen: torch.Generator, tol: float,
                 max_iter: int) -> torch.Tensor:
    """Split each row-group of ``idx`` (G x m, -1 padded) into two balanced halves: returns (2G x ceil(m/2))."""
    G, m = idx.shape
    valid = idx >= 0
    n = valid.sum(1)  # members per group (m or m - 1)
    n_left = (n + 1) // 2
    Xg = X[idx.clamp_min(0)] * valid.unsqueeze(-1)  # (G, m, D)
    # two distinct random members per group as initial centroids
    r = torch.rand(G, m, generator=gen).masked_fill(~valid, -1.0)
    first_two = r.topk(2, dim=1).indices  # (G, 2)
    cent = F.normalize(torch.gather(Xg, 1, first_two.unsqueeze(-1).expand(-1, -1, Xg.shape[-1])), dim=-1)
    ranks_pos = torch.arange(m).unsqueeze(0)
    prev = -math.inf
    for _ in range(max_iter):
        sims = torch.einsum("gmd,gkd->gmk", Xg, cent)  # (G, m, 2)
        diff = (sims[..., 0] - sims[..., 1]).masked_fill(~valid, -math.inf)
        order = diff.argsort(dim=1, descending=True, stable=True)
        rank = torch.empty_like(order)
        rank.scatter_(1, order, ranks_pos.expand(G, -1))
        left = (rank < n_left.unsqueeze(1)) & valid
        right = valid & ~left
        obj = float((torch.where(left, sims[..., 0], sims[..., 1]) * valid).sum() / valid.sum())
        c_left = (Xg * left.unsqueeze(-1)).sum(1)
        c_right = (Xg * right.unsqueeze(-1)).sum(1)
        cent = F.normalize(torch.stack([c_left, c_right], dim=1), dim=-1)
        if obj - prev < tol:
            break
        prev = obj
    half = (m + 1) // 2
    # members of each side, in rank order, padded to `half`
    side_rank = torch.where(left, rank, rank - n_left.unsqueeze(1))  # position within its side
    out = torch.full((G, 2, half), -1, dtype=idx.dtype)
    g = torch.arange(G).unsqueeze(1).expand(-1, m)
    s = (~left).long()
    out[g[valid], s[valid], side_rank[valid]] = idx[valid]
    return out.reshape(2 * G, half)


def balanced_clusters(X: np.ndarray | torch.Tensor, cluster_size: int, seed: int = 0, tol: float = 1e-4,
                      max_iter: int = 20) -> np.ndarray:
    """Cluster the rows of ``X`` (unit vectors) into ceil-balanced clusters of at most ``cluster_size``.

    Returns an (N,) int64 array of cluster ids 0..K-1 (K = 2^levels >= N / cluster_size); sizes differ by
    at most one. ``cluster_size`` <= 1 puts every point in its own cluster.
    """
    Xt = torch.as_tensor(np.asarray(X, dtype=np.float32))
    N = Xt.shape[0]
    if cluster_size <= 1 or N <= 1:
        return np.arange(N, dtype=np.int64)
    Xt = F.normalize(Xt, dim=-1)
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randperm(N, generator=gen).unsqueeze(0)
    while idx.shape[1] > cluster_size:
        idx = _split_level(Xt, idx, gen, tol, max_iter)
    labels = np.empty(N, dtype=np.int64)
    valid = (idx >= 0).numpy()
    groups = np.broadcast_to(np.arange(idx.shape[0])[:, None], idx.shape)
    labels[idx.numpy()[valid]] = groups[valid]
    return labels


def cluster_batches(labels: np.ndarray, rows: np.ndarray, batch_size: int,
                    rng: np.random.Generator) -> list[np.ndarray]:
    """NGAME batches: unions of random clusters (restricted to ``rows``) of about ``batch_size`` points, so
    in-batch negatives are hard negatives. One pass over ``rows``."""
    rows = np.asarray(rows)
    lab = labels[rows]
    order = np.argsort(lab, kind="stable")
    sorted_rows, sorted_lab = rows[order], lab[order]
    bounds = np.flatnonzero(np.diff(sorted_lab)) + 1
    clusters = np.split(sorted_rows, bounds)
    perm = rng.permutation(len(clusters))
    batches, cur, size = [], [], 0
    for c in perm:
        cur.append(clusters[c])
        size += len(clusters[c])
        if size >= batch_size:
            batches.append(np.concatenate(cur))
            cur, size = [], 0
    if size >= 2:
        batches.append(np.concatenate(cur))
    return batches
