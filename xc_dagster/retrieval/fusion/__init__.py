"""Score fusion: combine the classifier, embedding (and kNN) scores of each shortlisted label into one score.

A fusion is a component (:class:`Fusion`) fitted on the shortlists of the validation points carved from train,
chosen by ``fusion.method`` among the registry :data:`FUSIONS`:

=========  ===========================================  ====================================================
``alpha``  SiameseXML's alpha blend (+ kNN, propensity)  :class:`~.alpha.AlphaFusion` (``fusion/alpha.py``)
``tree``   NGAME's depth-7 tree fusion (Appendix C)      :class:`~.tree.TreeFusion` (``fusion/tree.py``)
=========  ===========================================  ====================================================

``alpha`` is the default (docs/decisions.md#fusion-alpha-over-tree). ``fusion/objective.py`` holds the
validation objective both are fitted or reported on (docs/decisions.md#fusion-objective-four-metrics). A fitted
fusion persists itself as plain JSON (``to_dict``, the fusion stage's ``fusion.json``) and :func:`load_fusion`
reads it back without executing code. A new fusion is one class implementing :class:`Fusion` and one line in
:data:`FUSIONS`.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import scipy.sparse as sp

from xc_dagster.config import FusionParams
from xc_dagster.errors import XCConfigError
from xc_dagster.retrieval.fusion.alpha import AlphaFusion, fit_alpha, propensity_boost, smooth_grid
from xc_dagster.retrieval.fusion.tree import TreeFusion, fit_tree, missed_positive_features
from xc_dagster.retrieval.shortlist import Shortlist

__all__ = ["FUSIONS", "AlphaFusion", "Fusion", "TreeFusion", "check_method", "fit_alpha", "fit_fusion", "fit_tree",
           "load_fusion", "missed_positive_features", "propensity_boost", "smooth_grid"]


class Fusion(Protocol):
    """A score fusion: fitted on validation shortlists, scores shortlists, describes and persists itself."""

    method: str  # its name in FUSIONS, written as the "method" of its to_dict

    @classmethod
    def fit(cls, sl: Shortlist, Y_valid: sp.csr_matrix, params: FusionParams, inv_prop: np.ndarray | None,
            filter_pairs: np.ndarray | None, extra: tuple[np.ndarray, np.ndarray] | None = None,
            top_k: int = 10) -> Fusion:
        """Fit on the validation shortlists ``sl`` with targets ``Y_valid`` (``extra``: missed positives)."""
        ...

    @classmethod
    def from_dict(cls, d: dict) -> Fusion:
        """The fusion its ``to_dict`` wrote."""
        ...

    def score(self, sl: Shortlist, inv_prop: np.ndarray | None = None) -> np.ndarray:
        """The fused score of every shortlist cell, float32, -inf on padding."""
        ...

    def to_dict(self) -> dict:
        """A JSON-able description that :func:`load_fusion` reads back."""
        ...

    def summary(self) -> dict:
        """The chosen parameters and validation numbers, for the stage summary."""
        ...


FUSIONS: dict[str, type[Fusion]] = {"alpha": AlphaFusion, "tree": TreeFusion}


def check_method(method: str) -> str:
    """Return ``method`` if it names a fusion of :data:`FUSIONS`, else raise naming ``fusion.method``."""
    if not isinstance(method, str) or method not in FUSIONS:
        raise XCConfigError(f"fusion.method: expected one of {sorted(FUSIONS)}, got {method!r}")
    return method


def fit_fusion(sl: Shortlist, Y_valid: sp.csr_matrix, params: FusionParams, inv_prop: np.ndarray | None,
               filter_pairs: np.ndarray | None, extra: tuple[np.ndarray, np.ndarray] | None = None,
               top_k: int = 10) -> Fusion:
    """Fit the fusion ``params.method`` names (``extra``: missed positives, used by the tree)."""
    return FUSIONS[check_method(params.method)].fit(sl, Y_valid, params, inv_prop, filter_pairs, extra, top_k)


def load_fusion(d: dict) -> Fusion:
    """A fusion from its ``to_dict`` form (``fusion.json``); no code is executed."""
    method = d.get("method")
    if not isinstance(method, str) or method not in FUSIONS:
        raise XCConfigError(f"fusion file: unknown method {method!r}; expected one of {sorted(FUSIONS)}")
    return FUSIONS[method].from_dict(d)
