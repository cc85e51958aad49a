"""Tests of xc_dagster.evaluation.metrics against hand-computed numbers and properties of the XC metrics."""

from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.sparse as sp
from hypothesis import given, settings
from hypothesis import strategies as st

from xc_dagster.catalog import DatasetSpec
from xc_dagster.config import PipelineConfig
from xc_dagster.evaluation import metrics
from xc_dagster.evaluation.metrics import evaluate, inverse_propensity, recall_at, remove_filtered, topk_from_csr
from xc_dagster.pipeline.context import StageContext
from xc_dagster.storage import ArtifactStore


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
    assert set(m) == {f"{f}_at_{k}" for f in ("precision", "ndcg", "recall", "coverage", "correct_coverage")
                      for k in (1, 3, 5)}


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


@pytest.mark.parametrize("name, family", [("LF-AmazonTitles-Mine", (0.6, 2.6)), ("MyClicks", (0.55, 1.5))])
def test_propensity_zero_means_the_dataset_family_as_unset(tmp_path, name, family):
    """evaluate.propensity_a/b = 0 is documented as "by dataset family": an explicit 0 (--set, --propensity 0 0,
    a config built without the dataset options) gives the weights of leaving it unset, not A = 0 (every label
    weighs the same) or B = 0 (an unseen label weighs inf)."""
    Y = csr([[0, 1], [0], [0, 2], [0]], 4)  # label 3 has no training point
    want = inverse_propensity(Y, *family)
    assert np.isfinite(want).all() and want[3] > want[1] > want[0]
    for spec in (DatasetSpec(name, "/d"), DatasetSpec(name, "/d", propensity_a=0.0, propensity_b=0.0),
                 DatasetSpec(name, "/d", overrides={"evaluate.propensity_a": "0", "evaluate.propensity_b": 0})):
        e = spec.config().evaluate
        assert (e.propensity_a, e.propensity_b) == family
        np.testing.assert_array_equal(inverse_propensity(Y, e.propensity_a, e.propensity_b), want)
        run = spec.config({"evaluate.propensity_b": 0})  # a run config's 0 too
        assert (run.evaluate.propensity_a, run.evaluate.propensity_b) == family
        ctx = StageContext(ArtifactStore(tmp_path), spec, PipelineConfig(), tmp_path)  # A = B = 0 as configured
        assert ctx.propensity() == family  # what the serving bundle records
        np.testing.assert_array_equal(ctx.inv_prop(Y), want)
    set_a = DatasetSpec(name, "/d", overrides={"evaluate.propensity_a": 0.5}).config().evaluate
    assert (set_a.propensity_a, set_a.propensity_b) == (0.5, family[1])  # a value > 0 is kept


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


def test_hand_example_coverage():
    # after de-duplication the top-5 lists are row0 [2, -, 1, 4, -], row1 [3, 1, -, -, -],
    # row2 [0, 1, 2, 3, -]; 6 labels; labels with a positive: {0, 1, 2, 4}
    m = evaluate(IDX3, Y3, ks=(1, 3, 5))
    # coverage@1: {2, 3, 0} -> 3/6; @3: + 1 -> {0, 1, 2, 3} 4/6; @5: + 4 -> 5/6 (label 5 never predicted)
    assert m["coverage_at_1"] == pytest.approx(3 / 6)
    assert m["coverage_at_3"] == pytest.approx(4 / 6)
    assert m["coverage_at_5"] == pytest.approx(5 / 6)
    # hits: row0 label 2 at rank 1 and label 4 at rank 4, row1 label 1 at rank 2
    # correct coverage@1: {2} -> 1/4; @3: {2, 1} -> 2/4; @5: {2, 1, 4} -> 3/4
    assert m["correct_coverage_at_1"] == pytest.approx(1 / 4)
    assert m["correct_coverage_at_3"] == pytest.approx(2 / 4)
    assert m["correct_coverage_at_5"] == pytest.approx(3 / 4)
    # drop_empty_rows drops row 2 and its predictions: @1 {2, 3} 2/6, @3 {1, 2, 3} 3/6, @5 {1, 2, 3, 4} 4/6;
    # correct coverage is unchanged (an empty row has no hits)
    d = evaluate(IDX3, Y3, ks=(1, 3, 5), drop_empty_rows=True)
    assert [d[f"coverage_at_{k}"] for k in (1, 3, 5)] == pytest.approx([2 / 6, 3 / 6, 4 / 6])
    assert [d[f"correct_coverage_at_{k}"] for k in (1, 3, 5)] == pytest.approx([1 / 4, 2 / 4, 3 / 4])


