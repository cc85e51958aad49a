"""The validation split carved from the training points (what the fusion is fitted on) and its targets."""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp


def validation_split(n: int, fraction: float, max_rows: int, seed: int) -> np.ndarray:
    """Sorted row ids of a seeded random validation split of ``n`` training rows."""
    size = min(int(round(n * fraction)), max_rows, max(n - 1, 0))
    if size <= 0:
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
