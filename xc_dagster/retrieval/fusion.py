"""Score fusion: combine classifier and embedding scores of each shortlisted label.

Two methods, chosen by ``fusion.method`` and both fitted on the shortlists of the validation points carved
from train:

``alpha`` (SiameseXML's blend, the baseline): s = a * w_l.e + (1 - a) * z_l.e with a chosen by a grid search
on a metric (default P@1). Adding the embedding score keeps tail labels, whose classifiers saw few
positives, in the ranking (PSP). When the shortlist has kNN scores (``index.sources`` with ``knn``:
SiameseXML's ANNS^x over the training points, the mean similarity of the ``index.knn_neighbours`` nearest
training points carrying the label), s = a * w_l.e + (1 - a) * z_l.e + c * kNN with (a, c) on a joint grid
(``fusion.knn_grid``; c = 0 is the two-score blend, so the grid can only match or beat it on validation), plus
b * log(1 / p_l) (``fusion.propensity_grid``), all three on one joint grid. ``fusion.smoothing`` > 1 averages
the grid's objective over neighbouring weights before its argmax, so that sampling noise on the validation points
does not pick a lone spike (off by default: measured no better on average).

``tree`` (NGAME, Appendix C): every candidate (point i, label l) gets the descriptor
d_il = (z_l.e_i, w_l.e_i, f_l) and a target t_il = 1 if l is relevant to i. A depth-7 tree T is fitted to
predict t from d, and the fused score is ``T(d) + z_l.e + w_l.e``, T(d) being the tree's probability of
relevance. The paper's third feature is the label's training frequency; we use its inverse propensity,
as NGAME's public code does: a strictly decreasing function of the frequency, so a tree splits the
training candidates identically. The paper calls T a "regression tree"; on 0/1 targets the squared-error
criterion is half the Gini impurity, so a classification tree with Gini finds the same splits and its leaf
probability is the regression leaf's mean. The paper fits on shortlist plus missed positives
(``fusion.tree_add_positives``); the code fits on the shortlist only.

Artifacts load without executing code: the fitted tree is stored as plain arrays in JSON and evaluated by a
vectorised numpy walk (one step per tree level, all candidates at once); sklearn is only needed to fit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import scipy.sparse as sp
from scipy.ndimage import uniform_filter1d

from xc_dagster.config import FusionParams
from xc_dagster.errors import XCConfigError
from xc_dagster.evaluation.metrics import evaluate
from xc_dagster.retrieval.shortlist import Shortlist, fuse, topk_from_scores

METHODS = ("alpha", "tree")
TREE_FEATURES = ("embedding_score", "classifier_score", "inv_propensity")
_OBJECTIVE_KS = (1, 3, 5)
_SCORE_BLOCK = 4096  # shortlist rows scored at once by the tree (bounds the feature array's memory)


class Fusion(Protocol):
    """What evaluation needs from a fitted fusion."""

    method: str

    def score(self, sl: Shortlist, inv_prop: np.ndarray | None = None) -> np.ndarray: ...

    def to_dict(self) -> dict: ...

    def summary(self) -> dict: ...


def check_method(method: str) -> str:
    """Return ``method`` if it is a known fusion method, else raise naming ``fusion.method``."""
    if method not in METHODS:
        raise XCConfigError(f"fusion.method: expected one of {', '.join(map(repr, METHODS))}, got {method!r}")
    return method


def _objective(ids: np.ndarray, scores: np.ndarray, Y: sp.csr_matrix, objective: str,
               inv_prop: np.ndarray | None, filter_pairs: np.ndarray | None, top_k: int) -> float:
    """``objective`` (a metric name of ``evaluate``, or several joined by ``+``, summed: e.g.
    ``precision_at_1+psprecision_at_1`` weighs head and tail equally) of the ranking by ``scores`` of the
    shortlist ``ids``."""
    top, _ = topk_from_scores(ids, scores, top_k)
    m = evaluate(top, Y, ks=_OBJECTIVE_KS, inv_prop=inv_prop, filter_pairs=filter_pairs)
    names = objective.split("+")
    for name in names:
        if name not in m:
            raise XCConfigError(f"fusion.objective: {name!r} is not a metric; one of {sorted(m)} (or several "
                                "joined by '+')")
    return float(sum(m[name] for name in names))


# ------------------------------------------------------------------------------------------------ alpha

def propensity_boost(ids: np.ndarray, inv_prop: np.ndarray | None) -> np.ndarray:
    """log(1 / p_l) of each shortlisted label (0 on padding): the alpha fusion's propensity feature."""
    if inv_prop is None:
        raise XCConfigError("the fusion weighs inverse propensities (fusion.propensity_grid) but none were given")
    return np.where(ids < 0, 0.0, np.log(np.asarray(inv_prop, dtype=np.float64))[np.maximum(ids, 0)]).astype(
        np.float32)


