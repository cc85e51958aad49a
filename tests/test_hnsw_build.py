"""An HNSW build kept as it goes (``xc_dagster.retrieval.hnsw_build``): chunked adds keep the graph's recall, a
stopped build goes on from its last kept chunk, and a kept graph over other vectors is never resumed."""

from __future__ import annotations

import numpy as np
import pytest

import xc_dagster.retrieval.hnsw_build as hb
from xc_dagster.faiss_module import faiss
from xc_dagster.pipeline.kept import KeptWork
from xc_dagster.retrieval.ann import LabelIndex

N, DIM, K = 4000, 16, 10


def _vectors(seed: int = 0) -> np.ndarray:
    x = np.random.default_rng(seed).standard_normal((N, DIM)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def _recall(index, x: np.ndarray) -> float:
    q = x[::40]
    index.hnsw.efSearch = 64
    got = index.search(q, K)[1]
    want = np.argsort(-(q @ x.T), axis=1)[:, :K]
    return float(np.mean([len(np.intersect1d(g, w)) / K for g, w in zip(got, want)]))


class _Memory:
    """A checkpoint held in memory: what was saved (each save's vector count), a stop after ``stop_at`` saves."""

    def __init__(self, stop_at: int | None = None):
        self.kept, self.saves, self.stop_at = None, [], stop_at

    def checkpoint(self) -> hb.GraphCheckpoint:
        def save(index):
            self.kept = faiss.deserialize_index(faiss.serialize_index(index))  # a copy, as on disk
            self.saves.append(int(index.ntotal))
            if self.stop_at is not None and len(self.saves) == self.stop_at:
                raise KeyboardInterrupt("stopped after a kept chunk")
        return hb.GraphCheckpoint(lambda: self.kept, save)


def test_a_chunked_build_keeps_each_chunk_and_the_recall_of_a_build_in_one_add(monkeypatch):
    monkeypatch.setattr(hb, "CHUNK", 1000)
    x, mem, done = _vectors(), _Memory(), []
    chunked = hb.build_hnsw(x, 16, 80, mem.checkpoint(), done.append)
    assert mem.saves == [1000, 2000, 3000] and done == [1000] * 4 and chunked.ntotal == N  # not after the last
    whole = hb.build_hnsw(x, 16, 80)
    assert _recall(chunked, x) >= 0.9 and _recall(chunked, x) >= _recall(whole, x) - 0.03


def test_a_stopped_build_goes_on_from_its_last_kept_chunk(monkeypatch, caplog):
    monkeypatch.setattr(hb, "CHUNK", 1000)
    x, mem = _vectors(), _Memory(stop_at=2)
    with pytest.raises(KeyboardInterrupt):
        LabelIndex("hnsw", x, m=16, ef_construction=80, checkpoint=mem.checkpoint())
    assert mem.kept.ntotal == 2000
    mem.stop_at, done = None, []
    with caplog.at_level("INFO", logger="xc_dagster"):
        index = LabelIndex("hnsw", x, m=16, ef_construction=80, checkpoint=mem.checkpoint(), progress=done.append)
    assert "resumed from a kept graph of 2000 of 4000 vectors" in caplog.text
    assert done == [2000, 1000, 1000] and mem.saves == [1000, 2000, 3000] and index.size == N
    assert np.array_equal(index.stored_vectors(), x)  # the kept rows and the added ones, in order
    assert _recall(index._index, x) >= 0.9


@pytest.mark.parametrize("other", ["vectors", "width"])
def test_a_kept_graph_over_other_vectors_is_not_resumed(monkeypatch, caplog, other):
    monkeypatch.setattr(hb, "CHUNK", 1000)
    mem = _Memory(stop_at=1)
    y = _vectors(seed=1) if other == "vectors" else np.ascontiguousarray(_vectors()[:, :8])
    with pytest.raises(KeyboardInterrupt):
        hb.build_hnsw(y, 16, 80, mem.checkpoint())
    mem.stop_at, done = None, []
    with caplog.at_level("WARNING", logger="xc_dagster"):
        index = hb.build_hnsw(_vectors(), 16, 80, mem.checkpoint(), done.append)
    assert "does not match these 4000 vectors" in caplog.text and done == [1000] * 4 and index.ntotal == N


def test_kept_work_keeps_a_partial_graph_on_disk_and_a_damaged_one_is_not_used(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(hb, "CHUNK", 1000)
    x = _vectors()
    with KeptWork(tmp_path / "kept", "k") as kept:
        graph = kept.graph("knn.index")
        assert graph.load() is None
        index = hb.build_hnsw(x[:1500], 16, 80, graph)  # one chunk kept, the second added after it
        assert index.ntotal == 1500 and graph.load().ntotal == 1000
        path = kept.path("partial-knn.index")
        path.write_bytes(path.read_bytes()[:1000])  # truncated, as by a full disk
        with caplog.at_level("WARNING", logger="xc_dagster"):
            assert graph.load() is None
        assert "does not read back" in caplog.text
        kept.drop("knn.index")
        assert kept.path("partial-knn.index") is None
    assert KeptWork(None, "").graph("knn.index") is None  # nothing kept: a plain build
