"""A killed mining or evaluation run does again only the row block it was in: the finished blocks are kept on
disk under a key of the settings and the upstream artifacts' versions, and read back by the next run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import xc_dagster.pipeline.evaluate as ev
import xc_dagster.pipeline.index as index_stage
import xc_dagster.pipeline.mining as mining
import xc_dagster.retrieval.hnsw_build as hnsw_build
import xc_dagster.retrieval.shortlist as shortlist
from tests.tinydata import tiny_lf_home
from xc_dagster.artifacts import CONTRACT, ArtifactReader
from xc_dagster.catalog import Catalog
from xc_dagster.faiss_module import faiss
from xc_dagster.pipeline import StageContext, run_all
from xc_dagster.pipeline.kept import KeptWork
from xc_dagster.sampling.stale_index import search_shards
from xc_dagster.storage import ArtifactStore, atomic_dir
from xc_dagster.training.distributed import DistEnv
from xc_dagster.training.label_sharded import RankShardedClassifier

ROOT = Path(__file__).resolve().parent.parent
CPU = torch.device("cpu")
TINY = {"pretrain.epochs": 1, "pretrain.batch_size": 16, "mining.shortlist_size": 8, "classifier.epochs": 1,
        "classifier.batch_size": 32, "classifier.num_negatives": 5, "index.shortlist_size": 8, "evaluate.top_k": 10,
        "ingest.valid_fraction": 0.1}
ROWS = 8  # rows per block here: 40 test points in 5 blocks, 120 training points in 15

# the evaluation stage alone, 8 queries a block, stopped for good inside its third block (it is killed there)
CHILD = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    import xc_dagster.pipeline.evaluate as ev
    from xc_dagster.catalog import Catalog
    from xc_dagster.home import Home
    from xc_dagster.pipeline import StageContext, run_all
    from xc_dagster.storage import ArtifactStore

    home, marker = Home.from_env(), Path(sys.argv[1])
    ev.STREAM_ROWS, real, calls = 8, ev._predict_block, []

    def third_block_hangs(*a, **k):
        calls.append(1)
        if len(calls) == 3:
            marker.write_text("in block 3")
            time.sleep(600)
        return real(*a, **k)

    ev._predict_block = third_block_hangs
    spec = Catalog(home.catalog).get("TinyTitles")
    run_all(StageContext(ArtifactStore(home.artifacts), spec, spec.config(), home.cache), ("evaluate",))
""")


@pytest.fixture
def home(tmp_path, monkeypatch, tiny_encoder):
    return tiny_lf_home(tmp_path, monkeypatch, TINY, encoder=tiny_encoder)


REAL = {(ev, "_predict_block"): ev._predict_block, (mining, "retrieve"): mining.retrieve,
        (index_stage, "LabelIndex"): index_stage.LabelIndex, (shortlist, "LabelIndex"): shortlist.LabelIndex}


def _counting(monkeypatch, module, name: str, fail_at: int | None = None) -> list[int]:
    """Count the calls of ``module.name``; raise at call ``fail_at`` (an in-process stand-in for a kill)."""
    real, calls = REAL[module, name], []

    def wrapped(*a, **k):
        calls.append(1)
        if fail_at is not None and len(calls) == fail_at:
            raise KeyboardInterrupt("stopped in a block")
        return real(*a, **k)

    monkeypatch.setattr(module, name, wrapped)
    return calls


def test_blocks_are_read_back_only_under_the_same_key_and_only_when_whole(tmp_path, caplog):
    folder, computed = tmp_path / "kept", []

    def compute(s: int, e: int) -> dict[str, np.ndarray]:
        computed.append(s)
        return {"ids": np.arange(s, e)[:, None] * np.ones((1, 3), dtype=np.int64), "x": np.full(e - s, s * 0.5)}

    def run(key: str, rows: int = 4) -> tuple[KeptWork, list[int], np.ndarray]:
        computed.clear()
        with KeptWork(folder, key) as kept:
            got = np.concatenate([a["ids"][:, 0] for _, _, a in kept.blocks(10, rows, compute)])
        return kept, list(computed), got

    kept, done, got = run("a")
    assert done == [0, 4, 8] and np.array_equal(got, np.arange(10))
    assert sorted(p.name for p in folder.glob("rows_*.npz")) == [f"rows_{s:012d}.npz" for s in (0, 4, 8)]
    kept, done, got = run("a")  # everything kept: nothing computed, the same arrays
    assert done == [] and kept.resumed == 3 and kept.resumed_rows == 10 and np.array_equal(got, np.arange(10))
    (folder / "rows_000000000004.npz").write_bytes((folder / "rows_000000000004.npz").read_bytes()[:50])
    with caplog.at_level("WARNING", logger="xc_dagster"):
        kept, done, got = run("a")  # a truncated block is done again, the others read back
    assert done == [4] and kept.resumed == 2 and "rows_000000000004.npz does not read back" in caplog.text
    _, done, _ = run("a", rows=5)  # another block size: nothing kept matches
    assert done == [0, 5]
    kept, done, _ = run("b", rows=5)  # another key: the folder is cleared first, never mixed
    assert done == [0, 5] and (folder / "key.txt").read_text() == "b"
    assert not (folder / "rows_000000000004.npz").exists()
    kept.clear()
    assert not folder.exists()
    off = KeptWork(None, "")
    assert [s for s, _, _ in off.blocks(10, 4, compute)] == [0, 4, 8] and off.resumed == 0


