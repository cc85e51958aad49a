"""SiameseXML's alpha fusion: a blend of the classifier and embedding scores, plus kNN, lexical, propensity terms.

s = a * w_l.e + (1 - a) * z_l.e with a chosen by a grid search on a validation metric (``fusion.objective``).
Adding the embedding score keeps tail labels, whose classifiers saw few positives, in the ranking (PSP). When the
shortlist has kNN scores (``index.sources`` with ``knn``: SiameseXML's ANNS^x over the training points, the mean
similarity of the ``index.knn_neighbours`` nearest training points carrying the label), the blend adds c * kNN
(``fusion.knn_grid``; c = 0 is the two-score blend, so the grid can only match or beat it on validation); with
lexical scores (``xc_dagster.retrieval.lexical``) d * lexical (``fusion.lexical_grid``, d = 0 always tried); and
b * log(1 / p_l) (``fusion.propensity_grid``, docs/decisions.md#fusion-propensity-term); the kNN scores may be
divided by their labels' counts ** f (``fusion.knn_discount_grid``, docs/decisions.md#fusion-knn-discount); a, c, d,
f and b are searched jointly (docs/decisions.md#fusion-joint-grid): one weight at a time, then two, or on the whole grid
(``fusion.search``, docs/decisions.md#fusion-coordinate-search). ``fusion.smoothing`` > 1 averages the grid's
objective over neighbouring weights before its argmax, so that sampling noise on the validation points does not
pick a lone spike (off by default: docs/decisions.md#fusion-smoothing-off). The grid blends in place (:class:`Blend`),
ranked by the objective prepared once per fit (``ObjectiveOnShortlist``; docs/decisions.md#fusion-fast-objective).
"""

from __future__ import annotations

import itertools
import math
import threading
from dataclasses import dataclass, field

import numpy as np
import scipy.sparse as sp
from scipy.ndimage import uniform_filter1d

from xc_dagster.config import FusionParams
from xc_dagster.config.choices import FUSION_SEARCHES
from xc_dagster.device import on_threads
from xc_dagster.errors import XCConfigError
from xc_dagster.retrieval.fusion.objective import ObjectiveOnShortlist
from xc_dagster.retrieval.shortlist import Shortlist, discounted_knn, fuse


def propensity_boost(ids: np.ndarray, inv_prop: np.ndarray | None) -> np.ndarray:
    """log(1 / p_l) of each shortlisted label (0 on padding): the alpha fusion's propensity feature."""
    if inv_prop is None:
        raise XCConfigError("the fusion weighs inverse propensities (fusion.propensity_grid) but none were given")
    return np.where(ids < 0, 0.0, np.log(np.asarray(inv_prop, dtype=np.float64))[np.maximum(ids, 0)]).astype(
        np.float32)


