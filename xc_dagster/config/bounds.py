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

# "stage.field" -> (least, most or None, what the value is); a tuple field's range holds for each item
BOUNDS: dict[str, tuple[float, float | None, str]] = {
    "ingest.valid_fraction": (0, 1, "a share of the training points (0 = no validation split)"),
    "ingest.valid_max": (0, None, "a number of points (0 = no validation split)"),
    "ingest.valid_min": (0, None, "a number of points (0 = always carve)"),
    "ingest.split": (0, None, "a column of the split tables"),
    "tokenize.max_len": (2, None, "tokens per text, the two special tokens included"),
    "tokenize.label_max_len": (2, None, "tokens per label text, the two special tokens included "
                                        "(0 = tokenize.max_len)"),
    "index.lexical_char_weight": (0, None, "the lexical source's char n-grams' weight (0 = words only)"),
    "evaluate.ks": (1, None, "the number of predictions each metric reads"),
    "evaluate.top_k": (1, None, "predictions kept per test point"),
    "evaluate.propensity_a": (0, None, "propensity A (0 = by dataset family)"),
    "evaluate.propensity_b": (0, None, "propensity B (0 = by dataset family)"),
}
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
    for v in value if isinstance(value, tuple) else (value,):
        if (v < least or (most is not None and v > most)) and not (v == 0 and key in ZERO_ALLOWED):
            expected = f"{least} <= value <= {most}" if most is not None else f"a value >= {least}"
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
