"""The ranges of the numeric config fields, checked where overrides are coerced (``--set``, the catalog, the run
config) and, for the one range that depends on another field (``evaluate.top_k``), once the config is resolved:
a value outside its range fails there naming the field and the range, not a stage later with a raw numpy error."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from xc_dagster.errors import XCConfigError

# the k = 1..10 the evaluation stage always computes (the P@k / PSP@k curves), whatever evaluate.ks holds
CURVE_KS = tuple(range(1, 11))

MAX_TOKENS = 32_768  # tokens per text at most: longer than any encoder's positions (MiniLM 512, long-context 8,192)
# the common ranges: (least, most or None, what the value is)
EPOCHS, STEPS, WEIGHT, SHARE = (0, None, "epochs"), (0, None, "steps"), (0, None, "a weight"), (0, 1, "a share")
RATE, PROBABILITY = (0, None, "a positive number"), (0, 1, "a probability")  # both in ABOVE_LEAST: > 0
COUNT0, COUNT1, GRAPH_M = (0, None, "a count"), (1, None, "a count"), (2, None, "links per node")
ROWS = (1, None, "rows a batch or chunk")
# "stage.field" -> (least, most or None, what the value is); a tuple field's range holds for each item
BOUNDS: dict[str, tuple[float, float | None, str]] = {
    "ingest.valid_fraction": (0, 1, "a share of the training points (0 = no validation split)"),
    "ingest.valid_max": (0, None, "a number of points (0 = no validation split)"),
    "ingest.valid_min": (0, None, "a number of points (0 = always carve)"),
    "ingest.split": (0, None, "a column of the split tables"),
    "tokenize.max_len": (2, MAX_TOKENS, "tokens per text, the two special tokens included"),
    "tokenize.label_max_len": (2, MAX_TOKENS, "tokens per label text, the two special tokens included "
                                              "(0 = tokenize.max_len)"),
    "index.lexical_char_weight": (0, None, "the lexical source's char n-grams' weight (0 = words only)"),
    "evaluate.ks": (1, 10_000, "the number of predictions each metric reads (at most evaluate.top_k's most)"),
    "evaluate.top_k": (1, 10_000, "predictions kept per test point"),
    "evaluate.propensity_a": (0, None, "propensity A (0 = by dataset family)"),
    "evaluate.propensity_b": (0, None, "propensity B (0 = by dataset family)"),
    **{f"train.{k}": v for k, v in {
        "budget_minutes": (0, None, "minutes (0 = no budget)"), "calibration_steps": (1, None, "timed steps"),
        "calibration_seconds": (0, None, "seconds"), "reserve": (0, 1, "a share of the budget below 1"),
        "max_epochs": (0, None, "epochs (0 = no cap)"),
        "replan_every": (0, 1, "a share of the planned training seconds (0 = never)")}.items()},
    **{f"pretrain.{k}": v for k, v in {
        "epochs": EPOCHS, "batch_size": (2, None, "points per step"), "lr": RATE, "warmup_steps": STEPS,
        "weight_decay": WEIGHT, "margin": WEIGHT, "num_negatives": COUNT0, "temperature": RATE,
        "freeze_layers": (0, None, "layers"), "chunk_size": ROWS, "encode_batch_size": ROWS,
        "max_cluster_size": (1, None, "points per cluster"), "curriculum": (0, None, "epochs"),
        "cluster_every": (1, None, "epochs"), "label_point_cooccurrence": SHARE, "label_power": WEIGHT,
        "centroid_points": COUNT0, "centroid_weight": SHARE, "contrastive_c": PROBABILITY,
        "contrastive_d": RATE, "infonce_temperature": RATE}.items()},
    **{f"mining.{k}": v for k, v in {
        "shortlist_size": COUNT1, "knn_weight": SHARE, "hnsw_m": GRAPH_M, "hnsw_ef_construction": COUNT1,
        "hnsw_ef_search": COUNT1}.items()},
    **{f"classifier.{k}": v for k, v in {
        "epochs": EPOCHS, "batch_size": ROWS, "lr": RATE, "num_positives": COUNT1, "propensity_weight": WEIGHT,
        "scale": RATE, "weight_decay": WEIGHT, "label_point_cooccurrence": SHARE, "num_negatives": COUNT0,
        "cluster_size": COUNT0, "margin": WEIGHT, "contrastive_c": PROBABILITY, "contrastive_d": RATE,
        "neg_threshold": WEIGHT, "residual_lr": RATE, "num_hard": COUNT0, "num_random": COUNT0,
        "hard_start": EPOCHS, "refresh_every": EPOCHS, "sampler_hnsw_m": GRAPH_M,
        "sampler_hnsw_ef": COUNT1, "sampler_hnsw_ef_construction": COUNT1, "mips_partitions": COUNT0,
        "mips_probe": COUNT1, "encoder_lr": WEIGHT, "dropout": (0, 1, "a share below 1"), "warmup_steps": STEPS,
        "shards": COUNT0, "chunk_size": ROWS, "encode_batch_size": ROWS}.items()},
    **{f"fusion.{k}": v for k, v in {
        "cross_fit_folds": (2, None, "folds"), "cross_fit_max_points": COUNT1, "grid_step": (0, 1, "a step"),
        "smoothing": COUNT1, "knn_grid_extend": COUNT0, "lexical_grid_extend": COUNT0,
        "cooccurrence_grid_extend": COUNT0, "propensity_grid_extend": COUNT0, "tree_depth": COUNT1,
        "tree_min_samples_leaf": COUNT1, "tree_max_samples": COUNT0}.items()},
    **{f"index.{k}": v for k, v in {
        "hnsw_m": GRAPH_M, "hnsw_ef_construction": COUNT1, "hnsw_ef_search": COUNT1, "shortlist_size": COUNT1,
        "knn_neighbours": COUNT0, "knn_power": RATE, "lexical_neighbours": COUNT1, "lexical_power": RATE,
        "lexical_min_df": COUNT1, "lexical_max_postings": COUNT0, "lexical_exact_points": COUNT0,
        "lexical_classifier_epochs": RATE, "lexical_classifier_hard_negatives": COUNT0,
        "lexical_classifier_random_negatives": COUNT0, "lexical_classifier_max_terms": COUNT1,
        "lexical_classifier_max_pairs": COUNT1, "lexical_classifier_candidates": COUNT1,
        "lexical_classifier_c": RATE, "cooccurrence_neighbours": COUNT1, "cooccurrence_power": RATE,
        "cooccurrence_max_entries": COUNT1}.items()},
}
# fields whose range excludes its least (a rate, a temperature: > 0) or its most (a share below 1)
ABOVE_LEAST = frozenset(k for k, v in BOUNDS.items() if v in (RATE, PROBABILITY)) | {"fusion.grid_step"}
BELOW_MOST = frozenset({"train.reserve", "classifier.dropout"})
# fields whose 0 has a meaning of its own below their range: tokenize.label_max_len 0 = tokenize.max_len
ZERO_ALLOWED = frozenset({"tokenize.label_max_len"})
SEED_BOUND = (0, None, "a seed")  # every stage's `seed` (numpy refuses a negative one)
# tuple fields with no meaning when empty (`--set index.sources=` would build no index and fail later, unnamed)
NON_EMPTY = frozenset({"index.sources", "mining.sources", "evaluate.ks", "index.lexical_classifier_weights"})


def is_finite_number(value: Any) -> bool:
    """A finite real number, not a bool (True is an int to Python, never a setting's number): what a numeric
    setting checked where it is used (a library call without the config's coercion) must be first."""
    return (not isinstance(value, bool) and isinstance(value, (int, float, np.integer, np.floating))
            and math.isfinite(value))


def check_bounds(key: str, value: Any) -> None:
    """Raise naming ``key`` when its coerced ``value`` (each item of a tuple) is outside the field's range, or is
    empty where the field needs an item."""
    if key in NON_EMPTY and value == ():
        raise XCConfigError(f"config field {key!r}: expected one or more values, got none")
    bound = BOUNDS.get(key) or (SEED_BOUND if key.endswith(".seed") else None)
    if bound is None:
        return
    least, most, meaning = bound
    above, below = key in ABOVE_LEAST, key in BELOW_MOST
    for v in value if isinstance(value, tuple) else (value,):
        out = v < least or (above and v == least) or (most is not None and (v > most or (below and v == most)))
        if out and not (v == 0 and key in ZERO_ALLOWED):
            if most is not None:
                expected = f"{least} {'<' if above else '<='} value {'<' if below else '<='} {most}"
            else:
                expected = f"a value {'>' if above else '>='} {least}"
            if key in ZERO_ALLOWED:
                expected = f"0 or {expected}"
            items = "items each " if isinstance(value, tuple) else ""
            raise XCConfigError(f"config field {key!r}: expected {items}{expected}, {meaning}; got {v!r}")


def check_resolved(cfg: Any) -> None:
    """The ranges that depend on another field of the resolved config ``cfg``: ``evaluate.top_k`` keeps at least
    the largest k the evaluation reports (``evaluate.ks`` and the curves' 1..10), else P@k reads short lists."""
    need = max((*cfg.evaluate.ks, *CURVE_KS))
    if cfg.evaluate.top_k < need:
        raise XCConfigError(
            f"config field 'evaluate.top_k': expected at least {need}, the largest k the evaluation reports "
            f"(evaluate.ks {','.join(map(str, cfg.evaluate.ks))} and k = 1..10 for the curves), "
            f"got {cfg.evaluate.top_k}")
