"""What a served model's request holds: its texts, or its feature vectors, read within the request's bounds.

A model of text reads column ``text``: one query text per row (``as_text``). A model of feature rows (trained on
BoW features without their words, ``serving.json`` ``input: features``) reads column ``features``: one query per
row, as a line of the dataset's feature files, ``"id:value id:value ..."`` (0-based feature ids below the model's
``num_features``; an id given twice sums), or a mapping of id to value; an empty row gets no labels. A bad token,
an id out of range or a value that is not a finite float32 is refused naming the row and the token.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Sequence

import numpy as np
import pandas as pd
import scipy.sparse as sp

from xc_dagster.errors import XCConfigError, XCError
from xc_dagster.serving.limits import RequestLimits, XCRequestError, as_text

TEXT_COLUMN = "text"
FEATURES_COLUMN = "features"
F32_MAX = float(np.finfo(np.float32).max)


def input_values(model_input: Any, column: str) -> Sequence[Any]:
    """The input's values of ``column``, not yet checked: a DataFrame's ``column`` (or only) column, a sequence, one
    value, or a mapping's ``column``."""
    if isinstance(model_input, pd.DataFrame):
        if column in model_input.columns:
            return model_input[column]
        if model_input.shape[1] == 1:
            return model_input.iloc[:, 0]
        raise XCError(f"model input: expected a column {column!r}, got columns {list(model_input.columns)}")
    if isinstance(model_input, Mapping) and column in model_input:
        model_input = model_input[column]
    if isinstance(model_input, (str, bytes, bytearray)) or (column == FEATURES_COLUMN
                                                            and isinstance(model_input, Mapping)):
        return [model_input]
    if isinstance(model_input, (list, tuple, pd.Series, np.ndarray)):
        return model_input
    raise XCError(f"model input: expected a DataFrame with a {column!r} column, got {type(model_input).__name__}")


def input_texts(model_input: Any, limits: RequestLimits | None = None) -> list[str]:
    """The texts of a pyfunc input (``bytes`` decoded as UTF-8, None / NaN as ""), within ``limits``: the number
    of values is checked before any is read, the characters once they are decoded."""
    values = input_values(model_input, TEXT_COLUMN)
    if limits is not None:
        limits.check_count(len(values))
    texts = [as_text(v, i) for i, v in enumerate(values)]
    if limits is not None:
        limits.check_chars(texts)
    return texts


def _pairs(value: Any, row: int) -> list[tuple[Any, Any]]:
    """One row's (id, value) tokens as written: a line's ``id:value`` tokens, or a mapping's items."""
    if isinstance(value, Mapping):
        return list(value.items())
    text = as_text(value, row)
    out = []
    for tok in text.split():
        i, sep, v = tok.partition(":")
        if not sep:
            raise XCRequestError(f"model input row {row}: token {tok!r}: expected id:value")
        out.append((i, v))
    return out


def _feature(i: Any, v: Any, row: int, num_features: int) -> tuple[int, float]:
    try:
        fid = int(i) if not isinstance(i, (bool, np.bool_, float)) else None
        val = float(v) if not isinstance(v, (bool, np.bool_)) else None
    except (TypeError, ValueError):
        fid = val = None
    if fid is None or val is None or not 0 <= fid < num_features or not math.isfinite(val) or abs(val) > F32_MAX:
        raise XCRequestError(f"model input row {row}: feature {i!r}:{v!r}: expected an id in [0, {num_features}) "
                             f"and a finite float32 value")
    return fid, val


def input_features(model_input: Any, num_features: int, limits: RequestLimits | None = None) -> sp.csr_matrix:
    """The feature rows (n, ``num_features``) float32 CSR of a pyfunc input (module docstring), within ``limits``:
    the number of rows is checked before any is read, the characters (a mapping's items as ``id:value``) before
    any is parsed."""
    values = input_values(model_input, FEATURES_COLUMN)
    if limits is not None:
        limits.check_count(len(values), "feature rows")
    rows = [_pairs(v, r) for r, v in enumerate(values)]
    if limits is not None:
        limits.check_chars([" ".join(f"{i}:{v}" for i, v in pairs) for pairs in rows], "feature rows")
    ids, vals, lengths = [], [], []
    for r, pairs in enumerate(rows):
        for i, v in pairs:
            fid, val = _feature(i, v, r, num_features)
            ids.append(fid)
            vals.append(val)
        lengths.append(len(pairs))
    X = sp.csr_matrix((np.asarray(vals, np.float64), np.asarray(ids, np.int64),
                       np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])), shape=(len(rows), num_features))
    X.sum_duplicates()
    if (big := np.flatnonzero(np.abs(X.data) > F32_MAX)).size:
        row = int(np.searchsorted(X.indptr, big[0], side="right") - 1)
        raise XCRequestError(f"model input row {row}: an id given twice sums past float32")
    return sp.csr_matrix(X, dtype=np.float32)


def feature_lines(X: sp.spmatrix) -> list[str]:
    """Feature rows as request lines, ``"id:value ..."`` (the inverse of :func:`input_features`)."""
    X = sp.csr_matrix(X)
    return [" ".join(f"{i}:{v:g}" for i, v in zip(X.indices[s:e], X.data[s:e]))
            for s, e in zip(X.indptr[:-1], X.indptr[1:])]


def param_k(params: Mapping[str, Any] | None, default: int) -> int:
    k = (params or {}).get("k", default)
    try:
        k = int(k)
    except (TypeError, ValueError):
        raise XCConfigError(f"param k: expected an integer, got {k!r}") from None
    if k < 1:
        raise XCConfigError(f"param k: expected >= 1, got {k}")
    return k