@dataclass
class AlphaFusion:
    alpha: float
    grid: list[tuple[float, float]] = field(default_factory=list)  # (alpha, objective) tried at the chosen c, b
    knn_weight: float = 0.0  # c: weight of the kNN score (0: the two-score blend)
    knn_grid: list[tuple[float, float]] = field(default_factory=list)  # (c, best objective over alpha) tried
    propensity_weight: float = 0.0  # b: weight of log(1 / p_l) (0: no propensity term)
    propensity_grid: list[tuple[float, float]] = field(default_factory=list)  # (b, best objective over alpha)
    objective_value: float | None = None  # validation objective at the chosen (a, c, b)
    objective_smoothed: float | None = None  # ... averaged over its grid neighbours (fusion.smoothing), as chosen
    method: str = field(default="alpha", init=False)

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


def smooth_grid(values: np.ndarray, width: int) -> np.ndarray:
    """Mean of each grid point's ``width`` neighbours along every axis of length > 1 (a box filter in index
    space; the edges repeat their value). The validation objective measured on a few thousand points jumps by
    several tenths between neighbouring weights while its expectation is smooth in them, so the argmax of the
    smoothed grid picks the middle of a high plateau rather than a lone spike."""
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
    if not 0 < params.grid_step <= 1:
        raise XCConfigError(f"fusion.grid_step: expected a value in (0, 1], got {params.grid_step}")
    if not (isinstance(params.smoothing, int) and params.smoothing >= 1 and params.smoothing % 2 == 1):
        raise XCConfigError(f"fusion.smoothing: expected an odd int >= 1 (grid points averaged per axis; 1 = none), "
                            f"got {params.smoothing!r}")
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
                out[j, k] = _objective(sl.ids, s + np.float32(b) * boost if b else s, Y_valid, params.objective,
                                       inv_prop, filter_pairs, top_k)
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


# ------------------------------------------------------------------------------------------------- tree

def tree_features(ids: np.ndarray, clf: np.ndarray, emb: np.ndarray, inv_prop: np.ndarray
                  ) -> tuple[np.ndarray, np.ndarray]:
    """The descriptors of the valid (non-padding) candidates: (mask of valid cells, (n_valid, 3) float32).

    Columns follow ``TREE_FEATURES``; float32 because the tree compares float32 features (as sklearn does).
    """
    valid = ids >= 0
    lab = ids[valid]
    X = np.empty((len(lab), 3), dtype=np.float32)
    X[:, 0] = emb[valid]
    X[:, 1] = clf[valid]
    X[:, 2] = inv_prop[lab]
    return valid, X


def _keys(rows: np.ndarray, labels: np.ndarray, L: int) -> np.ndarray:
    return rows.astype(np.int64) * np.int64(L) + labels.astype(np.int64)


def _true_keys(Y: sp.csr_matrix) -> np.ndarray:
    Y = sp.csr_matrix(Y)
    Y.eliminate_zeros()
    rows = np.repeat(np.arange(Y.shape[0], dtype=np.int64), np.diff(Y.indptr))
    return _keys(rows, Y.indices, Y.shape[1])


def missed_positive_features(sl: Shortlist, Y_valid: sp.csr_matrix, queries: np.ndarray, W: np.ndarray,
                             label_emb: np.ndarray, inv_prop: np.ndarray, block: int = 65536
                             ) -> tuple[np.ndarray, np.ndarray]:
    """(rows, (m, 3) descriptors) of the relevant labels the shortlist missed (NGAME fits on N_i u P_i).

    Their scores are computed exactly from the query embeddings, W and the label embeddings.
    """
    Y = sp.csr_matrix(Y_valid)
    L = Y.shape[1]
    keys = _true_keys(Y)
    ok = sl.ids >= 0
    listed = _keys(np.nonzero(ok)[0], sl.ids[ok], L)
    miss = keys[~np.isin(keys, listed)]
    rows, labels = miss // L, miss % L
    X = np.empty((len(miss), 3), dtype=np.float32)
    for s in range(0, len(miss), block):
        r, lab = rows[s:s + block], labels[s:s + block]
        q = np.asarray(queries[r], dtype=np.float32)
        X[s:s + block, 0] = np.einsum("ij,ij->i", q, np.asarray(label_emb[lab], dtype=np.float32))
        X[s:s + block, 1] = np.einsum("ij,ij->i", q, np.asarray(W[lab], dtype=np.float32))
    X[:, 2] = inv_prop[labels]
    return rows, X


