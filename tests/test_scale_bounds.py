"""The retrieval pieces whose cost per query must not grow with N: capped lexical postings, packed top-k, bounded
exact search, and the index kind chosen by size (issue: the pipeline at the XC scales)."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import scipy.sparse as sp
import torch

from tests.test_pipeline import TINY
from tests.tinydata import tiny_lf_home
from xc_dagster import device
from xc_dagster.catalog import Catalog
from xc_dagster.errors import XCConfigError
from xc_dagster.pipeline import StageContext, run_all
from xc_dagster.pipeline import evaluate as evaluate_stage
from xc_dagster.pipeline import mining as mining_stage
from xc_dagster.retrieval import ann, exact_settings
from xc_dagster.retrieval.ann import LabelIndex, exact_topk
from xc_dagster.retrieval.exact_settings import resolve_kind
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


def test_sparse_topk_of_a_product_skips_the_sort_of_its_rows_and_returns_the_same(monkeypatch):
    """A sparse product's rows store each column once, in no order: ``unique=True`` ranks them as they are, the
    same as after scipy's sort and sum, on both paths (packed and sort), and the rows are never sorted."""
    A = sp.random(60, 300, density=0.05, random_state=0, format="csr", dtype=np.float32)
    B = sp.random(300, 2000, density=0.01, random_state=1, format="csr", dtype=np.float32)
    S = A @ B
    assert not S.has_sorted_indices  # what scipy's product gives
    want = {share: sparse_topk(S.copy(), 7, packed_share=share) for share in (0.0, np.inf)}
    calls = []
    monkeypatch.setattr(sp.csr_matrix, "sort_indices", lambda self: calls.append(1))
    monkeypatch.setattr(sp.csr_matrix, "sum_duplicates", lambda self: calls.append(1))
    for share in (0.0, np.inf):
        got = sparse_topk(S, 7, packed_share=share, unique=True)
        assert np.array_equal(got[0], want[share][0]) and np.array_equal(got[1], want[share][1])
    assert calls == []


def test_gathered_scores_equal_the_dense_products_and_gather_a_bounded_chunk(monkeypatch):
    """Q[i] . K[ids[i, j]] for every (i, j), whatever the chunking; each chunk gathers at most GATHER_FLOATS
    floats (one query's row at least)."""
    g = torch.Generator().manual_seed(0)
    Q, K = torch.randn(37, 8, generator=g), torch.randn(500, 8, generator=g)
    ids = torch.randint(0, 500, (37, 11), generator=g)
    want = (Q @ K.T).gather(1, ids)
    gathered = []
    real = torch.Tensor.index_select
    monkeypatch.setattr(torch.Tensor, "index_select",
                        lambda self, dim, index: gathered.append(len(index) * self.shape[1]) or real(self, dim, index))
    for limit in (1, 88, 200, 1 << 20):
        monkeypatch.setattr(ann, "GATHER_FLOATS", limit)
        gathered.clear()
        torch.testing.assert_close(ann.gathered_scores(Q, K, ids), want)
        assert max(gathered) <= max(limit, 11 * 8) and sum(gathered) == 37 * 11 * 8


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
    monkeypatch.setattr(exact_settings, "EXACT_MAX_VECTORS", 100)
    monkeypatch.setattr(exact_settings, "EXACT_MAX_VECTORS_LOW", 200)
    monkeypatch.setenv("XC_EXACT_PRECISION", "bf16")  # bf16 scoring: the higher threshold
    assert resolve_kind("auto", 200, 16) == "exact" and resolve_kind("auto", 201, 16) == "hnsw"
    monkeypatch.setenv("XC_EXACT_PRECISION", "fp32")
    assert resolve_kind("auto", 100, 16) == "exact" and resolve_kind("auto", 101, 16) == "hnsw"
    assert resolve_kind("hnsw", 5, 16) == "hnsw"
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


