"""Approximate (and exact) maximum-inner-product search over label vectors: W or label embeddings.

``hnsw`` is a faiss HNSW graph (inner product), O(log L) per query; ``ivf`` is a faiss inverted file (inner
product): the vectors clustered by k-means into ``nlist`` partitions, a query scans the ``nprobe`` partitions
whose centroids score highest (MIPS-s's clustering-based MIPS, O(nprobe * L / nlist) per query); ``exact`` is a
blocked matrix product in torch (on the GPU when there is one), the reference that recall is measured against;
``auto`` is ``exact`` up to a size that depends on where exact search runs and ``hnsw`` above
(``exact_settings.resolve_kind``): below it a matrix product over every vector costs less than building the graph
and walking it, above it the per-query cost stays O(log L). All return the top-k (scores, ids) per
query, ids -1 where fewer than k exist (exact: ties broken by smaller id, also which of the keys tied at the k-th
place are kept).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from xc_dagster.device import resolve_device
from xc_dagster.faiss_module import faiss
from xc_dagster.retrieval.exact_settings import exact_block_entries, exact_dtype, resolve_kind
from xc_dagster.retrieval.hnsw_build import GraphCheckpoint, build_hnsw

FP32_AFTER_REDONE = 0.5  # bf16 exact search: with more of its queries searched again in fp32, an index switches
FP32_SWITCH_MIN_QUERIES = 1024  # to fp32 for good, once it has searched at least this many queries in bf16
_INT32_MIN = torch.iinfo(torch.int32).min
GATHER_FLOATS = 1 << 20  # gathered_scores on a CPU: rows gathered at once (4 MiB, in cache; 2^23 took 4x the time)
TOPK_GROUP = 16  # CPU top-k over many keys: selection over the maxima of groups of 16 keys first (row_topk)
GATHER_FLOATS_GPU = 1 << 23  # the same on a GPU, where few large launches beat cache-sized ones
_NPY_MAGIC = b"\x93NUMPY"  # an exact index's file (np.save); faiss files start otherwise


def exact_topk(queries: np.ndarray, keys: np.ndarray, k: int, block: int = 4096,
               device: torch.device | None = None, exclude: np.ndarray | None = None,
               precision: str | None = None, cache: dict | None = None,
               certify: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """Exact top-k inner products, in blocks of at most ``block`` queries and ``exact_block_entries`` scores, so memory
    stays bounded at any L; ``exclude``: key rows never returned. Where bf16 or int8 pays (``exact_dtype``) the
    product over every key runs in that precision, its top ``rerank_width(k)`` are re-scored in fp32, and a query
    whose k-th fp32 score is not clear of the low precision's error bound above every other key is searched again
    in fp32 (``_certified``): the top k and the scores returned are fp32's either way. Once more than
    FP32_AFTER_REDONE of the queries searched on ``cache``'s keys were searched again (keys closer than the low
    precision resolves), later blocks and calls go straight to fp32. ``cache``: keeps the keys' tensors (and those
    counts) between calls. ``certify=False`` skips the second search (the run planner times the common path with
    it; near-ties may then be missed)."""
    device = device or resolve_device("auto")
    cache = {} if cache is None else cache
    cache["work"] = cache.get("work", 0) + len(queries) * keys.size  # multiply-adds on these keys, this call's too
    low = exact_dtype(device, precision, cache["work"]) if len(keys) else None  # no keys: nothing to score at all
    n, L = len(queries), len(keys)
    block = max(1, min(block, exact_block_entries(device) // max(L, 1)))
    kk = min(k, L)
    kk1 = min(k + 1, L)  # one past the k-th: an exact tie at the k-th place that spills past it is seen
    width = kk1 if low is None else min(L, rerank_width(k, low))
    scores = np.full((n, k), -np.inf, dtype=np.float32)
    ids = np.full((n, k), -1, dtype=np.int64)
    K, K_low = _key_tensors(keys, device, low, cache)
    drop = None if exclude is None else torch.from_numpy(np.asarray(exclude, dtype=np.int64)).to(device)
    out = _ScoreBuffers(L, device)
    for s in range(0, n, block):
        Q = torch.from_numpy(np.ascontiguousarray(queries[s:s + block], dtype=np.float32)).to(device)
        low = None if cache.get("fp32_only") else low
        if low is None:
            top_s, top_i = _scored_topk(Q, K, drop, kk1, sorted=False, out=out)
        else:
            quantized = _quantize(Q) if low == torch.int8 else None  # codes, scales, residual norms
            top_s, top_i = (_int8_topk(quantized, K_low, cache["int8_scale"], drop, width, out) if quantized else
                            _scored_topk(Q, K_low, drop, width, sorted=False, out=out))
            floor = top_s.min(dim=1).values.float()  # no key outside the candidates scored above this
            top_s, top_i = _rerank(Q, K, top_s, top_i, kk1)  # certified below: the top k + 1 are fp32's
            ok = _certified(top_s, floor, _error_bound(Q, floor, cache, None if quantized is None else quantized[2]))
            redo = (~ok).nonzero()[:, 0] if width < L and certify else []
            if len(redo):
                top_s[redo], top_i[redo] = _scored_topk(Q[redo], K, drop, kk1, sorted=False, out=out)
            # keys too close for the low precision (most queries searched twice): fp32 from here on, for these keys
            done, again = cache.get("low_searched", 0) + len(Q), cache.get("low_redone", 0) + len(redo)
            cache.update(low_searched=done, low_redone=again,
                         fp32_only=done >= FP32_SWITCH_MIN_QUERIES and again > FP32_AFTER_REDONE * done)
        ts, ti = top_s.cpu().numpy(), top_i.cpu().numpy()
        ti = np.where(np.isneginf(ts), -1, ti)
        order = np.lexsort((ti, -ts), axis=1)  # deterministic ties: by (-score, id)
        ts, ti = np.take_along_axis(ts, order, 1), np.take_along_axis(ti, order, 1)
        if kk1 > kk:  # the k-th and (k+1)-th tie (duplicate keys): which tied keys are kept is the selection's
            for r in np.flatnonzero((ts[:, kk - 1] == ts[:, kk]) & np.isfinite(ts[:, kk])):  # choice: by id
                ts[r, :kk], ti[r, :kk] = _ties_by_id(Q[r:r + 1], K, drop, kk)
        scores[s:s + len(Q), :kk] = ts[:, :kk]
        ids[s:s + len(Q), :kk] = ti[:, :kk]
    return scores, ids


def _ties_by_id(q: torch.Tensor, K: torch.Tensor, drop: torch.Tensor | None, k: int) -> tuple[np.ndarray, np.ndarray]:
    """One query's exact top ``k`` in fp32 by (score descending, id ascending) over every key: the keys above the
    k-th score and the smallest ids of those equal to it. For the rare query whose k-th place is an exact tie."""
    sim = torch.matmul(q, K.T)[0]
    if drop is not None:
        sim[drop] = -torch.inf
    kth = torch.topk(sim, k).values[-1]
    keep = torch.cat([(sim > kth).nonzero()[:, 0], (sim == kth).nonzero()[:, 0]])[:k]  # nonzero: ids ascending
    top_s, top_i = sim[keep].cpu().numpy(), keep.cpu().numpy()
    order = np.lexsort((top_i, -top_s))
    return top_s[order], top_i[order]


class _ScoreBuffers:
    """The (rows x L) score matrix of a search block, per dtype, carved from one flat buffer per (thread, device,
    dtype) that every block and every search reuses (it grows to the largest block, ``exact_block_entries``): a fresh
    matrix per block is a fresh mapping whose page faults cost 30-50% of the product (docs/decisions.md#exact-int8).
    Per thread, so that concurrent searches never share one."""

    _arena = threading.local()

    def __init__(self, n_keys: int, device: torch.device):
        self.n_keys, self.device = n_keys, device

    def __call__(self, rows: int, dtype: torch.dtype) -> torch.Tensor:
        bufs = self._arena.__dict__.setdefault("bufs", {})
        need, buf = rows * self.n_keys, bufs.get((self.device, dtype))
        if buf is None or buf.numel() < need:
            buf = bufs[self.device, dtype] = torch.empty(need, dtype=dtype, device=self.device)
        return buf[:need].view(rows, self.n_keys)


def _scored_topk(Q: torch.Tensor, K: torch.Tensor, drop: torch.Tensor | None, k: int, sorted: bool,
                 out: _ScoreBuffers) -> tuple[torch.Tensor, torch.Tensor]:
    """Each query's top ``k`` of its products with every key (in ``K``'s dtype), ``drop`` keys at -inf."""
    sim = torch.matmul(Q.to(K.dtype), K.T, out=out(len(Q), K.dtype))
    if drop is not None:
        sim[:, drop] = -torch.inf
    return row_topk(sim, k, sorted)


def row_topk(sim: torch.Tensor, k: int, sorted: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.topk(sim, k, dim=1)``, the same values; on a CPU with many columns through the maxima of groups of
    TOPK_GROUP columns: the top k values lie in the k groups of largest maximum (each of those k maxima is a distinct
    value at least as large as the k-th group maximum), so selection runs over L / 16 maxima and 16k values instead
    of L. Group j is the columns j, j + M, ..., j + 15M (M = L // 16): its maximum is an elementwise maximum of 16
    contiguous slices, which vectorizes (2.3x a reduction over 16 adjacent columns); the last L - 16M columns are
    always candidates (docs/decisions.md#grouped-topk)."""
    n, L = sim.shape
    m = L // TOPK_GROUP
    if sim.device.type != "cpu" or m < max(4 * k, 1):
        return torch.topk(sim, k, dim=1, sorted=sorted)
    _, best = torch.topk(sim[:, :m * TOPK_GROUP].view(n, TOPK_GROUP, m).amax(dim=1), k, dim=1, sorted=False)
    cols = (best.unsqueeze(2) + torch.arange(0, m * TOPK_GROUP, m)).view(n, -1)
    if m * TOPK_GROUP < L:
        cols = torch.cat([cols, torch.arange(m * TOPK_GROUP, L).expand(n, -1)], dim=1)
    top, j = torch.topk(sim.gather(1, cols), k, dim=1, sorted=sorted)
    return top, cols.gather(1, j)