@dataclass
class TreeFusion:
    """A fitted binary tree as arrays (sklearn's layout) plus how it was fitted; scores without sklearn.

    ``children_left[n] == -1`` marks a leaf; ``leaf_prob[n]`` is the fraction of relevant training candidates
    in node ``n``; an internal node sends x left when ``x[feature[n]] <= threshold[n]`` (x as float32).
    """

    children_left: np.ndarray
    children_right: np.ndarray
    feature: np.ndarray
    threshold: np.ndarray
    leaf_prob: np.ndarray
    max_depth: int
    num_labels: int | None = None  # length of the inverse-propensity vector it was fitted with
    info: dict[str, Any] = field(default_factory=dict)  # fit provenance and validation numbers
    method: str = field(default="tree", init=False)

    def __post_init__(self) -> None:
        self.children_left = np.asarray(self.children_left, dtype=np.int64)
        self.children_right = np.asarray(self.children_right, dtype=np.int64)
        self.feature = np.asarray(self.feature, dtype=np.int64)
        self.threshold = np.asarray(self.threshold, dtype=np.float64)
        self.leaf_prob = np.asarray(self.leaf_prob, dtype=np.float64)
        n = len(self.children_left)
        if n == 0 or any(len(a) != n for a in (self.children_right, self.feature, self.threshold,
                                               self.leaf_prob)):
            raise XCConfigError("fusion file: tree arrays are empty or of different lengths")
        internal = self.children_left >= 0
        kids = np.concatenate([self.children_left[internal], self.children_right[internal]])
        if (kids >= n).any() or (kids <= 0).any() or (self.children_right[internal] < 0).any():
            raise XCConfigError("fusion file: tree child indices out of range")
        if (self.feature[internal] < 0).any() or (self.feature[internal] >= len(TREE_FEATURES)).any():
            raise XCConfigError(f"fusion file: tree features must be in [0, {len(TREE_FEATURES)})")
        if self.max_depth < 0:
            raise XCConfigError(f"fusion file: tree max_depth must be >= 0, got {self.max_depth}")

    @property
    def alpha(self) -> None:
        """No blend weight (kept so code that reports ``fusion.alpha`` still works)."""
        return None

    def predict_proba(self, X: np.ndarray) -> np.ndarray:
        """Probability of relevance of each row of ``X`` (n, 3): walk all rows down one level per step."""
        X = np.asarray(X, dtype=np.float32)
        node = np.zeros(len(X), dtype=np.int64)
        rows = np.arange(len(X))
        for _ in range(self.max_depth):
            left = self.children_left[node]
            inner = left >= 0
            if not inner.any():
                break
            go_left = X[rows, np.maximum(self.feature[node], 0)] <= self.threshold[node]
            node = np.where(inner, np.where(go_left, left, self.children_right[node]), node)
        return self.leaf_prob[node]

    def score(self, sl: Shortlist, inv_prop: np.ndarray | None = None) -> np.ndarray:
        """NGAME's fused score T(d) + z_l.e + w_l.e per shortlist cell; -inf on padding."""
        if inv_prop is None:
            raise XCConfigError("tree fusion: score() needs the labels' inverse propensities (inv_prop)")
        inv_prop = np.asarray(inv_prop, dtype=np.float64)
        if self.num_labels is not None and len(inv_prop) != self.num_labels:
            raise XCConfigError(f"tree fusion: fitted with {self.num_labels} labels' inverse propensities, "
                                f"got {len(inv_prop)}")
        out = np.full(sl.ids.shape, -np.inf, dtype=np.float32)
        for s in range(0, len(sl.ids), _SCORE_BLOCK):
            e = slice(s, s + _SCORE_BLOCK)
            valid, X = tree_features(sl.ids[e], sl.clf[e], sl.emb[e], inv_prop)
            t = self.predict_proba(X)
            block = out[e]
            block[valid] = (t + X[:, 0].astype(np.float64) + X[:, 1].astype(np.float64)).astype(np.float32)
        return out

    def to_dict(self) -> dict:
        return {"method": "tree", "format": 1, "features": list(TREE_FEATURES), "max_depth": int(self.max_depth),
                "num_labels": self.num_labels, "children_left": self.children_left.tolist(),
                "children_right": self.children_right.tolist(), "feature": self.feature.tolist(),
                "threshold": self.threshold.tolist(), "leaf_prob": self.leaf_prob.tolist(), "info": self.info}

    @classmethod
    def from_dict(cls, d: dict) -> TreeFusion:
        try:
            if list(d.get("features", TREE_FEATURES)) != list(TREE_FEATURES):
                raise XCConfigError(f"fusion file: tree features {d['features']!r}, expected {list(TREE_FEATURES)}")
            nl = d.get("num_labels")
            return cls(d["children_left"], d["children_right"], d["feature"], d["threshold"], d["leaf_prob"],
                       int(d["max_depth"]), None if nl is None else int(nl), dict(d.get("info", {})))
        except KeyError as e:
            raise XCConfigError(f"fusion file: tree fusion lacks {e.args[0]!r}") from None

    def summary(self) -> dict:
        keys = ("objective_value", "objective_in_sample", "n_candidates", "n_train", "n_positive",
                "n_missed_positives", "n_leaves", "depth")
        return {"method": "tree", **{k: self.info[k] for k in keys if k in self.info}}