def test_exact_on_a_gpu_sized_by_its_memory(monkeypatch):
    """On a GPU, ``auto`` is exact up to 2^22 vectors while one index's keys (fp32 + bf16: 6 bytes a dimension) take
    at most 1/8 of its memory, and a search block holds the largest power of two of fp32 scores within 1/32 of it
    (at most 2^29, at least the CPU's 2^25); a CPU keeps its limits. The H200 the GPU rules were measured on: 2.25M
    points of 384 dimensions exact, blocks of 2^29 scores."""
    gpu, cpu, gib = torch.device("cuda"), torch.device("cpu"), 1 << 30
    memory = {"bytes": 0}
    monkeypatch.setattr(exact_settings, "_gpu_memory", lambda d: memory["bytes"])
    monkeypatch.setattr(exact_settings, "resolve_device", lambda name: gpu)
    monkeypatch.setenv("XC_EXACT_PRECISION", "bf16")
    memory["bytes"] = 140 * gib  # an H200: 17.5 GiB for one index's keys -> 8.2M vectors of 384 > the 2^22 cap
    assert exact_settings.exact_max_vectors(gpu, 384) == 1 << 22
    assert resolve_kind("auto", 2_248_619, 384) == "exact" and resolve_kind("auto", (1 << 22) + 1, 384) == "hnsw"
    assert exact_settings.exact_block_entries(gpu) == 1 << 29  # 140 GiB / 32 / 4 bytes = 1.1e9 -> capped
    memory["bytes"] = 16 * gib  # a 16 GB card: 2 GiB of keys -> 932,067 vectors of 384 in fp32 + bf16
    assert exact_settings.exact_max_vectors(gpu, 384) == 2 * gib // (384 * 6) == 932_067
    assert resolve_kind("auto", 1_305_265, 384) == "hnsw" and resolve_kind("auto", 932_067, 384) == "exact"
    assert exact_settings.exact_block_entries(gpu) == 1 << 27  # 16 GiB / 32 / 4 = 2^27 exactly
    monkeypatch.setenv("XC_EXACT_PRECISION", "fp32")  # keys held once: 4 bytes a dimension
    assert exact_settings.exact_max_vectors(gpu, 384) == 2 * gib // (384 * 4)
    memory["bytes"] = 2 * gib  # a small card: blocks never below the CPU's
    assert exact_settings.exact_block_entries(gpu) == exact_settings.EXACT_BLOCK_ENTRIES == 1 << 25
    assert exact_settings.exact_block_entries(cpu) == 1 << 25
    assert exact_settings.exact_max_vectors(cpu, 384) in (1 << 18, 1 << 19)


@pytest.mark.parametrize("precision", ["fp32", "bf16", "int8"])
def test_exact_search_blocks_bound_the_score_matrix(monkeypatch, precision):
    """At most EXACT_BLOCK_ENTRIES scores at once, the same top-k as one block (bf16 scoring: its re-rank's top-k
    are over the candidates only)."""
    monkeypatch.setenv("XC_EXACT_PRECISION", precision)
    rng = np.random.default_rng(1)
    keys, q = rng.normal(size=(1000, 8)).astype(np.float32), rng.normal(size=(64, 8)).astype(np.float32)
    want = exact_topk(q, keys, 7)
    seen = []
    real_topk = ann.row_topk

    def spy(t, *a, **kw):  # the selection over every key (the re-rank of its candidates is torch.topk)
        seen.append(t.shape[0] * t.shape[1])
        return real_topk(t, *a, **kw)

    monkeypatch.setattr(exact_settings, "EXACT_BLOCK_ENTRIES", 5000)
    monkeypatch.setattr(ann, "row_topk", spy)
    got = exact_topk(q, keys, 7)
    assert max(seen) <= 5000 and len(seen) == 13  # 5 queries x 1,000 keys per block
    np.testing.assert_array_equal(got[1], want[1])
    np.testing.assert_allclose(got[0], want[0], rtol=1e-6)


def same_top_k(q: np.ndarray, keys: np.ndarray, got: np.ndarray, want: np.ndarray, want_s: np.ndarray) -> None:
    """``got`` is the fp32 top k ``want`` up to the order of near-ties: each returned key's true score (float64)
    is the reference's at that rank. Differently shaped fp32 products (AVX2 and AVX-512 kernels sum in other
    orders) may swap keys an ulp apart."""
    true = np.einsum("qd,qkd->qk", q.astype(np.float64), keys[got].astype(np.float64))
    np.testing.assert_allclose(true, want_s, atol=1e-5)
    assert (got != want).mean() < 0.01


