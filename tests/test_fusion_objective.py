"""The prepared fusion objective and the in-place blend: equal, to the bit, to ``validation_objective`` and
``fuse``, so that the alpha grid chooses the same fusion as with them."""

from __future__ import annotations

from dataclasses import replace
from functools import partial

import numpy as np
import pytest
import scipy.sparse as sp

from xc_dagster.config import FusionParams
from xc_dagster.errors import XCConfigError
from xc_dagster.evaluation.fixed_shortlist import FixedShortlistMetrics, candidate_order, row_floor
from xc_dagster.evaluation.metrics import _evaluate, evaluate_families
from xc_dagster.retrieval.fusion.alpha import Blend, fit_alpha
from xc_dagster.retrieval.fusion.objective import ObjectiveOnShortlist, validation_objective
from xc_dagster.retrieval.shortlist import Shortlist, fuse

FAMILIES = ("precision", "ndcg", "recall", "psprecision", "psndcg", "psrecall")
NAMES = [f"{f}_at_{k}" for f in FAMILIES for k in (1, 3, 5)]
SUMS = ["precision_at_1+precision_at_5+psprecision_at_1+psprecision_at_5", "ndcg_at_3+psrecall_at_5",
        "recall_at_1+psndcg_at_3+precision_at_3+psprecision_at_5"]