def test_a_sigkilled_evaluation_resumes_from_its_kept_blocks_with_the_same_predictions(home, tmp_path, monkeypatch,
                                                                                      caplog):
    spec = Catalog(home.catalog).get("TinyTitles")
    store = ArtifactStore(home.artifacts)
    ctx = StageContext(store, spec, spec.config(), home.cache)
    monkeypatch.setattr(ev, "STREAM_ROWS", ROWS)
    full = run_all(ctx)["evaluate"]  # uninterrupted
    assert full["resumed_queries"] == 0
    stage = store.stage_dir("TinyTitles", "evaluate")
    want, version = dict(np.load(stage / "predictions.npz")), stage.resolve()

    marker = tmp_path / "marker"
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(marker)], env=env, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 180
        while not marker.exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.poll() else "slow"
            time.sleep(0.05)
        kept = ctx.checkpoint_dir("evaluate")
        blocks = ["rows_000000000000.npz", "rows_000000000008.npz"]
        assert sorted(p.name for p in kept.glob("rows_*.npz")) == blocks
        assert stage.resolve() == version  # the stage's artifacts are still the finished run's
        # a second run of the stage while the first is alive: it keeps nothing and leaves the first one's blocks
        with caplog.at_level("WARNING", logger="xc_dagster"):
            second = run_all(ctx, ("evaluate",))["evaluate"]
        assert second["resumed_queries"] == 0 and second["metrics"] == full["metrics"]
        assert "another run of this stage is keeping its work there" in caplog.text
        assert sorted(p.name for p in kept.glob("rows_*.npz")) == blocks
        os.kill(proc.pid, signal.SIGKILL)  # as the OOM killer or a lost machine: no handler runs
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()

    calls = _counting(monkeypatch, ev, "_predict_block")
    out = run_all(ctx, ("evaluate",))["evaluate"]
    assert len(calls) == 3 and out["resumed_queries"] == 2 * ROWS  # blocks 3-5 searched, 1-2 read back
    got = dict(np.load(stage / "predictions.npz"))
    assert np.array_equal(got["ids"], want["ids"]) and np.array_equal(got["scores"], want["scores"])
    assert out["metrics"] == full["metrics"] and out["ms_per_query_index_fusion"] > 0  # of the 3 blocks searched
    assert not kept.exists()  # cleared once the artifacts are written
    # the test embeddings: encoded by the first run, read back by every later one (the same encoder and tokens)
    assert full["encoding_reused"] is False and second["encoding_reused"] is out["encoding_reused"] is True
    encoded = sorted(ctx.encoded_dir().glob("test-*.npy"))
    assert len(encoded) == 1 and np.load(encoded[0]).shape[0] == full["n_test"]
    run_all(ctx, ("pretrain",))  # a new encoder (a new version folder): encoded again, the old file replaced
    assert run_all(ctx, ("evaluate",))["evaluate"]["encoding_reused"] is False
    now = sorted(ctx.encoded_dir().glob("test-*.npy"))
    assert len(now) == 1 and now != encoded


