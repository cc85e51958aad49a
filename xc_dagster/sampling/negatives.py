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

With W sharded (``xc_dagster.training.sharded``), each shard gets its own index and the per-shard top lists are
merged by score, as ASTRA does across GPUs (``xc_dagster.sampling.stale_index``).
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import numpy as np
import scipy.sparse as sp

from xc_dagster.config import EndToEndTrainerParams
from xc_dagster.errors import XCConfigError
from xc_dagster.retrieval.ann import LabelIndex
from xc_dagster.sampling.labels import dedupe_rows, positive_mask
from xc_dagster.sampling.stale_index import (
    IndexSettings,
    Snapshot,
    dump_index,
    extra_neighbours,
    first_valid,
    hard_negatives,
    load_index,
)
from xc_dagster.training.distributed import gather_objects, label_range


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


def epochs_to_steps(epochs: float, field: str, steps_per_epoch: int) -> int:
    """An interval of ``classifier.<field>`` epochs (>= 0) in steps."""
    if epochs < 0:
        raise XCConfigError(f"classifier.{field}: expected >= 0 epochs, got {epochs}")
    return int(round(epochs * steps_per_epoch))


class NegativeSampler(Protocol):
    """What the BCE trainer calls on its negative sampler (a new sampler: one class and one
    ``SAMPLED_NEGATIVES`` line)."""

    refreshes: int  # stale indexes (or tables) put in use so far
    build_seconds: list[float]  # the time of each index build

    @classmethod
    def from_params(cls, params: EndToEndTrainerParams, Y: sp.csr_matrix, bank: np.ndarray, steps_per_epoch: int,
                    initial_table: np.ndarray | None, total_steps: int) -> NegativeSampler:
        """The sampler over the examples' labels ``Y``; ``bank``: each example's latest embedding;
        ``initial_table``: a hard-negative table valid at step 0 (the mined shortlist), or None."""

    def before_step(self, step: int, snapshot_fn: Callable[[], Snapshot]) -> None:
        """Before step ``step``: refresh what is stale, from ``snapshot_fn()`` (a CPU copy of W)."""

    def observe(self, rows: np.ndarray, emb: np.ndarray) -> None:
        """The examples ``rows``' embeddings of this step (the encoder is trained)."""

    def sample(self, rows: np.ndarray, emb: np.ndarray, step: int, rng: np.random.Generator) -> NegativeSample:
        """Negatives of the examples ``rows`` (query embeddings ``emb``), never one of their positives."""

    def state(self) -> dict[str, Any]:
        """Everything a resumed run needs (numpy arrays, numbers)."""

    def load_state(self, st: dict[str, Any]) -> None:
        """Restore ``state()``."""

    def close(self) -> None:
        """Stop background work."""


