"""The validation objective that the alpha fusion maximises and the tree fusion reports."""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp

from xc_dagster.errors import XCConfigError
from xc_dagster.evaluation.fixed_shortlist import FixedShortlistMetrics
from xc_dagster.evaluation.metrics import evaluate, evaluate_families
from xc_dagster.retrieval.shortlist import topk_from_scores

OBJECTIVE_KS = (1, 3, 5)  # the ks evaluated for the objective (``fusion.objective`` names one of their metrics)
# metric families computed alone from the scored shortlist; an objective naming another (coverage) is computed
# by the full evaluation of the top ``top_k``
_PS_FAMILIES = ("psprecision", "psndcg", "psrecall")  # these need inv_prop
_FAMILIES = ("precision", "ndcg", "recall", *_PS_FAMILIES)


def validation_objective(ids: np.ndarray, scores: np.ndarray, Y: sp.csr_matrix, objective: str,
                         inv_prop: np.ndarray | None, filter_pairs: np.ndarray | None, top_k: int) -> float:
    """``objective`` of the ranking by ``scores`` of the shortlist ``ids``.

    ``objective`` is a metric name of :func:`~xc_dagster.evaluation.metrics.evaluate`, or several joined by
    ``+`` and summed (e.g. ``precision_at_1+psprecision_at_1`` weighs head and tail equally). Only the named
    metrics' families are computed, on the shortlist ranked by ``scores`` (filtered pairs removed first), as the
    fusion's grid evaluates this thousands of times.
    """
    names = objective.split("+")
    families = {name.rpartition("_at_")[0] for name in names}
    if "" in families or any(f not in _FAMILIES for f in families):
        top, _ = topk_from_scores(ids, scores, top_k)
        m = evaluate(top, Y, ks=OBJECTIVE_KS, inv_prop=inv_prop, filter_pairs=filter_pairs)
    else:
        m = evaluate_families(sorted(families), ids, Y, OBJECTIVE_KS, inv_prop, filter_pairs, scores)
    for name in names:
        if name not in m:
            raise XCConfigError(f"fusion.objective: {name!r} is not a metric; one of {sorted(m)} (or several "
                                "joined by '+')")
    return float(sum(m[name] for name in names))


class ObjectiveOnShortlist:
    """:func:`validation_objective` of many rankings of one shortlist, to the bit, its score-free work (checks,
    relevance, filter pairs, padding, duplicates, ideal rankings) done once: what the alpha grid evaluates.

    Objectives naming another family (coverage), propensity-scored metrics without ``inv_prop`` or a name that is
    no metric take :func:`validation_objective` itself at every call (its errors included); so does
    ``prepared=False``.
    """

    def __init__(self, ids: np.ndarray, Y: sp.csr_matrix, objective: str, inv_prop: np.ndarray | None,
                 filter_pairs: np.ndarray | None, top_k: int, prepared: bool = True) -> None:
        self.names = objective.split("+")
        self.args = (Y, objective, inv_prop, filter_pairs, top_k)
        self.ids = ids
        families = sorted({name.rpartition("_at_")[0] for name in self.names})
        known = {f"{f}_at_{k}" for f in families for k in OBJECTIVE_KS}
        fast = (prepared and all(f in _FAMILIES for f in families) and all(name in known for name in self.names)
                and (inv_prop is not None or not any(f in _PS_FAMILIES for f in families)))
        self.metrics = FixedShortlistMetrics(families, ids, Y, OBJECTIVE_KS, inv_prop, filter_pairs) if fast \
            else None

    def value(self, scores: np.ndarray) -> float:
        """The objective of the shortlist ranked by ``scores``."""
        if self.metrics is None:
            return validation_objective(self.ids, scores, *self.args)
        m = self.metrics.evaluate(scores)
        return float(sum(m[name] for name in self.names))