def _tree_from_sklearn(est: Any, num_labels: int | None, info: dict) -> TreeFusion:
    """Export a fitted ``DecisionTreeClassifier`` to arrays; the leaf value becomes P(relevant)."""
    t = est.tree_
    value = np.asarray(t.value)[:, 0, :]  # (nodes, classes): counts or fractions by sklearn version
    tot = value.sum(1)
    classes = list(est.classes_)
    pos = value[:, classes.index(1)] if 1 in classes else np.zeros(len(value))
    prob = np.divide(pos, tot, out=np.zeros_like(pos, dtype=np.float64), where=tot > 0)
    return TreeFusion(t.children_left.copy(), t.children_right.copy(), t.feature.copy(), t.threshold.copy(),
                      prob, int(t.max_depth), num_labels, info)


def _constant_tree(prob: float, num_labels: int | None, info: dict) -> TreeFusion:
    return TreeFusion([-1], [-1], [-2], [-2.0], [prob], 0, num_labels, info)


def _fit_arrays(X: np.ndarray, y: np.ndarray, params: FusionParams, rng: np.random.Generator,
                num_labels: int | None, info: dict) -> TreeFusion:
    """Fit the tree on at most ``params.tree_max_samples`` rows drawn without replacement."""
    if params.tree_max_samples > 0 and len(y) > params.tree_max_samples:
        pick = np.sort(rng.choice(len(y), params.tree_max_samples, replace=False))
        X, y = X[pick], y[pick]
    info = {**info, "n_train": int(len(y)), "n_train_positive": int(y.sum())}
    if len(y) == 0 or y.min() == y.max():  # nothing to split: a constant T
        return _constant_tree(float(y[0]) if len(y) else 0.0, num_labels, {**info, "n_leaves": 1, "depth": 0})
    from sklearn.tree import DecisionTreeClassifier  # fitting only; scoring needs no sklearn

    est = DecisionTreeClassifier(max_depth=params.tree_depth, min_samples_leaf=params.tree_min_samples_leaf,
                                 random_state=params.seed)
    est.fit(X, y)
    return _tree_from_sklearn(est, num_labels, {**info, "n_leaves": int(est.get_n_leaves()),
                                                "depth": int(est.get_depth())})


