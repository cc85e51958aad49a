"""Data parallelism of an encoder's training step over torch.distributed ranks (``DistEnv``), equal to one process.

Every rank holds the whole encoder and draws the same global batch (the same seeded generator); each embeds its
``rank_rows`` part, the parts are all-gathered with autograd and every rank computes the loss of the global batch.
The all-gather's backward sums the ranks' gradients of the gathered rows (xc_dagster/training/distributed.py), so
after every rank's backward of that same loss its encoder holds ``world_size`` times its rows' share of the
gradient; ``average_gradients`` all-reduces the sum and divides by ``world_size``, leaving on every rank the
gradient one process computes for the global batch. Clipping, AdamW and the schedule then run identically on
every rank.

The gradients are combined after the step's backward, not by torch's ``DistributedDataParallel``: DDP reduces
from per-parameter hooks that must fire once per backward, while a Siamese step calls the encoder once per chunk
(points, labels, centroid points) and a gradient-cached step backpropagates chunk by chunk, a different number of
times on each rank (docs/decisions.md#ddp-pretrain).

Collectives here are no-ops in a world of one process, so single-process training runs unchanged.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from xc_dagster.errors import XCError
from xc_dagster.training.distributed import DistEnv, gather_with_grad, rank_rows


def check_group(env: DistEnv, where: str) -> None:
    """Refuse a world of several processes whose process group is not up (the collectives would be skipped)."""
    if env.world_size > 1 and not env.active:
        raise XCError(f"{where}: rank {env.rank} of {env.world_size}: the torch.distributed process group is not "
                      "up; call DistEnv.init() first")


def broadcast_module(module: torch.nn.Module, env: DistEnv, parameters: bool = True) -> None:
    """Every rank's parameters (unless not ``parameters``) and buffers set to rank 0's, as DDP does when it wraps
    a module (parameters and buffers) and before each forward (buffers)."""
    if env.world_size == 1:
        return
    with torch.no_grad():
        for t in [*(module.parameters() if parameters else ()), *module.buffers()]:
            dist.broadcast(t.data, src=0)


def embed_global(embed: Callable[[np.ndarray], torch.Tensor], rows: np.ndarray, dim: int,
                 env: DistEnv) -> torch.Tensor:
    """Embeddings of ``rows`` of the global batch (``embed(rows)`` in one process): this rank embeds its
    ``rank_rows``, and the parts are all-gathered with autograd (float32)."""
    if env.world_size == 1:
        return embed(rows)
    mine = rank_rows(rows, env.rank, env.world_size)
    if len(mine) == 0:  # more ranks than rows: an empty part (the gather's backward still runs here)
        part = torch.zeros((0, dim), device=env.device, requires_grad=True)
    else:
        part = embed(mine).float()
    return gather_with_grad(part)


def average_gradients(params: Sequence[torch.nn.Parameter], env: DistEnv, mean: bool = True) -> None:
    """Each gradient replaced by its mean over the ranks (one flat all-reduce), or its sum (``mean`` False: each
    rank holds the gradient of its own rows only). A parameter without a gradient on some rank (its rows of the
    batch did not reach it) counts zero there; one without a gradient on every rank keeps None, as in one
    process (AdamW skips it)."""
    if env.world_size == 1 or not params:
        return
    dev = params[0].device
    has = torch.tensor([p.grad is not None for p in params], dtype=torch.int32, device=dev)
    dist.all_reduce(has, op=dist.ReduceOp.MAX)
    used = [p for p, h in zip(params, has.tolist()) if h]
    if not used:
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in used]
    flat = torch.cat([g.reshape(-1).float() for g in grads])
    dist.all_reduce(flat)
    if mean:
        flat /= env.world_size
    offset = 0
    for p, g in zip(used, grads):
        part = flat[offset:offset + g.numel()].view_as(g).to(g.dtype)
        offset += g.numel()
        p.grad = part.clone() if p.grad is None else p.grad.copy_(part)


def any_rank(flag: bool, env: DistEnv) -> bool:
    """Whether ``flag`` holds on some rank (every rank must call it; a decision all ranks then take together)."""
    if env.world_size == 1:
        return bool(flag)
    t = torch.tensor([int(bool(flag))], dtype=torch.int32, device=env.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def past(deadline: float | None, env: DistEnv) -> bool:
    """Whether ``deadline`` (``time.perf_counter()``; None: never) has passed, on any rank: the ranks stop at the same
    step (every rank passes the same ``deadline``-or-None, so a None costs no collective)."""
    return deadline is not None and any_rank(time.perf_counter() > deadline, env)


def check_same(value: int, what: str, env: DistEnv) -> None:
    """Raise XCError on every rank unless every rank passes the same ``value`` (``what`` names it)."""
    if env.world_size == 1:
        return
    mine = torch.tensor([int(value)], dtype=torch.int64, device=env.device)
    parts = [torch.zeros_like(mine) for _ in range(env.world_size)]
    dist.all_gather(parts, mine)
    values = [int(p.item()) for p in parts]
    if len(set(values)) > 1:
        raise XCError(f"{what} differs between the ranks (rank: value {dict(enumerate(values))}); every rank "
                      "must start from the same state")


def digest(arrays: Iterable[Any], *extra: Any) -> int:
    """A 63-bit hash of numpy arrays (shape, dtype, bytes) and ``extra`` values' reprs (a generator's state)."""
    h = hashlib.blake2b(digest_size=8)
    for a in arrays:
        a = np.ascontiguousarray(a)
        h.update(f"{a.shape}{a.dtype}".encode())
        h.update(memoryview(a).cast("B"))
    for x in extra:
        h.update(repr(x).encode())
    return int.from_bytes(h.digest(), "little") >> 1
