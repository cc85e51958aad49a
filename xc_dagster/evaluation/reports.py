"""Evaluation reports: metric tables, P@k / PSP@k curves, head-to-tail decile contributions, recall by label
frequency.

The decile analysis follows NGAME's figure 3a: labels are sorted by training frequency (head first) and cut
into ``n_bins`` bins holding about the same number of training positives each (so the head bin has few
labels and the tail bin many); each bin's contribution to P@k and PSP@k is the share of the hits that fall on
its labels, so the contributions add up to the reported P@k and PSP@k. The recall plot buckets labels by
training frequency on a log scale (1, 2-3, 4-7, ...) and gives, per bucket, the fraction of the test
positives of those labels found in the top k (and in the shortlist).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib
import numpy as np
import scipy.sparse as sp

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from xc_dagster.sampling.labels import positive_mask  # noqa: E402

MAIN_METRICS = ("precision", "ndcg", "psprecision", "psndcg", "recall", "psrecall", "coverage")
_BLOCK = 65536


def metrics_table(metrics: dict[str, float], ks: tuple[int, ...] = (1, 3, 5)) -> str:
    """Markdown table: one row per metric family, one column per k, values in percent."""
    head = "| metric | " + " | ".join(f"@{k}" for k in ks) + " |"
    sep = "|---|" + "---|" * len(ks)
    lines = [head, sep]
    for fam in MAIN_METRICS:
        vals = [metrics.get(f"{fam}_at_{k}") for k in ks]
        if all(v is None for v in vals):
            continue
        cells = " | ".join("" if v is None else f"{100 * v:.2f}" for v in vals)
        lines.append(f"| {fam} | {cells} |")
    return "\n".join(lines)


def pk_plot(metrics: dict[str, float], path: Path, title: str = "") -> Path:
    """P@k, PSP@k and nDCG@k against every k present in ``metrics`` (k = 1..10 in the pipeline), as PNG."""
    ks = sorted({int(k.rsplit("_", 1)[1]) for k in metrics if k.startswith("precision_at_")})
    fig, ax = plt.subplots(figsize=(5.5, 3.4), dpi=100)
    for fam, label in (("precision", "P@k"), ("psprecision", "PSP@k"), ("ndcg", "nDCG@k")):
        pts = [(k, 100 * metrics[f"{fam}_at_{k}"]) for k in ks if f"{fam}_at_{k}" in metrics]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
    ax.set_xlabel("k")
    ax.set_ylabel("%")
    ax.set_xticks(ks)
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(fig, ax, path, title)


def _save(fig, ax, path: Path, title: str) -> Path:
    """Title, layout, write the PNG, free the figure."""
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


# --------------------------------------------------------------------------------- per-label analyses


def frequency_deciles(freq: np.ndarray, n_bins: int = 10) -> np.ndarray:
    """Bin of every label, 0 = head ... ``n_bins - 1`` = tail, by training frequency ``freq``.

    Labels are sorted by frequency descending (ties by label id) and cut where the running count of training
    positives crosses each multiple of total/n_bins; labels never seen in training fall in the tail bin.
    """
    freq = np.asarray(freq, dtype=np.int64)
    if n_bins < 1:
        raise ValueError(f"n_bins must be >= 1, got {n_bins}")
    order = np.lexsort((np.arange(len(freq)), -freq))
    f = freq[order]
    before = np.cumsum(f) - f  # positives of the more frequent labels
    total = max(int(f.sum()), 1)
    bins_sorted = np.minimum(before * n_bins // total, n_bins - 1)
    out = np.empty(len(freq), dtype=np.int64)
    out[order] = bins_sorted
    return out


def _hit_matrix(ids: np.ndarray, Y: sp.csr_matrix) -> np.ndarray:
    """Boolean (n, K): is ``ids[i, j]`` a positive of row i (-1 padding is never a hit); row blocks."""
    Y = Y.tocsr()
    out = np.zeros(ids.shape, dtype=bool)
    for r0 in range(0, ids.shape[0], _BLOCK):
        r1 = min(ids.shape[0], r0 + _BLOCK)
        out[r0:r1] = positive_mask(Y, np.arange(r0, r1), ids[r0:r1])
    return out


def decile_contributions(ids: np.ndarray, Y_test: sp.csr_matrix, freq: np.ndarray, inv_prop: np.ndarray,
                         metrics: dict[str, float], k: int = 5, n_bins: int = 10) -> dict[str, Any]:
    """Each frequency bin's share of P@k and PSP@k (NGAME fig. 3a); shares add up to ``metrics``' values.

    ``ids``: (n, K) ranked predictions, unique per row, filter pairs already removed, -1 padded (what the
    evaluation stage predicts). P@k's share of bin b is (hits@k on bin-b labels) / (n k); PSP@k's share is
    PSP@k times bin b's fraction of the propensity-weighted hits (the normaliser is common to all bins).
    """
    top = np.asarray(ids)[:, :k]
    n = top.shape[0]
    bins = frequency_deciles(freq, n_bins)
    hit = _hit_matrix(top, Y_test)
    hb = bins[top[hit]]
    w = np.asarray(inv_prop, dtype=np.float64)[top[hit]]
    p_share = np.bincount(hb, minlength=n_bins) / max(n * k, 1)
    ps_num = np.bincount(hb, weights=w, minlength=n_bins)
    psp = float(metrics.get(f"psprecision_at_{k}", 0.0))
    ps_share = psp * ps_num / ps_num.sum() if ps_num.sum() > 0 else np.zeros(n_bins)
    n_labels = np.bincount(bins, minlength=n_bins)
    fr = np.asarray(freq, dtype=np.int64)
    lo = np.array([fr[bins == b].min() if n_labels[b] else 0 for b in range(n_bins)])
    hi = np.array([fr[bins == b].max() if n_labels[b] else 0 for b in range(n_bins)])
    return {"k": k, "bins": n_bins, "precision": p_share.tolist(), "psprecision": ps_share.tolist(),
            "n_labels": n_labels.tolist(), "min_freq": lo.tolist(), "max_freq": hi.tolist()}


def frequency_buckets(freq: np.ndarray) -> tuple[np.ndarray, list[str]]:
    """Log2 bucket of every label's training frequency: 0 = unseen, 1 = 1, 2 = 2-3, 3 = 4-7, ..."""
    freq = np.asarray(freq, dtype=np.int64)
    b = np.zeros(len(freq), dtype=np.int64)
    seen = freq > 0
    b[seen] = np.floor(np.log2(freq[seen])).astype(np.int64) + 1
    names = ["0"] + [f"{2 ** (j - 1)}" if j == 1 else f"{2 ** (j - 1)}-{2 ** j - 1}"
                     for j in range(1, int(b.max(initial=0)) + 1)]
    return b, names


