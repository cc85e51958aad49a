"""The validation split carved from the training points (what the fusion is fitted on) and its targets."""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp

from xc_dagster.errors import XCConfigError


def validation_split(n: int, fraction: float, max_rows: int, seed: int, min_rows: int = 0) -> np.ndarray:
    """Sorted row ids of a seeded random validation split of ``n`` training rows; none when it would hold fewer
    than ``min_rows`` (the fusion is then cross-fitted: ``cross_fit_folds``)."""
    size = min(int(round(n * fraction)), max_rows, max(n - 1, 0))
    if size <= 0 or size < min_rows:
        return np.zeros(0, dtype=np.int64)
    rng = np.random.default_rng(seed)
    return np.sort(rng.choice(n, size=size, replace=False)).astype(np.int64)


def validation_targets(Y_train: sp.csr_matrix, valid: np.ndarray, train_rows: np.ndarray,
                       filter_pairs: np.ndarray) -> tuple[sp.csr_matrix, np.ndarray, int]:
    """The validation labels a fusion is fitted against: ``Y_train[valid]`` without the pairs whose label has no
    training point among ``train_rows``, and the filter pairs (re-indexed to validation rows) with those pairs
    added, so predicting such a label is neither rewarded nor penalised. Returns (Y, filter pairs, pairs dropped).

    Carving the validation split out of train makes a label whose only training point falls in validation
    *unseen* by the models, which almost no test positive is; left in, such pairs pull the fit towards scores
    that ignore training (docs/decisions.md#validation-unseen-label-pairs).
    """
    Yv = Y_train[np.asarray(valid, dtype=np.int64)].tocsr()
    Yv.sum_duplicates()
    seen = np.zeros(Y_train.shape[1], dtype=bool)
    seen[Y_train[np.asarray(train_rows, dtype=np.int64)].indices] = True
    unseen = ~seen[Yv.indices]
    rows = np.repeat(np.arange(Yv.shape[0], dtype=np.int64), np.diff(Yv.indptr))
    dropped = np.stack([rows[unseen], Yv.indices[unseen].astype(np.int64)], axis=1)
    Yv.data = np.where(unseen, 0, Yv.data)
    Yv.eliminate_zeros()
    pairs = np.concatenate([np.asarray(filter_pairs, dtype=np.int64).reshape(-1, 2), dropped])
    return Yv, pairs, int(unseen.sum())


def cross_fit_folds(rows: np.ndarray, folds: int, max_scored: int, seed: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Seeded ``folds`` disjoint folds of ``rows``: per fold (its rows, which that fold's models never see; the
    rows of it that are scored for the fit, a seeded sample so that all folds together score at most
    ``max_scored``), both sorted."""
    rows = np.asarray(rows, dtype=np.int64)
    if not (isinstance(folds, int) and 2 <= folds <= max(len(rows), 2)):
        raise XCConfigError(f"fusion.cross_fit_folds: expected an int from 2 to the {len(rows)} training points, "
                            f"got {folds!r}")
    if not (isinstance(max_scored, int) and max_scored >= folds):
        raise XCConfigError(f"fusion.cross_fit_max_points: expected an int >= cross_fit_folds ({folds}), "
                            f"got {max_scored!r}")
    rng = np.random.default_rng(seed)
    parts = np.array_split(rng.permutation(rows), folds)
    per_fold = max_scored // folds
    out = []
    for part in parts:
        scored = part if len(part) <= per_fold else rng.choice(part, size=per_fold, replace=False)
        out.append((np.sort(part), np.sort(scored)))
    return out


def filter_rows(pairs: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Filter pairs of ``rows`` (original row ids) re-indexed to positions within ``rows``."""
    pos = np.full(int(max(pairs[:, 0].max(initial=-1), rows.max(initial=-1))) + 1, -1, dtype=np.int64)
    pos[rows] = np.arange(len(rows))
    keep = pairs[:, 0] < len(pos)
    p = pairs[keep]
    new = pos[p[:, 0]]
    ok = new >= 0
    return np.stack([new[ok], p[ok, 1]], axis=1) if ok.any() else np.zeros((0, 2), dtype=np.int64)
