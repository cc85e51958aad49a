"""torch.distributed building blocks for training with several processes (``torchrun``: gloo on CPU, NCCL on GPUs).

* ``DistEnv``: this process's rank, world and device from torchrun's variables; ``init`` / ``barrier`` / ``close``
  are no-ops in a world of one process, so single-process code runs unchanged.
* ``rank_rows``: this rank's contiguous part of a global batch (``np.array_split`` order), so a world of ranks sees
  the same global batch as one process would, without overlap.
* ``gather_with_grad``: all-gather of (n_rank, D) rows in rank order with autograd, n_rank may differ per rank
  (NGAME's in-batch negatives over the global batch).
* ``label_range`` / ``RankShardedW``: the classifier matrix W sharded by label across ranks (Renee, ASTRA), the same
  contiguous split as ``sharded.ShardedClassifier``; each rank scores the pairs of its own labels against the
  all-gathered queries and updates only its rows. ``consolidate`` / ``from_full`` move W between world sizes.
* ``sharded_bce_loss``: BCE summed over every (query, candidate) pair of the global batch, split by label owner.

Autograd through the all-gather: its backward SUMS the gradients every rank's loss gives to the gathered rows and
returns to each rank those of its own rows. Each rank must therefore backpropagate only its part of the total loss
(as ``sharded_bce_loss`` does); a loss that every rank computes in full gives world_size times the gradient.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn
import torch.nn.functional as F

from xc_dagster.errors import XCConfigError

# torch >= 2.10 marks torch.distributed.nn.functional.all_gather deprecated in favour of a private module
# (torch.distributed._functional_collectives); the public one works over the whole supported range (torch >= 2.3)
_ALL_GATHER_DEPRECATION = r"torch\.distributed\.nn\.functional\.all_gather is deprecated"


def _env_int(environ: Mapping[str, str], name: str, default: int | None, why: str) -> int:
    raw = environ.get(name)
    if raw is None:
        if default is None:
            raise XCConfigError(f"{name}: expected an integer {why}, but it is not set")
        return default
    try:
        return int(raw.strip())
    except ValueError:
        raise XCConfigError(f"{name}: expected an integer {why}, got {raw!r}") from None


def world_size(environ: Mapping[str, str]) -> int:
    """torchrun's WORLD_SIZE in ``environ`` (1 when unset or blank)."""
    if not environ.get("WORLD_SIZE", "").strip():
        return 1
    world = _env_int(environ, "WORLD_SIZE", 1, ">= 1 (number of processes, set by torchrun)")
    if world < 1:
        raise XCConfigError(f"WORLD_SIZE: expected an integer >= 1 (number of processes, set by torchrun), got {world}")
    return world


def _pick_device(device: str | torch.device | None, local_rank: int) -> torch.device:
    if device is None:
        return torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise XCConfigError(f"device: expected 'cpu', 'cuda' or 'cuda:<n>', got {device!r}") from None
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", local_rank)
    if dev.type not in ("cpu", "cuda"):
        raise XCConfigError(f"device: expected 'cpu', 'cuda' or 'cuda:<n>', got {device!r}")
    return dev


