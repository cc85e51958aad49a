"""NGAME's tree fusion (Appendix C): a depth-7 tree on each candidate's scores and label propensity.

Every candidate (point i, label l) gets the descriptor d_il = (z_l.e_i, w_l.e_i, f_l) and a target t_il = 1 if l
is relevant to i. A tree T is fitted to predict t from d, and the fused score is ``T(d) + z_l.e + w_l.e``, T(d)
being the tree's probability of relevance. The paper's third feature is the label's training frequency; we use
its inverse propensity, as NGAME's public code does: a strictly decreasing function of the frequency, so a tree
splits the training candidates identically. The paper calls T a "regression tree"; on 0/1 targets the
squared-error criterion is half the Gini impurity, so a classification tree with Gini finds the same splits and
its leaf probability is the regression leaf's mean. The paper fits on shortlist plus missed positives
(``fusion.tree_add_positives``); NGAME's public code fits on the shortlist only.

Artifacts load without executing code: the fitted tree is stored as plain arrays in JSON and evaluated by a
vectorised numpy walk (one step per tree level, all candidates at once); sklearn is only needed to fit.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import scipy.sparse as sp

from xc_dagster.config import FusionParams
from xc_dagster.errors import XCConfigError
from xc_dagster.retrieval.fusion.objective import validation_objective
from xc_dagster.retrieval.shortlist import Shortlist

TREE_FEATURES = ("embedding_score", "classifier_score", "inv_propensity")
_SCORE_BLOCK = 4096  # shortlist rows scored at once by the tree (bounds the feature array's memory)


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

    @classmethod
    def fit(cls, sl: Shortlist, Y_valid: sp.csr_matrix, params: FusionParams, inv_prop: np.ndarray | None,
            filter_pairs: np.ndarray | None, extra: tuple[np.ndarray, np.ndarray] | None = None,
            top_k: int = 10) -> TreeFusion:
        """:func:`fit_tree` (``extra``: the missed positives' rows and descriptors)."""
        return fit_tree(sl, Y_valid, params, inv_prop, filter_pairs, extra, top_k)

    @classmethod
    def from_dict(cls, d: dict) -> TreeFusion:
        """The fusion ``to_dict`` wrote; a missing key or a malformed tree is a config error."""
        try:
            if list(d.get("features", TREE_FEATURES)) != list(TREE_FEATURES):
                raise XCConfigError(f"fusion file: tree features {d['features']!r}, expected {list(TREE_FEATURES)}")
            nl = d.get("num_labels")
            return cls(d["children_left"], d["children_right"], d["feature"], d["threshold"], d["leaf_prob"],
                       int(d["max_depth"]), None if nl is None else int(nl), dict(d.get("info", {})))
        except KeyError as e:
            raise XCConfigError(f"fusion file: tree fusion lacks {e.args[0]!r}") from None

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
    # imported here: sklearn takes about 1.5 s to import, and loading or scoring a fitted tree needs none of it
    from sklearn.tree import DecisionTreeClassifier

    est = DecisionTreeClassifier(max_depth=params.tree_depth, min_samples_leaf=params.tree_min_samples_leaf,
                                 random_state=params.seed)
    est.fit(X, y)
    return _tree_from_sklearn(est, num_labels, {**info, "n_leaves": int(est.get_n_leaves()),
                                                "depth": int(est.get_depth())})


def _candidates(sl: Shortlist, Y: sp.csr_matrix, inv_prop: np.ndarray, filter_pairs: np.ndarray | None,
                extra: tuple[np.ndarray, np.ndarray] | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(rows, descriptors, targets) of the training candidates: the shortlist's valid cells not in
    ``filter_pairs``, then the missed positives ``extra`` (rows, descriptors), all relevant."""
    L = Y.shape[1]
    valid, X = tree_features(sl.ids, sl.clf, sl.emb, inv_prop)
    rows = np.nonzero(valid)[0]
    keys = _keys(rows, sl.ids[valid], L)
    y = np.isin(keys, _true_keys(Y)).astype(np.int8)
    if filter_pairs is not None and len(filter_pairs):
        fp = np.asarray(filter_pairs, dtype=np.int64)
        keep = ~np.isin(keys, _keys(fp[:, 0], fp[:, 1], L))
        rows, X, y = rows[keep], X[keep], y[keep]
    if extra is not None:
        er, eX = extra
        rows = np.concatenate([rows, np.asarray(er, dtype=np.int64)])
        X = np.concatenate([X, np.asarray(eX, dtype=np.float32)])
        y = np.concatenate([y, np.ones(len(er), dtype=np.int8)])
    return rows, X, y


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
    n = Y.shape[0]
    if len(sl.ids) != n:
        raise ValueError(f"shortlist has {len(sl.ids)} rows, Y_valid {n}")
    rows, X, y = _candidates(sl, Y, inv_prop, filter_pairs, extra)
    info: dict[str, Any] = {"objective": params.objective, "n_candidates": int(len(y)), "n_positive": int(y.sum()),
                            "n_missed_positives": int(0 if extra is None else len(extra[0])), "n_points": int(n),
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
    info["objective_value"] = validation_objective(sl.ids, cross, Y, params.objective, inv_prop, filter_pairs,
                                                   top_k)
    tree = _fit_arrays(X, y, params, rng, len(inv_prop), info)
    tree.info["objective_in_sample"] = validation_objective(sl.ids, tree.score(sl, inv_prop), Y, params.objective,
                                                            inv_prop, filter_pairs, top_k)
    return tree
