"""The classifier matrix W sharded by label across devices (ASTRA's model-parallel classifiers).

Shard k holds the contiguous label range ``[offsets[k], offsets[k + 1])`` on its own device. A step gathers
only the distinct rows it scores (at most B x (positives + negatives)) as a small leaf tensor, computes the
scores on the shard's device and returns them on the query's device; the backward pass gives a dense gradient
for those rows only, and the update writes them back. Memory and time per step therefore do not grow with L.
On one device it is the same code with one shard. Updates (``ROW_OPTIMIZERS``): plain SGD with weight decay on the
touched rows (ASTRA trains its classifiers with SGD), or lazy Adam (``torch.optim.SparseAdam``) on them.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from xc_dagster.errors import XCConfigError


def check_optimizer(kind: str) -> str:
    """``classifier.w_optimizer`` is one of ``ROW_OPTIMIZERS``, or a config error naming the field."""
    if kind not in ROW_OPTIMIZERS:
        raise XCConfigError(f"classifier.w_optimizer: expected one of {sorted(ROW_OPTIMIZERS)}, got {kind!r}")
    return kind


def shard_devices(shards: int, device: torch.device) -> list[torch.device]:
    """``shards`` devices for W: 0 = one shard per visible CUDA device (one on CPU); n = n shards, round-robin
    over the CUDA devices when there are any, else all on ``device``."""
    if shards < 0:
        raise XCConfigError(f"classifier.shards: expected >= 0, got {shards}")
    cuda = torch.cuda.device_count() if device.type == "cuda" else 0
    if shards == 0:
        shards = max(cuda, 1)
    if cuda:
        return [torch.device("cuda", i % cuda) for i in range(shards)]
    return [device] * shards


class ShardedClassifier:
    """One-vs-all classifiers w_l, rows split by label over ``devices``."""

    def __init__(self, W0: np.ndarray, devices: list[torch.device]):
        L = len(W0)
        if not devices:
            raise ValueError("ShardedClassifier needs at least one device")
        n = min(len(devices), max(L, 1))
        self.offsets = np.linspace(0, L, n + 1).round().astype(np.int64)
        self.devices = devices[:n]
        self.weights = [torch.nn.Parameter(torch.from_numpy(np.array(
            W0[self.offsets[k]:self.offsets[k + 1]], dtype=np.float32)).to(dev), requires_grad=False)
            for k, dev in enumerate(self.devices)]
        self._leaves: list[tuple[int, torch.Tensor, torch.Tensor]] = []

    @property
    def num_labels(self) -> int:
        return int(self.offsets[-1])

    def scores(self, x: torch.Tensor, ids: torch.Tensor, normalize: bool = False,
               query_grad: torch.Tensor | None = None) -> torch.Tensor:
        """``(B, K)`` scores w_ids[b, j] . x[b] (0 where ``ids`` < 0), with gradients to x and to the rows used
        (kept for ``ShardedOptimizer.step``); ``normalize``: cosine scores (each w_l scaled to unit norm);
        ``query_grad`` (B, K) bool: where False the score's gradient reaches the row of W but not x."""
        self._leaves = []
        out = torch.zeros(ids.shape, dtype=x.dtype, device=x.device)
        for k, dev in enumerate(self.devices):
            lo, hi = int(self.offsets[k]), int(self.offsets[k + 1])
            inside = (ids >= lo) & (ids < hi)
            local = torch.where(inside, ids - lo, -1).to(dev)
            uniq, inv = torch.unique(local, return_inverse=True)
            has_pad = bool(uniq.numel()) and int(uniq[0]) < 0
            rows = uniq[1:] if has_pad else uniq
            if rows.numel() == 0:
                continue
            leaf = self.weights[k].detach()[rows].requires_grad_(True)
            if has_pad:  # other shards' / padding entries read row 0 of the leaf; masked out below (zero grad)
                inv = (inv - 1).clamp_min(0)
            w = leaf
            if normalize:
                w = F.normalize(w, dim=-1)
            xd = x.to(dev)
            s = self._pair_scores(xd, w, inv)
            if query_grad is not None:
                s = torch.where(query_grad.to(dev), s, self._pair_scores(xd.detach(), w, inv))
            out = out + torch.where(inside, s.to(x.device), torch.zeros((), dtype=x.dtype, device=x.device))
            self._leaves.append((k, rows, leaf))
        return out

    @staticmethod
    def _pair_scores(x: torch.Tensor, w: torch.Tensor, inv: torch.Tensor) -> torch.Tensor:
        """(B, K) scores w[inv[b, j]] . x[b]."""
        # few distinct rows U (L small or shared negatives): one (B, U) matmul; from U > B K / 5 the gather,
        # whose backward costs the same whatever U (docs/decisions.md#hardest-negative-trainer-sharded-w)
        if len(w) * 5 <= inv.numel():
            return torch.gather(x @ w.T, 1, inv)
        # gather each candidate's row: O(B K D), whatever L is
        return torch.bmm(w.index_select(0, inv.reshape(-1)).view(*inv.shape, -1), x.unsqueeze(2)).squeeze(2)

    def full_scores(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, L)`` scores against every label (the O(L) full-softmax step ASTRA avoids; for baselines)."""
        return torch.cat([(x.to(dev) @ w.T).to(x.device) for w, dev in zip(self.weights, self.devices)], 1)

    def snapshot(self) -> list[tuple[int, np.ndarray]]:
        """A CPU copy of each shard as ``(first label id, rows)``: what a stale index is built from."""
        return [(int(self.offsets[k]), w.detach().to("cpu", copy=True).numpy()) for k, w in enumerate(self.weights)]

    def full(self) -> np.ndarray:
        """W as one (L, D) float32 array."""
        return np.concatenate([w for _, w in self.snapshot()])

    def full_weights(self) -> torch.Tensor:
        """W as one (L, D) tensor: the one shard itself (no copy), else the shards joined on the first device."""
        if len(self.weights) == 1:
            return self.weights[0].detach()
        return torch.cat([w.detach().to(self.devices[0]) for w in self.weights])

    def rows(self) -> torch.Tensor:
        """W as the hard-negative pools index it (``W[ids]``, ``W.shape``)."""
        return self.full_weights()

    def sum_scores(self, scores: torch.Tensor) -> torch.Tensor:
        """Scores of the pools' candidates as complete (one process holds every label: unchanged)."""
        return scores

    def load_full(self, W: torch.Tensor | np.ndarray) -> None:
        W = torch.as_tensor(np.asarray(W, dtype=np.float32))
        with torch.no_grad():
            for k, w in enumerate(self.weights):
                w.copy_(W[self.offsets[k]:self.offsets[k + 1]].to(w.device))


