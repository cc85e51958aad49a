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

    Carving the validation split out of train makes every label seen once in train *unseen* by the models when
    its one point falls in validation; a test point's labels were all in the models' training data (at most
    ~0.3% of test positives are unseen on LF-WordNetNouns vs 7.3% of validation positives before this). Left in,
    those pairs reward scores that ignore training (label text alone) and the fit leans away from the trained
    classifiers (bench/RESULTS.md, ninth session).
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
