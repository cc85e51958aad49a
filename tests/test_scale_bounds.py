"""The retrieval pieces whose cost per query must not grow with N: capped lexical postings, packed top-k, bounded
exact search, and the index kind chosen by size (issue: the pipeline at the XC scales)."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp
import torch

from tests.test_pipeline import TINY
from tests.tinydata import tiny_lf_home
from xc_dagster.catalog import Catalog
from xc_dagster.errors import XCConfigError
from xc_dagster.pipeline import StageContext, run_all
from xc_dagster.pipeline import evaluate as evaluate_stage
from xc_dagster.pipeline import mining as mining_stage
from xc_dagster.retrieval import ann
from xc_dagster.retrieval.ann import LabelIndex, exact_topk, resolve_kind
from xc_dagster.retrieval.lexical import LexicalIndex
from xc_dagster.retrieval.sparse_rows import cap_postings, sparse_topk, work_blocks
from xc_dagster.storage import ArtifactStore, load_json


def test_cap_postings_keeps_each_rows_largest_entries_ties_by_column():
    M = sp.csr_matrix(np.array([[0.5, 0.9, 0.5, 0.1, 0.5],
                                [0.0, 0.2, 0.0, 0.0, 0.0],
                                [0.3, 0.3, 0.3, 0.3, 0.0]], dtype=np.float32))
    got = cap_postings(M, 2).toarray()
    # row 0: 0.9 (col 1), then the tie 0.5 at cols 0, 2, 4 -> col 0; row 1 unchanged; row 2: cols 0, 1
    want = np.array([[0.5, 0.9, 0, 0, 0], [0, 0.2, 0, 0, 0], [0.3, 0.3, 0, 0, 0]], dtype=np.float32)
    np.testing.assert_array_equal(got, want)
    assert cap_postings(M, 0) is not None and (cap_postings(M, 0) != M).nnz == 0
    assert (cap_postings(M, 5) != M).nnz == 0  # no row longer than the cap: unchanged


def test_work_blocks_bound_each_ranges_work_and_rows():
    work = np.array([3, 3, 3, 10, 1, 1, 1, 1])
    assert work_blocks(work, 6, 100) == [(0, 2), (2, 3), (3, 4), (4, 8)]  # the 10 alone, over the budget
    assert work_blocks(work, 100, 3) == [(0, 3), (3, 6), (6, 8)]
    assert work_blocks(np.zeros(0, dtype=np.int64), 5, 5) == []


@pytest.mark.parametrize("seed", [0, 1])
def test_packed_dense_topk_equals_sparse_topk_on_skewed_rows(seed):
    """Rows of very different lengths (one common-term row among short ones), few distinct values (ties)."""
    rng = np.random.default_rng(seed)
    S = sp.random(40, 5000, density=0.002, random_state=seed, format="lil", dtype=np.float32)
    S[3, rng.choice(5000, 3000, replace=False)] = 0.5
    S = sp.csr_matrix(S)
    S.data = np.ceil(S.data * 4) / 4
    for k in (1, 10, 200):
        got, want = sparse_topk(S, k, packed_share=0.0), sparse_topk(S, k, packed_share=np.inf)
        assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])


def test_sparse_topk_by_hand_and_packed_rows_of_any_sign_equal_the_sort():
    """The packed path (kNN votes: rows of similar length) takes any values, negative ones too, and breaks ties
    in the entries' own dtype by column, exactly as the sort of every entry does."""
    S = sp.csr_matrix(np.array([[0.0, -0.5, 0.25, -0.5, -0.25], [0.0] * 5, [1.0, 1.0, -2.0, 0.0, 3.0]]))
    for share in (0.0, np.inf):
        ids, vals = sparse_topk(S, 3, packed_share=share)
        assert ids.tolist() == [[2, 4, 1], [-1, -1, -1], [4, 0, 1]]
        assert vals.tolist() == [[0.25, -0.25, -0.5], [0, 0, 0], [3.0, 1.0, 1.0]]
    rng = np.random.default_rng(3)
    for trial in range(60):
        n, L = int(rng.integers(1, 30)), int(rng.integers(1, 60))
        M = sp.random(n, L, density=rng.random(), random_state=trial, format="csr")
        M.data = np.round(rng.standard_normal(M.nnz), 1) + 1e-12 * rng.random(M.nnz)  # float32-equal, float64-unequal
        k = int(rng.integers(1, 70))
        got, want = sparse_topk(M, k, packed_share=0.0), sparse_topk(M, k, packed_share=np.inf)
        assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1]), trial