class SGDRows:
    """w -= lr (g + wd w) on the rows a step touched (weight decay lazy: touched rows only; ASTRA)."""

    def __init__(self, weights: list[torch.nn.Parameter], lr: float, weight_decay: float):
        self.weights, self.weight_decay = weights, weight_decay

    def update(self, k: int, rows: torch.Tensor, g: torch.Tensor, lr: float) -> None:
        w = self.weights[k]
        if self.weight_decay:
            g.add_(w[rows], alpha=self.weight_decay)  # g is this step's own leaf gradient
        w.index_add_(0, rows, g, alpha=-lr)

    def tick(self, k: int) -> None:
        """A step that touched none of shard ``k``'s rows: plain SGD keeps no count."""

    def state_dict(self) -> dict:
        return {"adam": []}

    def load_state_dict(self, st: dict) -> None:
        pass


class SparseAdamRows:
    """Lazy Adam (``torch.optim.SparseAdam``) on the rows a step touched (NGAME); no weight decay."""

    def __init__(self, weights: list[torch.nn.Parameter], lr: float, weight_decay: float):
        self.weights = weights
        self._adam = [torch.optim.SparseAdam([w], lr=lr) for w in weights]

    def update(self, k: int, rows: torch.Tensor, g: torch.Tensor, lr: float) -> None:
        w, opt = self.weights[k], self._adam[k]
        for group in opt.param_groups:
            group["lr"] = lr
        w.grad = torch.sparse_coo_tensor(rows.unsqueeze(0), g, w.shape, is_coalesced=True, check_invariants=False)
        opt.step()
        w.grad = None

    def tick(self, k: int) -> None:
        """A step that touched none of shard ``k``'s rows still counts in Adam's bias correction (an empty
        gradient: the count moves, no row does)."""
        w = self.weights[k]
        w.grad = torch.sparse_coo_tensor(torch.zeros((1, 0), dtype=torch.int64, device=w.device),
                                         w.new_zeros((0, w.shape[1])), w.shape, is_coalesced=True)
        self._adam[k].step()
        w.grad = None

    def state_dict(self) -> dict:
        return {"adam": [o.state_dict() for o in self._adam]}

    def load_state_dict(self, st: dict) -> None:
        for o, s in zip(self._adam, st.get("adam", [])):
            o.load_state_dict(s)


ROW_OPTIMIZERS = {"sgd": SGDRows, "sparse-adam": SparseAdamRows}  # classifier.w_optimizer


class ShardedOptimizer:
    """Updates the rows a step scored with the ``kind`` of ``ROW_OPTIMIZERS``; ``lr`` is scaled by the schedule
    factor passed to ``step``."""

    def __init__(self, clf: ShardedClassifier, kind: str, lr: float, weight_decay: float = 0.0):
        check_optimizer(kind)
        self.clf, self.kind, self.lr, self.weight_decay = clf, kind, lr, weight_decay
        self.rule = ROW_OPTIMIZERS[kind](clf.weights, lr, weight_decay)

    @torch.no_grad()
    def step(self, factor: float = 1.0) -> None:
        lr = self.lr * factor
        for k, rows, leaf in self.clf._leaves:
            if leaf.grad is not None:
                self.rule.update(k, rows, leaf.grad, lr)
        self.clf._leaves = []

    def state_dict(self) -> dict:
        return self.rule.state_dict()

    def load_state_dict(self, st: dict) -> None:
        self.rule.load_state_dict(st)
