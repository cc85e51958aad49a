"""SiameseXML's alpha fusion: a blend of the classifier and embedding scores, plus kNN and propensity terms.

s = a * w_l.e + (1 - a) * z_l.e with a chosen by a grid search on a validation metric (``fusion.objective``).
Adding the embedding score keeps tail labels, whose classifiers saw few positives, in the ranking (PSP). When the
shortlist has kNN scores (``index.sources`` with ``knn``: SiameseXML's ANNS^x over the training points, the mean
similarity of the ``index.knn_neighbours`` nearest training points carrying the label), the blend adds c * kNN
(``fusion.knn_grid``; c = 0 is the two-score blend, so the grid can only match or beat it on validation), and
b * log(1 / p_l) (``fusion.propensity_grid``, docs/decisions.md#fusion-propensity-term); a, c and b are
searched on one joint grid (docs/decisions.md#fusion-joint-grid). ``fusion.smoothing`` > 1 averages the grid's
objective over neighbouring weights before its argmax, so that sampling noise on the validation points does not
pick a lone spike (off by default: docs/decisions.md#fusion-smoothing-off).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import scipy.sparse as sp
from scipy.ndimage import uniform_filter1d

from xc_dagster.config import FusionParams
from xc_dagster.errors import XCConfigError
from xc_dagster.retrieval.fusion.objective import validation_objective
from xc_dagster.retrieval.shortlist import Shortlist, fuse


def propensity_boost(ids: np.ndarray, inv_prop: np.ndarray | None) -> np.ndarray:
    """log(1 / p_l) of each shortlisted label (0 on padding): the alpha fusion's propensity feature."""
    if inv_prop is None:
        raise XCConfigError("the fusion weighs inverse propensities (fusion.propensity_grid) but none were given")
    return np.where(ids < 0, 0.0, np.log(np.asarray(inv_prop, dtype=np.float64))[np.maximum(ids, 0)]).astype(
        np.float32)


@dataclass
class AlphaFusion:
    """A fitted alpha fusion: the chosen weights (a, c, b) and the validation grid they were chosen on."""

    alpha: float
    grid: list[tuple[float, float]] = field(default_factory=list)  # (alpha, objective) tried at the chosen c, b
    knn_weight: float = 0.0  # c: weight of the kNN score (0: the two-score blend)
    knn_grid: list[tuple[float, float]] = field(default_factory=list)  # (c, best objective over alpha) tried
    propensity_weight: float = 0.0  # b: weight of log(1 / p_l) (0: no propensity term)
    propensity_grid: list[tuple[float, float]] = field(default_factory=list)  # (b, best objective over alpha)
    objective_value: float | None = None  # validation objective at the chosen (a, c, b)
    objective_smoothed: float | None = None  # ... averaged over its grid neighbours (fusion.smoothing), as chosen
    method: str = field(default="alpha", init=False)

    @classmethod
    def fit(cls, sl: Shortlist, Y_valid: sp.csr_matrix, params: FusionParams, inv_prop: np.ndarray | None,
            filter_pairs: np.ndarray | None, extra: tuple[np.ndarray, np.ndarray] | None = None,
            top_k: int = 10) -> AlphaFusion:
        """:func:`fit_alpha` (``extra``, the missed positives, is the tree's and unused here)."""
        return fit_alpha(sl, Y_valid, params, inv_prop, filter_pairs, top_k)

    @classmethod
    def from_dict(cls, d: dict) -> AlphaFusion:
        """The fusion ``to_dict`` wrote (keys added later default to the two-score blend)."""
        return cls(float(d["alpha"]), [tuple(x) for x in d.get("grid", [])], float(d.get("knn_weight", 0.0)),
                   [tuple(x) for x in d.get("knn_grid", [])], float(d.get("propensity_weight", 0.0)),
                   [tuple(x) for x in d.get("propensity_grid", [])], d.get("objective_value"),
                   d.get("objective_smoothed"))

    def score(self, sl: Shortlist, inv_prop: np.ndarray | None = None) -> np.ndarray:
        """a * classifier + (1 - a) * embedding (+ c * kNN) (+ b * log(1 / p_l): ``inv_prop`` needed when b > 0)."""
        if self.knn_weight and sl.knn is None:
            raise XCConfigError(f"the fusion weighs kNN scores (c = {self.knn_weight}) but the shortlist has none: "
                                "its sources lack knn (index.sources)")
        s = fuse(sl, self.alpha, self.knn_weight)
        if self.propensity_weight:
            s = s + np.float32(self.propensity_weight) * propensity_boost(sl.ids, inv_prop)
        return s

    def to_dict(self) -> dict:
        return {"method": "alpha", "alpha": self.alpha, "grid": self.grid, "knn_weight": self.knn_weight,
                "knn_grid": self.knn_grid, "propensity_weight": self.propensity_weight,
                "propensity_grid": self.propensity_grid, "objective_value": self.objective_value,
                "objective_smoothed": self.objective_smoothed}

    def summary(self) -> dict:
        value = self.objective_value if self.objective_value is not None else max(
            (o for _, o in self.grid), default=None)  # fits saved before the smoothed grid recorded their value
        return {"method": "alpha", "alpha": self.alpha, "knn_weight": self.knn_weight,
                "propensity_weight": self.propensity_weight, "objective_value": value,
                "objective_smoothed": self.objective_smoothed}