def _int8_topk(quantized: tuple[torch.Tensor, torch.Tensor, torch.Tensor], K8: torch.Tensor, key_scale: float,
               drop: torch.Tensor | None, k: int, out: _ScoreBuffers) -> tuple[torch.Tensor, torch.Tensor]:
    """Each query's top ``k`` keys by int8 product (``quantized``: the queries by ``_quantize``, per row; ``K8`` the
    keys' codes at one ``key_scale``), as approximate fp32 scores (-inf for ``drop``): the int32 products are
    exact, so the ranking is that of the quantized vectors, and only the top k are scaled back."""
    codes, q_scale, _ = quantized
    sim = torch._int_mm(codes, K8.T, out=out(len(codes), torch.int32))
    if drop is not None:
        sim[:, drop] = _INT32_MIN
    top, ids = row_topk(sim, k)
    scores = (top.double() * (q_scale.double()[:, None] * key_scale)).float()
    return scores.masked_fill(top == _INT32_MIN, -torch.inf), ids


def _quantize(X: torch.Tensor, scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Symmetric int8 codes of ``X``'s rows (codes * scale ~ X): one scale per row, or ``scale`` for all; with the
    scales and each row's residual norm |x - codes * scale|, which the error bound needs."""
    if scale is None:
        s = (X.abs().amax(dim=1) / 127.0).clamp_min(torch.finfo(torch.float32).tiny)
    else:
        s = torch.full((len(X),), scale, dtype=torch.float32, device=X.device)
    codes = torch.round(X / s[:, None]).clamp_(-127, 127)
    resid = (X - codes * s[:, None]).norm(dim=1)
    return codes.to(torch.int8), s, resid


def _error_bound(Q: torch.Tensor, floor: torch.Tensor, cache: dict, e_q: torch.Tensor | None = None) -> torch.Tensor:
    """Per query: how far above its low-precision score a key's true score can be. bf16 (``e_q`` None): |floor|
    2^-7 (the product's rounding) + 2^-7 |q| max|k| (its inputs' rounding, by Cauchy-Schwarz). int8 (``e_q``: the
    queries' residual norms): q.k - q'.k' = e_q.k + q'.e_k for the quantized q', k' and residuals e, so at most
    |e_q| max|k| + (|q| + |e_q|) max|e_k| (the int32 product is exact), plus fp32 rounding of the scaled score."""
    if e_q is not None:
        return (e_q * cache["max_norm"] + (Q.norm(dim=1) + e_q) * cache["int8_resid"]
                + floor.abs() * 2.0 ** -20)
    return floor.abs() * 2.0 ** -7 + 2.0 ** -7 * Q.norm(dim=1) * cache["max_norm"]


def _certified(top_s: torch.Tensor, floor: torch.Tensor, bound: torch.Tensor) -> torch.Tensor:
    """Per query: its k-th fp32 score beats every key left out of the candidates, which scored at most ``floor``
    in the low precision, so at most floor + ``bound`` truly (``_error_bound``). Fewer valid keys than candidates
    (floor -inf): every key was a candidate."""
    return (top_s.min(dim=1).values > floor + bound) | torch.isneginf(floor)


def _key_tensors(keys: np.ndarray, device: torch.device, low: torch.dtype | None,
                 cache: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys in fp32 and in the scoring dtype on ``device`` (and their largest norm; for int8 the codes at one
    scale and the largest residual norm), made once per (device, dtype) and kept in ``cache``."""
    if (device, None) not in cache:
        cache[device, None] = torch.from_numpy(np.ascontiguousarray(keys, dtype=np.float32)).to(device)
        cache["max_norm"] = cache[device, None].norm(dim=1).max() if len(keys) else torch.tensor(0.0)
    K = cache[device, None]
    if (device, low) not in cache and low == torch.int8:
        scale = max(float(K.abs().max()), torch.finfo(torch.float32).tiny) / 127.0  # keys exist: exact_topk
        codes, resid = torch.empty(K.shape, dtype=torch.int8, device=device), torch.zeros(len(K), device=device)
        for r in range(0, len(K), 1 << 16):  # in row chunks: the float codes of every key at once need not exist
            codes[r:r + (1 << 16)], _, resid[r:r + (1 << 16)] = _quantize(K[r:r + (1 << 16)], scale)
        cache.update({(device, low): codes, "int8_scale": scale, "int8_resid": resid.max()})
    if (device, low) not in cache:
        cache[device, low] = K.to(low)
    return K, cache[device, low]


def rerank_width(k: int, low: torch.dtype = torch.bfloat16) -> int:
    """How many low-precision candidates per query exact search re-scores in fp32 for a top ``k``: for bf16 2k, at
    least k + 32; for int8, whose error bound is ~1.5x bf16's, twice that. On the 131K shape's vectors every
    query's top 100 is then certified by bf16 (``_certified``), at k + 25 most are not; on MiniLM's vectors of
    LF-WordNetNouns int8 certifies 81% at 2k and all at 4k (docs/decisions.md#exact-bf16, #exact-int8)."""
    return (k + max(k, 32)) * (2 if low == torch.int8 else 1)


def _rerank(Q: torch.Tensor, K: torch.Tensor, low_s: torch.Tensor, cand: torch.Tensor,
            k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The top ``k`` of each query's candidates ``cand`` by fp32 inner product (-inf kept where the low-precision
    pass had excluded the key)."""
    exact = gathered_scores(Q, K, cand).masked_fill(torch.isneginf(low_s), -torch.inf)
    s, j = torch.topk(exact, k, dim=1, sorted=False)
    return s, cand.gather(1, j)


def gathered_scores(Q: torch.Tensor, K: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Row-wise inner products ``Q[i] . K[ids[i, j]]`` (ids >= 0): (n, C) in Q's dtype, the rows of K gathered
    GATHER_FLOATS at a time so that they are used while in cache (a 256 x 400 x 384 gather at once: 4-5x slower)."""
    limit = GATHER_FLOATS if Q.device.type == "cpu" else GATHER_FLOATS_GPU
    rows = max(1, limit // max(ids.shape[1] * K.shape[1], 1))
    out = torch.empty(ids.shape, dtype=Q.dtype, device=Q.device)
    for r in range(0, len(Q), rows):
        c = ids[r:r + rows]
        out[r:r + rows] = torch.bmm(K.index_select(0, c.reshape(-1)).view(*c.shape, -1), Q[r:r + rows, :, None])[..., 0]
    return out


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
                 ef_search: int = 200, faiss_index=None, nlist: int = 0, nprobe: int = 64, seed: int = 0,
                 checkpoint: GraphCheckpoint | None = None, progress: Callable[[int], None] | None = None):
        """``checkpoint``, ``progress``: an HNSW build kept as it goes and followed (``hnsw_build.build_hnsw``)."""
        if kind == "auto" and vectors is None:
            raise ValueError("an auto index is resolved from its vectors")
        kind = resolve_kind(kind, 0 if vectors is None else len(vectors), 0 if vectors is None else vectors.shape[1])
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
                idx = build_hnsw(self._vectors, m, ef_construction, checkpoint, progress)
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