@dataclass
class AlphaFusion:
    """A fitted alpha fusion: the chosen weights (a, c, d, b) and the validation grid they were chosen on."""

    alpha: float
    grid: list[tuple[float, float]] = field(default_factory=list)  # (alpha, objective) at the chosen c, d, b
    knn_weight: float = 0.0  # c: weight of the kNN score (0: the two-score blend)
    knn_grid: list[tuple[float, float]] = field(default_factory=list)  # (c, best objective over alpha) tried
    propensity_weight: float = 0.0  # b: weight of log(1 / p_l) (0: no propensity term)
    propensity_grid: list[tuple[float, float]] = field(default_factory=list)  # (b, best objective over alpha)
    objective_value: float | None = None  # validation objective at the chosen (a, c, d, b)
    objective_smoothed: float | None = None  # ... averaged over its grid neighbours (fusion.smoothing), as chosen
    lexical_weight: float = 0.0  # d: weight of the lexical score (0: no lexical term)
    lexical_grid: list[tuple[float, float]] = field(default_factory=list)  # (d, best objective over alpha) tried
    cooccurrence_weight: float = 0.0  # e: weight of the co-occurrence votes (0: no co-occurrence term)
    cooccurrence_grid: list[tuple[float, float]] = field(default_factory=list)  # (e, best over alpha) tried
    knn_discount: float = 0.0  # f: the kNN scores divided by their labels' counts ** f (0: as they are)
    knn_discount_grid: list[tuple[float, float]] = field(default_factory=list)  # (f, best over alpha) tried
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
                   d.get("objective_smoothed"), float(d.get("lexical_weight", 0.0)),
                   [tuple(x) for x in d.get("lexical_grid", [])], float(d.get("cooccurrence_weight", 0.0)),
                   [tuple(x) for x in d.get("cooccurrence_grid", [])], float(d.get("knn_discount", 0.0)),
                   [tuple(x) for x in d.get("knn_discount_grid", [])])

    def score(self, sl: Shortlist, inv_prop: np.ndarray | None = None) -> np.ndarray:
        """a * classifier + (1 - a) * embedding (+ c * kNN / n_l ** f) (+ d * lexical) (+ e * co-occurrence) (+ b *
        log(1 / p_l): ``inv_prop`` needed when b > 0)."""
        for weight, scores, name, source in ((self.knn_weight, sl.knn, "kNN", "knn"),
                                             (self.lexical_weight, sl.lex, "lexical", "lexical"),
                                             (self.cooccurrence_weight, sl.cooc, "co-occurrence", "cooccurrence")):
            if weight and scores is None:
                raise XCConfigError(f"the fusion weighs {name} scores ({weight}) but the shortlist has none: its "
                                    f"sources lack {source} (index.sources)")
        s = fuse(sl, self.alpha, self.knn_weight, self.lexical_weight, self.cooccurrence_weight, self.knn_discount)
        if self.propensity_weight:
            s = s + np.float32(self.propensity_weight) * propensity_boost(sl.ids, inv_prop)
        return s

    def to_dict(self) -> dict:
        return {"method": "alpha", "alpha": self.alpha, "grid": self.grid, "knn_weight": self.knn_weight,
                "knn_grid": self.knn_grid, "lexical_weight": self.lexical_weight, "lexical_grid": self.lexical_grid,
                "cooccurrence_weight": self.cooccurrence_weight, "cooccurrence_grid": self.cooccurrence_grid,
                "knn_discount": self.knn_discount, "knn_discount_grid": self.knn_discount_grid,
                "propensity_weight": self.propensity_weight, "propensity_grid": self.propensity_grid,
                "objective_value": self.objective_value, "objective_smoothed": self.objective_smoothed}

    def summary(self) -> dict:
        value = self.objective_value if self.objective_value is not None else max(
            (o for _, o in self.grid), default=None)  # fits saved before the smoothed grid recorded their value
        return {"method": "alpha", "alpha": self.alpha, "knn_weight": self.knn_weight,
                "lexical_weight": self.lexical_weight, "cooccurrence_weight": self.cooccurrence_weight,
                "knn_discount": self.knn_discount, "propensity_weight": self.propensity_weight,
                "objective_value": value,
                "objective_smoothed": self.objective_smoothed}