def test_coverage_after_filtering():
    Y = csr([[1], [0]], 3)
    idx = np.array([[0, 1, 2], [0, 2, 1]])
    # unfiltered top-1: row0 0 (miss), row1 0 (hit): coverage {0} 1/3, correct {0} of {0, 1} -> 1/2
    m = evaluate(idx, Y, ks=(1, 2))
    assert (m["coverage_at_1"], m["correct_coverage_at_1"]) == pytest.approx((1 / 3, 1 / 2))
    # top-2: {0, 1} + {0, 2} -> 3/3; hits row0 1 (rank 2), row1 0 -> 2/2
    assert (m["coverage_at_2"], m["correct_coverage_at_2"]) == pytest.approx((1.0, 1.0))
    # filtering (0, 0): row0 becomes [1, 2, -1] -> top-1 {1, 0}: 2/3, both hits: 2/2
    f = evaluate(idx, Y, ks=(1,), filter_pairs=np.array([[0, 0]]))
    assert (f["coverage_at_1"], f["correct_coverage_at_1"]) == pytest.approx((2 / 3, 1.0))


def test_k_larger_than_list_and_fewer_positives_than_k():
    # one row, positives {0, 1}, two predictions [1, 5] of 8 labels; ks go beyond the list
    Y = csr([[0, 1]], 8)
    m = evaluate(np.array([[1, 5]]), Y, ks=(1, 2, 4), inv_prop=np.array([2.0, 4.0, 1, 1, 1, 1, 1, 1]))
    assert [m[f"precision_at_{k}"] for k in (1, 2, 4)] == pytest.approx([1.0, 1 / 2, 1 / 4])
    # nDCG@4: DCG 1 / IDCG over min(4, 2) = 2 positives (1 + D2) = 0.613147...
    assert m["ndcg_at_4"] == pytest.approx(1 / (1 + D2))
    assert m["recall_at_4"] == pytest.approx(1 / 2)
    # PSP@1: hit ip 4 / ideal 4 = 1; PSP@4: 4 / (4 + 2) = 2/3; PSnDCG@4: 4 / (4 + 2 D2) = 0.760...
    assert m["psprecision_at_1"] == pytest.approx(1.0)
    assert m["psprecision_at_4"] == pytest.approx(2 / 3)
    assert m["psndcg_at_4"] == pytest.approx(4 / (4 + 2 * D2))
    assert m["psrecall_at_4"] == pytest.approx(4 / 6)
    # labels predicted anywhere: {1, 5} of 8; correct: {1} of {0, 1}
    assert m["coverage_at_4"] == pytest.approx(2 / 8)
    assert m["correct_coverage_at_4"] == pytest.approx(1 / 2)


def test_repeated_filtered_label_reads_further_columns():
    # without scores only the first k + (pairs per row) columns are needed -- unless a filtered label
    # repeats: here all of the first six are label 5, filtered, so ranks 1..2 are labels 1 and 2
    Y = csr([[2]], 6)
    idx = np.array([[5, 5, 5, 5, 5, 5, 1, 2, 3]])
    m = evaluate(idx, Y, ks=(1, 2), filter_pairs=np.array([[0, 5]]))
    assert (m["precision_at_1"], m["precision_at_2"]) == pytest.approx((0.0, 1 / 2))
    assert m["coverage_at_2"] == pytest.approx(2 / 6)


