"""Negative samplers over the whole label space for BCE classifier training (ASTRA, MIPS-s).

Every sampler returns, per query of a mini-batch, candidate negative label ids (-1 = none) and a weight per
candidate; the loss is ``sum_pos BCE+ + sum_j weight_j * BCE-(s_j)``. No positive of the query is ever returned.

- ``uniform``: k draws uniform over [L] with replacement, draws that hit a positive dropped, weight L / k: an
  unbiased estimate of the full negative loss sum_{l not positive} log(1 + exp(s_l)) (ASTRA's warm-up).
- ``astra`` (ASTRA Algorithm 1): after the warm-up, k_h hard negatives per query = its top-k_h labels in an ANNS
  index over a stale snapshot of the classifier vectors W (positives excluded), looked up from a per-query table
  that is refreshed every ``refresh_steps``; plus k_r uniform draws over [L] with those and the positives
  dropped, weight L / k_r. E[weighted sum] = the full negative loss exactly (the paper writes (L - k_h) / k_r for
  the same estimator over [L] minus the hard set). The refresh is pipelined as in the paper: the table used from
  step s is built in a background thread during the preceding ``lead_steps`` from W and the query embeddings as
  they were when the build started (the embedding bank holds each query's embedding from its last training
  step), so training never waits unless the build is slower than a whole interval.
- ``mips`` (MIPS-s Algorithm 1): every ``refresh_steps`` W is snapshot and clustered into ~sqrt(L) partitions
  (faiss IVF, inner product); each step the fresh query embeddings probe the ``nprobe`` best partitions for the k
  best stale columns (positives removed) and R - k uniform labels are added (positives and repeats removed);
  plain, unweighted BCE.

With W sharded (``xc_dagster.training.sharded``), each shard gets its own index and the per-shard top lists are merged
by score, as ASTRA does across GPUs.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import faiss
import numpy as np
import scipy.sparse as sp

from xc_dagster.errors import XCConfigError
from xc_dagster.retrieval.ann import LabelIndex
from xc_dagster.sampling.labels import dedupe_rows, positive_mask

SAMPLERS = ("uniform", "astra", "mips")


@dataclass
class NegativeSample:
    ids: np.ndarray  # (B, K) int64, -1 = no candidate
    weights: np.ndarray  # (B, K) float32, 0 where ids < 0
    hard: int = 0  # the first ``hard`` columns come from the index over W, the rest are uniform draws


def drop_members(ids: np.ndarray, other: np.ndarray, num_labels: int) -> np.ndarray:
    """``ids`` with every entry that also occurs in the same row of ``other`` set to -1 (vectorised)."""
    if other.size == 0 or ids.size == 0:
        return ids
    rows = np.arange(len(ids), dtype=np.int64)[:, None]
    keys = rows * num_labels + np.maximum(ids, 0)
    okeys = (rows * num_labels + other)[other >= 0]
    return np.where((ids >= 0) & ~np.isin(keys, okeys), ids, -1)


def first_valid(ids: np.ndarray, k: int, scores: np.ndarray | None = None) -> np.ndarray:
    """The first ``k`` non-negative ids of each row (by descending ``scores`` when given), -1 padded."""
    key = np.where(ids >= 0, 0.0, 1.0) if scores is None else np.where(ids >= 0, -scores, np.inf)
    order = np.argsort(key, axis=1, kind="stable")[:, :k]
    out = np.take_along_axis(ids, order, 1)
    if out.shape[1] < k:
        out = np.concatenate([out, np.full((len(ids), k - out.shape[1]), -1, dtype=ids.dtype)], 1)
    return out


def uniform_draws(num_labels: int, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    return rng.integers(0, num_labels, size=(n, k), dtype=np.int64)


def uniform_negatives(Y: sp.csr_matrix, rows: np.ndarray, k: int, rng: np.random.Generator,
                      exclude: np.ndarray | None = None) -> NegativeSample:
    """k uniform draws over [L] per row; draws that are positives of the row or in ``exclude[i]`` are dropped;
    weight L / k, so sum_j w_j f(ids_j) is unbiased for sum over [L] minus (positives u exclude) of f."""
    L = Y.shape[1]
    ids = uniform_draws(L, len(rows), k, rng)
    ids = np.where(positive_mask(Y, rows, ids), -1, ids)
    if exclude is not None:
        ids = drop_members(ids, exclude, L)
    w = np.where(ids >= 0, L / max(k, 1), 0.0).astype(np.float32)
    return NegativeSample(ids, w)


def search_shards(indexes: list[tuple[int, LabelIndex]], queries: np.ndarray, k: int
                  ) -> tuple[np.ndarray, np.ndarray]:
    """Top-``k`` (scores, global ids) over all shards' indexes, merged by score."""
    all_s, all_i = [], []
    for offset, idx in indexes:
        s, i = idx.search(queries, min(k, idx.size))
        all_s.append(s)
        all_i.append(np.where(i >= 0, i + offset, -1))
    s, i = np.concatenate(all_s, 1), np.concatenate(all_i, 1)
    if len(indexes) > 1:
        order = np.argsort(-s, axis=1, kind="stable")[:, :k]
        s, i = np.take_along_axis(s, order, 1), np.take_along_axis(i, order, 1)
    return s, i