@dataclass(frozen=True)
class DistEnv:
    """This process's place in a world of ``world_size`` processes; ``backend`` follows ``device`` (gloo on CPU,
    nccl on CUDA)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    backend: str = "gloo"
    device: torch.device = torch.device("cpu")
    _owns_group: bool = field(default=False, init=False, repr=False, compare=False)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None,
                 device: str | torch.device | None = None) -> DistEnv:
        """From torchrun's RANK, WORLD_SIZE and LOCAL_RANK (``os.environ`` unless ``environ``); WORLD_SIZE absent:
        one process. ``device`` None: ``cuda:LOCAL_RANK`` when CUDA is available, else the CPU."""
        environ = os.environ if environ is None else environ
        world = world_size(environ)
        need = None if world > 1 else 0
        rank = _env_int(environ, "RANK", need, f"in [0, {world}) when WORLD_SIZE={world} (set by torchrun)")
        if not 0 <= rank < world:
            raise XCConfigError(f"RANK: expected an integer in [0, {world}) for WORLD_SIZE={world}, got {rank}")
        local = _env_int(environ, "LOCAL_RANK", rank, "(this process's index on its machine, set by torchrun)")
        if not 0 <= local <= rank:
            raise XCConfigError(f"LOCAL_RANK: expected an integer in [0, RANK={rank}], got {local}")
        dev = _pick_device(device, local)
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise XCConfigError(f"device: expected 'cpu' on a machine without a CUDA device, got {device!r}")
        if dev.type == "cuda" and dev.index >= torch.cuda.device_count():
            raise XCConfigError(f"LOCAL_RANK: expected < {torch.cuda.device_count()} (the CUDA devices of this "
                                f"machine) for device {dev}, got {local}")
        return cls(rank, world, local, "nccl" if dev.type == "cuda" else "gloo", dev)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def active(self) -> bool:
        """Whether collectives run (world_size > 1 and the process group is up)."""
        return self.world_size > 1 and dist.is_available() and dist.is_initialized()

    def init(self, timeout_s: float | None = None) -> DistEnv:
        """Join the process group (``env://``: MASTER_ADDR / MASTER_PORT, which torchrun sets) when world_size > 1
        and it is not up yet; ``timeout_s``: how long a collective waits for a missing rank. Returns self."""
        if self.world_size == 1:
            return self
        if dist.is_initialized():
            if (dist.get_rank(), dist.get_world_size()) != (self.rank, self.world_size):
                raise XCConfigError(f"RANK/WORLD_SIZE: expected the running process group's rank "
                                    f"{dist.get_rank()} of {dist.get_world_size()}, got {self.rank} of "
                                    f"{self.world_size}")
            return self
        for var in ("MASTER_ADDR", "MASTER_PORT"):
            if not os.environ.get(var):
                raise XCConfigError(f"{var}: expected rank 0's address/port (set by torchrun) when WORLD_SIZE="
                                    f"{self.world_size}, but it is not set")
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        kw = {} if timeout_s is None else {"timeout": timedelta(seconds=timeout_s)}
        dist.init_process_group(self.backend, rank=self.rank, world_size=self.world_size, **kw)
        object.__setattr__(self, "_owns_group", True)
        return self

    def barrier(self) -> None:
        if self.active:
            if self.device.type == "cuda":
                dist.barrier(device_ids=[self.device.index])
            else:
                dist.barrier()

    def close(self) -> None:
        """Destroy the process group if ``init`` created it."""
        if self._owns_group and dist.is_initialized():
            dist.destroy_process_group()
        object.__setattr__(self, "_owns_group", False)

    def __enter__(self) -> DistEnv:
        return self.init()

    def __exit__(self, *exc) -> None:
        self.close()


def _check_part(rank: int, world: int) -> None:
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"expected 0 <= rank < world, got rank {rank} of world {world}")


def rank_slice(n: int, rank: int, world: int) -> slice:
    """Rows of rank ``rank`` among ``n`` (``np.array_split``: contiguous, the first n % world ranks one more)."""
    _check_part(rank, world)
    q, r = divmod(n, world)
    lo = rank * q + min(rank, r)
    return slice(lo, lo + q + (rank < r))


def rank_rows(batch, rank: int, world: int):
    """This rank's part of a global ``batch`` (array, tensor or list); the parts in rank order concatenate to it."""
    return batch[rank_slice(len(batch), rank, world)]


def label_range(L: int, rank: int, world: int) -> tuple[int, int]:
    """Label rows [lo, hi) of W on ``rank``: ``np.linspace(0, L, world + 1).round()``, as ``ShardedClassifier``."""
    _check_part(rank, world)
    offsets = np.linspace(0, L, world + 1).round().astype(np.int64)
    return int(offsets[rank]), int(offsets[rank + 1])


def _gather_padded(x: torch.Tensor, with_grad: bool) -> tuple[torch.Tensor, list[int]]:
    """All ranks' rows of ``x`` in rank order and each rank's row count (sizes exchanged, padded to the max)."""
    world = dist.get_world_size()
    n = torch.tensor([x.shape[0]], dtype=torch.int64, device=x.device)
    counts = [torch.zeros_like(n) for _ in range(world)]
    dist.all_gather(counts, n)
    sizes = [int(c) for c in counts]
    most = max(sizes)
    if most == 0:
        return x, sizes
    if x.shape[0] < most:
        x = torch.cat([x, x.new_zeros((most - x.shape[0], *x.shape[1:]))])
    if with_grad:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_ALL_GATHER_DEPRECATION, category=FutureWarning)
            parts = dist_nn.all_gather(x)
    else:
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x.contiguous())
    return torch.cat([p[:s] for p, s in zip(parts, sizes)]), sizes


