"""The kept embeddings of a split (``xc_dagster.pipeline.encoded``): read back only under the same key, whole and of
the split's shape. Evaluation reading them back, and encoding again after a new encoder, is tested with its kept
blocks (tests/test_kept_work.py)."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

from xc_dagster.pipeline.encoded import EncodedCache

SETTINGS = {"encoder": ".pretrain.v-1", "tokenize": ".tokenize.v-1", "pooling": "mean", "device": "cpu",
            "dtype": "None", "batch_size": 256}


def test_the_key_covers_every_setting_and_a_damaged_or_misshapen_file_is_encoded_again(tmp_path, caplog):
    folder = tmp_path / "encoded"
    base = EncodedCache(folder, "test", SETTINGS)
    for field, other in (("encoder", ".pretrain.v-2"), ("tokenize", ".tokenize.v-2"), ("device", "cuda"),
                         ("dtype", "torch.bfloat16"), ("pooling", "cls"), ("batch_size", 64)):
        assert EncodedCache(folder, "test", {**SETTINGS, field: other}).key != base.key, field
    assert EncodedCache(folder, "label", SETTINGS).key != base.key
    assert base.load(5) is None  # nothing kept yet

    emb = np.random.default_rng(0).standard_normal((5, 4)).astype(np.float32)
    base.save(emb)
    assert np.array_equal(EncodedCache(folder, "test", dict(SETTINGS)).load(5), emb)
    with caplog.at_level("WARNING", logger="xc_dagster"):
        assert base.load(6) is None  # another number of texts: not these embeddings
    assert "not 6 rows of float32" in caplog.text

    other = EncodedCache(folder, "test", {**SETTINGS, "encoder": ".pretrain.v-2"})
    other.save(emb[:3])
    assert sorted(p.name for p in folder.glob("test-*.npy")) == [other.path.name]  # one file per split
    assert base.load(5) is None
    other.path.write_bytes(other.path.read_bytes()[:100])  # truncated, as by a full disk
    with caplog.at_level("WARNING", logger="xc_dagster"):
        assert other.load(3) is None
    assert "do not read back" in caplog.text


@pytest.mark.parametrize("age_s, removed", [(7200, True), (10, False)])
def test_a_killed_writes_temporary_file_is_removed_only_once_stale(tmp_path, age_s, removed):
    cache = EncodedCache(tmp_path, "test", SETTINGS)
    left = tmp_path / f".test-{'0' * 32}.npy.tmp-deadbeef"
    left.write_bytes(b"partial")
    os.utime(left, (time.time() - age_s, time.time() - age_s))
    cache.save(np.zeros((2, 3), dtype=np.float32))
    assert left.exists() is not removed