def build_indexes(snapshot: list[tuple[int, np.ndarray]], kind: str, *, m: int = 32, ef_construction: int = 100,
                  ef_search: int = 100, nlist: int = 0, nprobe: int = 64, seed: int = 0
                  ) -> list[tuple[int, LabelIndex]]:
    """One index per shard of a W snapshot."""
    return [(off, LabelIndex(kind, W, m=m, ef_construction=ef_construction, ef_search=ef_search, nlist=nlist,
                             nprobe=nprobe, seed=seed)) for off, W in snapshot if len(W)]


def hard_negatives(indexes: list[tuple[int, LabelIndex]], queries: np.ndarray, Y: sp.csr_matrix,
                   rows: np.ndarray, num: int, extra: int, block: int = 65536) -> np.ndarray:
    """(len(rows), num) hardest non-positive labels of each query in ``indexes`` (-1 padded): searched for
    ``num + extra`` neighbours (``extra`` covers positives ranked first), positives dropped, best ``num`` kept."""
    out = np.full((len(rows), num), -1, dtype=np.int64)
    for s in range(0, len(rows), block):
        sc, ids = search_shards(indexes, queries[s:s + block], num + extra)
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

    def build(self, snapshot: list[tuple[int, np.ndarray]]) -> list[tuple[int, LabelIndex]]:
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


def _extra(Y: sp.csr_matrix) -> int:
    """Extra neighbours to search so that positives ranked first still leave k negatives (capped)."""
    nnz = np.diff(Y.indptr)
    return int(min(nnz.max(initial=0), 64))


class UniformNegatives:
    """Uniform negatives only, importance-weighted (ASTRA's warm-up; the ``uniform`` ablation)."""

    name = "uniform"

    def __init__(self, Y: sp.csr_matrix, num: int):
        self.Y, self.num = Y, num
        self.refreshes = 0

    def before_step(self, step: int, snapshot_fn) -> None:
        pass

    def observe(self, rows: np.ndarray, emb: np.ndarray) -> None:
        pass

    def sample(self, rows: np.ndarray, emb: np.ndarray, step: int, rng: np.random.Generator) -> NegativeSample:
        return uniform_negatives(self.Y, rows, self.num, rng)

    def state(self) -> dict[str, Any]:
        return {}

    def load_state(self, st: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass


class AstraNegatives:
    """ASTRA: uniform warm-up until ``start_step``; then stale hard negatives (per-query table from an index over a
    W snapshot, refreshed every ``refresh_steps``, built in the background over the ``lead_steps`` before it is
    used) + importance-weighted uniform negatives.

    ``bank``: (n, D) the latest embedding of every training query (initially the pre-trained encoder's);
    ``initial_table``: hard negatives valid at step 0 (e.g. the mining stage's shortlist, an index over W0 =
    the label embeddings), used when ``start_step`` is 0 instead of building the first table.
    """

    name = "astra"

    def __init__(self, Y: sp.csr_matrix, bank: np.ndarray, num_hard: int, num_random: int, start_step: int,
                 refresh_steps: int, lead_steps: int, index: IndexSettings, asynchronous: bool = True,
                 initial_table: np.ndarray | None = None, total_steps: int | None = None):
        if num_hard < 0 or num_random < 1:
            raise XCConfigError(f"classifier.num_hard / num_random: expected >= 0 / >= 1, got {num_hard} / "
                                f"{num_random}")
        if refresh_steps < 1:
            raise XCConfigError(f"classifier.refresh_every: must come to at least one step, got {refresh_steps}")
        self.Y, self.bank = Y, bank
        self.extra = _extra(Y)
        self.num_hard, self.num_random = num_hard, num_random
        self.start, self.every = max(start_step, 0), refresh_steps
        self.lead = max(0, min(lead_steps, refresh_steps)) if asynchronous else 0
        self.index, self.asynchronous = index, asynchronous
        self.total = total_steps  # no refresh is built for a step training never reaches
        self.table: np.ndarray | None = None
        self.next_k = 0
        self.refreshes = 0
        self._pool = ThreadPoolExecutor(max_workers=1) if asynchronous else None
        self._future: Future | None = None
        self._pending_at = -1
        self._pending_table: np.ndarray | None = None
        self.build_seconds: list[float] = []
        if initial_table is not None and self.start == 0 and num_hard > 0:
            rows = np.arange(len(bank))
            t = np.asarray(initial_table, dtype=np.int64)
            t = np.where(positive_mask(Y, rows, t), -1, t)
            self.table, self.next_k = first_valid(t, num_hard), 1

    def refresh_step(self, k: int) -> int:
        return self.start + k * self.every

    def _build(self, snapshot: list[tuple[int, np.ndarray]], queries: np.ndarray) -> np.ndarray:
        t0 = time.perf_counter()
        table = hard_negatives(self.index.build(snapshot), queries, self.Y, np.arange(len(queries)),
                               self.num_hard, self.extra)
        self.build_seconds.append(time.perf_counter() - t0)
        return table

    def before_step(self, step: int, snapshot_fn) -> None:
        """Swap in a finished table when its step comes; start the next build ``lead`` steps before its step."""
        if self.num_hard == 0:
            return
        if self._pending_at >= 0 and step >= self._pending_at:
            self.table = self._future.result() if self._future is not None else self._pending_table
            self._future, self._pending_table, self._pending_at = None, None, -1
            self.refreshes += 1
        due = self.refresh_step(self.next_k)
        if self.total is not None and due >= self.total:
            return
        if self._pending_at < 0 and step >= due - self.lead:
            snap, queries = snapshot_fn(), self.bank.copy()
            if self._pool is not None:
                self._future = self._pool.submit(self._build, snap, queries)
            else:
                self._pending_table = self._build(snap, queries)
            self._pending_at, self.next_k = due, self.next_k + 1
            if step >= due:  # synchronous, or launched on its own step: use it now
                self.before_step(step, snapshot_fn)

    def observe(self, rows: np.ndarray, emb: np.ndarray) -> None:
        self.bank[rows] = emb

    def sample(self, rows: np.ndarray, emb: np.ndarray, step: int, rng: np.random.Generator) -> NegativeSample:
        if self.table is None or step < self.start or self.num_hard == 0:
            return uniform_negatives(self.Y, rows, self.num_hard + self.num_random, rng)
        hard = self.table[rows]
        rand = uniform_negatives(self.Y, rows, self.num_random, rng, exclude=hard)
        w = np.concatenate([(hard >= 0).astype(np.float32), rand.weights], 1)
        return NegativeSample(np.concatenate([hard, rand.ids], 1), w, hard.shape[1])

    def state(self) -> dict[str, Any]:
        """Everything a resumed run needs (waits for a build in flight)."""
        pending = self._future.result() if self._future is not None else self._pending_table
        return {"table": self.table, "next_k": self.next_k, "refreshes": self.refreshes, "bank": self.bank.copy(),
                "pending_table": pending, "pending_at": self._pending_at}

    def load_state(self, st: dict[str, Any]) -> None:
        self.table, self.next_k, self.refreshes = st["table"], int(st["next_k"]), int(st["refreshes"])
        self.bank[:] = st["bank"]
        self._future, self._pending_table, self._pending_at = None, st["pending_table"], int(st["pending_at"])

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)