def test_ties_at_top_k_boundary_use_smaller_label():
    # scores 0.9 for label 7, then a three-way tie at 0.5 between labels 3, 5, 1 (given in that order):
    # the top 2 must be [7, 1], the top 3 [7, 1, 3]
    Y = csr([[1], [3]], 8)
    idx = np.array([[7, 3, 5, 1], [7, 3, 5, 1]])
    sc = np.array([[0.9, 0.5, 0.5, 0.5], [0.9, 0.5, 0.5, 0.5]], dtype=np.float32)
    m = evaluate(idx, Y, ks=(2, 3), scores=sc)
    # row0 hits label 1 at rank 2; row1 hits label 3 only at rank 3
    assert m["precision_at_2"] == pytest.approx((1 / 2 + 0) / 2)
    assert m["precision_at_3"] == pytest.approx((1 / 3 + 1 / 3) / 2)
    assert m["coverage_at_2"] == pytest.approx(2 / 8)
    S = sp.csr_matrix((sc.ravel(), (np.repeat([0, 1], 4), idx.ravel())), shape=(2, 8))
    ids, vals = topk_from_csr(S, 3)
    np.testing.assert_array_equal(ids, [[7, 1, 3], [7, 1, 3]])
    np.testing.assert_allclose(vals, [[0.9, 0.5, 0.5]] * 2)
    assert evaluate(S, Y, ks=(2, 3)) == m


def test_topk_from_csr_padding_zeros_and_filters():
    # row0: stored scores {4: 0.0 (explicit zero), 2: -1.0}; row1: nothing; row2: {0: 3, 1: 3, 2: 5}
    S = sp.csr_matrix((np.array([0.0, -1.0, 3.0, 3.0, 5.0]), (np.array([0, 0, 2, 2, 2]),
                                                                np.array([4, 2, 0, 1, 2]))), shape=(3, 6))
    assert S.nnz == 5
    ids, vals = topk_from_csr(S, 3)
    np.testing.assert_array_equal(ids, [[4, 2, -1], [-1, -1, -1], [2, 0, 1]])
    np.testing.assert_array_equal(vals, [[0.0, -1.0, -np.inf], [-np.inf] * 3, [5.0, 3.0, 3.0]])
    assert ids.dtype == np.int64
    ids_f, _ = topk_from_csr(S, 2, filter_pairs=np.array([[2, 2], [0, 4]]), block_rows=1)
    np.testing.assert_array_equal(ids_f, [[2, -1], [-1, -1], [0, 1]])
    # the stored zero is a prediction: label 4 is the top-1 of row 0
    Y = csr([[4], [], [0]], 6)
    m = evaluate(S, Y, ks=(1,))
    assert m["precision_at_1"] == pytest.approx(1 / 3)  # row0 hit, row1 nothing, row2 top-1 is 2
    # a non-canonical matrix: duplicate entries are summed (scipy's meaning): label 2 of row 0 -> 1.5
    D = sp.csr_matrix((np.array([1.0, 0.5, 1.2]), np.array([2, 2, 4]), np.array([0, 3, 3, 3])), shape=(3, 6))
    np.testing.assert_array_equal(topk_from_csr(D, 2)[0][0], [2, 4])