class Blend:
    """``fuse(sl, a, c, d, e, f)`` to the bit, cheaper across a grid: c * kNN (discounted by f), d * lexical and e *
    co-occurrence are kept while their weights repeat (alpha is the grid's inner axis) and the sums are made in
    place (float32 shortlists)."""

    def __init__(self, sl: Shortlist) -> None:
        self.sl = sl
        scores = [x for x in (sl.clf, sl.emb, sl.knn, sl.lex, sl.cooc) if x is not None]
        self.float32 = all(isinstance(x, np.ndarray) and x.dtype == np.float32 and x.shape == sl.ids.shape
                           for x in scores)
        self.pad = sl.ids < 0 if self.float32 and (sl.ids < 0).any() else None
        # "knn" / "lex" / "cooc" -> ((weight, kNN discount), weight * scores)
        self.terms: dict[str, tuple[tuple[float, float], np.ndarray]] = {}

    def term(self, name: str, weight: float, discount: float = 0.0) -> np.ndarray:
        """``weight * scores`` of the kNN (discounted), lexical or co-occurrence scores (float32, as ``fuse``)."""
        if name not in self.terms or self.terms[name][0] != (weight, discount):
            scores = discounted_knn(self.sl, discount) if name == "knn" else getattr(self.sl, name)
            with np.errstate(invalid="ignore"):
                self.terms[name] = ((weight, discount), weight * scores)
        return self.terms[name][1]

    def __call__(self, alpha: float, knn_weight: float = 0.0, lexical_weight: float = 0.0,
                 cooccurrence_weight: float = 0.0, knn_discount: float = 0.0) -> np.ndarray:
        """The fused scores (float32, -inf on padding): the same operations as ``fuse``, in the same order."""
        sl = self.sl
        weights = (alpha, knn_weight, lexical_weight, cooccurrence_weight, knn_discount)
        if not self.float32 or not all(type(w) is float for w in weights):
            return fuse(sl, *weights)
        with np.errstate(invalid="ignore"):
            s = alpha * sl.clf
            s += (1.0 - alpha) * sl.emb
            if knn_weight:
                s += self.term("knn", knn_weight, knn_discount)
            if lexical_weight:
                s += self.term("lex", lexical_weight)
            if cooccurrence_weight:
                s += self.term("cooc", cooccurrence_weight)
        if self.pad is not None:
            np.copyto(s, -np.inf, where=self.pad)
        return s


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


Weights = tuple[float, float, float, float, float]  # (c, d, e, f, b): the kNN, lexical, co-occurrence weights, the
# kNN discount and the propensity weight
WEIGHT_AXES = 5
PROPENSITY_AXIS = 4  # b multiplies log(1 / p_l), whose scale is fixed, not the fused scores': its grid also halves
COORDINATE_ROUNDS = 8  # sweeps of every weight at most (each round moves one weight or stops)


class Cells:
    """The validation objective at weights (c, d, e, f, b), for every alpha of the grid, each computed once: a
    (c, d, e, f, alpha)'s fused scores are shared by the b values asked with it, and the cells run on the process's
    threads (numpy's array operations release the GIL; the objective only reads shared state)."""

    def __init__(self, sl: Shortlist, objective: ObjectiveOnShortlist, boost: np.ndarray | None,
                 alphas: np.ndarray) -> None:
        self.sl, self.objective, self.boost, self.alphas = sl, objective, boost, alphas
        self.values: dict[Weights, np.ndarray] = {}  # (c, d, e, f, b) -> the objective at each alpha
        self.local = threading.local()  # a Blend per thread: it keeps the c, d and e terms of the cell it last scored

    def __call__(self, points: list[Weights]) -> list[np.ndarray]:
        """The objective over alpha at each of ``points``, the ones not seen before computed."""
        groups: dict[tuple[float, float, float, float], list[float]] = {}
        for w in dict.fromkeys(points):
            if w not in self.values:
                groups.setdefault(w[:4], []).append(w[4])
        todo = list(groups.items())
        out = {(*cdef, b): np.empty(len(self.alphas)) for cdef, bs in todo for b in bs}

        def cell(t: tuple[int, int]) -> None:
            if not hasattr(self.local, "blend"):
                self.local.blend = Blend(self.sl)
            (c, d, e, f), bs = todo[t[0]]
            s = self.local.blend(float(self.alphas[t[1]]), c, d, e, f)
            for b in bs:
                out[(c, d, e, f, b)][t[1]] = self.objective.value(s + np.float32(b) * self.boost if b else s)

        on_threads(cell, [(g, j) for g in range(len(todo)) for j in range(len(self.alphas))])  # alpha innermost
        self.values.update(out)
        return [self.values[w] for w in points]