def _active() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def gather_with_grad(x: torch.Tensor) -> torch.Tensor:
    """``torch.cat`` of every rank's ``x`` (n_rank, ...) in rank order, n_rank may differ; gradients flow back to
    each rank's rows (summed over the ranks' losses). Identity in a world of one process."""
    return _gather_padded(x, with_grad=True)[0] if _active() else x


def gather_rows(x: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    """Every rank's rows of ``x`` in rank order without autograd (ids, masks) and the row count of each rank."""
    return _gather_padded(x, with_grad=False) if _active() else (x, [x.shape[0]])


def all_reduce_sum(value: torch.Tensor) -> torch.Tensor:
    """The sum over ranks of a detached copy of ``value`` (for reporting)."""
    total = value.detach().clone()
    if _active():
        dist.all_reduce(total)
    return total


def _require_group(env: DistEnv) -> None:
    if env.world_size > 1 and not env.active:
        raise RuntimeError(f"rank {env.rank} of {env.world_size}: the process group is not up; call "
                           "DistEnv.init() first")


def gather_blocks(block: torch.Tensor, num_labels: int, env: DistEnv) -> torch.Tensor | None:
    """The ranks' label blocks (rows ``label_range``) stacked in label order on rank 0; None on the others. Every
    rank must call it."""
    if not env.active:
        return block
    sizes = [hi - lo for lo, hi in (label_range(num_labels, r, env.world_size) for r in range(env.world_size))]
    most = max(sizes)
    padded = torch.cat([block, block.new_zeros((most - len(block), *block.shape[1:]))]).contiguous()
    parts = [torch.empty_like(padded) for _ in sizes] if env.is_main else None
    dist.gather(padded, parts, dst=0)
    return torch.cat([p[:s] for p, s in zip(parts, sizes)]) if env.is_main else None


def gather_objects(obj: Any, env: DistEnv) -> list[Any] | None:
    """Every rank's ``obj`` (picklable: pickled in memory between the ranks, never read from a file) in rank order
    on rank 0, None on the others; ``[obj]`` in one process. Every rank must call it."""
    if not env.active:
        return [obj]
    parts = [None] * env.world_size if env.is_main else None
    dist.gather_object(obj, parts, dst=0)
    return parts


class RankShardedW:
    """This rank's rows [lo, hi) of the (L, D) classifier matrix W (float32 on ``env.device``); ``pair_logits``
    scores the pairs of its labels as a small leaf of the rows touched, ``sgd_update`` applies their gradient."""

    def __init__(self, block: np.ndarray | torch.Tensor, num_labels: int, env: DistEnv):
        self.env, self.num_labels = env, int(num_labels)
        self.lo, self.hi = label_range(self.num_labels, env.rank, env.world_size)
        block = torch.as_tensor(np.asarray(block, dtype=np.float32) if isinstance(block, np.ndarray) else block)
        if block.ndim != 2 or block.shape[0] != self.hi - self.lo:
            raise ValueError(f"rank {env.rank} of {env.world_size}: expected a ({self.hi - self.lo}, D) block of "
                             f"labels [{self.lo}, {self.hi}) of {self.num_labels}, got shape {tuple(block.shape)}")
        self.weight = block.detach().to(device=env.device, dtype=torch.float32, copy=True)
        self._touched: tuple[torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def from_full(cls, W: np.ndarray | torch.Tensor, env: DistEnv) -> RankShardedW:
        """This rank's rows of a consolidated (L, D) W, whatever world size wrote it."""
        if W.ndim != 2:
            raise ValueError(f"expected W of shape (L, D), got {tuple(W.shape)}")
        lo, hi = label_range(len(W), env.rank, env.world_size)
        return cls(W[lo:hi], len(W), env)

    def owns(self, label_ids: torch.Tensor) -> torch.Tensor:
        return (label_ids >= self.lo) & (label_ids < self.hi)

    def pair_logits(self, x_all: torch.Tensor, query_idx: torch.Tensor,
                    label_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """For pairs (``query_idx``, ``label_ids``) of one shape (global label ids; < 0 = padding): w_l . x_q with
        x_q = ``x_all[query_idx]`` where this rank owns l, 0 elsewhere, and that ownership mask. The gradient
        reaches ``x_all`` and the distinct rows touched (kept for ``sgd_update``; one call per step)."""
        owned = self.owns(label_ids.to(self.weight.device))
        rows, inv = torch.unique(label_ids.to(self.weight.device)[owned] - self.lo, return_inverse=True)
        leaf = self.weight[rows].requires_grad_(True)
        self._touched = (rows, leaf)
        q = x_all[query_idx.to(x_all.device)[owned.to(x_all.device)]].to(self.weight.device)
        vals = (leaf[inv] * q).sum(-1)
        logits = torch.zeros(owned.shape, dtype=vals.dtype, device=vals.device).masked_scatter(owned, vals)
        return logits, owned

    @torch.no_grad()
    def sgd_update(self, lr: float, weight_decay: float = 0.0) -> None:
        """w -= lr (g + weight_decay w) on the rows the last ``pair_logits`` touched (lazy decay, as
        ``sharded.SGDRows``)."""
        if self._touched is None:
            return
        rows, leaf = self._touched
        self._touched = None
        if leaf.grad is None:
            return
        g = leaf.grad
        if weight_decay:
            g = g + weight_decay * self.weight[rows]
        self.weight.index_add_(0, rows, g, alpha=-lr)

    def consolidate(self) -> np.ndarray | None:
        """The full (L, D) float32 W on rank 0 (the ranks' blocks gathered), None on the other ranks; every rank
        must call it."""
        if self.env.world_size == 1:
            return self.weight.detach().cpu().numpy().copy()
        _require_group(self.env)
        full = gather_blocks(self.weight.detach(), self.num_labels, self.env)
        return None if full is None else full.cpu().numpy()


class ShardedLoss(NamedTuple):
    local: torch.Tensor  # this rank's part, to backpropagate
    total: torch.Tensor  # the global batch's loss (detached, the same on every rank), to report


def _positive_mask(cand: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    return (cand.unsqueeze(-1) == pos.unsqueeze(-2)).any(-1) & (cand >= 0)


def sharded_bce_loss(W: RankShardedW, x_local: torch.Tensor, pos_ids_global: torch.Tensor,
                     cand_ids_global: torch.Tensor, env: DistEnv) -> ShardedLoss:
    """Binary cross-entropy summed over every (query, candidate) pair of the global batch. ``x_local`` (n, D):
    this rank's queries; ``cand_ids_global`` (n, K) and ``pos_ids_global`` (n, P): their candidates and positives
    as global label ids (< 0 = padding; K and P the same on every rank). Each rank scores the pairs of its own
    labels on the all-gathered queries; ``local.backward()`` then gives W's rows their gradient and, through the
    all-gather, each query the gradient of the total loss on the rank that owns it. Every rank must call it (the
    all-gather's backward is a collective), even one whose labels met no pair (its ``local`` is 0)."""
    _require_group(env)
    if cand_ids_global.shape[0] != x_local.shape[0] or pos_ids_global.shape[0] != x_local.shape[0]:
        raise ValueError(f"expected {x_local.shape[0]} rows of candidates and positives (one per query), got "
                         f"{cand_ids_global.shape[0]} and {pos_ids_global.shape[0]}")
    x_all = gather_with_grad(x_local)
    is_pos = _positive_mask(cand_ids_global, pos_ids_global.to(cand_ids_global.device))
    cand_all, _ = gather_rows(cand_ids_global.to(x_local.device))
    pos_all = gather_rows(is_pos.to(device=x_local.device, dtype=torch.uint8))[0].bool()
    query_idx = torch.arange(len(cand_all), device=x_local.device).unsqueeze(1).expand_as(cand_all)
    logits, owned = W.pair_logits(x_all, query_idx, cand_all)
    pairs = F.binary_cross_entropy_with_logits(logits, pos_all.to(logits), reduction="none")
    local = pairs.masked_fill(~owned, 0.0).sum().to(x_local.device)
    return ShardedLoss(local, all_reduce_sum(local))
