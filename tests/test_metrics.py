"""Tests of xc_dagster.metrics against hand-computed numbers and properties of the XC metrics."""

from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.sparse as sp
from hypothesis import given, settings
from hypothesis import strategies as st

from xc_dagster.metrics import evaluate, inverse_propensity, recall_at, remove_filtered


def csr(rows: list[list[int]], L: int) -> sp.csr_matrix:
    """CSR matrix with a 1 at each listed (row, label)."""
    r = [i for i, ls in enumerate(rows) for _ in ls]
    c = [l for ls in rows for l in ls]
    return sp.csr_matrix((np.ones(len(c)), (r, c)), shape=(len(rows), L))


# 3 rows, 6 labels.
#   row 0: positives {0, 2, 4}; predictions [2, 2, 1, 4] -> hits [1, 0(dup), 0, 1] (+ rank 5 missing: miss)
#   row 1: positive  {1};       predictions [3, 1, -1, -1] -> hits [0, 1, 0, 0]
#   row 2: no positives;        predictions [0, 1, 2, 3]  -> all misses
Y3 = csr([[0, 2, 4], [1], []], 6)
IDX3 = np.array([[2, 2, 1, 4], [3, 1, -1, -1], [0, 1, 2, 3]])
D2 = 1 / math.log2(3)  # 0.6309297535714575, discount at rank 2
D4 = 1 / math.log2(5)  # 0.43067655807339306, discount at rank 4
IDCG3_ROW0 = 1 + D2 + 0.5  # 2.1309297535714578: three positives at ranks 1..3


def test_hand_example_precision_ndcg_recall():
    m = evaluate(IDX3, Y3, ks=(1, 3, 5))
    # P@1: row0 1, row1 0, row2 0 -> 1/3
    assert m["precision_at_1"] == pytest.approx(1 / 3)
    # P@3: row0 1/3, row1 1/3, row2 0 -> (2/3)/3 = 2/9
    assert m["precision_at_3"] == pytest.approx(2 / 9)
    # P@5: row0 2/5 (ranks 1 and 4), row1 1/5, row2 0 -> (3/5)/3 = 1/5
    assert m["precision_at_5"] == pytest.approx(1 / 5)
    # nDCG@1: row0 1/1, others 0 -> 1/3
    assert m["ndcg_at_1"] == pytest.approx(1 / 3)
    # nDCG@3: row0 1/IDCG3 = 0.469278..., row1 (1 positive) D2/1 = 0.630929...; /3 = 0.366736...
    assert m["ndcg_at_3"] == pytest.approx((1 / IDCG3_ROW0 + D2) / 3)
    assert m["ndcg_at_3"] == pytest.approx(0.366736159864738)
    # nDCG@5: row0 (1 + D4)/IDCG3 (only 3 positives), row1 D2 -> 0.434105...
    assert m["ndcg_at_5"] == pytest.approx(((1 + D4) / IDCG3_ROW0 + D2) / 3)
    assert m["ndcg_at_5"] == pytest.approx(0.43410527536492055)
    # recall@1: row0 1/3, row1 0 -> 1/9; recall@3: 1/3 + 1 -> 4/9; recall@5: 2/3 + 1 -> 5/9
    assert m["recall_at_1"] == pytest.approx(1 / 9)
    assert m["recall_at_3"] == pytest.approx(4 / 9)
    assert m["recall_at_5"] == pytest.approx(5 / 9)
    assert set(m) == {f"{f}_at_{k}" for f in ("precision", "ndcg", "recall") for k in (1, 3, 5)}


def test_hand_example_drop_empty_rows():
    m = evaluate(IDX3, Y3, ks=(1, 3, 5), drop_empty_rows=True)
    # row 2 removed: means over 2 rows instead of 3
    assert m["precision_at_1"] == pytest.approx(1 / 2)
    assert m["precision_at_3"] == pytest.approx(1 / 3)
    assert m["precision_at_5"] == pytest.approx(3 / 10)
    assert m["ndcg_at_3"] == pytest.approx(0.550104239797107)  # (0.469278 + 0.630930) / 2
    assert m["recall_at_5"] == pytest.approx(5 / 6)