def fit_tree(sl: Shortlist, Y_valid: sp.csr_matrix, params: FusionParams, inv_prop: np.ndarray,
             filter_pairs: np.ndarray | None = None, extra: tuple[np.ndarray, np.ndarray] | None = None,
             top_k: int = 10) -> TreeFusion:
    """Fit NGAME's tree fusion on the validation shortlists (plus ``extra`` = missed positives' rows, X).

    Candidates in ``filter_pairs`` are left out (never predicted). ``info["objective_value"]`` is
    ``params.objective`` with 2-fold cross-fitting over validation points (each half scored by a tree fitted
    on the other half), comparable to the alpha grid's value; ``objective_in_sample`` scores the final tree,
    fitted on all points, on the same points.
    """
    if params.tree_depth < 1:
        raise XCConfigError(f"fusion.tree_depth: expected >= 1, got {params.tree_depth}")
    if params.tree_min_samples_leaf < 1:
        raise XCConfigError(f"fusion.tree_min_samples_leaf: expected >= 1, got {params.tree_min_samples_leaf}")
    if inv_prop is None:
        raise XCConfigError("tree fusion: fitting needs the labels' inverse propensities (inv_prop)")
    inv_prop = np.asarray(inv_prop, dtype=np.float64)
    Y = sp.csr_matrix(Y_valid)
    n, L = Y.shape
    if len(sl.ids) != n:
        raise ValueError(f"shortlist has {len(sl.ids)} rows, Y_valid {n}")
    valid, X = tree_features(sl.ids, sl.clf, sl.emb, inv_prop)
    rows = np.nonzero(valid)[0]
    keys = _keys(rows, sl.ids[valid], L)
    y = np.isin(keys, _true_keys(Y)).astype(np.int8)
    if filter_pairs is not None and len(filter_pairs):
        fp = np.asarray(filter_pairs, dtype=np.int64)
        keep = ~np.isin(keys, _keys(fp[:, 0], fp[:, 1], L))
        rows, X, y = rows[keep], X[keep], y[keep]
    n_missed = 0
    if extra is not None:
        er, eX = extra
        n_missed = len(er)
        rows = np.concatenate([rows, np.asarray(er, dtype=np.int64)])
        X = np.concatenate([X, np.asarray(eX, dtype=np.float32)])
        y = np.concatenate([y, np.ones(len(er), dtype=np.int8)])
    info: dict[str, Any] = {"objective": params.objective, "n_candidates": int(len(y)), "n_positive": int(y.sum()),
                            "n_missed_positives": int(n_missed), "n_points": int(n),
                            "params": {"tree_depth": params.tree_depth, "seed": params.seed,
                                       "tree_min_samples_leaf": params.tree_min_samples_leaf,
                                       "tree_max_samples": params.tree_max_samples,
                                       "tree_add_positives": extra is not None}}
    rng = np.random.default_rng(params.seed)
    # 2-fold cross-fitted objective: honest comparison with the one-parameter alpha blend
    fold = rng.permutation(n) % 2
    cross = np.full(sl.ids.shape, -np.inf, dtype=np.float32)
    for k in (0, 1):
        part = _fit_arrays(X[fold[rows] != k], y[fold[rows] != k], params, rng, len(inv_prop), {})
        held = np.nonzero(fold == k)[0]
        sub = Shortlist(sl.ids[held], sl.clf[held], sl.emb[held])
        cross[held] = part.score(sub, inv_prop)
    info["objective_value"] = _objective(sl.ids, cross, Y, params.objective, inv_prop, filter_pairs, top_k)
    tree = _fit_arrays(X, y, params, rng, len(inv_prop), info)
    tree.info["objective_in_sample"] = _objective(sl.ids, tree.score(sl, inv_prop), Y, params.objective,
                                                  inv_prop, filter_pairs, top_k)
    return tree


# ------------------------------------------------------------------------------------------------ both

def fit_fusion(sl: Shortlist, Y_valid: sp.csr_matrix, params: FusionParams, inv_prop: np.ndarray | None,
               filter_pairs: np.ndarray | None, extra: tuple[np.ndarray, np.ndarray] | None = None,
               top_k: int = 10) -> AlphaFusion | TreeFusion:
    """Fit the fusion ``params.method`` names (``extra``: missed positives, tree only)."""
    if check_method(params.method) == "alpha":
        return fit_alpha(sl, Y_valid, params, inv_prop, filter_pairs, top_k)
    return fit_tree(sl, Y_valid, params, inv_prop, filter_pairs, extra, top_k)


def load_fusion(d: dict) -> AlphaFusion | TreeFusion:
    """A fusion from its ``to_dict`` form (``fusion.json``); no code is executed."""
    method = d.get("method")
    if method == "alpha":
        return AlphaFusion(float(d["alpha"]), [tuple(x) for x in d.get("grid", [])], float(d.get("knn_weight", 0.0)),
                           [tuple(x) for x in d.get("knn_grid", [])], float(d.get("propensity_weight", 0.0)),
                           [tuple(x) for x in d.get("propensity_grid", [])], d.get("objective_value"),
                           d.get("objective_smoothed"))
    if method == "tree":
        return TreeFusion.from_dict(d)
    raise XCConfigError(f"fusion file: unknown method {method!r}; expected one of {', '.join(METHODS)}")
