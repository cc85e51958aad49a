"""Stage ``ingest``: the source resolved and parsed from its XC layout into canonical tables, plus the
validation split carved from train, the validation checks and the label-frequency plot."""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from xc_dagster.artifacts import CHECKS, DATASET, LABEL_FREQ, LABEL_FREQ_PLOT, SUMMARY, VALID_ROWS
from xc_dagster.catalog import BUILTIN_PREFIX, builtin_path
from xc_dagster.data import read_dataset, resolve_source, save_dataset
from xc_dagster.data.checks import check_counts, compute_checks, label_frequencies, label_frequency_plot
from xc_dagster.data.companions import has_label_names, points_have_text, text_hint
from xc_dagster.data.registry import verify_counts
from xc_dagster.data.splits import validation_split
from xc_dagster.errors import XCError
from xc_dagster.pipeline.context import StageContext
from xc_dagster.serving.source_changes import source_fingerprint
from xc_dagster.storage import save_json


def _fields(text: str) -> tuple[str, ...]:
    return ("title",) if text == "title" else ("title", "content")


def _source_digest(source: str) -> str | None:
    """The source's file fingerprint (names, sizes, modification stamps) that the retrain schedule compares."""
    try:
        fp = source_fingerprint(source)
    except XCError:
        return None
    return None if fp is None else fp.digest


def run(ctx: StageContext) -> dict[str, Any]:
    """Fetch/resolve the source, parse its layout into canonical tables, carve the validation split.

    A known public dataset's counts must equal the published ones (``ingest.verify_counts``); the validation
    checks (``checks.json``) and the label-frequency plot (``label_freq.png``) are written with the tables.
    """
    p = ctx.cfg.ingest
    t0 = time.perf_counter()
    src = ctx.spec.source
    source_digest = _source_digest(src)  # before reading: a change made during ingest shows next time
    folder = (builtin_path(src[len(BUILTIN_PREFIX):]) if src.startswith(BUILTIN_PREFIX)
              else resolve_source(src, ctx.cache_dir / ctx.name, sha256=ctx.spec.sha256))
    text = p.text if p.text != "auto" else ctx.spec.text_fields
    label_fields = _fields(text) if p.label_text == "same" else _fields(p.label_text)
    ds = read_dataset(folder, layout=ctx.spec.layout, text_fields=_fields(text), label_text_fields=label_fields,
                      split=p.split)
    stats = dict(ds.stats())
    known = ctx.spec.known
    if p.verify_counts:  # before anything is written: a wrong download never becomes an ingested dataset
        verify_counts(ctx.name, stats, known, str(folder))
    freq = label_frequencies(ds.Y_train, ds.num_labels)
    checks = compute_checks(ds, known, freq)
    valid = validation_split(ds.num_train, p.valid_fraction, p.valid_max, p.seed, p.valid_min)
    with ctx.writing() as out:
        save_dataset(ds, out / DATASET)
        np.save(out / VALID_ROWS, valid)
        save_json(out / CHECKS, checks)
        np.save(out / LABEL_FREQ, freq)
        label_frequency_plot(freq, out / LABEL_FREQ_PLOT, ctx.name)
        stats.update({"n_valid": int(len(valid)), "layout": ds.layout, "text": text, "source": str(folder),
                      "registry": known.name if known else None, "source_fingerprint": source_digest,
                      "counts_verified": bool(known is not None and p.verify_counts),
                      "label_names": has_label_names(ds.label_texts),
                      # points with text (the checks counted the empty ones); 0: the encoder would read nothing
                      "train_texts": ds.num_train - checks["checks"]["duplicate_point_texts"]["metadata"][
                          "empty_train_texts"],
                      "checks_failed": checks["failed"], "check_counts": check_counts(checks),
                      "label_frequency": checks["label_frequency"],
                      "seconds": time.perf_counter() - t0})
        save_json(out / SUMMARY, stats)
    ctx.info(f"ingest {ctx.name}: {stats['n_train']} train / {stats['n_test']} test / {stats['n_labels']} labels")
    if not points_have_text(stats):
        ctx.info(f"ingest {ctx.name}: no training point has text ({text_hint(ds.layout)}); the encoder is not "
                 f"trained and the model is the lexical source over the shipped features")
    return stats
