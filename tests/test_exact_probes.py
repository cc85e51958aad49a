"""Exact search on a CPU asks the precision probes (``device.cpu_bf16_pays``, ``device.cpu_int8_pays``: timed
products, ~31 s for the int8 one on a CPU whose int8 products are slow) only for searches large enough to repay
them: a small search scores in fp32 unprobed, and the index kind of a small index is exact without asking."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from xc_dagster.retrieval import ann, exact_settings
from xc_dagster.retrieval.ann import exact_topk
from xc_dagster.retrieval.exact_settings import resolve_kind

CPU = torch.device("cpu")


@pytest.fixture
def probes(monkeypatch):
    """The probes replaced by recorders that say bf16 does not pay and int8 does; the list of probes asked."""
    asked = []
    monkeypatch.delenv("XC_EXACT_PRECISION", raising=False)
    monkeypatch.setattr(exact_settings, "resolve_device", lambda name: CPU)
    monkeypatch.setattr(exact_settings, "amp_dtype", lambda d, amp: asked.append("bf16") or None)
    monkeypatch.setattr(exact_settings, "cpu_int8_pays", lambda: asked.append("int8") or True)
    return asked


def _passes(monkeypatch) -> list[torch.dtype]:
    """The dtypes of exact search's passes over every key, recorded as they run."""
    seen, real = [], ann.row_topk
    monkeypatch.setattr(ann, "row_topk", lambda t, *a, **kw: seen.append(t.dtype) or real(t, *a, **kw))
    return seen


def test_a_small_search_scores_in_fp32_without_probing_a_large_one_probes(probes, monkeypatch):
    rng = np.random.default_rng(0)
    keys, q = rng.normal(size=(500, 16)).astype(np.float32), rng.normal(size=(40, 16)).astype(np.float32)
    want_s, want = exact_topk(q, keys, 5, device=CPU, precision="fp32")
    passes = _passes(monkeypatch)
    got_s, got = exact_topk(q, keys, 5, device=CPU)  # 40 x 500 x 16 multiply-adds, far below PROBE_MIN_WORK
    assert probes == [] and passes == [torch.float32]
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got_s, want_s)

    # the work counts over the calls on one set of keys (evaluation searches in batches): int8 once it is large
    monkeypatch.setattr(exact_settings, "PROBE_MIN_WORK", 2 * len(q) * keys.size)
    cache: dict = {}
    passes.clear()
    exact_topk(q, keys, 5, device=CPU, cache=cache)
    assert probes == [] and passes == [torch.float32] and cache["work"] == len(q) * keys.size
    _, got = exact_topk(q, keys, 5, device=CPU, cache=cache)
    assert probes == ["bf16", "int8"] and passes[1] == torch.int32  # the int8 pass (int32 products), re-ranked
    assert (got != want).mean() < 0.01  # fp32's top 5 (up to an ulp-apart swap)


def test_a_pinned_precision_is_taken_for_a_small_search_too(probes, monkeypatch):
    monkeypatch.setenv("XC_EXACT_PRECISION", "int8")
    rng = np.random.default_rng(1)
    keys, q = rng.normal(size=(300, 8)).astype(np.float32), rng.normal(size=(10, 8)).astype(np.float32)
    passes = _passes(monkeypatch)
    exact_topk(q, keys, 3, device=CPU)
    assert probes == [] and passes[0] == torch.int32


def test_the_kind_of_a_small_index_is_decided_without_the_probes(probes, monkeypatch):
    monkeypatch.setattr(exact_settings, "EXACT_MAX_VECTORS", 100)
    monkeypatch.setattr(exact_settings, "EXACT_MAX_VECTORS_LOW", 200)
    assert resolve_kind("auto", 100, 16) == "exact" and probes == []
    assert resolve_kind("auto", 200, 16) == "exact" and probes == ["bf16", "int8"]  # int8 scoring: the higher one
    monkeypatch.setattr(exact_settings, "cpu_int8_pays", lambda: False)
    assert resolve_kind("auto", 101, 16) == "hnsw"