def test_mining_stopped_mid_way_resumes_and_kept_blocks_of_older_inputs_are_not_used(home, tmp_path, monkeypatch):
    spec = Catalog(home.catalog).get("TinyTitles")
    cfg = spec.config({"mining.index": "hnsw", "index.hnsw_m": 8})
    monkeypatch.setattr(mining, "STREAM_ROWS", ROWS)
    full_store, store = ArtifactStore(tmp_path / "full"), ArtifactStore(tmp_path / "stopped")
    upstream = ("ingest", "tokenize", "pretrain")
    want = run_all(StageContext(full_store, spec, cfg, home.cache), (*upstream, "mining"))["mining"]
    ctx = StageContext(store, spec, cfg, home.cache)
    run_all(ctx, upstream)
    calls = _counting(monkeypatch, mining, "retrieve", fail_at=4)
    with pytest.raises(KeyboardInterrupt):
        run_all(ctx, ("mining",))
    kept = ctx.checkpoint_dir("mining")
    assert len(list(kept.glob("rows_*.npz"))) == 3 and len(calls) == 4 and (kept / "label_emb.index").is_file()
    calls, builds = _counting(monkeypatch, mining, "retrieve"), _counting(monkeypatch, shortlist, "LabelIndex")
    out = run_all(ctx, ("mining",))["mining"]
    assert builds == []  # the label graph is the stopped run's, read back
    assert len(calls) == 15 - 3 and out["resumed_points"] == 3 * ROWS and out["train_recall"] == want["train_recall"]
    got, whole = store.stage_dir("TinyTitles", "mining"), full_store.stage_dir("TinyTitles", "mining")
    for f in ("shortlist.npy", "shortlist_scores.npy"):
        assert np.array_equal(np.load(got / f), np.load(whole / f))
    assert (got / "label_emb.index").stat().st_size > 0 and not kept.exists()  # the graph the index stage reuses
    with KeptWork(kept, "held by another run"):  # a run of the stage beside this one: this one keeps nothing
        again = run_all(ctx, ("mining",))["mining"]
    assert again["train_recall"] == want["train_recall"] and (got / "label_emb.index").stat().st_size > 0

    # work kept over the previous pretraining: a new pretrain version makes it stale, all 15 blocks are searched
    calls = _counting(monkeypatch, mining, "retrieve", fail_at=3)
    with pytest.raises(KeyboardInterrupt):
        run_all(ctx, ("mining",))
    run_all(ctx, ("pretrain",))
    calls, builds = _counting(monkeypatch, mining, "retrieve"), _counting(monkeypatch, shortlist, "LabelIndex")
    assert run_all(ctx, ("mining",))["mining"]["resumed_points"] == 0 and len(calls) == 15 and len(builds) == 1


def test_an_index_stage_stopped_in_its_second_build_builds_only_the_indexes_it_had_not(home, tmp_path, monkeypatch):
    spec = Catalog(home.catalog).get("TinyTitles")
    cfg = spec.config({"index.sources": ("W", "label", "knn"), "index.kind": "hnsw", "index.hnsw_m": 8})
    full_store, store = ArtifactStore(tmp_path / "full"), ArtifactStore(tmp_path / "stopped")
    upstream = ("ingest", "tokenize", "pretrain", "mining", "classifier")
    real, vectors = index_stage.LabelIndex, []
    monkeypatch.setattr(index_stage, "LabelIndex", lambda kind, v, **kw: vectors.append(v) or real(kind, v, **kw))
    run_all(StageContext(full_store, spec, cfg, home.cache), (*upstream, "index"))
    assert len(vectors) == 3  # knn, W, label (the label graph: pretrained embeddings, mining's is exact here)
    # the kNN index over every training point (include_validation) reads the memory-mapped embeddings, no copy
    assert isinstance(vectors[0], np.memmap) and len(vectors[0]) == 120
    ctx = StageContext(store, spec, cfg, home.cache)
    run_all(ctx, upstream)
    builds = _counting(monkeypatch, index_stage, "LabelIndex", fail_at=2)
    with pytest.raises(KeyboardInterrupt):
        run_all(ctx, ("index",))
    assert sorted(p.name for p in ctx.checkpoint_dir("index").iterdir()) == ["key.txt", "knn.index"]
    assert not store.stage_dir("TinyTitles", "index").exists()  # nothing half-written
    builds = _counting(monkeypatch, index_stage, "LabelIndex")
    out = run_all(ctx, ("index",))["index"]
    assert len(builds) == 2 and out["kinds"] == {"W": "hnsw", "label": "hnsw", "knn": "hnsw"}
    got, want = store.stage_dir("TinyTitles", "index"), full_store.stage_dir("TinyTitles", "index")
    assert (got / "knn.index").stat().st_size == (want / "knn.index").stat().st_size > 0
    assert not ctx.checkpoint_dir("index").exists()
    assert (got / "knn.index").stat().st_nlink == 1  # the kept copy's link is gone with the folder

    # stopped inside the kNN graph's build (120 points, 32 a chunk): the next run adds only what it had not
    monkeypatch.setattr(hnsw_build, "CHUNK", 32)
    real_graph, saves = KeptWork.graph, []

    def stopping(self, name):
        graph = real_graph(self, name)

        def save(index):
            graph.save(index)
            saves.append(int(index.ntotal))
            if len(saves) == 2:
                raise KeyboardInterrupt("stopped inside a build")
        return hnsw_build.GraphCheckpoint(graph.load, save)

    monkeypatch.setattr(KeptWork, "graph", stopping)
    run_all(ctx, ("pretrain",))  # new embeddings: nothing kept applies, every index is built again
    with pytest.raises(KeyboardInterrupt):
        run_all(ctx, ("mining", "classifier", "index"))
    assert saves == [32, 64] and (ctx.checkpoint_dir("index") / "partial-knn.index").is_file()
    out = run_all(ctx, ("index",))["index"]
    assert saves == [32, 64, 96] and out["kinds"]["knn"] == "hnsw"  # resumed at 64: one more chunk kept
    assert faiss.read_index(str(store.stage_dir("TinyTitles", "index") / "knn.index")).ntotal == 120
    assert not ctx.checkpoint_dir("index").exists()


