"""Validation of an ingested dataset: the numbers behind the ingest asset's checks, and the label-frequency plot.

:func:`compute_checks` returns one JSON-able result per check (``passed``, ``severity`` ``"ERROR"`` or
``"WARN"``, ``description``, ``metadata`` counts); the ingest stage writes them to ``checks.json`` and the
Dagster asset reports them as asset checks. Everything is vectorised: texts are compared through 64-bit
hashes (pandas ``hash_array``), never pairwise.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import numpy as np
import pandas as pd
import scipy.sparse as sp

from xc_dagster.data.canonical import XCDataset
from xc_dagster.data.registry import KnownDataset, count_mismatches

ERROR = "ERROR"
WARN = "WARN"

CHECKS: dict[str, tuple[str, str]] = {  # name -> (severity, description)
    "label_ids_in_range": (ERROR, "every label id of Y_train / Y_test lies in [0, L), L = number of label texts"),
    "counts_match": (ERROR, "the tables agree with each other (the files' N/D/L headers) and, for a known "
                            "public dataset, with its published counts"),
    "points_without_labels": (WARN, "train and test points with no label"),
    "duplicate_point_texts": (WARN, "non-empty point texts that repeat an earlier one of the same split"),
    "train_test_overlap": (WARN, "test points whose (non-empty) text is also a training point's text"),
    "filter_pairs_in_range": (ERROR, "filter pairs (row, label) have a row of their split and a label in [0, L)"),
}


def text_hashes(texts: Sequence[str]) -> np.ndarray:
    """64-bit hashes of texts (vectorised; collisions are negligible below ~10^8 texts)."""
    if len(texts) == 0:
        return np.zeros(0, dtype=np.uint64)
    return pd.util.hash_array(np.asarray(texts, dtype=object), categorize=False)


def _result(name: str, passed: bool, metadata: dict[str, Any]) -> dict[str, Any]:
    severity, description = CHECKS[name]
    return {"passed": bool(passed), "severity": severity, "description": description, "metadata": metadata}


def _out_of_range(m: sp.spmatrix | None, n: int) -> int:
    if m is None or m.nnz == 0:
        return 0
    idx = sp.csr_matrix(m).indices
    return int(((idx < 0) | (idx >= n)).sum())


def _check_labels(ds: XCDataset) -> dict[str, Any]:
    L = len(ds.label_texts)
    bad_tr, bad_te = _out_of_range(ds.Y_train, L), _out_of_range(ds.Y_test, L)
    width_ok = ds.Y_train.shape[1] == L and ds.Y_test.shape[1] == L
    max_id = max([int(m.indices.max()) for m in (ds.Y_train, ds.Y_test) if m.nnz] or [-1])
    return _result("label_ids_in_range", bad_tr == 0 and bad_te == 0 and width_ok, {
        "n_labels": L, "max_label_id": max_id, "out_of_range_train": bad_tr, "out_of_range_test": bad_te,
        "y_columns_train": int(ds.Y_train.shape[1]), "y_columns_test": int(ds.Y_test.shape[1])})


def _check_counts(ds: XCDataset, known: KnownDataset | None) -> dict[str, Any]:
    L = len(ds.label_texts)
    pairs = [("train texts vs Y_train rows", len(ds.train_texts), ds.Y_train.shape[0]),
             ("test texts vs Y_test rows", len(ds.test_texts), ds.Y_test.shape[0]),
             ("label texts vs Y_train columns", L, ds.Y_train.shape[1]),
             ("label texts vs Y_test columns", L, ds.Y_test.shape[1])]
    for name, X, n in (("X_train", ds.X_train, ds.Y_train.shape[0]), ("X_test", ds.X_test, ds.Y_test.shape[0]),
                       ("X_label", ds.X_label, L)):
        if X is not None:
            pairs.append((f"{name} rows", n, X.shape[0]))
    dims = {name: X.shape[1] for name, X in (("X_train", ds.X_train), ("X_test", ds.X_test),
                                              ("X_label", ds.X_label)) if X is not None}
    if dims:
        first = next(iter(dims))
        pairs += [(f"{name} columns vs {first}", dims[first], d) for name, d in dims.items() if name != first]
        if ds.feature_words is not None:
            pairs.append((f"feature words vs {first} columns", dims[first], len(ds.feature_words)))
    mismatches = [{"field": f, "expected": int(e), "got": int(g)} for f, e, g in pairs if int(e) != int(g)]
    meta: dict[str, Any] = {"n_train": ds.num_train, "n_test": ds.num_test, "n_labels": L,
                            "n_features": int(ds.X_train.shape[1]) if ds.X_train is not None else None,
                            "registry": known.name if known else None}
    if known is not None:
        mismatches += [{"field": f"{f} (published)", "expected": e, "got": g}
                       for f, e, g in count_mismatches(ds.stats(), known)]
    meta["n_mismatches"] = len(mismatches)
    meta["mismatches"] = mismatches
    return _result("counts_match", not mismatches, meta)


def _check_empty(ds: XCDataset) -> dict[str, Any]:
    tr = int((np.diff(ds.Y_train.indptr) == 0).sum())
    te = int((np.diff(ds.Y_test.indptr) == 0).sum())
    return _result("points_without_labels", tr == 0 and te == 0,
                   {"train_without_labels": tr, "test_without_labels": te})


def _nonempty_hashes(texts: Sequence[str]) -> tuple[np.ndarray, int]:
    """Hashes of the non-empty (after strip) texts, and the number of empty ones."""
    s = pd.Series(np.asarray(texts, dtype=object), dtype=object)
    keep = s.str.strip().str.len().fillna(0).to_numpy() > 0 if len(s) else np.zeros(0, dtype=bool)
    return text_hashes(s[keep].to_numpy()), int((~keep).sum())


def _check_texts(ds: XCDataset) -> tuple[dict[str, Any], dict[str, Any]]:
    h_tr, empty_tr = _nonempty_hashes(ds.train_texts)
    h_te, empty_te = _nonempty_hashes(ds.test_texts)
    dup_tr = int(len(h_tr) - len(np.unique(h_tr)))
    dup_te = int(len(h_te) - len(np.unique(h_te)))
    overlap = int(np.isin(h_te, h_tr).sum()) if len(h_te) and len(h_tr) else 0
    dups = _result("duplicate_point_texts", dup_tr == 0 and dup_te == 0, {
        "duplicate_train_texts": dup_tr, "duplicate_test_texts": dup_te,
        "empty_train_texts": empty_tr, "empty_test_texts": empty_te})
    over = _result("train_test_overlap", overlap == 0, {
        "test_texts_in_train": overlap, "test_points_compared": int(len(h_te)),
        "overlap_fraction": float(overlap / len(h_te)) if len(h_te) else 0.0})
    return dups, over


def _check_filters(ds: XCDataset) -> dict[str, Any]:
    L = len(ds.label_texts)
    meta: dict[str, Any] = {}
    ok = True
    for split, pairs, n in (("train", ds.filter_train, ds.num_train), ("test", ds.filter_test, ds.num_test)):
        p = np.asarray(pairs, dtype=np.int64).reshape(-1, 2)
        bad_rows = int(((p[:, 0] < 0) | (p[:, 0] >= n)).sum())
        bad_labels = int(((p[:, 1] < 0) | (p[:, 1] >= L)).sum())
        bad = int((((p[:, 0] < 0) | (p[:, 0] >= n)) | ((p[:, 1] < 0) | (p[:, 1] >= L))).sum())
        meta.update({f"filter_{split}_pairs": int(len(p)), f"filter_{split}_out_of_range": bad,
                     f"filter_{split}_bad_rows": bad_rows, f"filter_{split}_bad_labels": bad_labels})
        ok = ok and bad == 0
    return _result("filter_pairs_in_range", ok, meta)


def label_frequencies(Y_train: sp.spmatrix, n_labels: int | None = None) -> np.ndarray:
    """Number of training points of each label (int64, length L)."""
    Y = sp.csr_matrix(Y_train)
    L = int(n_labels if n_labels is not None else Y.shape[1])
    idx = Y.indices[(Y.indices >= 0) & (Y.indices < L)]
    return np.bincount(idx, minlength=L).astype(np.int64)


def frequency_summary(freq: np.ndarray) -> dict[str, Any]:
    """Shape of the label-frequency distribution: zeros, max, median, head share, tail labels."""
    L = len(freq)
    total = int(freq.sum())
    srt = np.sort(freq)[::-1]
    top = max(1, int(np.ceil(0.01 * L))) if L else 0
    return {
        "n_labels": L, "positives": total,
        "labels_without_train_points": int((freq == 0).sum()),
        "labels_with_at_most_5_points": int((freq <= 5).sum()),
        "max_frequency": int(srt[0]) if L else 0,
        "median_frequency": float(np.median(freq)) if L else 0.0,
        "mean_frequency": float(total / L) if L else 0.0,
        "top_1pct_labels_share": float(srt[:top].sum() / total) if total else 0.0,
    }


def compute_checks(ds: XCDataset, known: KnownDataset | None = None,
                   freq: np.ndarray | None = None) -> dict[str, Any]:
    """Every check on ``ds`` (see :data:`CHECKS`) plus the label-frequency summary, JSON-able.

    ``freq``: the training label frequencies when the caller already has them (else computed here).
    """
    dups, overlap = _check_texts(ds)
    checks = {
        "label_ids_in_range": _check_labels(ds),
        "counts_match": _check_counts(ds, known),
        "points_without_labels": _check_empty(ds),
        "duplicate_point_texts": dups,
        "train_test_overlap": overlap,
        "filter_pairs_in_range": _check_filters(ds),
    }
    if freq is None:
        freq = label_frequencies(ds.Y_train, len(ds.label_texts))
    return {"checks": checks, "label_frequency": frequency_summary(freq),
            "failed": sorted(k for k, v in checks.items() if not v["passed"])}


def check_counts(result: dict[str, Any]) -> dict[str, int]:
    """The headline counts of a :func:`compute_checks` result (for summaries and MLflow metrics)."""
    c = {k: v["metadata"] for k, v in result["checks"].items()}
    return {
        "duplicate_train_texts": c["duplicate_point_texts"]["duplicate_train_texts"],
        "duplicate_test_texts": c["duplicate_point_texts"]["duplicate_test_texts"],
        "test_texts_in_train": c["train_test_overlap"]["test_texts_in_train"],
        "train_without_labels": c["points_without_labels"]["train_without_labels"],
        "test_without_labels": c["points_without_labels"]["test_without_labels"],
        "count_mismatches": c["counts_match"]["n_mismatches"],
        "filter_pairs_out_of_range": (c["filter_pairs_in_range"]["filter_train_out_of_range"]
                                      + c["filter_pairs_in_range"]["filter_test_out_of_range"]),
        "label_ids_out_of_range": (c["label_ids_in_range"]["out_of_range_train"]
                                   + c["label_ids_in_range"]["out_of_range_test"]),
    }


def label_frequency_plot(freq: np.ndarray, path: Path, title: str = "") -> Path:
    """Log-log plot of label frequency (training points per label) against its rank, saved as PNG."""
    # matplotlib is imported here, not at the top: it is heavy and only this plot needs it
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    srt = np.sort(np.asarray(freq))[::-1]
    pos = srt[srt > 0]
    fig, ax = plt.subplots(figsize=(5, 3.2), dpi=100)
    if len(pos):
        ranks = np.arange(1, len(pos) + 1)
        if len(pos) > 20000:  # thin out the long tail for a light PNG; log-spaced ranks keep the shape
            keep = np.unique(np.geomspace(1, len(pos), 5000).astype(np.int64)) - 1
            ranks, pos = ranks[keep], pos[keep]
        ax.loglog(ranks, pos, marker=".", markersize=2, linewidth=1)
    zeros = int((srt == 0).sum())
    ax.set_xlabel("label rank")
    ax.set_ylabel("training points per label")
    ax.grid(alpha=0.3, which="both")
    ax.set_title(f"{title}  ({len(srt)} labels" + (f", {zeros} unseen)" if zeros else ")"), fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return Path(path)