def test_topk_from_csr_uneven_rows_match_dense():
    # one row with 300 entries and 40 rows with one: exercises the sort-based path for ragged blocks
    rng = np.random.default_rng(3)
    rows = np.concatenate([np.zeros(300, dtype=int), np.arange(1, 41)])
    cols = np.concatenate([rng.permutation(400)[:300], rng.integers(0, 400, 40)])
    vals = np.round(rng.random(rows.size), 1)  # many ties
    S = sp.csr_matrix((vals, (rows, cols)), shape=(41, 400))
    fp = np.array([[0, int(cols[0])], [5, int(cols[44])]])
    ids, sc = topk_from_csr(S, 7, filter_pairs=fp)
    counts = np.diff(S.indptr)
    dense_ids = np.full((41, counts.max()), -1)
    dense_sc = np.full((41, counts.max()), -np.inf)
    for i in range(41):
        dense_ids[i, :counts[i]] = S.indices[S.indptr[i]:S.indptr[i + 1]]
        dense_sc[i, :counts[i]] = S.data[S.indptr[i]:S.indptr[i + 1]]
    for i in range(41):  # plain per-row reference
        row = [(-s, l) for l, s in zip(dense_ids[i], dense_sc[i]) if l >= 0 and [i, l] not in fp.tolist()]
        top = sorted(row)[:7]
        want = [l for _, l in top] + [-1] * (7 - len(top))
        np.testing.assert_array_equal(ids[i], want)
    Y = sp.csr_matrix((np.ones(41), (np.arange(41), cols[:41] % 400)), shape=(41, 400))
    kw = dict(ks=(1, 3, 7), filter_pairs=fp, inv_prop=rng.uniform(1, 5, 400))
    assert evaluate(S, Y, **kw) == pytest.approx(evaluate(dense_ids, Y, scores=dense_sc, **kw))


def test_memory_layout_and_dtypes_do_not_matter():
    rng = np.random.default_rng(0)
    idx = rng.integers(-1, 30, (50, 12))
    sc = np.round(rng.random((50, 12)), 1)
    Y = sp.random(50, 30, density=0.1, format="csr", random_state=1)
    fp = np.stack([np.arange(50), rng.integers(0, 30, 50)], axis=1)
    kw = dict(ks=(1, 3, 5), inv_prop=rng.uniform(1, 3, 30), filter_pairs=fp, block_rows=7)
    base = evaluate(idx, Y, scores=sc, **kw)
    assert evaluate(np.asfortranarray(idx.astype(np.int32)), Y, scores=np.asfortranarray(sc), **kw) == \
        pytest.approx(base)
    assert evaluate(idx.astype(np.int16), Y, scores=sc.astype(np.float32), **kw) == pytest.approx(base)
    assert evaluate(idx[:, ::1], Y.tocoo(), scores=(sc * 10).astype(np.int64), **kw) == pytest.approx(base)


def test_new_validation_errors():
    with pytest.raises(ValueError, match="NaN"):
        evaluate(IDX3, Y3, scores=np.full(IDX3.shape, np.nan))
    one = np.where(IDX3 >= 0, 1.0, np.nan)
    one[2, 1] = np.nan  # a single NaN on a real prediction is rejected too
    with pytest.raises(ValueError, match="NaN"):
        evaluate(IDX3, Y3, scores=one)
    # NaN in padding slots is ignored: the result is the one without those entries (padding scored -inf, or
    # the rows ranked by hand: row0 [4, 1, 2, 2], row1 [1, 3], row2 [3, 2, 1, 0]), wherever the padding sits
    rank = np.tile(np.arange(1.0, 5.0), (3, 1))  # ascending: the scores reverse the given order
    sc = np.where(IDX3 >= 0, rank, np.nan)
    got = evaluate(IDX3, Y3, ks=(1, 3, 5), scores=sc)
    assert got == evaluate(IDX3, Y3, ks=(1, 3, 5), scores=np.where(IDX3 >= 0, rank, -np.inf))
    assert got == evaluate(np.array([[4, 1, 2, 2], [1, 3, -1, -1], [3, 2, 1, 0]]), Y3, ks=(1, 3, 5))
    front = np.array([IDX3[0], [-1, -1, 3, 1], IDX3[2]])
    assert evaluate(front, Y3, ks=(1, 3, 5), scores=np.where(front >= 0, rank, np.nan)) == got
    # P@1: row0 4 hit, row1 1 hit -> 2/3; P@3: row0 {4, 2} of [4, 1, 2], row1 {1} -> (2/3 + 1/3)/3 = 1/3
    assert got["precision_at_1"] == pytest.approx(2 / 3) and got["precision_at_3"] == pytest.approx(1 / 3)
    S = sp.csr_matrix(np.eye(3, 6))
    with pytest.raises(ValueError, match="scores must be None"):
        evaluate(S, Y3, scores=np.ones((3, 6)))
    with pytest.raises(ValueError, match=r"score matrix has shape \(3, 5\)"):
        evaluate(sp.csr_matrix(np.eye(3, 5)), Y3)
    with pytest.raises(ValueError, match="sparse"):
        topk_from_csr(np.eye(3), 2)
    with pytest.raises(ValueError, match="k must be >= 1"):
        topk_from_csr(S, 0)
    with pytest.raises(ValueError, match=">= 0 or -1"):
        evaluate(np.array([[-2], [0], [0]]), Y3)
    with pytest.raises(ValueError, match="block_rows"):
        evaluate(IDX3, Y3, block_rows=0)


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
    assert len(m) == 8 * len(KS)
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