class UniformNegatives:
    """Uniform negatives only, importance-weighted (ASTRA's warm-up; the ``uniform`` ablation)."""

    name = "uniform"

    def __init__(self, Y: sp.csr_matrix, num: int):
        self.Y, self.num = Y, num
        self.refreshes = 0
        self.build_seconds: list[float] = []

    @classmethod
    def from_params(cls, params: EndToEndTrainerParams, Y: sp.csr_matrix, bank: np.ndarray, steps_per_epoch: int,
                    initial_table: np.ndarray | None, total_steps: int) -> UniformNegatives:
        """``num_hard + num_random`` uniform draws."""
        return cls(Y, params.num_hard + params.num_random)

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
        self.extra = extra_neighbours(Y)
        self.num_hard, self.num_random = num_hard, num_random
        self.start, self.every = max(start_step, 0), refresh_steps
        self.anchor = self.start  # the step tables are due from: anchor + k * every
        self._lead_cap = max(0, lead_steps) if asynchronous else 0
        self.lead = min(self._lead_cap, refresh_steps)
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

    @classmethod
    def from_params(cls, params: EndToEndTrainerParams, Y: sp.csr_matrix, bank: np.ndarray, steps_per_epoch: int,
                    initial_table: np.ndarray | None, total_steps: int) -> AstraNegatives:
        """``hard_start`` and ``refresh_every`` in steps; the next table is built during the epoch (at most)
        before it is due."""
        every = max(1, epochs_to_steps(params.refresh_every, "refresh_every", steps_per_epoch))
        return cls(Y, bank, params.num_hard, params.num_random,
                   epochs_to_steps(params.hard_start, "hard_start", steps_per_epoch), every,
                   min(steps_per_epoch, every), IndexSettings.from_params(params), params.refresh_async,
                   initial_table, total_steps)

    def refresh_step(self, k: int) -> int:
        return self.anchor + k * self.every

    def reinterval(self, step: int, every: int | None = None, start: int | None = None) -> None:
        """A re-planned run's intervals from ``step`` on (None: kept): a table every ``every`` steps after the last
        one built or in flight, and the hard negatives from ``start`` where the first table is not yet on its way."""
        if start is not None and self.next_k == 0:
            self.start = self.anchor = max(int(start), step)
        if every is not None:
            if self.next_k > 0:
                self.anchor, self.next_k = self.refresh_step(self.next_k - 1), 1
            self.every = max(1, int(every))
            self.lead = min(self._lead_cap, self.every)

    def _build(self, snapshot: list[tuple[int, np.ndarray]], queries: np.ndarray) -> np.ndarray:
        t0 = time.perf_counter()
        table = hard_negatives(self.index.build(snapshot), queries, self.Y, np.arange(len(queries)),
                               self.num_hard, self.extra, env=self.index.env)
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
                "pending_table": pending, "pending_at": self._pending_at,
                "intervals": np.array([self.start, self.anchor, self.every, self.lead], dtype=np.int64)}

    def load_state(self, st: dict[str, Any]) -> None:
        self.table, self.next_k, self.refreshes = st["table"], int(st["next_k"]), int(st["refreshes"])
        if st.get("intervals") is not None:  # a re-planned run's (checkpoints before them: the plan's)
            self.start, self.anchor, self.every, self.lead = (int(x) for x in st["intervals"])
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
        self.extra = extra_neighbours(Y)  # once: Y does not change, sample() runs every step
        self.indexes: list[tuple[int, LabelIndex]] | None = None
        self.refreshes = 0
        self.build_seconds: list[float] = []

    @classmethod
    def from_params(cls, params: EndToEndTrainerParams, Y: sp.csr_matrix, bank: np.ndarray, steps_per_epoch: int,
                    initial_table: np.ndarray | None, total_steps: int) -> MipsNegatives:
        """k = ``num_hard`` MIPS negatives of R = ``num_hard + num_random``, the index rebuilt every
        ``refresh_every`` epochs."""
        every = max(1, epochs_to_steps(params.refresh_every, "refresh_every", steps_per_epoch))
        return cls(Y, params.num_hard, params.num_hard + params.num_random, every, IndexSettings.from_params(params))

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
        queries = np.ascontiguousarray(emb, dtype=np.float32)
        hard = (hard_negatives(self.indexes, queries, self.Y, rows, self.k, self.extra, env=self.index.env)
                if self.k > 0 else np.zeros((len(rows), 0), dtype=np.int64))
        rand = uniform_draws(L, len(rows), self.R - self.k, rng)
        rand = np.where(positive_mask(self.Y, rows, rand), -1, rand)
        rand = dedupe_rows(drop_members(rand, hard, L))
        ids = np.concatenate([hard, rand], 1)
        return NegativeSample(ids, (ids >= 0).astype(np.float32), hard.shape[1])

    def state(self) -> dict[str, Any]:
        """The stale indexes in use, serialised (no extra copy of W is kept while training); with W's label ranges
        on several ranks every rank's, gathered on rank 0 (every rank must call it): (first label id, index) per
        shard, which a run of any world size resumes from."""
        mine = None if self.indexes is None else [(off, dump_index(i)) for off, i in self.indexes]
        env = self.index.env
        if env is not None and env.active:
            parts = gather_objects(mine, env)
            mine = (None if parts is None or any(p is None for p in parts)
                    else sorted((shard for p in parts for shard in p), key=lambda shard: shard[0]))
        return {"refreshes": self.refreshes, "indexes": mine, "every": self.every}

    def reinterval(self, step: int, every: int | None = None, start: int | None = None) -> None:
        """A re-planned run's rebuild interval (``start``: MIPS-s has no warm-up)."""
        if every is not None:
            self.every = max(1, int(every))

    def load_state(self, st: dict[str, Any]) -> None:
        """The saved shards' indexes; on one of several ranks only those overlapping its label range (searched
        for its own labels only: ``search_shards``) until its first refresh indexes its own rows."""
        self.refreshes = int(st["refreshes"])
        self.every = int(st.get("every", self.every))
        if st["indexes"] is None:
            self.indexes = None
            return
        env = self.index.env
        lo, hi = (label_range(self.Y.shape[1], env.rank, env.world_size) if env is not None and env.active
                  else (0, self.Y.shape[1]))
        saved = [(int(off), a) for off, a in st["indexes"]]
        ends = [off for off, _ in saved[1:]] + [self.Y.shape[1]]  # the shards are W's consecutive label ranges
        self.indexes = [(off, load_index(a, self.index)) for (off, a), end in zip(saved, ends) if off < hi and end > lo]

    def close(self) -> None:
        pass


SAMPLED_NEGATIVES: dict[str, type[NegativeSampler]] = {
    "uniform": UniformNegatives,
    "astra": AstraNegatives,
    "mips": MipsNegatives,
}
SAMPLERS = tuple(SAMPLED_NEGATIVES)  # the classifier.negatives values the BCE trainer takes
