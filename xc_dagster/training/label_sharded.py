"""The hardest-negative classifiers with W's label ranges on separate ranks (Renee's and ASTRA's model parallelism,
over processes instead of the devices of one process: ``sharded.py``).

Every rank runs the same batches (same seed, the frozen point embeddings are on each) and holds the rows
``label_range(L, rank, world)`` of W and their optimizer state. A score w_l.x is computed by the rank that owns l,
0 elsewhere, and the (B, K) score matrices are summed over the ranks: the hardest negatives are chosen from the
whole pool's scores and every rank computes the same loss. The sum's backward passes the gradient through
unchanged, so each rank's rows get exactly their single-process gradient and the ranks' W together are the one
process's W (each score has exactly one non-zero term, so the sum is exact). A rank none of whose rows a step
touched still counts the step in SparseAdam, whose bias correction reads the step count.

The BCE trainer with sampled negatives (``end_to_end.py``: uniform, ASTRA, MIPS-s) uses the same classifier: each
rank's stale index covers its own rows (``snapshot``), and the ranks' top lists are merged by score
(``xc_dagster.sampling.stale_index.search_shards``).

Checkpoints hold the consolidated W and optimizer moments (rank 0 writes them), so a run saved with one world size
resumes with another.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from xc_dagster.training.distributed import DistEnv, gather_blocks, label_range
from xc_dagster.training.sharded import ShardedClassifier, ShardedOptimizer

MOMENTS = ("exp_avg", "exp_avg_sq")  # SparseAdam's per-row state, split by label like W


class _SumOverRanks(torch.autograd.Function):
    """Forward: the sum of every rank's tensor. Backward: the gradient unchanged -- each rank computes the same loss
    from the sum, so its gradient is already the one its own (non-zero) terms get in one process."""

    @staticmethod
    def forward(ctx, part: torch.Tensor) -> torch.Tensor:
        out = part.detach().clone()
        dist.all_reduce(out)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad


def sum_over_ranks(part: torch.Tensor, env: DistEnv) -> torch.Tensor:
    return _SumOverRanks.apply(part) if env.active else part


class RankRows:
    """W as the hard-negative pools index it (``W[ids]``, ``W.shape``): this rank's rows, zeros for the others'
    labels (their scores come from the rank that owns them)."""

    def __init__(self, weight: torch.Tensor, lo: int, num_labels: int):
        self.weight, self.lo, self.hi = weight, lo, lo + len(weight)
        self.shape = (num_labels, weight.shape[1])

    def __getitem__(self, ids: torch.Tensor) -> torch.Tensor:
        inside = (ids >= self.lo) & (ids < self.hi)
        out = self.weight.new_zeros((*ids.shape, self.shape[1]))
        out[inside] = self.weight[ids[inside] - self.lo]
        return out


class RankShardedClassifier(ShardedClassifier):
    """This rank's label range of W (one shard on ``device``); ``scores`` are summed over the ranks."""

    def __init__(self, W0: np.ndarray, device: torch.device, env: DistEnv):
        self.env, self._num_labels = env, len(W0)
        self.lo, self.hi = label_range(len(W0), env.rank, env.world_size)
        super().__init__(W0[self.lo:self.hi], [device])

    @property
    def num_labels(self) -> int:
        return self._num_labels

    def scores(self, x: torch.Tensor, ids: torch.Tensor, normalize: bool = False,
               query_grad: torch.Tensor | None = None) -> torch.Tensor:
        local = torch.where((ids >= self.lo) & (ids < self.hi), ids - self.lo, torch.full_like(ids, -1))
        part = super().scores(x, local, normalize, query_grad)
        if not part.requires_grad:  # none of this rank's labels in the step: the loss still has a graph here,
            # through x when it has one (an encoder trained: the backward must reach its all-gather on every rank)
            part = part + 0.0 * x.sum() if x.requires_grad else part.requires_grad_(True)
        return sum_over_ranks(part, self.env)

    def snapshot(self) -> list[tuple[int, np.ndarray]]:
        """A CPU copy of this rank's rows as ``(first global label id, rows)``: what its stale index is built from."""
        return [(self.lo + off, rows) for off, rows in super().snapshot()]

    def rows(self) -> RankRows:
        return RankRows(self.weights[0], self.lo, self._num_labels)

    def sum_scores(self, scores: torch.Tensor) -> torch.Tensor:
        """This rank's part of the pools' candidate scores, summed over the ranks."""
        return sum_over_ranks(scores, self.env)

    def load_full(self, W: torch.Tensor | np.ndarray) -> None:
        super().load_full(np.asarray(W, dtype=np.float32)[self.lo:self.hi])

    def full(self) -> np.ndarray | None:
        """W as one (L, D) float32 array on rank 0, None on the others (every rank must call it)."""
        W = self.full_weights()
        return None if W is None else W.cpu().numpy()

    def full_weights(self) -> torch.Tensor | None:
        """W (L, D) on rank 0, None on the others (every rank must call it)."""
        return gather_blocks(self.weights[0].detach(), self._num_labels, self.env)


class RankShardedOptimizer(ShardedOptimizer):
    """``ShardedOptimizer`` of a rank's label range: a step that touched none of its rows still counts in SparseAdam;
    its state is saved consolidated (rank 0) and loaded as this rank's rows."""

    clf: RankShardedClassifier

    def step(self, factor: float = 1.0) -> None:
        touched = any(leaf.grad is not None for _, _, leaf in self.clf._leaves)
        super().step(factor)
        if not touched:  # the ranks' steps stay counted alike (SparseAdam's bias correction)
            self.rule.tick(0)

    def state_dict(self) -> dict:
        """SparseAdam's state with its moments consolidated on rank 0 (copies: the live state is not touched)."""
        n, env = self.clf.num_labels, self.clf.env
        return {"adam": [{**opt, "state": {k: {**v, **{m: gather_blocks(v[m], n, env) for m in MOMENTS}}
                                           for k, v in opt["state"].items()}}
                         for opt in super().state_dict()["adam"]]}

    def load_state_dict(self, st: dict) -> None:
        lo, hi = self.clf.lo, self.clf.hi
        super().load_state_dict({"adam": [{**opt, "state": {k: {**v, **{m: v[m][lo:hi].clone() for m in MOMENTS}}
                                                            for k, v in opt["state"].items()}}
                                          for opt in st.get("adam", [])]})

