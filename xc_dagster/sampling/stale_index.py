"""The stale ANNS index over W that ASTRA and MIPS-s draw hard negatives from: one index per shard of a W
snapshot, searched for each query's best non-positive labels, serialisable for checkpoints."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import scipy.sparse as sp
import torch

from xc_dagster.config import EndToEndTrainerParams
from xc_dagster.faiss_module import faiss
from xc_dagster.retrieval.ann import LabelIndex
from xc_dagster.sampling.labels import positive_mask
from xc_dagster.training.distributed import DistEnv, gather_rows, label_range

Snapshot = list[tuple[int, np.ndarray]]  # W as (first label id, rows) per shard


def first_valid(ids: np.ndarray, k: int, scores: np.ndarray | None = None) -> np.ndarray:
    """The first ``k`` non-negative ids of each row (by descending ``scores`` when given), -1 padded."""
    key = np.where(ids >= 0, 0.0, 1.0) if scores is None else np.where(ids >= 0, -scores, np.inf)
    order = np.argsort(key, axis=1, kind="stable")[:, :k]
    out = np.take_along_axis(ids, order, 1)
    if out.shape[1] < k:
        out = np.concatenate([out, np.full((len(ids), k - out.shape[1]), -1, dtype=ids.dtype)], 1)
    return out


def search_shards(indexes: list[tuple[int, LabelIndex]], queries: np.ndarray, k: int,
                  env: DistEnv | None = None, own: tuple[int, int] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Top-``k`` (scores, global ids) over all shards' indexes, merged by score; ``env`` (W's label ranges on
    several ranks, each with the indexes of its own rows): merged over the ranks too. ``own``: the label range
    [lo, hi) this rank answers for; ids outside it are dropped (a rank resumed from a checkpoint of another world
    size searches the saved shards that overlap its range: each id is kept by the one rank that owns it)."""
    all_s, all_i = [], []
    for offset, idx in indexes:
        s, i = idx.search(queries, min(k, idx.size))
        i = np.where(i >= 0, i + offset, -1)
        if own is not None:
            outside = (i < own[0]) | (i >= own[1])
            s, i = np.where(outside, -np.inf, s).astype(np.float32), np.where(outside, -1, i)
        all_s.append(s)
        all_i.append(i)
    if not all_s:  # a rank whose label range is empty (fewer labels than ranks): nothing of its own
        all_s, all_i = [np.zeros((len(queries), 0), np.float32)], [np.zeros((len(queries), 0), np.int64)]
    s, i = _top(np.concatenate(all_s, 1), np.concatenate(all_i, 1), k, len(indexes) > 1)
    if env is not None and env.active:  # every rank's top k, side by side (padded to k), then merged
        pad = k - s.shape[1]
        s = np.pad(s, ((0, 0), (0, pad)), constant_values=-np.inf).astype(np.float32)
        i = np.pad(i, ((0, 0), (0, pad)), constant_values=-1).astype(np.int64)
        s, i = (np.concatenate(np.split(gather_rows(torch.from_numpy(a))[0].numpy(), env.world_size), 1)
                for a in (s, i))
        s, i = _top(s, i, k, True)
    return s, i


def _top(s: np.ndarray, i: np.ndarray, k: int, merge: bool) -> tuple[np.ndarray, np.ndarray]:
    """The best ``k`` columns of each row by score (stable: ties keep the shards' label order), when there are
    more than ``k`` or ``merge`` (columns from several shards)."""
    if s.shape[1] > k or merge:
        order = np.argsort(-s, axis=1, kind="stable")[:, :k]
        s, i = np.take_along_axis(s, order, 1), np.take_along_axis(i, order, 1)
    return s, i


def build_indexes(snapshot: Snapshot, kind: str, *, m: int = 32, ef_construction: int = 100,
                  ef_search: int = 100, nlist: int = 0, nprobe: int = 64, seed: int = 0
                  ) -> list[tuple[int, LabelIndex]]:
    """One index per shard of a W snapshot."""
    return [(off, LabelIndex(kind, W, m=m, ef_construction=ef_construction, ef_search=ef_search, nlist=nlist,
                             nprobe=nprobe, seed=seed)) for off, W in snapshot if len(W)]


def hard_negatives(indexes: list[tuple[int, LabelIndex]], queries: np.ndarray, Y: sp.csr_matrix,
                   rows: np.ndarray, num: int, extra: int, block: int = 65536, env: DistEnv | None = None
                   ) -> np.ndarray:
    """(len(rows), num) hardest non-positive labels of each query in ``indexes`` (-1 padded): searched for
    ``num + extra`` neighbours (``extra`` covers positives ranked first), positives dropped, best ``num`` kept."""
    out = np.full((len(rows), num), -1, dtype=np.int64)
    own = label_range(Y.shape[1], env.rank, env.world_size) if env is not None and env.active else None
    for s in range(0, len(rows), block):
        sc, ids = search_shards(indexes, queries[s:s + block], num + extra, env, own)
        r = rows[s:s + block]
        ids = np.where(positive_mask(Y, r, ids), -1, ids)
        out[s:s + block] = first_valid(ids, num, np.where(ids >= 0, sc, -np.inf))
    return out


@dataclass
class IndexSettings:
    """ANNS settings of a sampler's stale index (``kind`` hnsw|ivf|exact)."""

    kind: str = "hnsw"
    m: int = 32
    ef_construction: int = 100
    ef_search: int = 100
    nlist: int = 0  # ivf: 0 = round(sqrt(L_shard))
    nprobe: int = 64
    seed: int = 0
    env: DistEnv | None = field(default=None, compare=False)  # W's label ranges on several ranks: merge over them

    @classmethod
    def from_params(cls, params: EndToEndTrainerParams) -> IndexSettings:
        """``classifier.sampler_*`` / ``mips_*``."""
        return cls(params.sampler_index, params.sampler_hnsw_m, params.sampler_hnsw_ef_construction,
                   params.sampler_hnsw_ef, params.mips_partitions, params.mips_probe, params.seed)

    def build(self, snapshot: Snapshot) -> list[tuple[int, LabelIndex]]:
        return build_indexes(snapshot, self.kind, m=self.m, ef_construction=self.ef_construction,
                             ef_search=self.ef_search, nlist=self.nlist, nprobe=self.nprobe, seed=self.seed)


def dump_index(index: LabelIndex) -> np.ndarray:
    """An index as one array (faiss's serialisation, or the exact index's vectors) for a checkpoint."""
    if index.kind == "exact":
        return index._vectors
    return faiss.serialize_index(index._index)


def load_index(array: np.ndarray, settings: IndexSettings) -> LabelIndex:
    if settings.kind == "exact":
        return LabelIndex("exact", np.asarray(array, dtype=np.float32))
    return LabelIndex(settings.kind, faiss_index=faiss.deserialize_index(np.asarray(array, dtype=np.uint8)),
                      ef_search=settings.ef_search, nprobe=settings.nprobe)


def extra_neighbours(Y: sp.csr_matrix) -> int:
    """Extra neighbours to search so that positives ranked first still leave k negatives (capped)."""
    nnz = np.diff(Y.indptr)
    return int(min(nnz.max(initial=0), 64))