def _lexical(n_points: int, cap: int, seed: int = 0) -> tuple[LexicalIndex, sp.csr_matrix]:
    """TF-IDF-like unit rows over 200 terms where term 0 (a stop word) is in every point, with 50 labels."""
    rng = np.random.default_rng(seed)
    rows = np.repeat(np.arange(n_points), 4)
    cols = np.column_stack([np.zeros(n_points, dtype=np.int64), rng.integers(1, 200, (n_points, 3))]).ravel()
    vals = rng.uniform(0.1, 1.0, len(rows)).astype(np.float32)
    vals[::4] = 0.05  # the stop word's idf is small, as in TF-IDF
    P = sp.csr_matrix((vals, (rows, cols)), shape=(n_points, 200))
    P.sum_duplicates()
    P = sp.csr_matrix(P.multiply(1.0 / np.sqrt(P.multiply(P).sum(1))))
    Y = sp.csr_matrix((np.ones(n_points, np.float32), (np.arange(n_points), rng.integers(0, 50, n_points))),
                      shape=(n_points, 50))
    return LexicalIndex(None, P, Y, None, 5, max_postings=cap), P


def test_capped_lexical_work_per_query_does_not_grow_with_points():
    """Each query's products with the indexed points: every posting of its terms uncapped (the stop word's run
    over all N points), at most terms x P capped, at N = 2,000 and 16,000 alike."""
    for n in (2_000, 16_000):
        full, P = _lexical(n, 0)
        capped, _ = _lexical(n, 64)
        Q = P[:50]
        per_row = lambda ix: np.diff(sp.csr_matrix(Q @ ix._points_t).indptr)  # noqa: E731
        assert per_row(full).max() >= n  # the stop word alone reaches every point
        assert per_row(capped).max() <= 4 * 64  # 4 terms per query x P


def test_cap_at_least_the_longest_postings_is_exact_and_a_small_cap_keeps_most_neighbours():
    full, P = _lexical(3_000, 0)
    same, _ = _lexical(3_000, 3_000)
    Q, own = P[:300], np.arange(300)
    a, b = full.scores(Q, own=own), same.scores(Q, own=own)
    assert (a != b).nnz == 0
    capped, _ = _lexical(3_000, 256)
    n_full, _ = full.nearest(Q, own=own)
    n_cap, _ = capped.nearest(Q, own=own)
    recall = np.mean([len(np.intersect1d(x[x >= 0], y[y >= 0])) / max((y >= 0).sum(), 1)
                      for x, y in zip(n_cap, n_full)])
    # the neighbours share rare terms; the stop word's postings, cut to the 256 heaviest, matter little
    assert recall >= 0.8


def test_capped_index_round_trips_its_cap(tmp_path):
    texts = [f"the common word{i % 7} item{i % 5}" for i in range(40)]
    Y = sp.csr_matrix((np.ones(40, np.float32), (np.arange(40), np.arange(40) % 3)), shape=(40, 3))
    ix = LexicalIndex.fit(texts, ["word1 label", "word2 label", "item3 label"], Y, 3, 1, max_postings=4)
    assert np.diff(ix._points_t.indptr).max() == 4  # "the", "common", "the common" in all 40, cut to 4
    ix.save(tmp_path / "lex")
    back = LexicalIndex.load(tmp_path / "lex")
    assert back.max_postings == 4
    Q = ix.transform(["the common word3 item1", "item2"])
    assert (back.scores(Q) != ix.scores(Q)).nnz == 0
    with pytest.raises(Exception, match="lexical_max_postings"):
        LexicalIndex(None, ix.points, ix.point_labels, None, 5, max_postings=-1)


