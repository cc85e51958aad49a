"""Inference chunks: length-sorted, and on a CPU bounded in padded tokens for a transformer (encode_tokens)."""

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from transformers import BertConfig, BertModel

from xc_dagster.encoders.encode import encode_tokens, length_sorted_chunks
from xc_dagster.encoders.transformer import SiameseEncoder

VOCAB = 50


def _encoder() -> SiameseEncoder:
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=64, max_position_embeddings=64)
    return SiameseEncoder(BertModel(cfg)).eval()


def _tokens(n: int, width: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    lens = rng.integers(0, width + 1, n)
    ids = np.where(np.arange(width) < lens[:, None], rng.integers(1, VOCAB, (n, width)), 0).astype(np.int32)
    return ids, lens


@pytest.mark.parametrize("max_tokens", [None, 1, 7, 40, 1000])
def test_chunks_cover_every_row_once_longest_first_within_the_token_budget(max_tokens):
    lens = np.array([3, 9, 0, 9, 5, 1, 12, 4, 4, 7, 2])
    chunks = length_sorted_chunks(lens, 4, max_tokens)
    rows = np.concatenate(chunks)
    assert sorted(rows.tolist()) == list(range(len(lens)))
    assert (np.diff(lens[rows]) <= 0).all()  # longest first, over and within chunks
    for c in chunks:
        assert 1 <= len(c) <= 4
        if max_tokens is not None and len(c) > 1:  # one row may exceed the budget alone
            assert len(c) * max(int(lens[c].max()), 1) <= max_tokens
    if max_tokens is None:
        assert [len(c) for c in chunks] == [4, 4, 3]
    if max_tokens == 40:  # widths 12 -> 3 rows, then 7 -> 4 (chunk_size), then 4 -> 4, then the rest
        assert [len(c) for c in chunks] == [3, 4, 4]


def test_budget_is_a_cpu_transformer_bound_and_changes_no_embedding():
    enc = _encoder()
    ids, lens = _tokens(300, 24)
    shapes = []

    def forward(t_ids, mask):
        shapes.append(tuple(t_ids.shape))
        return enc(t_ids, mask)

    got = encode_tokens(enc, ids, lens, torch.device("cpu"), None, 256, forward=forward)
    assert all(r * w <= enc.cpu_batch_tokens or r == 1 for r, w in shapes)
    assert len(shapes) > 2 and max(r for r, _ in shapes) <= 256
    enc.cpu_batch_tokens = None  # the unbounded chunks: 256 rows, then the rest
    shapes.clear()
    want = encode_tokens(enc, ids, lens, torch.device("cpu"), None, 256, forward=forward)
    assert [r for r, _ in shapes] == [256, 44]
    np.testing.assert_allclose(got, want, atol=2e-6)
    np.testing.assert_allclose(np.linalg.norm(got[lens > 0], axis=1), 1.0, atol=1e-5)  # empty texts: 0
    # input order kept: each row equals its own encoding alone
    for i in (0, 17, 299):
        alone = encode_tokens(enc, ids[i:i + 1], lens[i:i + 1], torch.device("cpu"), None)
        np.testing.assert_allclose(got[i], alone[0], atol=2e-6)


def test_rows_that_are_all_one_input_take_one_forward_pass_with_the_same_embeddings():
    """Every row the same sequence (a dataset whose points have no text: each the empty text's tokens): one row
    encoded, every row given it, progress counting them all, the same as the chunked encoding; rows of equal
    lengths that differ past the first check block, and padding past each row's length, are told apart."""
    enc = _encoder()
    ids = np.zeros((70_000, 6), dtype=np.int32)
    ids[:, :2] = [2, 3]  # [CLS] [SEP]
    ids[::7, 4] = 9  # past the length: padding, not read
    lens = np.full(70_000, 2)
    calls, counted = [], []

    def forward(t_ids, mask):
        calls.append(len(t_ids))
        return enc(t_ids, mask)

    got = encode_tokens(enc, ids, lens, torch.device("cpu"), None, 256, counted.append, forward=forward)
    assert calls == [1] and sum(counted) == 70_000
    want = encode_tokens(enc, ids[:300], lens[:300] + np.r_[1, np.zeros(299, int)], torch.device("cpu"), None)
    np.testing.assert_allclose(got[:300][1:], want[1:], atol=2e-6)  # the chunked encoding of the same rows
    np.testing.assert_array_equal(got, np.broadcast_to(got[0], got.shape))
    ids[69_999, 1] = 4  # one row differs, in the second block of rows compared
    calls.clear()
    again = encode_tokens(enc, ids, lens, torch.device("cpu"), None, 256, forward=forward)
    assert len(calls) > 1 and not np.allclose(again[69_999], got[0], atol=1e-4)
    np.testing.assert_allclose(again[:69_999], got[:69_999], atol=2e-6)


def test_cpu_chunks_run_on_the_process_threads_one_torch_thread_each_with_the_same_embeddings():
    """With two torch threads a transformer's CPU chunks run on two threads, each with one intra-op thread; the
    embeddings equal the one-thread encoding, progress counts every row once, and the caller's thread count (and
    the count a thread started afterwards gets) is two again."""
    enc = _encoder()
    enc.cpu_batch_tokens = 64
    ids, lens = _tokens(200, 16, seed=1)
    seen, counted = [], []

    def forward(t_ids, mask):
        seen.append((threading.get_ident(), torch.get_num_threads()))
        return enc(t_ids, mask)

    n = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        want = encode_tokens(enc, ids, lens, torch.device("cpu"), None, 256, forward=forward)
        assert {t for _, t in seen} == {1} and len({i for i, _ in seen}) == 1
        seen.clear()
        torch.set_num_threads(2)
        got = encode_tokens(enc, ids, lens, torch.device("cpu"), None, 256, progress=counted.append, forward=forward)
        assert torch.get_num_threads() == 2
        with ThreadPoolExecutor(1) as later:
            assert later.submit(torch.get_num_threads).result() == 2
    finally:
        torch.set_num_threads(n)
    assert len({i for i, _ in seen}) == 2 and {t for _, t in seen} == {1}  # two workers, one torch thread each
    assert threading.get_ident() not in {i for i, _ in seen}
    assert sum(counted) == len(lens) and len(counted) == len(seen)
    np.testing.assert_allclose(got, want, atol=1e-6)
    # few chunks per thread: the calling thread encodes them with its intra-op threads
    seen.clear()
    encode_tokens(enc, ids[:10], lens[:10], torch.device("cpu"), None, 256, forward=forward)
    assert {i for i, _ in seen} == {threading.get_ident()}