# ------------------------------------------------------------------ agreement with a plain reference


def plain_top(ids: list[int], sc: list[float] | None, filt: set[int], kmax: int) -> list[int]:
    """One row's ranked top-kmax list (-1 = miss) by the documented conventions, written plainly."""
    kept = [(l, s) for l, s in zip(ids, sc if sc is not None else [0.0] * len(ids))
            if not (l >= 0 and l in filt)]
    if sc is not None:  # score descending, then smaller label id; padding dropped (it goes last)
        ranked = [l for l, _ in sorted((t for t in kept if t[0] >= 0), key=lambda t: (-t[1], t[0]))]
    else:  # given order; a -1 keeps its rank
        ranked = [l for l, _ in kept]
    ranked = (ranked + [-1] * kmax)[:kmax]
    seen: set[int] = set()
    out = []
    for l in ranked:  # later copies are misses
        out.append(-1 if l in seen and l >= 0 else l)
        seen.add(l)
    return out


def plain_metrics(tops: list[list[int]], rows: list[list[int]], ip: np.ndarray, ks, L: int,
                  drop: bool) -> dict[str, float]:
    """Every metric of ``evaluate`` from the per-row top lists, straight from the definitions."""
    used = [i for i in range(len(rows)) if rows[i] or not drop]
    nu = len(used)
    out = {}
    for k in ks:
        disc = [1 / math.log2(r + 2) for r in range(k)]
        p = nd = rc = psr = psp_n = psp_d = psn_n = psn_d = 0.0
        pred: set[int] = set()
        hit_labels: set[int] = set()
        for i in used:
            y = set(rows[i])
            top = tops[i][:k]
            pred |= {l for l in top if l >= 0}
            hits = [r for r, l in enumerate(top) if l >= 0 and l in y]
            hit_labels |= {top[r] for r in hits}
            p += len(hits) / k
            ideal = sorted((ip[l] for l in y), reverse=True)[:k]
            psp_n += sum(ip[top[r]] for r in hits) / k
            psp_d += sum(ideal) / k
            psn_n += sum(ip[top[r]] * disc[r] for r in hits)
            psn_d += sum(v * disc[r] for r, v in enumerate(ideal))
            if y:
                nd += sum(disc[r] for r in hits) / sum(disc[:min(k, len(y))])
                rc += len(hits) / len(y)
                psr += sum(ip[top[r]] for r in hits) / sum(ip[l] for l in y)
        pos_labels = {l for i in used for l in rows[i]}
        out.update({f"precision_at_{k}": p / nu if nu else 0.0, f"ndcg_at_{k}": nd / nu if nu else 0.0,
                    f"recall_at_{k}": rc / nu if nu else 0.0,
                    f"psprecision_at_{k}": psp_n / psp_d if psp_d else 0.0,
                    f"psndcg_at_{k}": psn_n / psn_d if psn_d else 0.0,
                    f"psrecall_at_{k}": psr / nu if nu else 0.0,
                    f"coverage_at_{k}": len(pred) / L,
                    f"correct_coverage_at_{k}": len(hit_labels) / len(pos_labels) if pos_labels else 0.0})
    return out