def test_auto_kind_is_exact_up_to_the_threshold_then_hnsw(monkeypatch, tmp_path):
    monkeypatch.setattr(ann, "EXACT_MAX_VECTORS", 100)
    monkeypatch.setattr(ann, "EXACT_MAX_VECTORS_BF16", 200)
    monkeypatch.setenv("XC_EXACT_PRECISION", "bf16")  # bf16 scoring: the higher threshold
    assert resolve_kind("auto", 200) == "exact" and resolve_kind("auto", 201) == "hnsw"
    monkeypatch.setenv("XC_EXACT_PRECISION", "fp32")
    assert resolve_kind("auto", 100) == "exact" and resolve_kind("auto", 101) == "hnsw"
    assert resolve_kind("hnsw", 5) == "hnsw"
    rng = np.random.default_rng(0)
    small, big = rng.normal(size=(80, 16)).astype(np.float32), rng.normal(size=(300, 16)).astype(np.float32)
    for vectors, kind in ((small, "exact"), (big, "hnsw")):
        ix = LabelIndex("auto", vectors)
        assert ix.kind == kind
        ix.save(tmp_path / f"{kind}.index")
        back = LabelIndex.load(tmp_path / f"{kind}.index", "auto")
        assert back.kind == kind
        q = rng.normal(size=(20, 16)).astype(np.float32)
        np.testing.assert_array_equal(back.search(q, 5)[1], ix.search(q, 5)[1])


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_exact_search_blocks_bound_the_score_matrix(monkeypatch, precision):
    """At most EXACT_BLOCK_ENTRIES scores at once, the same top-k as one block (bf16 scoring: its re-rank's top-k
    are over the candidates only)."""
    monkeypatch.setenv("XC_EXACT_PRECISION", precision)
    rng = np.random.default_rng(1)
    keys, q = rng.normal(size=(1000, 8)).astype(np.float32), rng.normal(size=(64, 8)).astype(np.float32)
    want = exact_topk(q, keys, 7)
    seen = []
    real_topk = ann.torch.topk

    def spy(t, *a, **kw):
        if t.shape[1] == len(keys):  # the pass over every key, not the re-rank of its candidates
            seen.append(t.shape[0] * t.shape[1])
        return real_topk(t, *a, **kw)

    monkeypatch.setattr(ann, "EXACT_BLOCK_ENTRIES", 5000)
    monkeypatch.setattr(ann.torch, "topk", spy)
    got = exact_topk(q, keys, 7)
    assert max(seen) <= 5000 and len(seen) == 13  # 5 queries x 1,000 keys per block
    np.testing.assert_array_equal(got[1], want[1])
    np.testing.assert_allclose(got[0], want[0], rtol=1e-6)


def test_bf16_exact_search_returns_the_fp32_top_k_and_scores(monkeypatch):
    """bf16 scoring with the fp32 re-rank returns fp32's top k and fp32 scores (bf16's own are off by ~1e-3): on
    spread-out vectors every query is certified by the bf16 pass; in tight clusters (near-ties below bf16's
    resolution) the uncertified queries are searched again in fp32, still exact. Excluded keys never return; a
    bad setting fails naming the variable."""
    rng = np.random.default_rng(3)
    spread = rng.normal(size=(4000, 32))
    centres = rng.normal(size=(20, 32))
    tight = centres[rng.integers(0, 20, 4000)] + 0.05 * rng.normal(size=(4000, 32))
    real_topk = ann.torch.topk
    for keys, redone in ((spread, False), (tight, True)):
        keys = (keys / np.linalg.norm(keys, axis=1, keepdims=True)).astype(np.float32)
        q = keys[rng.choice(4000, 300, replace=False)] + 0.01 * rng.normal(size=(300, 32)).astype(np.float32)
        want_s, want = exact_topk(q, keys, 50, precision="fp32")
        full_passes = []

        def spy(t, *a, **kw):
            if t.shape[1] == len(keys):
                full_passes.append(t.dtype)
            return real_topk(t, *a, **kw)

        monkeypatch.setattr(ann.torch, "topk", spy)
        got_s, got = exact_topk(q, keys, 50, precision="bf16", block=64)
        monkeypatch.setattr(ann.torch, "topk", real_topk)
        assert full_passes.count(torch.bfloat16) == 5  # 300 queries in blocks of 64
        assert (torch.float32 in full_passes) == redone  # the fp32 pass of uncertified queries
        np.testing.assert_array_equal(got, want)
        np.testing.assert_allclose(got_s, want_s, atol=2e-6)
        assert np.abs(got_s - torch.tensor(got_s).bfloat16().float().numpy()).max() > 1e-4  # not bf16 values
        drop = want[:, 0]
        _, ids = exact_topk(q, keys, 50, precision="bf16", exclude=drop)
        np.testing.assert_array_equal(ids, exact_topk(q, keys, 50, precision="fp32", exclude=drop)[1])
        assert not np.isin(ids, drop).any()
    # an index whose queries mostly need the second search switches to fp32 after FP32_SWITCH_MIN_QUERIES
    cache, q2 = {}, np.repeat(q, 4, axis=0)
    _, ids = exact_topk(q2, keys, 50, precision="bf16", block=64, cache=cache)
    np.testing.assert_array_equal(ids, np.repeat(want, 4, axis=0))
    assert cache["fp32_only"] and cache["bf16_searched"] == ann.FP32_SWITCH_MIN_QUERIES  # 16 blocks of 64
    monkeypatch.setenv("XC_EXACT_PRECISION", "fp16")
    with pytest.raises(XCConfigError, match="XC_EXACT_PRECISION"):
        exact_topk(q, keys, 5)