def _check_weights(name: str, weights: tuple[float, ...]) -> tuple[float, ...]:
    w = tuple(float(x) for x in weights)
    if not w or any(not (math.isfinite(x) and x >= 0) for x in w):
        raise XCConfigError(f"fusion.{name}: expected weights >= 0, got {list(weights)}")
    return w


def _check_params(params: FusionParams) -> None:
    """The alpha fit's own fields of ``fusion`` (the weight grids are checked as they are read)."""
    if not 0 < params.grid_step <= 1:
        raise XCConfigError(f"fusion.grid_step: expected a value in (0, 1], got {params.grid_step}")
    if not (isinstance(params.smoothing, int) and params.smoothing >= 1 and params.smoothing % 2 == 1):
        raise XCConfigError(f"fusion.smoothing: expected an odd int >= 1 (grid points averaged per axis; 1 = none), "
                            f"got {params.smoothing!r}")


def smooth_grid(values: np.ndarray, width: int) -> np.ndarray:
    """Mean of each grid point's ``width`` neighbours along every axis of length > 1 (a box filter in index
    space; the edges repeat their value), so that the argmax picks the middle of a high plateau of a noisy
    validation objective rather than a lone spike (docs/decisions.md#fusion-smoothing-off)."""
    out = np.asarray(values, dtype=np.float64)
    if width <= 1:
        return out
    for axis in range(out.ndim):
        if out.shape[axis] > 1:
            out = uniform_filter1d(out, width, axis=axis, mode="nearest")
    return out


def fit_alpha(sl: Shortlist, Y_valid: sp.csr_matrix, params: FusionParams, inv_prop: np.ndarray | None,
              filter_pairs: np.ndarray | None, top_k: int = 10) -> AlphaFusion:
    """Grid-search ``alpha`` in [0, 1] jointly with the kNN weight c (``fusion.knn_grid``, shortlists with kNN
    scores) and the propensity weight b (``fusion.propensity_grid``) maximising ``params.objective`` on the
    validation shortlists, after smoothing the objective over neighbouring grid points (``fusion.smoothing``
    points per axis; 1 = the raw argmax). Ties prefer the smaller c, then the smaller b, then more classifier
    weight; b = 0 is always tried (and c = 0 where ``knn_grid`` has it, as by default), so each added term can
    only match or beat validation without it.
    When the chosen c (or b) is its grid's largest, the grid was too small: it keeps doubling, ``*_extend``
    times at most, while the doubled weight is chosen. As the kNN grid needs kNN scores, the propensity grid
    needs ``inv_prop``: without them c, b stay 0."""
    _check_params(params)
    alphas = np.round(np.arange(0.0, 1.0 + 1e-9, params.grid_step), 6)
    cs = [0.0] if sl.knn is None else sorted(set(_check_weights("knn_grid", params.knn_grid)))
    prop_grid = _check_weights("propensity_grid", params.propensity_grid)
    for name in ("knn_grid_extend", "propensity_grid_extend"):
        if getattr(params, name) < 0:
            raise XCConfigError(f"fusion.{name}: expected an int >= 0, got {getattr(params, name)}")
    boost = propensity_boost(sl.ids, inv_prop) if max(prop_grid) > 0 and inv_prop is not None else None
    bs = [0.0] if boost is None else sorted(set(prop_grid) | {0.0})

    def block(c: float, b_values: list[float]) -> np.ndarray:
        """The objective at every (alpha, b) for kNN weight ``c``: (len(alphas), len(b_values)); each alpha's
        fused scores are computed once and shared by the b values."""
        out = np.empty((len(alphas), len(b_values)))
        for j, a in enumerate(alphas):
            s = fuse(sl, float(a), c)
            for k, b in enumerate(b_values):
                out[j, k] = validation_objective(sl.ids, s + np.float32(b) * boost if b else s, Y_valid,
                                                 params.objective, inv_prop, filter_pairs, top_k)
        return out

    raw = np.stack([block(c, bs) for c in cs])  # (c, alpha, b)
    extends = {"c": params.knn_grid_extend if sl.knn is not None else 0,
               "b": params.propensity_grid_extend if boost is not None else 0}
    while True:
        smooth = smooth_grid(raw, params.smoothing)
        i, j, k = max(np.ndindex(*raw.shape), key=lambda t: (smooth[t], -t[0], -t[2], t[1]))
        if i == len(cs) - 1 and cs[-1] > 0 and extends["c"] > 0:
            extends["c"] -= 1
            cs.append(2.0 * cs[-1])
            raw = np.concatenate([raw, block(cs[-1], bs)[None]], axis=0)
        elif k == len(bs) - 1 and bs[-1] > 0 and extends["b"] > 0:
            extends["b"] -= 1
            bs.append(2.0 * bs[-1])
            raw = np.concatenate([raw, np.stack([block(c, bs[-1:]) for c in cs])], axis=2)
        else:
            break
    return AlphaFusion(float(alphas[j]), [(float(a), float(v)) for a, v in zip(alphas, raw[i, :, k])], cs[i],
                       [(c, float(raw[ci, :, k].max())) for ci, c in enumerate(cs)] if sl.knn is not None else [],
                       bs[k], [(b, float(raw[i, :, bk].max())) for bk, b in enumerate(bs)] if boost is not None else [],
                       objective_value=float(raw[i, j, k]), objective_smoothed=float(smooth[i, j, k]))