def test_recall_at_whole_list():
    # row0 finds {2, 4} of {0, 2, 4}: 2/3; row1 finds {1}: 1; row2 empty: 0 -> (5/3)/3 = 5/9
    assert recall_at(IDX3, Y3) == pytest.approx(5 / 9)
    assert recall_at(IDX3, Y3, block_rows=1) == pytest.approx(5 / 9)


def test_inverse_propensity_hand():
    # N = 4 rows; column counts N_l = [4, 1, 0] (the explicit stored 0 must not count)
    r, c = [0, 0, 1, 2, 3, 3], [0, 1, 0, 0, 0, 2]
    Y = sp.csr_matrix((np.array([1.0, 1.0, 1.0, 1.0, 1.0, 0.0]), (r, c)), shape=(4, 3))
    assert Y.nnz == 6  # (3, 2) is a stored explicit zero
    # C = (ln 4 - 1) * 2.5^0.55 = 0.386294... * 1.655263... = 0.639419
    # l0: 1 + C * 5.5^-0.55 = 1 + 0.639419 * 0.391562 = 1.250372
    # l1: 1 + C * 2.5^-0.55 = 1 + (ln 4 - 1) = ln 4 = 1.386294
    # l2: 1 + C * 1.5^-0.55 = 1 + 0.639419 * 0.800110 = 1.511605
    expected = [1.2503720781975358, math.log(4), 1.5116054719900802]
    np.testing.assert_allclose(inverse_propensity(Y), expected, rtol=1e-12)
    np.testing.assert_allclose(inverse_propensity(Y.toarray()), expected, rtol=1e-12)
    assert inverse_propensity(Y).dtype == np.float64


# PS example: 4 labels, ip = [1, 10, 2, 3].
#   row 0: positives {0};    predictions [0, 3] -> hit at rank 1 (ip 1)
#   row 1: positives {1, 2}; predictions [2, 3] -> hit at rank 1 (ip 2); ideal order ip 10, 2
IP = np.array([1.0, 10.0, 2.0, 3.0])
Y_PS = csr([[0], [1, 2]], 4)
IDX_PS = np.array([[0, 3], [2, 3]])


def test_psp_psndcg_ratio_of_means():
    m = evaluate(IDX_PS, Y_PS, ks=(1, 3), inv_prop=IP)
    # PSP@1 = mean(1, 2) / mean(1, 10) = 3/11 = 0.2727 (mean of ratios would be (1 + 0.2)/2 = 0.6)
    assert m["psprecision_at_1"] == pytest.approx(3 / 11)
    # PSP@3: numerators (1/3, 2/3); ideals (1/3, (10+2)/3) -> 3/13
    assert m["psprecision_at_3"] == pytest.approx(3 / 13)
    # PSnDCG@1 = 3/11; PSnDCG@3 = (1 + 2) / (1 + 10 + 2/log2 3) = 3/12.2618595 = 0.244661
    assert m["psndcg_at_1"] == pytest.approx(3 / 11)
    assert m["psndcg_at_3"] == pytest.approx(3 / (11 + 2 * D2))
    assert m["psndcg_at_3"] == pytest.approx(0.2446610971404791)
    # PS-recall is a per-row ratio averaged: row0 1/1, row1 2/(10+2) -> (1 + 1/6)/2 = 7/12
    assert m["psrecall_at_1"] == pytest.approx(7 / 12)
    assert m["psrecall_at_3"] == pytest.approx(7 / 12)
    # plain P@1 = 1 (both rows hit at rank 1)
    assert m["precision_at_1"] == pytest.approx(1.0)