class MipsNegatives:
    """MIPS-s: k negatives from a clustering-based MIPS over stale W (fresh query embeddings), R - k uniform."""

    name = "mips"

    def __init__(self, Y: sp.csr_matrix, num_mips: int, num_total: int, refresh_steps: int, index: IndexSettings):
        if not 0 <= num_mips <= num_total or num_total < 1:
            raise XCConfigError(f"classifier.num_hard / num_random: MIPS-s needs 0 <= k <= R, R >= 1; got k="
                                f"{num_mips}, R={num_total}")
        if refresh_steps < 1:
            raise XCConfigError(f"classifier.refresh_every: must come to at least one step, got {refresh_steps}")
        self.Y, self.k, self.R, self.every, self.index = Y, num_mips, num_total, refresh_steps, index
        self.extra = _extra(Y)  # once: Y does not change, sample() runs every step
        self.indexes: list[tuple[int, LabelIndex]] | None = None
        self.refreshes = 0
        self.build_seconds: list[float] = []

    def before_step(self, step: int, snapshot_fn) -> None:
        if self.k > 0 and (self.indexes is None or step % self.every == 0):
            t0 = time.perf_counter()
            self.indexes = self.index.build(snapshot_fn())
            self.build_seconds.append(time.perf_counter() - t0)
            self.refreshes += 1

    def observe(self, rows: np.ndarray, emb: np.ndarray) -> None:
        pass

    def sample(self, rows: np.ndarray, emb: np.ndarray, step: int, rng: np.random.Generator) -> NegativeSample:
        L = self.Y.shape[1]
        hard = (hard_negatives(self.indexes, np.ascontiguousarray(emb, dtype=np.float32), self.Y, rows, self.k,
                               self.extra) if self.k > 0 else np.zeros((len(rows), 0), dtype=np.int64))
        rand = uniform_draws(L, len(rows), self.R - self.k, rng)
        rand = np.where(positive_mask(self.Y, rows, rand), -1, rand)
        rand = dedupe_rows(drop_members(rand, hard, L))
        ids = np.concatenate([hard, rand], 1)
        return NegativeSample(ids, (ids >= 0).astype(np.float32), hard.shape[1])

    def state(self) -> dict[str, Any]:
        """The stale indexes in use, serialised (no extra copy of W is kept while training)."""
        return {"refreshes": self.refreshes,
                "indexes": None if self.indexes is None else [(off, dump_index(i)) for off, i in self.indexes]}

    def load_state(self, st: dict[str, Any]) -> None:
        self.refreshes = int(st["refreshes"])
        self.indexes = (None if st["indexes"] is None else
                        [(int(off), load_index(a, self.index)) for off, a in st["indexes"]])

    def close(self) -> None:
        pass