@st.composite
def filtered_problems(draw):
    """problems() plus scores with -inf, filter pairs (some beyond the rows / labels) and a ks list."""
    idx, Y, ip, sc, rows = draw(problems())
    n, L = Y.shape
    sc = np.where(np.array(draw(st.lists(st.booleans(), min_size=sc.size, max_size=sc.size)),
                           dtype=bool).reshape(sc.shape) & (sc == 0.0), -np.inf, sc)
    fp = np.array(draw(st.lists(st.tuples(st.integers(0, n), st.integers(0, L)), max_size=6)),
                  dtype=np.int64).reshape(-1, 2)
    ks = draw(st.lists(st.integers(1, 9), min_size=1, max_size=4, unique=True))
    return idx, Y, ip, sc, rows, fp, ks


@settings(max_examples=150, deadline=None)
@given(filtered_problems(), st.booleans(), st.booleans(), st.integers(1, 4))
def test_agrees_with_plain_reference(prob, use_scores, drop, block_rows):
    idx, Y, ip, sc, rows, fp, ks = prob
    kmax = max(ks)
    tops = [plain_top(idx[i].tolist(), sc[i].tolist() if use_scores else None,
                      {int(l) for r, l in fp if r == i}, kmax) for i in range(len(rows))]
    want = plain_metrics(tops, rows, ip, ks, Y.shape[1], drop)
    got = evaluate(idx, Y, ks=ks, inv_prop=ip, filter_pairs=fp, scores=sc if use_scores else None,
                   block_rows=block_rows, drop_empty_rows=drop)
    assert set(got) == set(want)
    for key in want:
        assert got[key] == pytest.approx(want[key], abs=1e-12), key


@settings(max_examples=100, deadline=None)
@given(filtered_problems(), st.integers(1, 4))
def test_csr_scores_equal_indices_and_scores(prob, block_rows):
    idx, Y, ip, sc, rows, fp, ks = prob
    n, L = Y.shape
    # a CSR score matrix holds one score per (row, label): keep the first copy of each label
    r, c, v = [], [], []
    for i in range(n):
        seen: set[int] = set()
        for l, s in zip(idx[i], sc[i]):
            if l >= 0 and l not in seen:
                seen.add(int(l))
                r.append(i), c.append(int(l)), v.append(s)
    S = sp.csr_matrix((np.array(v, dtype=float), (np.array(r, dtype=int), np.array(c, dtype=int))),
                      shape=(n, L))
    assert S.nnz == len(v)  # stored zeros stay stored: they are predictions
    uniq = np.full(idx.shape, -1)
    uniq_sc = np.full(idx.shape, -np.inf)
    for i in range(n):
        k = S.indptr[i + 1] - S.indptr[i]
        uniq[i, :k] = S.indices[S.indptr[i]:S.indptr[i + 1]]
        uniq_sc[i, :k] = S.data[S.indptr[i]:S.indptr[i + 1]]
    kw = dict(ks=ks, inv_prop=ip, filter_pairs=fp, block_rows=block_rows)
    assert evaluate(S, Y, **kw) == pytest.approx(evaluate(uniq, Y, scores=uniq_sc, **kw), abs=1e-12)
    ids, vals = topk_from_csr(S, max(ks), block_rows=block_rows, filter_pairs=fp)
    assert evaluate(ids, Y, **kw) == pytest.approx(evaluate(S, Y, **kw), abs=1e-12)
    assert np.all(vals[ids < 0] == -np.inf)


