"""Evaluation reuses the test embeddings an earlier run encoded while the encoder, the tokens and the encoding
settings are the same, and encodes again when any of them changes or the kept file is damaged."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

import xc_dagster.pipeline.evaluate as ev
from tests.tinydata import tiny_lf_home
from xc_dagster.catalog import Catalog
from xc_dagster.pipeline import StageContext, run_all
from xc_dagster.pipeline.encoded import EncodedCache
from xc_dagster.storage import ArtifactStore

TINY = {"pretrain.epochs": 1, "pretrain.batch_size": 16, "mining.shortlist_size": 8, "classifier.epochs": 1,
        "classifier.batch_size": 32, "classifier.num_negatives": 5, "index.shortlist_size": 8, "evaluate.top_k": 10,
        "ingest.valid_fraction": 0.1}
SETTINGS = {"encoder": ".pretrain.v-1", "tokenize": ".tokenize.v-1", "pooling": "mean", "device": "cpu",
            "dtype": "None", "batch_size": 256}


def _encodings(monkeypatch) -> list[int]:
    """Count the encodings of a split (``encode_split``), each run's rows."""
    real, calls = ev.encode_split, []

    def counted(ctx, split):
        emb = real(ctx, split)
        calls.append(len(emb))
        return emb

    monkeypatch.setattr(ev, "encode_split", counted)
    return calls


def test_a_re_evaluation_reads_the_test_embeddings_back_and_a_new_encoder_or_tokens_encode_again(
        tmp_path, monkeypatch, tiny_encoder):
    home = tiny_lf_home(tmp_path, monkeypatch, TINY, encoder=tiny_encoder)
    spec = Catalog(home.catalog).get("TinyTitles")
    store = ArtifactStore(home.artifacts)
    ctx = StageContext(store, spec, spec.config(), home.cache)
    calls = _encodings(monkeypatch)
    first = run_all(ctx)["evaluate"]
    n_test = first["n_test"]
    assert calls == [n_test] and first["encoding_reused"] is False
    kept = sorted(ctx.encoded_dir().glob("test-*.npy"))
    assert len(kept) == 1 and np.load(kept[0]).shape[0] == n_test
    stage = store.stage_dir("TinyTitles", "evaluate")
    want = dict(np.load(stage / "predictions.npz"))

    again = run_all(ctx, ("evaluate",))["evaluate"]  # e.g. after a change to the fusion: the same encoder
    assert calls == [n_test] and again["encoding_reused"] is True
    got = dict(np.load(stage / "predictions.npz"))
    assert np.array_equal(got["ids"], want["ids"]) and np.array_equal(got["scores"], want["scores"])
    assert again["metrics"] == first["metrics"]

    run_all(ctx, ("pretrain",))  # a new encoder (a new version folder): encoded again, the old file replaced
    third = run_all(ctx, ("evaluate",))["evaluate"]
    assert calls == [n_test, n_test] and third["encoding_reused"] is False
    now = sorted(ctx.encoded_dir().glob("test-*.npy"))
    assert len(now) == 1 and now != kept

    run_all(ctx, ("tokenize",))  # new tokens, the same encoder: encoded again
    assert run_all(ctx, ("evaluate",))["evaluate"]["encoding_reused"] is False
    assert calls == [n_test] * 3


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
