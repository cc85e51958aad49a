"""Approximate (and exact) maximum-inner-product search over label vectors: W or label embeddings.

``hnsw`` is a faiss HNSW graph (inner product), O(log L) per query; ``ivf`` is a faiss inverted file (inner
product): the vectors clustered by k-means into ``nlist`` partitions, a query scans the ``nprobe`` partitions
whose centroids score highest (MIPS-s's clustering-based MIPS, O(nprobe * L / nlist) per query); ``exact`` is a
blocked matrix product in torch (on the GPU when there is one), the reference that recall is measured against;
``auto`` is ``exact`` up to ``EXACT_MAX_VECTORS`` vectors (twice that where exact search scores in bf16) and
``hnsw`` above: below it a matrix product over every vector costs less than building the graph and walking it
(bench/SCALE.md#index-choice), above it the per-query cost stays O(log L). All return the top-k (scores, ids) per
query, ids -1 where fewer than k exist (exact: ties broken by smaller id).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from xc_dagster.device import amp_dtype, resolve_device
from xc_dagster.errors import XCConfigError
from xc_dagster.faiss_module import faiss

KINDS = ("hnsw", "ivf", "exact", "auto")
FP32_AFTER_REDONE = 0.5  # bf16 exact search: with more of its queries searched again in fp32, an index switches
FP32_SWITCH_MIN_QUERIES = 1024  # to fp32 for good, once it has searched at least this many queries in bf16
PRECISIONS = ("auto", "fp32", "bf16")  # exact search's scoring pass (XC_EXACT_PRECISION)
EXACT_MAX_VECTORS = 1 << 18  # kind "auto": exact search up to this many vectors, HNSW above (decisions.md#index-auto)
EXACT_MAX_VECTORS_BF16 = 1 << 19  # the same where exact search scores in bf16, ~1.8x cheaper (decisions.md#exact-bf16)
EXACT_BLOCK_ENTRIES = 1 << 25  # exact search: at most this many query x key scores held at once (128 MiB float32)
_NPY_MAGIC = b"\x93NUMPY"  # an exact index's file (np.save); faiss files start otherwise


def resolve_kind(kind: str, n: int) -> str:
    """The index kind built for ``n`` vectors: ``auto`` is exact up to EXACT_MAX_VECTORS (EXACT_MAX_VECTORS_BF16
    where exact search scores in bf16 on this machine), else HNSW."""
    if kind not in KINDS:
        raise XCConfigError(f"index kind: expected one of {'|'.join(KINDS)}, got {kind!r}")
    if kind != "auto":
        return kind
    limit = EXACT_MAX_VECTORS if exact_dtype(resolve_device("auto")) is None else EXACT_MAX_VECTORS_BF16
    return "exact" if n <= limit else "hnsw"


def exact_dtype(device: torch.device, precision: str | None = None) -> torch.dtype | None:
    """The dtype exact search scores in before its fp32 re-rank, None = fp32 throughout: ``precision`` (default
    ``$XC_EXACT_PRECISION``) ``fp32``, ``bf16`` or ``auto`` = bf16 where its matrix products pay (CUDA; AMX or a
    measured speed-up on a CPU: ``device.amp_dtype``), else fp32 (docs/decisions.md#exact-bf16)."""
    precision = (precision or os.environ.get("XC_EXACT_PRECISION", "").strip() or "auto").lower()
    if precision not in PRECISIONS:
        raise XCConfigError(f"XC_EXACT_PRECISION: expected one of {'|'.join(PRECISIONS)}, got {precision!r}")
    if precision == "fp32":
        return None
    if precision == "bf16":
        return torch.bfloat16
    return torch.bfloat16 if amp_dtype(device, "auto") is not None else None


def exact_topk(queries: np.ndarray, keys: np.ndarray, k: int, block: int = 4096,
               device: torch.device | None = None, exclude: np.ndarray | None = None,
               precision: str | None = None, cache: dict | None = None,
               certify: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """Exact top-k inner products, in blocks of at most ``block`` queries and EXACT_BLOCK_ENTRIES scores, so memory
    stays bounded at any L; ``exclude``: key rows never returned. Where bf16 pays (``exact_dtype``) the product
    over every key runs in bf16, its top ``rerank_width(k)`` are re-scored in fp32, and a query whose k-th fp32
    score is not clear of the bf16 error bound above every other key is searched again in fp32 (``_certified``):
    the top k and the scores returned are fp32's either way. Once more than FP32_AFTER_REDONE of the queries
    searched on ``cache``'s keys were searched again (keys closer than bf16 resolves), later blocks and calls go
    straight to fp32. ``cache``: keeps the keys' tensors (and those counts) between calls. ``certify=False``
    skips the second search (the run planner times the common path with it; near-ties may then be missed)."""
    device = device or resolve_device("auto")
    low = exact_dtype(device, precision)
    n, L = len(queries), len(keys)
    block = max(1, min(block, EXACT_BLOCK_ENTRIES // max(L, 1)))
    kk = min(k, L)
    width = kk if low is None else min(L, rerank_width(k))
    scores = np.full((n, k), -np.inf, dtype=np.float32)
    ids = np.full((n, k), -1, dtype=np.int64)
    cache = {} if cache is None else cache
    K, K_low = _key_tensors(keys, device, low, cache)
    drop = None if exclude is None else torch.from_numpy(np.asarray(exclude, dtype=np.int64)).to(device)
    for s in range(0, n, block):
        Q = torch.from_numpy(np.ascontiguousarray(queries[s:s + block], dtype=np.float32)).to(device)
        low = None if cache.get("fp32_only") else low
        top_s, top_i = _scored_topk(Q, K_low if low is not None else K, drop, width if low is not None else kk,
                                    sorted=low is None)
        if low is not None:
            floor = top_s.min(dim=1).values.float()  # no key outside the candidates scored above this in bf16
            top_s, top_i = _rerank(Q, K, top_s, top_i, kk)
            redo = (~_certified(top_s, floor, Q, cache["max_norm"])).nonzero()[:, 0] if width < L and certify else []
            if len(redo):
                top_s[redo], top_i[redo] = _scored_topk(Q[redo], K, drop, kk, sorted=False)
            # keys too close for bf16 (most queries searched twice): fp32 from here on, for these keys
            done, again = cache.get("bf16_searched", 0) + len(Q), cache.get("bf16_redone", 0) + len(redo)
            cache.update(bf16_searched=done, bf16_redone=again,
                         fp32_only=done >= FP32_SWITCH_MIN_QUERIES and again > FP32_AFTER_REDONE * done)
        ts, ti = top_s.cpu().numpy(), top_i.cpu().numpy()
        ti = np.where(np.isneginf(ts), -1, ti)
        order = np.lexsort((ti, -ts), axis=1)  # deterministic ties: by (-score, id)
        ts, ti = np.take_along_axis(ts, order, 1), np.take_along_axis(ti, order, 1)
        scores[s:s + len(Q), :kk] = ts
        ids[s:s + len(Q), :kk] = ti
    return scores, ids


def _scored_topk(Q: torch.Tensor, K: torch.Tensor, drop: torch.Tensor | None, k: int,
                 sorted: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Each query's top ``k`` of its products with every key (in ``K``'s dtype), ``drop`` keys at -inf."""
    sim = Q.to(K.dtype) @ K.T
    if drop is not None:
        sim[:, drop] = -torch.inf
    return torch.topk(sim, k, dim=1, sorted=sorted)


def _certified(top_s: torch.Tensor, floor: torch.Tensor, Q: torch.Tensor, max_norm: torch.Tensor) -> torch.Tensor:
    """Per query: its k-th fp32 score beats every key left out of the candidates. A key outside them scored at
    most ``floor`` in bf16, so its true score is at most floor + |floor| 2^-7 (the product's rounding to bf16) +
    2^-7 |q| max|k| (its inputs' rounding, by Cauchy-Schwarz). Fewer valid keys than candidates (floor -inf):
    every key was a candidate."""
    bound = floor + floor.abs() * 2.0 ** -7 + 2.0 ** -7 * Q.norm(dim=1) * max_norm
    return (top_s.min(dim=1).values > bound) | torch.isneginf(floor)


def _key_tensors(keys: np.ndarray, device: torch.device, low: torch.dtype | None,
                 cache: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys in fp32 and in the scoring dtype on ``device`` (and their largest norm), made once per (device,
    dtype) and kept in ``cache``."""
    if (device, None) not in cache:
        cache[device, None] = torch.from_numpy(np.ascontiguousarray(keys, dtype=np.float32)).to(device)
        cache["max_norm"] = cache[device, None].norm(dim=1).max() if len(keys) else torch.tensor(0.0)
    if (device, low) not in cache:
        cache[device, low] = cache[device, None].to(low)
    return cache[device, None], cache[device, low]


def rerank_width(k: int) -> int:
    """How many bf16 candidates per query exact search re-scores in fp32 for a top ``k``: 2k, at least k + 32. On
    the 131K shape's vectors every query's top 100 is then certified (``_certified``), at k + 25 most are not
    (docs/decisions.md#exact-bf16)."""
    return k + max(k, 32)


def _rerank(Q: torch.Tensor, K: torch.Tensor, low_s: torch.Tensor, cand: torch.Tensor,
            k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The top ``k`` of each query's candidates ``cand`` by fp32 inner product (-inf kept where the low-precision
    pass had excluded the key); gathered in row chunks of at most 2^23 floats."""
    rows = max(1, (1 << 23) // max(cand.shape[1] * K.shape[1], 1))
    out_s, out_i = [], []
    for r in range(0, len(Q), rows):
        c = cand[r:r + rows]
        exact = torch.bmm(K.index_select(0, c.reshape(-1)).view(*c.shape, -1), Q[r:r + rows, :, None])[..., 0]
        exact = exact.masked_fill(torch.isneginf(low_s[r:r + rows]), -torch.inf)
        s, j = torch.topk(exact, k, dim=1, sorted=False)
        out_s.append(s)
        out_i.append(c.gather(1, j))
    return torch.cat(out_s), torch.cat(out_i)


def saved_kind(path: Path) -> str:
    """What ``LabelIndex.save`` wrote at ``path``: ``exact`` (.npy vectors) or ``hnsw`` (a faiss file)."""
    with open(path, "rb") as fh:
        return "exact" if fh.read(len(_NPY_MAGIC)) == _NPY_MAGIC else "hnsw"


class _Owned:
    """An array view of memory that ``owner`` holds: ``np.asarray`` of it keeps ``owner`` alive with the view."""

    def __init__(self, view: np.ndarray, owner: object):
        self.__array_interface__ = view.__array_interface__
        self.owner = owner


class LabelIndex:
    """A MIPS index over L label vectors (rows of W or label embeddings)."""

    def __init__(self, kind: str, vectors: np.ndarray | None = None, *, m: int = 32, ef_construction: int = 200,
                 ef_search: int = 200, faiss_index=None, nlist: int = 0, nprobe: int = 64, seed: int = 0):
        if kind == "auto" and vectors is None:
            raise ValueError("an auto index is resolved from its vectors")
        kind = resolve_kind(kind, 0 if vectors is None else len(vectors))
        self.kind = kind
        self.ef_search = ef_search
        self.nprobe = nprobe
        self._index = faiss_index
        self._vectors = None if vectors is None else np.ascontiguousarray(vectors, dtype=np.float32)
        self._tensors: dict = {}  # exact search's key tensors per (device, dtype), made on first search
        if self._index is None and kind != "exact":
            if self._vectors is None:
                raise ValueError(f"{kind} index needs vectors")
            n, dim = self._vectors.shape
            if kind == "hnsw":
                idx = faiss.IndexHNSWFlat(dim, m, faiss.METRIC_INNER_PRODUCT)
                idx.hnsw.efConstruction = ef_construction
            else:
                nl = max(1, min(nlist or int(round(np.sqrt(n))), n))
                idx = faiss.IndexIVFFlat(faiss.IndexFlatIP(dim), dim, nl, faiss.METRIC_INNER_PRODUCT)
                idx.cp.seed = seed
                idx.cp.min_points_per_centroid = 1  # sqrt(L) partitions of L vectors: avoid faiss's warning
                idx.train(self._vectors)
            idx.add(self._vectors)
            self._index = idx
        if self._index is not None:
            self._vectors = None  # the faiss index holds its own copy: the caller's array can be freed
        if self._index is not None and kind == "hnsw":
            self._index.hnsw.efSearch = ef_search

    @property
    def size(self) -> int:
        return int(self._index.ntotal) if self._index is not None else len(self._vectors)

    def stored_vectors(self) -> np.ndarray | None:
        """The indexed vectors as the index holds them, without a copy (exact: its array; HNSW: a view of the
        graph's flat storage, which keeps the index alive); None for IVF, whose lists hold them scattered."""
        if self.kind == "exact":
            return self._vectors
        if self.kind != "hnsw":
            return None
        flat = faiss.downcast_index(self._index.storage)
        n, d = int(flat.ntotal), int(flat.d)
        if not isinstance(flat, faiss.IndexFlat) or n == 0:
            return None
        return np.asarray(_Owned(faiss.rev_swig_ptr(flat.get_xb(), n * d).reshape(n, d), self._index))

    def search(self, queries: np.ndarray, k: int,
               exclude: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Top-k (scores float32, ids int64) per query row; ``exclude``: ids never returned (the graph or the
        partitions are still walked through them), e.g. the validation points when fitting on them."""
        q = np.ascontiguousarray(queries, dtype=np.float32)
        if self.kind == "exact":
            return exact_topk(q, self._vectors, k, exclude=exclude, cache=self._tensors)
        if self.kind == "ivf":
            self._index.nprobe = min(self.nprobe, self._index.nlist)
        else:
            self._index.hnsw.efSearch = max(self.ef_search, k)
        if exclude is None or not len(exclude):
            scores, ids = self._index.search(q, k)
        else:
            sel = faiss.IDSelectorNot(faiss.IDSelectorBatch(np.ascontiguousarray(exclude, dtype=np.int64)))
            params = (faiss.SearchParametersIVF(sel=sel, nprobe=self._index.nprobe) if self.kind == "ivf" else
                      faiss.SearchParametersHNSW(sel=sel, efSearch=self._index.hnsw.efSearch))
            scores, ids = self._index.search(q, k, params=params)
        scores = np.where(ids < 0, -np.inf, scores).astype(np.float32)
        return scores, ids.astype(np.int64)

    def save(self, path: Path) -> None:
        """HNSW/IVF: a faiss file; exact: the vectors as .npy (loads without executing code)."""
        if self.kind != "exact":
            faiss.write_index(self._index, str(path))
        else:
            with open(path, "wb") as fh:
                np.save(fh, self._vectors)

    @classmethod
    def load(cls, path: Path, kind: str, ef_search: int = 200, nprobe: int = 64) -> "LabelIndex":
        """The index ``save`` wrote; ``auto``: exact or faiss as the file says."""
        if kind == "auto":
            kind = saved_kind(path)
        if kind != "exact":
            return cls(kind, faiss_index=faiss.read_index(str(path)), ef_search=ef_search, nprobe=nprobe)
        with open(path, "rb") as fh:
            return cls("exact", np.load(fh, allow_pickle=False))