def _axes(sl: Shortlist, params: FusionParams, inv_prop: np.ndarray | None
          ) -> tuple[list[list[float]], list[int], np.ndarray | None]:
    """The weight grids (c, d, e, f, b) this shortlist can use, their ``*_extend`` budgets (none for the discount
    f) and the propensity feature (None without the propensity term)."""
    cs = [0.0] if sl.knn is None else sorted(set(_check_weights("knn_grid", params.knn_grid)))
    ds = [0.0] if sl.lex is None else sorted(set(_check_weights("lexical_grid", params.lexical_grid)) | {0.0})
    es = [0.0] if sl.cooc is None else sorted(set(_check_weights("cooccurrence_grid", params.cooccurrence_grid))
                                              | {0.0})
    fs = [0.0] if sl.knn is None or sl.knn_count is None else sorted(
        set(_check_weights("knn_discount_grid", params.knn_discount_grid)) | {0.0})
    prop_grid = _check_weights("propensity_grid", params.propensity_grid)
    for name in ("knn_grid_extend", "lexical_grid_extend", "cooccurrence_grid_extend", "propensity_grid_extend"):
        if getattr(params, name) < 0:
            raise XCConfigError(f"fusion.{name}: expected an int >= 0, got {getattr(params, name)}")
    boost = propensity_boost(sl.ids, inv_prop) if max(prop_grid) > 0 and inv_prop is not None else None
    bs = [0.0] if boost is None else sorted(set(prop_grid) | {0.0})
    extends = [params.knn_grid_extend if sl.knn is not None else 0,
               params.lexical_grid_extend if sl.lex is not None else 0,
               params.cooccurrence_grid_extend if sl.cooc is not None else 0, 0,
               params.propensity_grid_extend if boost is not None else 0]
    return [cs, ds, es, fs, bs], extends, boost


def fit_alpha(sl: Shortlist, Y_valid: sp.csr_matrix, params: FusionParams, inv_prop: np.ndarray | None,
              filter_pairs: np.ndarray | None, top_k: int = 10) -> AlphaFusion:
    """Search ``alpha`` in [0, 1] with the kNN weight c (``fusion.knn_grid``, shortlists with kNN scores), the
    lexical weight d (``fusion.lexical_grid``, shortlists with lexical scores), the co-occurrence weight e
    (``fusion.cooccurrence_grid``, shortlists with co-occurrence votes), the kNN discount f
    (``fusion.knn_discount_grid``: the kNN scores divided by their labels' counts ** f) and the propensity weight b
    (``fusion.propensity_grid``) maximising ``params.objective`` on the validation shortlists.

    ``fusion.search`` "grid" tries every combination, the objective smoothed over neighbouring grid points
    (``fusion.smoothing`` points per axis; 1 = the raw argmax); "coordinate" moves one weight at a time over its
    grid (alpha's whole grid with each value), the others held, from every weight at its smallest, in rounds until
    no weight moves, then tries steps along two weights at once: the grid's choice on our five datasets with 4-12x
    fewer evaluations (docs/decisions.md#fusion-coordinate-search); smoothing then averages each sweep's
    (weight, alpha) plane.
    Ties prefer the smaller c, then d, e, f, b, then more classifier weight; b = 0, d = 0, e = 0 and f = 0 are
    always tried (and c = 0 where ``knn_grid`` has it, as by default), so each added term can only match or beat
    validation without it. When the chosen c (or d, e, b) is its grid's largest, the grid was too small: it keeps
    doubling, ``*_extend`` times at most, while the doubled weight is chosen (b = 0 chosen: b's smallest positive
    value halves, :func:`_extend`). The kNN, lexical and co-occurrence grids need their scores, the propensity grid
    ``inv_prop``: without them c, d, e, b stay 0."""
    _check_params(params)
    if params.search not in FUSION_SEARCHES:
        raise XCConfigError(f"fusion.search: expected one of {' | '.join(FUSION_SEARCHES)}, got {params.search!r}")
    alphas = np.round(np.arange(0.0, 1.0 + 1e-9, params.grid_step), 6)
    axes, extends, boost = _axes(sl, params, inv_prop)
    cells = Cells(sl, ObjectiveOnShortlist(sl.ids, Y_valid, params.objective, inv_prop, filter_pairs, top_k), boost,
                  alphas)
    if params.search == "grid":
        at, j, smoothed = _grid_search(cells, axes, extends, params.smoothing)
    else:
        # the discount's sweeps start where the search without it ends: the fit then never lands below the one
        # without the discount on validation (a fifth axis from the start took Bibtex along another path, to a
        # lower objective)
        discounts, axes[3] = axes[3], [0.0]
        at, j, smoothed = _coordinate_search(cells, axes, extends, params.smoothing)
        if len(discounts) > 1:
            axes[3] = discounts
            at, j, smoothed = _coordinate_search(cells, axes, extends, params.smoothing, at)
    return _fitted(cells, axes, at, j, smoothed, sl)


