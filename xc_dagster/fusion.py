"""Score fusion: combine classifier and embedding scores of each shortlisted label.

``alpha`` (SiameseXML's blend, the baseline): s = a * w_l.e + (1 - a) * z_l.e with a chosen on a validation
split carved from train by a grid search on a metric (default P@1). Adding the embedding score keeps tail
labels, whose classifiers saw few positives, in the ranking (PSP).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import scipy.sparse as sp

from xc_dagster.config import FusionParams
from xc_dagster.errors import XCConfigError
from xc_dagster.metrics import evaluate
from xc_dagster.predict import Shortlist, fuse, topk_from_scores


@dataclass
class AlphaFusion:
    alpha: float
    grid: list[tuple[float, float]] = field(default_factory=list)  # (alpha, objective) tried

    def score(self, sl: Shortlist) -> np.ndarray:
        return fuse(sl, self.alpha)

    def to_dict(self) -> dict:
        return {"method": "alpha", "alpha": self.alpha, "grid": self.grid}


def fit_alpha(sl: Shortlist, Y_valid: sp.csr_matrix, params: FusionParams, inv_prop: np.ndarray | None,
              filter_pairs: np.ndarray | None, top_k: int = 10) -> AlphaFusion:
    """Grid-search ``alpha`` in [0, 1] maximising ``params.objective`` on the validation shortlists."""
    if params.method != "alpha":
        raise XCConfigError(f"fusion.method: expected 'alpha', got {params.method!r}")
    if not 0 < params.grid_step <= 1:
        raise XCConfigError(f"fusion.grid_step: expected a value in (0, 1], got {params.grid_step}")
    grid = np.round(np.arange(0.0, 1.0 + 1e-9, params.grid_step), 6)
    tried: list[tuple[float, float]] = []
    ks = (1, 3, 5)
    for a in grid:
        ids, _ = topk_from_scores(sl.ids, fuse(sl, float(a)), top_k)
        m = evaluate(ids, Y_valid, ks=ks, inv_prop=inv_prop, filter_pairs=filter_pairs)
        if params.objective not in m:
            raise XCConfigError(f"fusion.objective: {params.objective!r} is not a metric; one of {sorted(m)}")
        tried.append((float(a), float(m[params.objective])))
    best = max(tried, key=lambda t: (t[1], t[0]))  # ties: prefer more classifier weight
    return AlphaFusion(best[0], tried)


def load_fusion(d: dict) -> AlphaFusion:
    if d.get("method") != "alpha":
        raise XCConfigError(f"fusion file: unknown method {d.get('method')!r}")
    return AlphaFusion(float(d["alpha"]), [tuple(x) for x in d.get("grid", [])])
