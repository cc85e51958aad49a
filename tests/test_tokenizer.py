"""Tokenization to the on-disk arrays: the fast tokenizer's Rust backend gives the tokenizer call's ids and
lengths, truncation and padding included, without changing the tokenizer it was copied from."""

from __future__ import annotations

import numpy as np
import pytest

from xc_dagster.encoders import tokenizer as tokenizer_module
from xc_dagster.encoders.tokenizer import check_positions, load_tokenizer, tokenize_to_npy
from xc_dagster.errors import XCConfigError

TEXTS = ["red running shoe", "", "Éclair au café — naïve façade", "  spaces   between  ",
         " ".join(["extreme classification of millions of labels"] * 12), "a", "tab\tand\nnewline", "数据集 标签"]


def _reference(tok, texts, max_len):
    """What the tokenizer's own call gives: right-padded to max_len with the pad id, lengths from the mask."""
    enc = tok([t if t else " " for t in texts], truncation=True, max_length=max_len, padding="max_length",
              return_attention_mask=True, return_tensors="np")
    ids, mask = enc["input_ids"].astype(np.int32), enc["attention_mask"]
    ids[mask == 0] = tok.pad_token_id
    return ids, mask.sum(1).astype(np.int32)


class _Slow:
    """A tokenizer without a Rust backend (a slow one): only its call."""

    def __init__(self, tok):
        self.tok, self.pad_token_id = tok, tok.pad_token_id

    def __call__(self, *a, **k):
        return self.tok(*a, **k)


@pytest.mark.parametrize("max_len", [4, 8, 32])
@pytest.mark.parametrize("slow", [False, True])
def test_tokenize_to_npy_equals_the_tokenizer_call(tmp_path, max_len, slow):
    tok = load_tokenizer("minilm")
    texts = TEXTS * 3
    want_ids, want_lens = _reference(tok, texts, max_len)
    st = tokenize_to_npy(_Slow(tok) if slow else tok, texts, max_len, tmp_path / "ids.npy", tmp_path / "lens.npy",
                         chunk=5)  # chunks cut through the texts
    np.testing.assert_array_equal(np.load(tmp_path / "ids.npy"), want_ids)
    np.testing.assert_array_equal(np.load(tmp_path / "lens.npy"), want_lens)
    assert want_lens.max() == max_len and st["truncated_fraction"] == pytest.approx((want_lens == max_len).mean())
    assert st["max_len_seen"] == max_len and st["rows"] == len(texts)


def test_the_backend_is_a_copy(tmp_path):
    """Truncation and no padding are set on a copy: the shared tokenizer's own calls are unchanged."""
    tok = load_tokenizer("minilm")
    before = tok(TEXTS[4])["input_ids"]
    tokenize_to_npy(tok, TEXTS, 6, tmp_path / "ids.npy", tmp_path / "lens.npy")
    assert tok(TEXTS[4])["input_ids"] == before and len(before) > 6
    assert tok.backend_tokenizer.truncation is None and tok.backend_tokenizer.padding is None
    assert tokenizer_module._backend(_Slow(tok), 6) is None


def test_a_length_past_the_encoders_positions_fails_before_any_tokenizing():
    """MiniLM has 512 positions: a tokenize.max_len past them failed at the first pretraining step with an index
    error; the tokenize stage names the field and the most. A bag encoder reads any length."""
    tok = load_tokenizer("minilm")
    with pytest.raises(XCConfigError, match="^tokenize.label_max_len: 513 tokens, past the 512 positions of the "
                                            "encoder 'minilm' .*; set at most 512$"):
        check_positions("minilm", tok, {"tokenize.max_len": 512, "tokenize.label_max_len": 513})
    check_positions("bag:64", tok, {"tokenize.max_len": 5000})
