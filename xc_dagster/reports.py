"""Evaluation reports: the metrics as a markdown table and a P@k / PSP@k plot."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

MAIN_METRICS = ("precision", "ndcg", "psprecision", "psndcg", "recall")


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
    """P@k and PSP@k against k, saved as PNG."""
    ks = sorted({int(k.rsplit("_", 1)[1]) for k in metrics if k.startswith("precision_at_")})
    fig, ax = plt.subplots(figsize=(5, 3.2), dpi=100)
    for fam, label in (("precision", "P@k"), ("psprecision", "PSP@k"), ("ndcg", "nDCG@k")):
        ys = [100 * metrics[f"{fam}_at_{k}"] for k in ks if f"{fam}_at_{k}" in metrics]
        if ys:
            ax.plot(ks[:len(ys)], ys, marker="o", label=label)
    ax.set_xlabel("k")
    ax.set_ylabel("%")
    ax.set_xticks(ks)
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