def test_filter_pairs_moves_rank_two_up():
    Y = csr([[1], [0]], 3)
    idx = np.array([[0, 1, 2], [0, 2, 1]])
    # unfiltered: row0 top-1 is 0 (miss), row1 top-1 is 0 (hit) -> P@1 = 1/2
    assert evaluate(idx, Y, ks=(1,))["precision_at_1"] == pytest.approx(1 / 2)
    # filtering (0, 0) moves label 1 to rank 1 in row 0 (hit); row 1 untouched -> P@1 = 1
    fp = np.array([[0, 0]])
    assert evaluate(idx, Y, ks=(1,), filter_pairs=fp)["precision_at_1"] == pytest.approx(1.0)
    # filtering (1, 0) instead: row1 rank 1 becomes label 2 (miss) -> P@1 = 0
    assert evaluate(idx, Y, ks=(1,), filter_pairs=np.array([[1, 0]]))["precision_at_1"] == 0.0


def test_remove_filtered_shifts_and_pads():
    idx = np.array([[5, 3, 7, 1], [3, 5, -1, -1]])
    sc = np.array([[0.9, 0.8, 0.7, 0.6], [0.5, 0.4, -np.inf, -np.inf]])
    fp = np.array([[0, 3], [0, 1], [1, 5], [9, 9]])  # (9, 9) is beyond the rows: ignored
    out, out_sc = remove_filtered(idx, sc, fp)
    np.testing.assert_array_equal(out, [[5, 7, -1, -1], [3, -1, -1, -1]])
    np.testing.assert_array_equal(out_sc, [[0.9, 0.7, -np.inf, -np.inf], [0.5, -np.inf, -np.inf, -np.inf]])
    out2, none_sc = remove_filtered(idx, None, None)
    np.testing.assert_array_equal(out2, idx)
    assert none_sc is None
    np.testing.assert_array_equal(idx[0], [5, 3, 7, 1])  # input untouched


def test_scores_ties_broken_by_smaller_label():
    Y = csr([[1], [1]], 4)
    # row0: labels 2 and 1 tie at 0.9 -> label 1 ranked first (hit); given order would put 2 first
    # row1: label 3 has the best score 0.95 -> rank 1 is 3 (miss)
    idx = np.array([[3, 2, 1], [1, 2, 3]])
    sc = np.array([[0.5, 0.9, 0.9], [0.1, 0.2, 0.95]])
    m = evaluate(idx, Y, ks=(1, 2), scores=sc)
    assert m["precision_at_1"] == pytest.approx(1 / 2)
    # P@2: row0 ranks [1, 2] -> 1/2; row1 ranks [3, 2] -> 0 -> 1/4
    assert m["precision_at_2"] == pytest.approx(1 / 4)
    # without scores the given order is the ranking: row0 top-1 = 3 (miss), row1 top-1 = 1 (hit)
    assert evaluate(idx, Y, ks=(1,))["precision_at_1"] == pytest.approx(1 / 2)
    assert evaluate(idx[:1], Y[:1], ks=(1,))["precision_at_1"] == 0.0


def test_validation_errors():
    with pytest.raises(ValueError, match="2-D"):
        evaluate(np.array([1, 2]), Y3)
    with pytest.raises(ValueError, match=r"\(2, 4\).*\(3, 6\)"):
        evaluate(IDX3[:2], Y3)
    with pytest.raises(ValueError, match="label id 6"):
        evaluate(np.array([[6], [0], [0]]), Y3)
    with pytest.raises(ValueError, match="inv_prop"):
        evaluate(IDX3, Y3, inv_prop=np.ones(5))
    with pytest.raises(ValueError, match="ks"):
        evaluate(IDX3, Y3, ks=(0, 1))
    with pytest.raises(ValueError, match="filter_pairs"):
        evaluate(IDX3, Y3, filter_pairs=np.array([1, 2, 3]))
    with pytest.raises(ValueError, match="scores"):
        evaluate(IDX3, Y3, scores=np.ones((3, 2)))


# --------------------------------------------------------------------------------- property tests


