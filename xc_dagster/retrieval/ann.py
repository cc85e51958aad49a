"""Approximate (and exact) maximum-inner-product search over label vectors: W or label embeddings.

``hnsw`` is a faiss HNSW graph (inner product), O(log L) per query; ``ivf`` is a faiss inverted file (inner
product): the vectors clustered by k-means into ``nlist`` partitions, a query scans the ``nprobe`` partitions
whose centroids score highest (MIPS-s's clustering-based MIPS, O(nprobe * L / nlist) per query); ``exact`` is a
blocked matrix product in torch (on the GPU when there is one), the reference that recall is measured against;
``auto`` is ``exact`` up to ``EXACT_MAX_VECTORS`` vectors and ``hnsw`` above: below it a matrix product over every
vector costs less than building the graph and walking it (bench/SCALE.md#index-choice), above it the per-query cost
stays O(log L). All return the top-k (scores, ids) per query, ids -1 where fewer than k exist (exact: ties broken by smaller id).
"""

from __future__ import annotations

from pathlib import Path

import faiss
import numpy as np
import torch

from xc_dagster.errors import XCConfigError

KINDS = ("hnsw", "ivf", "exact", "auto")
EXACT_MAX_VECTORS = 1 << 18  # kind "auto": exact search up to this many vectors, HNSW above (docs/decisions.md#index-auto)
EXACT_BLOCK_ENTRIES = 1 << 25  # exact search: at most this many query x key scores held at once (128 MiB float32)
_NPY_MAGIC = b"\x93NUMPY"  # an exact index's file (np.save); faiss files start otherwise


def resolve_kind(kind: str, n: int) -> str:
    """The index kind built for ``n`` vectors: ``auto`` is exact up to EXACT_MAX_VECTORS, else HNSW."""
    if kind not in KINDS:
        raise XCConfigError(f"index kind: expected one of {'|'.join(KINDS)}, got {kind!r}")
    return ("exact" if n <= EXACT_MAX_VECTORS else "hnsw") if kind == "auto" else kind


def exact_topk(queries: np.ndarray, keys: np.ndarray, k: int, block: int = 4096,
               device: torch.device | None = None,
               exclude: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Exact top-k inner products, in blocks of at most ``block`` queries and EXACT_BLOCK_ENTRIES scores, so memory
    stays bounded at any L; ``exclude``: key rows never returned."""
    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    n, L = len(queries), len(keys)
    block = max(1, min(block, EXACT_BLOCK_ENTRIES // max(L, 1)))
    kk = min(k, L)
    scores = np.full((n, k), -np.inf, dtype=np.float32)
    ids = np.full((n, k), -1, dtype=np.int64)
    K = torch.from_numpy(np.ascontiguousarray(keys, dtype=np.float32)).to(device)
    drop = None if exclude is None else torch.from_numpy(np.asarray(exclude, dtype=np.int64)).to(device)
    for s in range(0, n, block):
        Q = torch.from_numpy(np.ascontiguousarray(queries[s:s + block], dtype=np.float32)).to(device)
        sim = Q @ K.T
        if drop is not None:
            sim[:, drop] = -torch.inf
        top_s, top_i = torch.topk(sim, kk, dim=1, sorted=True)
        ts, ti = top_s.cpu().numpy(), top_i.cpu().numpy()
        ti = np.where(np.isneginf(ts), -1, ti)
        order = np.lexsort((ti, -ts), axis=1)  # deterministic ties: by (-score, id)
        ts, ti = np.take_along_axis(ts, order, 1), np.take_along_axis(ti, order, 1)
        scores[s:s + len(Q), :kk] = ts
        ids[s:s + len(Q), :kk] = ti
    return scores, ids


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
        if self._index is not None and kind == "hnsw":
            self._index.hnsw.efSearch = ef_search

    @property
    def size(self) -> int:
        return int(self._index.ntotal) if self._index is not None else len(self._vectors)

    def search(self, queries: np.ndarray, k: int,
               exclude: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Top-k (scores float32, ids int64) per query row; ``exclude``: ids never returned (the graph or the
        partitions are still walked through them), e.g. the validation points when fitting on them."""
        q = np.ascontiguousarray(queries, dtype=np.float32)
        if self.kind == "exact":
            return exact_topk(q, self._vectors, k, exclude=exclude)
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
            with open(path, "rb") as fh:
                kind = "exact" if fh.read(len(_NPY_MAGIC)) == _NPY_MAGIC else "hnsw"
        if kind != "exact":
            return cls(kind, faiss_index=faiss.read_index(str(path)), ef_search=ef_search, nprobe=nprobe)
        with open(path, "rb") as fh:
            return cls("exact", np.load(fh, allow_pickle=False))