def recall_by_frequency(ids: np.ndarray, Y_test: sp.csr_matrix, freq: np.ndarray, k: int = 5,
                        shortlist: np.ndarray | None = None) -> dict[str, Any]:
    """Per training-frequency bucket: labels, test positives, and the fraction of those positives found in the
    top ``k`` of ``ids`` (and anywhere in ``shortlist`` when given). Buckets without test positives get 0."""
    bucket, names = frequency_buckets(freq)
    nb = len(names)
    Y = Y_test.tocsr()
    pos_b = np.bincount(bucket[Y.indices], minlength=nb)

    def found(pred: np.ndarray) -> np.ndarray:
        hit = _hit_matrix(pred, Y)
        return np.bincount(bucket[pred[hit]], minlength=nb)

    def rate(x: np.ndarray) -> list[float]:
        return np.where(pos_b > 0, x / np.maximum(pos_b, 1), 0.0).tolist()

    out: dict[str, Any] = {"k": k, "buckets": names, "n_labels": np.bincount(bucket, minlength=nb).tolist(),
                           "test_positives": pos_b.tolist(), "recall": rate(found(np.asarray(ids)[:, :k]))}
    if shortlist is not None:
        out["shortlist_recall"] = rate(found(np.asarray(shortlist)))
    return out


def decile_table(dec: dict[str, Any]) -> str:
    """Markdown table of :func:`decile_contributions` (values in percent points)."""
    k = dec["k"]
    lines = [f"| bin (head to tail) | labels | train freq | P@{k} share | PSP@{k} share |", "|---|---|---|---|---|"]
    for b in range(dec["bins"]):
        lines.append(f"| {b + 1} | {dec['n_labels'][b]} | {dec['min_freq'][b]}-{dec['max_freq'][b]} | "
                     f"{100 * dec['precision'][b]:.2f} | {100 * dec['psprecision'][b]:.2f} |")
    lines.append(f"| all | {sum(dec['n_labels'])} | | {100 * sum(dec['precision']):.2f} | "
                 f"{100 * sum(dec['psprecision']):.2f} |")
    return "\n".join(lines)


def decile_plot(dec: dict[str, Any], path: Path, title: str = "") -> Path:
    """Grouped bars: each frequency bin's contribution to P@k and PSP@k (NGAME fig. 3a), as PNG."""
    k, nb = dec["k"], dec["bins"]
    x = np.arange(1, nb + 1)
    fig, ax = plt.subplots(figsize=(6, 3.4), dpi=100)
    ax.bar(x - 0.2, 100 * np.asarray(dec["precision"]), width=0.4, label=f"P@{k}")
    ax.bar(x + 0.2, 100 * np.asarray(dec["psprecision"]), width=0.4, label=f"PSP@{k}")
    ax.set_xticks(x)
    ax.set_xlabel("label bin by training frequency (1 = head, equal training positives per bin)")
    ax.set_ylabel("contribution (% points)")
    ax.grid(alpha=0.3, axis="y")
    ax.legend()
    return _save(fig, ax, path, title)


def recall_plot(rec: dict[str, Any], path: Path, title: str = "") -> Path:
    """Recall@k (and shortlist recall) per training-frequency bucket, with label counts, as PNG."""
    names = rec["buckets"]
    x = np.arange(len(names))
    fig, ax = plt.subplots(figsize=(6, 3.4), dpi=100)
    ax.plot(x, 100 * np.asarray(rec["recall"]), marker="o", label=f"recall@{rec['k']}")
    if "shortlist_recall" in rec:
        ax.plot(x, 100 * np.asarray(rec["shortlist_recall"]), marker="s", label="shortlist recall")
    ax.set_xticks(x)
    ax.set_xticklabels(names, rotation=45, fontsize=7)
    ax.set_xlabel("label frequency in training")
    ax.set_ylabel("% of test positives found")
    ax.set_ylim(0, 100)
    ax.grid(alpha=0.3)
    ax2 = ax.twinx()
    ax2.bar(x, rec["n_labels"], alpha=0.15, color="gray")
    ax2.set_ylabel("labels", color="gray")
    ax.legend(loc="upper left")
    return _save(fig, ax, path, title)