@st.composite
def problems(draw):
    """Random small (indices, Y, inv_prop, scores) with padding and duplicates."""
    n = draw(st.integers(1, 6))
    L = draw(st.integers(1, 8))
    K = draw(st.integers(0, 7))
    rows = [sorted(draw(st.sets(st.integers(0, L - 1), max_size=L))) for _ in range(n)]
    idx = np.array(draw(st.lists(st.lists(st.integers(-1, L - 1), min_size=K, max_size=K),
                                 min_size=n, max_size=n)), dtype=np.int64).reshape(n, K)
    ip = np.array(draw(st.lists(st.floats(1.0, 20.0), min_size=L, max_size=L)))
    sc = np.array(draw(st.lists(st.lists(st.sampled_from([0.0, 0.5, 1.0, 2.0]), min_size=K, max_size=K),
                                min_size=n, max_size=n)), dtype=float).reshape(n, K)
    return idx, csr(rows, L), ip, sc, rows


KS = (1, 2, 3, 5)


@settings(max_examples=50, deadline=None)
@given(problems(), st.booleans())
def test_metrics_in_unit_interval(prob, use_scores):
    idx, Y, ip, sc, _ = prob
    m = evaluate(idx, Y, ks=KS, inv_prop=ip, scores=sc if use_scores else None)
    assert len(m) == 6 * len(KS)
    assert all(0.0 <= v <= 1.0 for v in m.values()), m
    assert 0.0 <= recall_at(idx, Y) <= 1.0


@settings(max_examples=50, deadline=None)
@given(problems())
def test_perfect_predictions(prob):
    _, Y, ip, _, rows = prob
    rows = [r if r else [0] for r in rows]  # every row has a positive
    Y = csr(rows, Y.shape[1])
    kmax = max(KS)
    # true labels ranked by ip descending, padded with -1
    perfect = np.full((len(rows), kmax), -1)
    for i, r in enumerate(rows):
        ranked = sorted(r, key=lambda l: (-ip[l], l))[:kmax]
        perfect[i, :len(ranked)] = ranked
    m = evaluate(perfect, Y, ks=KS, inv_prop=ip)
    for k in KS:
        assert m[f"precision_at_{k}"] == pytest.approx(np.mean([min(k, len(r)) / k for r in rows]))
        assert m[f"recall_at_{k}"] == pytest.approx(np.mean([min(k, len(r)) / len(r) for r in rows]))
        assert m[f"ndcg_at_{k}"] == pytest.approx(1.0)
        assert m[f"psprecision_at_{k}"] == pytest.approx(1.0)
        assert m[f"psndcg_at_{k}"] == pytest.approx(1.0)


@settings(max_examples=50, deadline=None)
@given(problems(), st.randoms(use_true_random=False))
def test_row_permutation_invariance(prob, rnd):
    idx, Y, ip, sc, _ = prob
    perm = np.array(rnd.sample(range(idx.shape[0]), idx.shape[0]))
    a = evaluate(idx, Y, ks=KS, inv_prop=ip, scores=sc)
    b = evaluate(idx[perm], Y[perm], ks=KS, inv_prop=ip, scores=sc[perm])
    assert a == pytest.approx(b)
    assert recall_at(idx, Y) == pytest.approx(recall_at(idx[perm], Y[perm]))


@settings(max_examples=50, deadline=None)
@given(problems(), st.booleans())
def test_block_rows_match_default(prob, drop):
    idx, Y, ip, sc, _ = prob
    fp = np.array([[0, 0], [idx.shape[0] - 1, Y.shape[1] - 1]])
    kw = dict(ks=KS, inv_prop=ip, scores=sc, filter_pairs=fp, drop_empty_rows=drop)
    assert evaluate(idx, Y, block_rows=2, **kw) == pytest.approx(evaluate(idx, Y, **kw))
    assert recall_at(idx, Y, block_rows=2) == pytest.approx(recall_at(idx, Y))