@settings(max_examples=50, deadline=None)
@given(problems(), st.randoms(use_true_random=False))
def test_row_permutation_invariance_with_filters(prob, rnd):
    idx, Y, ip, sc, _ = prob
    n = idx.shape[0]
    perm = np.array(rnd.sample(range(n), n))
    fp = np.array([[0, 0], [n - 1, Y.shape[1] - 1]])
    inv = np.argsort(perm)  # old row r is new row inv[r]
    fp_perm = np.stack([inv[fp[:, 0]], fp[:, 1]], axis=1)
    a = evaluate(idx, Y, ks=KS, inv_prop=ip, scores=sc, filter_pairs=fp)
    b = evaluate(idx[perm], Y[perm], ks=KS, inv_prop=ip, scores=sc[perm], filter_pairs=fp_perm)
    assert a == pytest.approx(b, abs=1e-12)


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 5), st.integers(1, 6), st.data())
def test_perfect_predictions_rows_with_at_least_k_positives(n, kmax, data):
    # every row has >= kmax positives; predictions are the true labels by inverse propensity descending
    L = kmax + data.draw(st.integers(0, 5))
    ip = np.array(data.draw(st.lists(st.floats(1.0, 20.0), min_size=L, max_size=L)))
    rows = [sorted(data.draw(st.sets(st.integers(0, L - 1), min_size=kmax, max_size=L))) for _ in range(n)]
    Y = csr(rows, L)
    perfect = np.array([sorted(r, key=lambda l: (-ip[l], l))[:kmax] for r in rows])
    ks = list(range(1, kmax + 1))
    m = evaluate(perfect, Y, ks=ks, inv_prop=ip)
    for k in ks:
        assert m[f"precision_at_{k}"] == pytest.approx(1.0)  # = mean(min(k, |y|)/k) with |y| >= k
        assert m[f"ndcg_at_{k}"] == pytest.approx(1.0)
        assert m[f"psprecision_at_{k}"] == pytest.approx(1.0)
        assert m[f"psndcg_at_{k}"] == pytest.approx(1.0)
        assert m[f"correct_coverage_at_{k}"] == pytest.approx(m[f"coverage_at_{k}"] * L / len(set().union(*rows)))


def test_one_function_per_family_gives_evaluates_numbers():
    """precision, ndcg, ... each compute one family with exactly evaluate's numbers (scores, filters, dropped
    empty rows, small blocks); the propensity-scored ones need inv_prop."""
    rng = np.random.default_rng(11)
    n, L, K = 60, 40, 8
    Y = sp.random(n, L, density=0.05, random_state=3, format="csr")
    idx, sc = rng.integers(-1, L, (n, K)), np.round(rng.random((n, K)), 2)
    fp = np.stack([np.arange(0, n, 3), rng.integers(0, L, len(range(0, n, 3)))], axis=1)
    ip = inverse_propensity(Y)
    opts = {"filter_pairs": fp, "scores": sc, "block_rows": 7, "drop_empty_rows": True}
    everything = evaluate(idx, Y, ks=(1, 3, 5), inv_prop=ip, **opts)
    for family in ("precision", "ndcg", "recall", "coverage", "correct_coverage"):
        one = getattr(metrics, family)(idx, Y, (1, 3, 5), **opts)
        assert one == {f"{family}_at_{k}": everything[f"{family}_at_{k}"] for k in (1, 3, 5)}
    for family in ("psprecision", "psndcg", "psrecall"):
        one = getattr(metrics, family)(idx, Y, ip, (1, 3, 5), **opts)
        assert one == {f"{family}_at_{k}": everything[f"{family}_at_{k}"] for k in (1, 3, 5)}
        with pytest.raises(ValueError, match="inv_prop"):
            getattr(metrics, family)(idx, Y, None)