def test_evaluation_streamed_in_blocks_equals_one_block(tmp_path, monkeypatch):
    """Mining over blocks of 7 training points gives the same shortlists; the evaluate stage over blocks of 7 test
    queries (filter pairs on rows 0 and 3 fall in different blocks)
    gives the predictions, metrics and reports of one block."""
    home = tiny_lf_home(tmp_path, monkeypatch, {**TINY, "pretrain.epochs": 1, "classifier.epochs": 1,
                                                "index.sources": "W,label,knn,lexical"})
    spec = Catalog(home.catalog).get("TinyTitles")
    ctx = StageContext(ArtifactStore(home.artifacts), spec, spec.config(), home.cache)
    one = run_all(ctx)["evaluate"]
    first = np.load(ctx.store.stage_dir("TinyTitles", "evaluate") / "predictions.npz")["ids"]
    mined = np.load(ctx.store.stage_dir("TinyTitles", "mining") / "shortlist.npy")
    monkeypatch.setattr(evaluate_stage, "STREAM_ROWS", 7)
    monkeypatch.setattr(mining_stage, "STREAM_ROWS", 7)
    run_all(ctx, ("mining",))
    np.testing.assert_array_equal(np.load(ctx.store.stage_dir("TinyTitles", "mining") / "shortlist.npy"), mined)
    many = run_all(ctx, ("evaluate",))["evaluate"]
    again = np.load(ctx.store.stage_dir("TinyTitles", "evaluate") / "predictions.npz")["ids"]
    np.testing.assert_array_equal(first, again)
    assert many["metrics"] == one["metrics"]
    assert not (first[0] == 19).any() and not (first[3] == 18).any()  # the filter pairs stay out



def test_index_stage_reuses_minings_label_graph_only_when_it_is_the_same_graph(tmp_path, monkeypatch):
    """The index stage copies mining's HNSW graph over the label embeddings instead of building it again (20
    minutes at 1.3M labels) when the deployed encoder is the pretrained one and the graph settings match; other
    settings build their own. Both ways the label source is the same index."""
    home = tiny_lf_home(tmp_path, monkeypatch, {**TINY, "pretrain.epochs": 1, "classifier.epochs": 1,
                                                "mining.index": "hnsw", "index.kind": "hnsw", "mining.hnsw_m": 8,
                                                "index.sources": "W,label"})
    spec = Catalog(home.catalog).get("TinyTitles")
    store = ArtifactStore(home.artifacts)
    ctx = StageContext(store, spec, spec.config(), home.cache)
    run_all(ctx, ("ingest", "tokenize", "pretrain", "mining", "classifier", "index"))
    mined = (store.stage_dir("TinyTitles", "mining") / "label_emb.index").read_bytes()
    assert load_json(store.stage_dir("TinyTitles", "mining") / "summary.json")["label_index"] == {"kind": "hnsw", "m": 8, "ef_construction": 200}
    assert (store.stage_dir("TinyTitles", "index") / "label_emb.index").read_bytes() == mined
    assert load_json(store.stage_dir("TinyTitles", "index") / "summary.json")["kinds"] == {"W": "hnsw", "label": "hnsw"}
    other = StageContext(store, spec, spec.config({"index.hnsw_ef_construction": 40}), home.cache)
    run_all(other, ("index",))
    rebuilt = (store.stage_dir("TinyTitles", "index") / "label_emb.index").read_bytes()
    assert rebuilt != mined and len(rebuilt) == len(mined)  # its own graph: the same vectors, other links
    exact = StageContext(store, spec, spec.config({"mining.index": "exact"}), home.cache)
    run_all(exact, ("mining",))
    assert "label_index" not in load_json(store.stage_dir("TinyTitles", "mining") / "summary.json")  # an exact index: nothing to reuse
    assert not (store.stage_dir("TinyTitles", "mining") / "label_emb.index").exists()