@pytest.mark.parametrize("low, pass_dtype", [("bf16", torch.bfloat16), ("int8", torch.int32)])
def test_low_precision_exact_search_returns_the_fp32_top_k_and_scores(monkeypatch, low, pass_dtype):
    """bf16 or int8 scoring with the fp32 re-rank returns fp32's top k and fp32 scores (the low precision's own
    are off by ~1e-3): on spread-out vectors every query is certified by the low-precision pass; in tight clusters
    (near-ties below its resolution) the uncertified queries are searched again in fp32, still exact. Excluded
    keys never return; a bad setting fails naming the variable."""
    rng = np.random.default_rng(3)
    spread = rng.normal(size=(4000, 32))
    centres = rng.normal(size=(20, 32))
    tight = centres[rng.integers(0, 20, 4000)] + 0.05 * rng.normal(size=(4000, 32))
    real_topk = ann.row_topk
    for keys, redone in ((spread, False), (tight, True)):
        keys = (keys / np.linalg.norm(keys, axis=1, keepdims=True)).astype(np.float32)
        q = keys[rng.choice(4000, 300, replace=False)] + 0.01 * rng.normal(size=(300, 32)).astype(np.float32)
        want_s, want = exact_topk(q, keys, 50, precision="fp32")
        full_passes = []

        def spy(t, *a, **kw):  # the selections over every key
            assert t.shape[1] == len(keys)
            full_passes.append(t.dtype)
            return real_topk(t, *a, **kw)

        monkeypatch.setattr(ann, "row_topk", spy)
        got_s, got = exact_topk(q, keys, 50, precision=low, block=64)
        monkeypatch.setattr(ann, "row_topk", real_topk)
        assert full_passes.count(pass_dtype) == 5  # 300 queries in blocks of 64
        assert (torch.float32 in full_passes) == redone  # the fp32 pass of uncertified queries
        same_top_k(q, keys, got, want, want_s)
        np.testing.assert_allclose(got_s, want_s, atol=2e-6)
        assert np.abs(got_s - torch.tensor(got_s).bfloat16().float().numpy()).max() > 1e-4  # not bf16 values
        drop = want[:, 0]
        _, ids = exact_topk(q, keys, 50, precision=low, exclude=drop)
        same_top_k(q, keys, ids, *exact_topk(q, keys, 50, precision="fp32", exclude=drop)[::-1])
        assert not np.isin(ids, drop).any()
    # an index whose queries mostly need the second search switches to fp32 after FP32_SWITCH_MIN_QUERIES
    cache, q2 = {}, np.repeat(q, 4, axis=0)
    _, ids = exact_topk(q2, keys, 50, precision=low, block=64, cache=cache)
    same_top_k(q2, keys, ids, np.repeat(want, 4, axis=0), np.repeat(want_s, 4, axis=0))
    assert cache["fp32_only"] and cache["low_searched"] == ann.FP32_SWITCH_MIN_QUERIES  # 16 blocks of 64
    monkeypatch.setenv("XC_EXACT_PRECISION", "fp16")
    with pytest.raises(XCConfigError, match="XC_EXACT_PRECISION"):
        exact_topk(q, keys, 5)


def test_int8_error_bound_covers_every_key_and_is_tight_enough_to_certify():
    """The int8 bound holds for every query x key pair, including keys with an outlier dimension and rows of
    different norms (|q.k - q'.k'| <= |e_q| max|k| + (|q| + |e_q|) max|e_k|), and on unit vectors it is a few
    hundredths: about 2x bf16's (2^-6)."""
    rng = np.random.default_rng(5)
    keys = rng.normal(size=(3000, 48)) * rng.uniform(0.2, 3.0, size=(3000, 1))
    keys[:, 7] *= 6.0  # an outlier dimension, as transformer embeddings have
    K = torch.from_numpy(keys.astype(np.float32))
    Q = torch.from_numpy(rng.normal(size=(200, 48)).astype(np.float32) * 2.0)
    cache = {}
    _, K8 = ann._key_tensors(K.numpy(), torch.device("cpu"), torch.int8, cache)
    codes, q_scale, _ = ann._quantize(Q)
    approx = (codes.double() @ K8.double().T) * (q_scale.double()[:, None] * cache["int8_scale"])
    error = ((Q.double() @ K.double().T) - approx).abs().max(dim=1).values
    bound = ann._error_bound(Q, torch.zeros(len(Q)), cache, ann._quantize(Q)[2]).double()
    assert (error <= bound).all() and (error > 0.2 * bound).any()  # holds, and not vacuous
    unit = torch.nn.functional.normalize(torch.randn(4000, 384, generator=torch.Generator().manual_seed(0)), dim=1)
    unit_cache = {}
    ann._key_tensors(unit.numpy(), torch.device("cpu"), torch.int8, unit_cache)
    b = ann._error_bound(unit[:100], torch.zeros(100), unit_cache, ann._quantize(unit[:100])[2])
    assert 0.01 < float(b.max()) < 0.04