def _grid_search(cells: Cells, axes: list[list[float]], extends: list[int], smoothing: int
                 ) -> tuple[list[int], int, float]:
    """Every (c, d, e, f, b) of the grids with every alpha; returns the chosen weights' indexes in ``axes``, alpha's
    index and the chosen point's smoothed objective."""
    while True:
        points = list(itertools.product(*axes))
        raw = np.stack(cells(points)).reshape(*(len(a) for a in axes), len(cells.alphas))
        smooth = smooth_grid(raw, smoothing)
        best = max(np.ndindex(*raw.shape), key=lambda t: (smooth[t], *(-x for x in t[:WEIGHT_AXES]), t[-1]))
        nxt = (*best[:PROPENSITY_AXIS], 1, *best[PROPENSITY_AXIS + 1:WEIGHT_AXES])  # b one step up, any alpha
        lost = len(axes[PROPENSITY_AXIS]) > 1 and smooth[best] > smooth[nxt].max()  # as _sweeps judges it
        if not any(_extend(axes, extends, a, best[a], lost) for a in range(WEIGHT_AXES)):
            return list(best[:WEIGHT_AXES]), best[-1], float(smooth[best])


def _extend(axes: list[list[float]], extends: list[int], a: int, x: int, lost: bool = False) -> bool:
    """Extend weight ``a``'s grid where its chosen index ``x`` is on an edge, within its ``extends``: a largest
    positive value chosen doubles; b = 0 chosen over a smallest positive value that ``lost`` to it halves that value
    (inserted at index 1), as 0.01 * log(1 / p_l) can swamp fused scores that small weights shrank
    (docs/decisions.md#fusion-propensity-halving)."""
    if extends[a] <= 0:
        return False
    if x == len(axes[a]) - 1 and axes[a][-1] > 0:
        axes[a].append(2.0 * axes[a][-1])
    elif a == PROPENSITY_AXIS and x == 0 and lost and axes[a][0] == 0:
        axes[a].insert(1, 0.5 * axes[a][1])
    else:
        return False
    extends[a] -= 1
    return True


def _coordinate_search(cells: Cells, axes: list[list[float]], extends: list[int], smoothing: int,
                       start: list[int] | None = None) -> tuple[list[int], int, float]:
    """Sweeps of one weight at a time (:func:`_sweeps`) from ``start`` (default: every weight at its smallest),
    each sweep keeping the best of its values, the held one among them; where they stop, a step
    along two weights at once (:func:`_pair_step`) that beats the point restarts them, as the weights trade
    against each other along ridges a single weight cannot climb (Delicious' lexical and kNN weights:
    docs/decisions.md#fusion-coordinate-search). Returns as :func:`_grid_search`."""
    at, j, smoothed = _sweeps(cells, axes, extends, smoothing, [0] * WEIGHT_AXES if start is None else start)
    for _ in range(COORDINATE_ROUNDS - 1):
        step = _pair_step(cells, axes, at, j)
        if step is None:
            break
        at, j, smoothed = _sweeps(cells, axes, extends, smoothing, step)
    return at, j, smoothed


