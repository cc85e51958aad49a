"""bench/fusion_frontier.py: the oracle sweep of the alpha fusion, on a hand-computed shortlist."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
import scipy.sparse as sp

from bench import fusion_frontier as ff
from xc_dagster.config import FusionParams
from xc_dagster.retrieval.fusion import fit_alpha
from xc_dagster.retrieval.shortlist import Shortlist


def _case():
    # three test points, labels 0 (head, 1/p 1), 1 (1/p 2), 2 (tail, 1/p 4); truths 2, 0, 1
    ids = np.array([[0, 2], [0, 1], [1, 0]])
    clf = np.array([[0.9, 0.1], [0.9, 0.1], [0.2, 0.8]], dtype=np.float32)
    emb = np.array([[0.1, 0.9], [0.4, 0.6], [0.9, 0.1]], dtype=np.float32)
    Y = sp.csr_matrix((np.ones(3), ([0, 1, 2], [2, 0, 1])), shape=(3, 3))
    return Shortlist(ids, clf, emb), Y, np.array([1.0, 2.0, 4.0])


def test_sweep_scores_every_weighting_by_hand():
    sl, Y, inv = _case()
    res = ff.sweep(sl, Y, np.zeros((0, 2), dtype=np.int64), inv, np.array([0.0, 0.5, 1.0]), [0.0], [0.0, 1.0])
    got = {(a, b): (round(p, 2), round(s, 2)) for p, s, a, _, b in res}
    # PSP@1 = (1/p of the correct top-1 labels) / (the best top-1's: 4 + 1 + 2 = 7)
    assert got[(0.0, 0.0)] == (66.67, 85.71)  # embedding only: points 0 (4) and 2 (2) right
    assert got[(0.5, 0.0)] == (66.67, 42.86)  # point 0 ties 0.5 / 0.5 -> smaller id 0 (wrong); points 1, 2 right
    assert got[(1.0, 0.0)] == (33.33, 14.29)  # classifier only: point 1
    assert got[(1.0, 1.0)] == (100.0, 100.0)  # + log(1/p): 0.1 + log 4 > 0.9, 0.9 > 0.1 + log 2, 0.2 + log 2 > 0.8


def test_frontier_takes_the_best_psp_above_each_p1_floor():
    res = np.array([[70.0, 20.0, 0.1, 0, 0], [60.0, 30.0, 0.2, 0.5, 0.04], [50.0, 40.0, 0.3, 0, 0.08]])
    fr = ff.frontier(res, [80, 65, 55])
    assert fr["80"] is None
    assert fr["65"] == {"p1": 70.0, "psp1": 20.0, "alpha": 0.1, "knn_weight": 0.0, "propensity_weight": 0.0}
    assert fr["55"]["psp1"] == 30.0 and fr["55"]["knn_weight"] == 0.5


def test_bad_numbers_are_named():
    with pytest.raises(SystemExit, match="comma-separated numbers, got 'a,b'"):
        ff._floats("a,b")


def test_refit_by_smoothing_fits_on_validation_and_scores_on_test():
    """The hand case as both validation and test: the raw argmax (smoothing 1) finds a weighting that ranks every
    point right (a 1, b 1 as in the sweep above); each row is fit_alpha's own choice, scored by p1_psp1."""
    sl, Y, inv = _case()
    none = np.zeros((0, 2), dtype=np.int64)
    valid = SimpleNamespace(shortlist=sl, Y=Y, inv_prop=inv, filter_pairs=none)
    params = FusionParams(grid_step=0.5, propensity_grid=(0.0, 1.0), propensity_grid_extend=0,
                          objective="precision_at_1+psprecision_at_1")
    rows = ff.refit_by_smoothing(valid, params, [1, 3], sl, Y, none, inv)
    assert [r["smoothing"] for r in rows] == [1, 3]
    assert rows[0]["validation"] == 200.0 and (rows[0]["p1"], rows[0]["psp1"]) == (100.0, 100.0)
    for r in rows:
        fit = fit_alpha(sl, Y, replace(params, smoothing=r["smoothing"]), inv, none)
        assert (r["alpha"], r["propensity_weight"]) == (fit.alpha, fit.propensity_weight)
        want = ff.p1_psp1(sl.ids, fit.score(sl, inv), Y, none, inv)
        assert (r["p1"], r["psp1"]) == (round(want[0], 2), round(want[1], 2))


def test_sweep_keeps_the_deployed_fusions_lexical_weight():
    """With the lexical scores in the shortlist, the sweep ranks by a * clf + (1 - a) * emb + d * lexical at the
    deployed d: the lexical score below makes point 1's label 1 (wrong) beat label 0 at a = 1 only with d = 1."""
    sl, Y, inv = _case()
    lex = np.array([[0.0, 0.0], [0.0, 0.9], [0.0, 0.0]], dtype=np.float32)
    sl = replace(sl, lex=lex)
    none = np.zeros((0, 2), dtype=np.int64)
    args = (sl, Y, none, inv, np.array([1.0]), [0.0], [0.0])
    assert [round(x, 2) for x in ff.sweep(*args)[0, :2]] == [33.33, 14.29]  # d 0: the classifier alone, point 1
    assert [round(x, 2) for x in ff.sweep(*args, {"lexical_weight": 1.0})[0, :2]] == [0.0, 0.0]  # 0.1 + 0.9 > 0.9
