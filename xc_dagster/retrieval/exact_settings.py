"""Exact search's settings on a device: the precision of its scoring pass, how many query x key scores a block
holds, and up to how many vectors kind ``auto`` chooses it over an HNSW graph.

On a CPU exact search is a matrix product over every key that a graph's O(log L) walk overtakes at 2^18 vectors
(2^19 where it scores in bf16 or int8: docs/decisions.md#index-auto). On a GPU the product runs at GEMM speed and
the graph would be built and walked on the host's cores: exact search stays ahead up to millions of vectors, while
its keys fit in the GPU's memory (docs/decisions.md#exact-on-gpu).
"""

from __future__ import annotations

import os

import torch

from xc_dagster.device import amp_dtype, cpu_int8_pays, resolve_device
from xc_dagster.errors import XCConfigError

KINDS = ("hnsw", "ivf", "exact", "auto")
PRECISIONS = ("auto", "fp32", "bf16", "int8")  # exact search's scoring pass (XC_EXACT_PRECISION)
EXACT_MAX_VECTORS = 1 << 18  # kind "auto" on a CPU: exact search up to this many vectors, HNSW above
EXACT_MAX_VECTORS_LOW = 1 << 19  # the same where exact search scores in bf16 or int8, 1.6-1.8x cheaper
EXACT_MAX_VECTORS_GPU = 1 << 22  # on a GPU: exact up to this many vectors (2.25M measured 3-6x ahead of HNSW) ...
GPU_KEYS_SHARE = 1 / 8  # ... while one index's keys (fp32 and the scoring copy) take at most this share of its memory
EXACT_BLOCK_ENTRIES = 1 << 25  # on a CPU: at most this many query x key scores held at once (128 MiB float32)
EXACT_BLOCK_ENTRIES_GPU = 1 << 29  # on a GPU: up to this many (2 GiB), at most GPU_BLOCK_SHARE of its memory:
GPU_BLOCK_SHARE = 1 / 32  # blocks of 25 queries at 1.3M keys left an H200 1.7x slower than blocks of 411
# A CPU search (over the calls on one set of keys) of fewer multiply-adds than this scores in fp32 without the
# precision probes: they cost more than a lower precision could save it (docs/decisions.md#probe-small-searches)
PROBE_MIN_WORK = 1 << 34


def exact_dtype(device: torch.device, precision: str | None = None, work: int | None = None) -> torch.dtype | None:
    """The dtype exact search scores in before its fp32 re-rank, None = fp32 throughout: ``precision`` (default
    ``$XC_EXACT_PRECISION``) ``fp32``, ``bf16``, ``int8`` (CPU) or ``auto`` = bf16 where its matrix products pay
    (CUDA; AMX or a measured speed-up on a CPU: ``device.amp_dtype``), else int8 on a CPU whose int8 products
    measure faster (``device.cpu_int8_pays``), else fp32 (docs/decisions.md#exact-bf16, #exact-int8). ``work``:
    the search's multiply-adds; ``auto`` on a CPU below PROBE_MIN_WORK is fp32, unprobed."""
    precision = (precision or os.environ.get("XC_EXACT_PRECISION", "").strip() or "auto").lower()
    if precision not in PRECISIONS:
        raise XCConfigError(f"XC_EXACT_PRECISION: expected one of {'|'.join(PRECISIONS)}, got {precision!r}")
    if precision == "fp32":
        return None
    if precision == "bf16":
        return torch.bfloat16
    if precision == "int8":
        if device.type != "cpu":
            raise XCConfigError(f"XC_EXACT_PRECISION=int8 scores on a CPU only; this search runs on {device.type} "
                                "(use bf16 or auto there)")
        return torch.int8
    if device.type == "cpu" and work is not None and work < PROBE_MIN_WORK:
        return None
    if amp_dtype(device, "auto") is not None:
        return torch.bfloat16
    return torch.int8 if device.type == "cpu" and cpu_int8_pays() else None


def _gpu_memory(device: torch.device) -> int:
    return int(torch.cuda.get_device_properties(device).total_memory)


def exact_block_entries(device: torch.device) -> int:
    """Query x key scores exact search holds at once on ``device``: EXACT_BLOCK_ENTRIES on a CPU (a block in cache
    and a reused buffer); on a GPU the largest power of two within GPU_BLOCK_SHARE of its memory in fp32, at most
    EXACT_BLOCK_ENTRIES_GPU, where fewer, larger products and top-k selections keep it busy."""
    if device.type != "cuda":
        return EXACT_BLOCK_ENTRIES
    fits = max(int(_gpu_memory(device) * GPU_BLOCK_SHARE) // 4, 1)
    return max(EXACT_BLOCK_ENTRIES, min(EXACT_BLOCK_ENTRIES_GPU, 1 << (fits.bit_length() - 1)))


def exact_max_vectors(device: torch.device, dim: int) -> int:
    """Kind ``auto``'s largest exact index of ``dim``-wide vectors on ``device``: on a CPU EXACT_MAX_VECTORS
    (EXACT_MAX_VECTORS_LOW where it scores in bf16 or int8); on a GPU EXACT_MAX_VECTORS_GPU, fewer where the keys
    (fp32 and their scoring copy) would take more than GPU_KEYS_SHARE of its memory."""
    low = exact_dtype(device)
    if device.type != "cuda":
        return EXACT_MAX_VECTORS if low is None else EXACT_MAX_VECTORS_LOW
    per_vector = max(dim, 1) * (4 + (low.itemsize if low is not None else 0))
    return min(EXACT_MAX_VECTORS_GPU, int(_gpu_memory(device) * GPU_KEYS_SHARE) // per_vector)


def resolve_kind(kind: str, n: int, dim: int) -> str:
    """The index kind built for ``n`` vectors of width ``dim`` searched where exact search runs (the GPU when
    there is one): ``auto`` is exact up to ``exact_max_vectors``, else HNSW. On a CPU up to the lower of its two
    limits without asking which precision exact search scores in (which may run the CPU probes)."""
    if kind not in KINDS:
        raise XCConfigError(f"index kind: expected one of {'|'.join(KINDS)}, got {kind!r}")
    if kind != "auto":
        return kind
    device = resolve_device("auto")
    if device.type != "cuda" and n <= min(EXACT_MAX_VECTORS, EXACT_MAX_VECTORS_LOW):
        return "exact"
    return "exact" if n <= exact_max_vectors(device, dim) else "hnsw"