def _problem(seed: int, n: int = 120, C: int = 40, L: int = 300, dup: bool = False, pad_rate: float = 0.15):
    """A shortlist with padding (``pad_rate``, and rows with at most 2 candidates), filter pairs, rows without
    positives, zero propensities and duplicates (if ``dup``); about a third of the positives are shortlisted."""
    rng = np.random.default_rng(seed)
    ids = np.argsort(rng.random((n, L)), axis=1)[:, :C].astype(np.int64)
    if dup and C > 2:
        ids[: n // 2, 1] = ids[: n // 2, 0]
    pad = rng.random((n, C)) < pad_rate
    pad[: n // 20, 2:] = True  # rows with at most 2 candidates: fewer than k
    ids[pad] = -1
    npos = rng.poisson(2.3, n)
    npos[::6] = 0  # rows without positives
    rows = np.repeat(np.arange(n), npos)
    on = rng.random(rows.size) < 0.4
    cols = np.where(on, ids[rows, rng.integers(0, C, rows.size)], rng.integers(0, L, rows.size))
    ok = cols >= 0
    Y = sp.csr_matrix((np.ones(ok.sum()), (rows[ok], cols[ok])), shape=(n, L))
    inv_prop = rng.uniform(1.0, 6.0, L)
    inv_prop[rng.random(L) < 0.2] = 0.0  # zero propensity weights
    fr, fc = np.nonzero((rng.random((n, C)) < 0.03) & (ids >= 0))
    filter_pairs = np.stack([fr, ids[fr, fc]], axis=1)
    return ids, pad, Y, inv_prop, filter_pairs


def _tied_scores(rng: np.random.Generator, shape: tuple[int, int], pad: np.ndarray, dtype=np.float32) -> np.ndarray:
    """Scores from a few values (ties everywhere, -0.0 beside 0.0, some -inf on real ids), -inf on padding."""
    s = rng.choice(np.array([-1.0, -0.0, 0.0, 0.5, 2.0, -np.inf]), size=shape, p=[.2, .2, .2, .2, .15, .05])
    s[pad] = -np.inf
    return s.astype(dtype)


@pytest.mark.parametrize("C", [3, 5, 40, 41, 100])
def test_prepared_objective_equals_validation_objective_exactly(C):
    """Every family at k 1, 3, 5 and sums of them, on tied scores: == (the same sums in the same order)."""
    rng = np.random.default_rng(C)
    for seed, dup, pad_rate in ((C, False, 0.15), (C + 1, False, 0.02), (C + 2, True, 0.15)):
        ids, pad, Y, inv_prop, fp = _problem(seed, C=C, dup=dup, pad_rate=pad_rate)
        for filter_pairs in (fp, None):
            prepared = {name: ObjectiveOnShortlist(ids, Y, name, inv_prop, filter_pairs, 10)
                        for name in NAMES + SUMS}
            assert all(p.metrics is not None for p in prepared.values())
            for j in range(3):
                s = _tied_scores(rng, ids.shape, pad)
                if j == 2 and filter_pairs is not None:  # filtered candidates on top: they must not count
                    hit, col = np.nonzero(ids[filter_pairs[:, 0]] == filter_pairs[:, 1, None])
                    s[filter_pairs[hit, 0], col] = 3.0
                for name, p in prepared.items():
                    assert p.value(s) == validation_objective(ids, s, Y, name, inv_prop, filter_pairs, 10), name


def _non_canonical(Y: sp.csr_matrix) -> sp.csr_matrix:
    """``Y`` with a third of its entries stored twice and each row's columns reversed (not canonical CSR)."""
    coo = Y.tocoo()
    extra = np.arange(0, coo.nnz, 3)
    rows, cols = np.concatenate([coo.row, coo.row[extra]]), np.concatenate([coo.col, coo.col[extra]])
    order = np.lexsort((-cols, rows))
    indptr = np.concatenate([[0], np.cumsum(np.bincount(rows, minlength=Y.shape[0]))])
    out = sp.csr_matrix((np.ones(rows.size), cols[order], indptr), shape=Y.shape)
    assert not out.has_canonical_format
    return out


def test_fixed_shortlist_metrics_equal_evaluate_families_on_blocks_and_dtypes():
    """Several row blocks, float64 and integer scores (the lexsort path), continuous scores, targets with
    explicit zeros or repeated entries: the same dict as the evaluation itself."""
    rng = np.random.default_rng(7)
    ids, pad, Y, inv_prop, fp = _problem(7, n=200, C=48)
    Y_zeros = Y.copy()
    Y_zeros.data[::5] = 0.0  # stored zeros are not positives
    fam = list(FAMILIES)
    for block_rows in (65536, 37):
        for target in (Y, Y_zeros, _non_canonical(Y)):
            fm = FixedShortlistMetrics(fam, ids, target, (1, 3, 5), inv_prop, fp, block_rows=block_rows)
            for s in (_tied_scores(rng, ids.shape, pad, np.float64), rng.integers(-3, 3, ids.shape),
                      rng.standard_normal(ids.shape).astype(np.float32)):
                assert fm.evaluate(s) == _evaluate(fam, ids, target, (1, 3, 5), inv_prop, fp, s, block_rows, False)
    s = rng.standard_normal(ids.shape).astype(np.float32)
    assert FixedShortlistMetrics(fam, ids, Y, (1, 3, 5), inv_prop, fp).evaluate(s) == evaluate_families(
        fam, ids, Y, (1, 3, 5), inv_prop, fp, s)


def test_candidate_order_is_row_then_value_then_id():
    """The int64 key of float32 values orders as (row, value, id), -0.0 tied with 0.0, infinities at the ends."""
    rng = np.random.default_rng(3)
    r = np.sort(rng.integers(0, 50, 2000))
    v = rng.choice(np.array([-np.inf, -2.5, -1e-30, -0.0, 0.0, 1e-30, 3.0, np.inf], dtype=np.float32), 2000)
    ids = rng.integers(0, 10**6, 2000)
    np.testing.assert_array_equal(candidate_order(r, v, ids), np.lexsort((ids, v, r)))
    m = rng.standard_normal((30, 64)).astype(np.float32)
    for k in (1, 5, 7):
        assert ((m >= row_floor(m, k)[:, None]).sum(axis=1) >= k).all()


def test_nan_scores_raise_as_before_except_on_padding():
    """NaN on padding is ignored; on a real candidate, filtered or not, the same ValueError."""
    ids, pad, Y, inv_prop, fp = _problem(11)
    prepared = ObjectiveOnShortlist(ids, Y, SUMS[0], inv_prop, fp, 10)
    s = _tied_scores(np.random.default_rng(0), ids.shape, pad)
    s_pad = s.copy()
    s_pad[pad] = np.nan
    assert prepared.value(s_pad) == validation_objective(ids, s_pad, Y, SUMS[0], inv_prop, fp, 10)
    filtered = (fp[0, 0], int(np.flatnonzero(ids[fp[0, 0]] == fp[0, 1])[0]))
    kept = tuple(np.argwhere(~pad & ~np.isin(ids, fp[:, 1]))[0])
    for pos in (filtered, kept):
        bad = s.copy()
        bad[pos] = np.nan
        with pytest.raises(ValueError, match="NaN") as slow:
            validation_objective(ids, bad, Y, SUMS[0], inv_prop, fp, 10)
        with pytest.raises(ValueError, match="NaN") as fast:
            prepared.value(bad)
        assert str(fast.value) == str(slow.value)


def test_other_objectives_take_the_evaluation_itself():
    """Coverage, unknown names and propensity metrics without propensities: validation_objective's value or
    error."""
    ids, pad, Y, inv_prop, fp = _problem(5)
    s = _tied_scores(np.random.default_rng(1), ids.shape, pad)
    for name in ("coverage_at_5", "precision_at_1+coverage_at_3"):
        p = ObjectiveOnShortlist(ids, Y, name, inv_prop, fp, 10)
        assert p.metrics is None and p.value(s) == validation_objective(ids, s, Y, name, inv_prop, fp, 10)
    with pytest.raises(XCConfigError, match="precision_at_2"):
        ObjectiveOnShortlist(ids, Y, "precision_at_2", inv_prop, fp, 10).value(s)
    with pytest.raises(ValueError, match="need inv_prop"):
        ObjectiveOnShortlist(ids, Y, "psprecision_at_1", None, fp, 10).value(s)
    p = ObjectiveOnShortlist(ids, Y, "precision_at_1", None, fp, 10)
    assert p.metrics is not None and p.value(s) == validation_objective(ids, s, Y, "precision_at_1", None, fp, 10)
    assert ObjectiveOnShortlist(ids, Y, "precision_at_1", None, fp, 10, prepared=False).metrics is None


def _shortlist(seed: int, n: int = 150, C: int = 40, L: int = 300, dtype=np.float32):
    ids, pad, Y, inv_prop, fp = _problem(seed, n, C, L)
    rng = np.random.default_rng(seed)
    clf, emb, knn, lex = (np.round(rng.random((n, C)) * 8) / 8 for _ in range(4))  # ties
    knn[rng.random((n, C)) < 0.5] = 0.0
    clf[pad] = emb[pad] = -np.inf
    knn[pad] = lex[pad] = 0.0
    count = np.where(pad, 0, rng.integers(1, 60, (n, C))).astype(np.float32)  # the kNN index's points per label
    sl = Shortlist(ids, clf.astype(dtype), emb.astype(dtype), knn.astype(dtype), lex.astype(dtype), None, count)
    return sl, Y, inv_prop, fp


def test_blend_equals_fuse_bit_for_bit():
    sl, *_ = _shortlist(2)
    blend = Blend(sl)
    for c, f in ((0.0, 0.0), (0.25, 0.0), (1.0, 0.0), (0.25, 0.25), (1.0, 0.5)):
        for d in (0.0, 0.5):
            for a in np.round(np.arange(0.0, 1.0 + 1e-9, 0.05), 6):
                got, want = blend(float(a), c, d, 0.0, f), fuse(sl, float(a), c, d, 0.0, f)
                assert got.dtype == want.dtype == np.float32
                np.testing.assert_array_equal(got.view(np.int32), want.view(np.int32))
    sl64, *_ = _shortlist(2, dtype=np.float64)
    np.testing.assert_array_equal(Blend(sl64)(0.3, 0.5, 0.5), fuse(sl64, 0.3, 0.5, 0.5))
    np.testing.assert_array_equal(blend(np.float64(0.3), 0.5), fuse(sl, np.float64(0.3), 0.5))


@pytest.mark.filterwarnings("ignore:divide by zero")  # log(1 / p) of the zero propensities: -inf scores
@pytest.mark.parametrize("objective", [FusionParams().objective, "ndcg_at_3+psrecall_at_5"])
def test_fit_alpha_chooses_the_same_fusion_as_the_slow_objective(monkeypatch, objective):
    """Every field of the fit (weights, grids, objective values) equals the fit on ``validation_objective`` and
    ``fuse`` themselves, on a seeded problem with kNN, lexical and propensity terms and filter pairs."""
    sl, Y, inv_prop, fp = _shortlist(4)
    p = FusionParams(objective=objective, grid_step=0.1, knn_grid=(0.0, 0.5, 1.0), lexical_grid=(0.0, 0.5),
                     propensity_grid=(0.0, 0.02, 0.04), knn_grid_extend=1, lexical_grid_extend=1,
                     propensity_grid_extend=1, knn_discount_grid=(0.0, 0.25, 0.5))
    fast = [fit_alpha(sl, Y, p, inv_prop, fp).to_dict(), fit_alpha(sl, Y, replace(p, smoothing=3), inv_prop,
                                                                    None).to_dict()]
    monkeypatch.setattr("xc_dagster.retrieval.fusion.alpha.ObjectiveOnShortlist",
                        partial(ObjectiveOnShortlist, prepared=False))
    monkeypatch.setattr("xc_dagster.retrieval.fusion.alpha.Blend", lambda sl: partial(fuse, sl))
    slow = [fit_alpha(sl, Y, p, inv_prop, fp).to_dict(), fit_alpha(sl, Y, replace(p, smoothing=3), inv_prop,
                                                                    None).to_dict()]
    assert fast == slow


def test_fixed_shortlist_metrics_reject_what_the_evaluation_rejects():
    ids, pad, Y, inv_prop, fp = _problem(9, n=20, C=8)
    fm = FixedShortlistMetrics(["precision"], ids, Y, (1, 3, 5))
    with pytest.raises(ValueError, match="scores has shape"):
        fm.evaluate(np.zeros((20, 7), np.float32))
    with pytest.raises(ValueError, match="real numbers"):
        fm.evaluate(np.zeros(ids.shape, complex))
    with pytest.raises(ValueError, match="unsupported metric families"):
        FixedShortlistMetrics(["coverage"], ids, Y, (1, 3, 5))
    with pytest.raises(ValueError, match="need inv_prop"):
        FixedShortlistMetrics(["psndcg"], ids, Y, (1, 3, 5))
    with pytest.raises(ValueError, match="Y_true has only"):
        FixedShortlistMetrics(["precision"], np.where(ids < 0, ids, Y.shape[1]), Y, (1, 3, 5))


@pytest.mark.filterwarnings("ignore:divide by zero")
def test_the_knn_discount_never_fits_below_the_fit_without_it():
    """The coordinate search sweeps the kNN discount from where the search without it ends, so on validation the
    fit with ``fusion.knn_discount_grid`` is at least the fit without, on every seeded problem (seeds 16 and 40
    ended lower, 0.280 and 0.368 against 0.371 and 0.388, when the discount was a fifth axis from the start); a
    discount chosen is one of the grid's and raised the objective."""
    chosen = 0
    for seed in (0, 1, 2, 16, 40):
        sl, Y, inv_prop, fp = _shortlist(seed, n=80, C=30)
        p = FusionParams(grid_step=0.1, knn_grid=(0.0, 0.25, 0.5, 1.0), lexical_grid=(0.0, 0.25, 0.5),
                         propensity_grid=(0.0, 0.02, 0.04))
        off = fit_alpha(sl, Y, p, inv_prop, fp)
        on = fit_alpha(sl, Y, replace(p, knn_discount_grid=(0.0, 0.25, 0.5, 1.0)), inv_prop, fp)
        assert on.objective_value >= off.objective_value
        assert on.knn_discount in (0.0, 0.25, 0.5, 1.0)
        if on.knn_discount:
            chosen += 1
            assert on.objective_value > off.objective_value
    assert chosen  # the random counts pay somewhere, so the search is exercised
