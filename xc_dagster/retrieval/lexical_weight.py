"""The weight g of the lexical classifiers' part in the lexical score, chosen on held-out points.

The lexical score adds to its kNN votes and label-text cosine (each in [0, 1]) g * sigmoid(w_l . q + b_l)
(``xc_dagster.retrieval.lexical``). At g = 1 a classifier's probability counts as much as the mean vote of the K
nearest points, however the two compare on the data: ranked by the lexical score alone, LF-WordNetNouns' titles and
full text as BoW read +0.36 and +0.47 P@1 at g = 0.25, the 2.9K-label cut as BoW +0.16 at g = 4
(docs/decisions.md#lexical-classifier-weight). Given several ``index.lexical_classifier_weights``, the index stage
picks g by the fusion's objective of that ranking on the validation points: the other parts and the classifiers are
scored once each, every g is then a sparse sum. One weight (the default, 1) is used as it is: chosen so, g moved
the fused models -1.56 to +0.80 P@1 (the ranking alone is a proxy for what the fusion then makes of it), so it is an
option.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import scipy.sparse as sp

from xc_dagster.config.bounds import is_finite_number
from xc_dagster.errors import XCConfigError

MAX_POINTS = 20_000  # held-out points scored for the choice at most (a seeded sample beyond)


def check_weights(weights: Any) -> tuple[float, ...]:
    """``index.lexical_classifier_weights``: a non-empty sequence of finite numbers > 0, or a config error."""
    values = tuple(weights) if isinstance(weights, (list, tuple)) else (weights,)
    bad = [w for w in values if not is_finite_number(w) or w <= 0]
    if not values or bad:
        raise XCConfigError(f"index.lexical_classifier_weights: expected one or more numbers > 0 (the classifiers' "
                            f"weight g in the lexical score, chosen on validation), got {list(values)!r}")
    return tuple(float(w) for w in values)


def without_classifier(index: Any) -> Any:
    """A shallow copy of the lexical ``index`` that scores its label-text and kNN parts alone (matrices shared)."""
    out = copy.copy(index)
    out.classifier = None
    return out


def weighted(index: Any, weight: float) -> Any:
    """A shallow copy of the lexical ``index`` whose classifiers count ``weight`` times (their weights shared)."""
    out, clf = copy.copy(index), copy.copy(index.classifier)
    clf.settings = dataclasses.replace(clf.settings, weight=float(weight))
    out.classifier = clf
    return out


def weight_grid(index: Any, queries: sp.csr_matrix, excluded: np.ndarray | None, weights: Sequence[float],
                value: Callable[[sp.csr_matrix], float]) -> list[tuple[float, float]]:
    """(g, ``value`` of the lexical scores with g) for each g of ``weights``: ``queries`` the TF-IDF rows of
    held-out points, ``excluded`` the indexed points never their neighbours (``LexicalIndex.scores``)."""
    if index.classifier is None:
        raise ValueError("the lexical index has no classifiers to weigh")
    base = sp.csr_matrix(without_classifier(index).scores(queries, excluded))
    part = sp.csr_matrix(weighted(index, 1.0).scores(queries, excluded) - base)  # the classifiers' scores alone
    return [(float(g), float(value(sp.csr_matrix(base + np.float32(g) * part)))) for g in weights]


def best_weight(grid: Sequence[tuple[float, float]]) -> float:
    """The g of the largest value; ties: the earliest in the grid."""
    return max(enumerate(grid), key=lambda t: (t[1][1], -t[0]))[1][0]


def sample_points(points: np.ndarray, seed: int, at_most: int = MAX_POINTS) -> np.ndarray:
    """``points``, or a seeded sorted sample of ``at_most`` of them."""
    points = np.asarray(points, dtype=np.int64)
    if len(points) <= at_most:
        return points
    return np.sort(np.random.default_rng(seed).choice(points, size=at_most, replace=False))