def test_int8_is_chosen_where_its_products_pay_and_only_on_a_cpu(monkeypatch):
    """``auto``: bf16 where it pays, else int8 where the probe measures its product >= 1.5x faster than fp32,
    else fp32; int8 pinned on a GPU fails naming the setting; no int8 product in torch: the probe says no."""
    cpu = torch.device("cpu")
    monkeypatch.setattr(exact_settings, "amp_dtype", lambda d, amp: None)
    seconds = {torch.float32: 3.0, torch.int8: 2.0}
    products = []

    def speedup(slow, fast, reps=7, max_seconds=None):
        # the probe's two products, as exact search runs them: their seconds' ratio
        products.append((tuple(slow().shape), fast().dtype))
        return seconds[torch.float32] / seconds[torch.int8]

    monkeypatch.setattr(device, "speedup", speedup)
    device.cpu_int8_pays.cache_clear()
    try:
        assert device.cpu_int8_pays() and exact_settings.exact_dtype(cpu) == torch.int8  # exactly 1.5x
        assert products == [((256, 8192), torch.int32)]
        monkeypatch.setattr(exact_settings, "cpu_int8_pays", lambda: False)
        assert exact_settings.exact_dtype(cpu) is None
        monkeypatch.setattr(exact_settings, "amp_dtype", lambda d, amp: torch.bfloat16)
        assert exact_settings.exact_dtype(cpu) == torch.bfloat16
        seconds[torch.int8] = 2.01
        device.cpu_int8_pays.cache_clear()
        assert not device.cpu_int8_pays()
        device.cpu_int8_pays.cache_clear()
        monkeypatch.delattr(torch, "_int_mm")
        assert not device.cpu_int8_pays()
    finally:
        device.cpu_int8_pays.cache_clear()
    with pytest.raises(XCConfigError, match="XC_EXACT_PRECISION=int8 scores on a CPU only"):
        exact_settings.exact_dtype(torch.device("cuda"), "int8")


@pytest.mark.parametrize("precision", ["fp32", "int8"])
def test_exact_search_reuses_one_score_matrix_for_every_block_and_search(monkeypatch, precision):
    """Every block of a search, and the next search, write their scores into the same buffer (per dtype), not a
    fresh matrix; another thread gets its own."""
    rng = np.random.default_rng(2)
    keys, q = rng.normal(size=(500, 8)).astype(np.float32), rng.normal(size=(70, 8)).astype(np.float32)
    seen = []
    real = ann._ScoreBuffers.__call__

    def spy(self, rows, dtype):
        buf = real(self, rows, dtype)
        seen.append((threading.get_ident(), dtype, buf.untyped_storage().data_ptr()))
        return buf

    monkeypatch.setattr(ann._ScoreBuffers, "__call__", spy)
    want = exact_topk(q, keys, 5, block=16, precision="fp32")[1]
    np.testing.assert_array_equal(exact_topk(q, keys, 5, block=16, precision=precision)[1], want)
    np.testing.assert_array_equal(exact_topk(q[:9], keys[:300], 5, block=16, precision=precision)[1],
                                  exact_topk(q[:9], keys[:300], 5, precision="fp32")[1])
    other = threading.Thread(target=lambda: exact_topk(q, keys, 5, block=16, precision=precision))
    other.start()
    other.join()
    mine = [x for x in seen if x[0] == threading.get_ident()]
    assert len(mine) >= 10 and len(set(mine)) == len({d for _, d, _ in mine})  # one buffer per dtype
    theirs = {p for t, _, p in seen if t != threading.get_ident()}
    assert theirs and not theirs & {p for _, _, p in mine}


@pytest.mark.parametrize("precision", ["fp32", "bf16", "int8"])
def test_exact_search_with_no_keys_or_fewer_keys_than_k(precision):
    """No keys: every row -1 / -inf; fewer valid keys than k (4 keys, 2 excluded): the rest padded."""
    rng = np.random.default_rng(0)
    q, keys = rng.normal(size=(3, 8)).astype(np.float32), rng.normal(size=(4, 8)).astype(np.float32)
    s, i = exact_topk(q, np.zeros((0, 8), np.float32), 5, precision=precision)
    assert (i == -1).all() and np.isneginf(s).all()
    s, i = exact_topk(q, keys, 5, precision=precision, exclude=np.array([0, 1]))
    want = np.argsort(-(q @ keys[2:].T), axis=1) + 2
    np.testing.assert_array_equal(i[:, :2], want)
    assert (i[:, 2:] == -1).all() and np.isneginf(s[:, 2:]).all()


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