def _sweeps(cells: Cells, axes: list[list[float]], extends: list[int], smoothing: int, at: list[int]
            ) -> tuple[list[int], int, float]:
    """From the weights at indexes ``at``: one weight at a time over its grid, alpha's whole grid with each value,
    the other weights held, in rounds until one leaves every weight where it was (``COORDINATE_ROUNDS`` at most);
    a weight whose largest value wins has its grid extended (``*_extend``). Returns as :func:`_grid_search`."""
    at, j, smoothed = list(at), 0, -np.inf
    for _ in range(COORDINATE_ROUNDS):
        moved = False
        for a in range(WEIGHT_AXES):
            while True:
                points = [tuple(axes[i][x if i == a else at[i]] for i in range(WEIGHT_AXES))
                          for x in range(len(axes[a]))]
                raw = np.stack(cells(points))  # (values of weight a, alpha)
                smooth = smooth_grid(raw, smoothing)
                x, j = max(np.ndindex(*raw.shape), key=lambda t: (smooth[t], -t[0], t[1]))
                smoothed = float(smooth[x, j])
                if not _extend(axes, extends, a, x, len(axes[a]) > 1 and smooth[0].max() > smooth[1].max()):
                    break
            moved |= x != at[a]
            at[a] = x
        if not moved:
            break
    return at, j, smoothed


def _pair_step(cells: Cells, axes: list[list[float]], at: list[int], j: int) -> list[int] | None:
    """The best of the points one grid step away along two weights at once, the others held (alpha's whole grid
    with each), when it beats the point ``at`` (alpha index ``j``); else None."""
    here = cells([tuple(axes[i][x] for i, x in enumerate(at))])[0][j]
    moves = []
    for a, b in itertools.combinations(range(WEIGHT_AXES), 2):
        for da, db in itertools.product((-1, 1), repeat=2):
            t = list(at)
            t[a], t[b] = at[a] + da, at[b] + db
            if 0 <= t[a] < len(axes[a]) and 0 <= t[b] < len(axes[b]):
                moves.append(t)
    if not moves:
        return None
    best = [float(v.max()) for v in cells([tuple(axes[i][x] for i, x in enumerate(t)) for t in moves])]
    k = max(range(len(moves)), key=lambda m: (best[m], -m))
    return moves[k] if best[k] > here else None


def _fitted(cells: Cells, axes: list[list[float]], at: list[int], j: int, smoothed: float,
            sl: Shortlist) -> AlphaFusion:
    """The fusion at the chosen weights (indexes ``at`` in ``axes``) and alpha (index ``j``), with the grids'
    records: per weight, the best objective over alpha along its axis, the other weights as chosen."""
    chosen = [axes[i][x] for i, x in enumerate(at)]

    def record(a: int) -> list[tuple[float, float]]:
        points = [tuple(v if i == a else chosen[i] for i in range(WEIGHT_AXES)) for v in axes[a]]
        return [(float(v), float(r.max())) for v, r in zip(axes[a], cells(points))]

    c, d, e, f, b = chosen
    (values,) = cells([(c, d, e, f, b)])
    return AlphaFusion(
        float(cells.alphas[j]), [(float(x), float(v)) for x, v in zip(cells.alphas, values)], c,
        record(0) if sl.knn is not None else [], b, record(4) if len(axes[4]) > 1 else [],
        objective_value=float(values[j]), objective_smoothed=smoothed, lexical_weight=d,
        lexical_grid=record(1) if sl.lex is not None else [], cooccurrence_weight=e,
        cooccurrence_grid=record(2) if sl.cooc is not None else [], knn_discount=f,
        knn_discount_grid=record(3) if len(axes[3]) > 1 else [])