def test_an_index_stage_stopped_after_its_lexical_fit_reads_the_fitted_source_back(home, tmp_path, monkeypatch):
    """The lexical source (TF-IDF and classifiers: minutes at the 1.3M shape) is kept whole once fitted: a run
    after one stopped in the next build fits it no more, and writes the same files and summary."""
    spec = Catalog(home.catalog).get("TinyTitles")
    cfg = spec.config({"index.sources": ("W", "label", "lexical"), "index.kind": "exact"})
    full_store, store = ArtifactStore(tmp_path / "full"), ArtifactStore(tmp_path / "stopped")
    upstream = ("ingest", "tokenize", "pretrain", "mining", "classifier")
    full = run_all(StageContext(full_store, spec, cfg, home.cache), (*upstream, "index"))["index"]
    ctx = StageContext(store, spec, cfg, home.cache)
    run_all(ctx, upstream)
    real_fit, fits = index_stage.LexicalIndex.fit, []
    monkeypatch.setattr(index_stage.LexicalIndex, "fit", lambda *a, **k: fits.append(1) or real_fit(*a, **k))
    _counting(monkeypatch, index_stage, "LabelIndex", fail_at=1)  # stopped in the W build, after the lexical fit
    with pytest.raises(KeyboardInterrupt):
        run_all(ctx, ("index",))
    assert fits == [1] and sorted(p.name for p in ctx.checkpoint_dir("index").iterdir()) == ["key.txt", "lexical-fit"]
    assert not store.stage_dir("TinyTitles", "index").exists()  # nothing half-written
    _counting(monkeypatch, index_stage, "LabelIndex")
    out = run_all(ctx, ("index",))["index"]
    assert fits == [1] and out["lexical"] == full["lexical"] and out["sources"] == full["sources"]
    got, want = (s.stage_dir("TinyTitles", "index") / "lexical" for s in (store, full_store))
    names = sorted(p.name for p in want.iterdir())
    assert sorted(p.name for p in got.iterdir()) == names and "classifier_weights.npy" in names  # with classifiers
    for name in names:  # the same fit: the same bytes
        assert (got / name).read_bytes() == (want / name).read_bytes(), name
    assert not ctx.checkpoint_dir("index").exists()


def test_the_key_follows_a_stage_folder_that_is_not_a_version(tmp_path):
    """A stage folder written before versions (a real folder) is keyed by its path and its summary's stamp and
    size: rewritten, the key changes, so work kept over the old contents is not used."""
    store = ArtifactStore(tmp_path / "artifacts", remote=None)
    ingest = store.stage_dir("D", "ingest")
    ingest.mkdir(parents=True)
    (ingest / "summary.json").write_text('{"n": 1}')
    reader = ArtifactReader(store, "D", CONTRACT["tokenize"])
    before = reader.versions()
    (ingest / "summary.json").write_text('{"n": 22}')
    assert set(before) == {"ingest"} and reader.versions() != before and reader.opened == set()
    with atomic_dir(store.stage_dir("D", "tokenize")) as out:  # a version folder: its name is the version
        (out / "summary.json").write_text("{}")
    assert ArtifactReader(store, "D", CONTRACT["pretrain"]).versions()["tokenize"].startswith(".tokenize.v-")


def test_a_rank_without_labels_in_a_step_still_backpropagates_into_the_queries():
    """W's label ranges over 2 ranks: rank 1 owns labels 2-3; a step that scores only labels 0-1 gives it zero
    scores that still reach the (gathered) query embeddings, so its backward joins the all-gather's."""
    clf = RankShardedClassifier(np.eye(4, 3, dtype=np.float32), CPU, DistEnv(1, 2, 1, "gloo", CPU))
    x = torch.ones((2, 3), requires_grad=True)
    scores = clf.scores(x, torch.tensor([[0, 1], [1, 0]]))
    scores.sum().backward()
    assert torch.equal(scores, torch.zeros(2, 2)) and x.grad is not None and torch.equal(x.grad, torch.zeros(2, 3))
    frozen = clf.scores(torch.ones((2, 3)), torch.tensor([[0, 1], [1, 0]]))
    assert frozen.requires_grad  # a frozen encoder: a leaf, as before


def test_a_rank_whose_label_range_is_empty_has_an_empty_top_list():
    s, i = search_shards([], np.ones((5, 3), np.float32), 4)
    assert s.shape == (5, 0) and i.shape == (5, 0)
