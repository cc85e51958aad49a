"""What a served model's request holds: its texts, or its feature vectors, read within the request's bounds.

A model of text reads column ``text``: one query text per row (``as_text``). A model of feature rows (trained on
BoW features without their words, ``serving.json`` ``input: features``) reads column ``features``: one query per
row, as a line of the dataset's feature files, ``"id:value id:value ..."`` (0-based feature ids below the model's
``num_features``; an id given twice sums), or a mapping of id to value; an empty row gets no labels. A bad token,
an id out of range or a value that is not a finite float32 is refused naming the row and the token; so is, for a
model whose lexical TF-IDF was fitted on counts (sublinear tf, 1 + log(v): a value under 1 would turn its term's
weight down or negative, a negative one NaN), a value that is not a count: a whole number >= 1, or 0 (absent, as
the training files' zeros), as ``xc_dagster.retrieval.tfidf.are_counts`` read the training features.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any, Sequence

import numpy as np
import pandas as pd
import scipy.sparse as sp

from xc_dagster.errors import XCError
from xc_dagster.serving.limits import RequestLimits, XCRequestError, as_text

TEXT_COLUMN = "text"
FEATURES_COLUMN = "features"
F32_MAX = float(np.finfo(np.float32).max)


def input_values(model_input: Any, column: str) -> Sequence[Any]:
    """The input's values of ``column``, not yet checked: a DataFrame's ``column`` (or only) column, a sequence, one
    value, or a mapping's ``column``."""
    if isinstance(model_input, pd.DataFrame):
        if (same := int((model_input.columns == column).sum())) > 1:  # df[column] would be a DataFrame
            raise XCRequestError(f"model input: column {column!r} given {same} times; send it once")
        if column in model_input.columns:
            return model_input[column]
        if model_input.shape[1] == 1:
            return model_input.iloc[:, 0]
        raise XCError(f"model input: expected a column {column!r}, got columns {list(model_input.columns)}")
    if isinstance(model_input, Mapping) and column in model_input:
        model_input = model_input[column]
    if isinstance(model_input, np.ndarray) and model_input.ndim == 0:  # one value, as an array of no dimension
        model_input = model_input.item()
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


def _shown(x: Any, width: int = 40) -> str:
    """``repr(x)``, cut to ``width`` characters: an error names a token without echoing a huge one."""
    r = repr(x)
    return r if len(r) <= width else r[:width - 3] + "..."


def _row(value: Any, row: int) -> str | Mapping:
    """One row as sent: a mapping as it is, anything else as its text."""
    return value if isinstance(value, Mapping) else as_text(value, row)


def _row_chars(value: str | Mapping, row: int) -> int:
    """A row's characters: a text's, or its mapping's items written as ``id:value`` tokens, without parsing."""
    if not isinstance(value, Mapping):
        return len(value)
    try:
        return max(0, sum(len(str(i)) + len(str(v)) + 2 for i, v in value.items()) - 1)  # joined by spaces
    except (TypeError, ValueError, OverflowError) as e:  # e.g. an int past Python's digits limit of str()
        raise XCRequestError(f"model input row {row}: a feature that cannot be read as id:value ({e})") from None


def _pairs(value: str | Mapping, row: int) -> list[tuple[Any, Any]]:
    """One row's (id, value) tokens as written: a line's ``id:value`` tokens, or a mapping's items."""
    if isinstance(value, Mapping):
        return list(value.items())
    out = []
    for tok in value.split():
        i, sep, v = tok.partition(":")
        if not sep:
            raise XCRequestError(f"model input row {row}: token {_shown(tok)}: expected id:value")
        out.append((i, v))
    return out


def _feature(i: Any, v: Any, row: int, num_features: int, counts: bool) -> tuple[int, float]:
    try:
        fid = int(i) if not isinstance(i, (bool, np.bool_, float)) else None
        val = float(v) if not isinstance(v, (bool, np.bool_)) else None
    except (TypeError, ValueError, OverflowError):  # OverflowError: an int too large for a float
        fid = val = None
    if fid is None or val is None or not 0 <= fid < num_features or not math.isfinite(val) or abs(val) > F32_MAX:
        raise XCRequestError(f"model input row {row}: feature {_shown(i)}:{_shown(v)}: expected an id in "
                             f"[0, {num_features}) and a finite float32 value")
    if counts and not (val == 0 or (val >= 1 and val.is_integer())):
        raise XCRequestError(f"model input row {row}: feature {_shown(i)}:{_shown(v)}: this model's TF-IDF was "
                             "fitted on counts; expected a whole number >= 1 (or 0: absent)")
    return fid, val


def input_features(model_input: Any, num_features: int, limits: RequestLimits | None = None,
                   counts: bool = False) -> sp.csr_matrix:
    """The feature rows (n, ``num_features``) float32 CSR of a pyfunc input (module docstring), within ``limits``:
    the number of rows is checked before any is read, the characters (a mapping's items as ``id:value``) before
    any is parsed. ``counts``: the model's TF-IDF was fitted on counts, so each value must be one."""
    values = input_values(model_input, FEATURES_COLUMN)
    if limits is not None:
        limits.check_count(len(values), "feature rows")
    sent = [_row(v, r) for r, v in enumerate(values)]
    if limits is not None:
        limits.check_total(sum(_row_chars(v, r) for r, v in enumerate(sent)), "feature rows")
    ids, vals, lengths = [], [], []
    for r, value in enumerate(sent):
        pairs = _pairs(value, r)
        for i, v in pairs:
            fid, val = _feature(i, v, r, num_features, counts)
            ids.append(fid)
            vals.append(val)
        lengths.append(len(pairs))
    X = sp.csr_matrix((np.asarray(vals, np.float64), np.asarray(ids, np.int64),
                       np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])), shape=(len(sent), num_features))
    X.sum_duplicates()
    if (big := np.flatnonzero(np.abs(X.data) > F32_MAX)).size:
        row = int(np.searchsorted(X.indptr, big[0], side="right") - 1)
        raise XCRequestError(f"model input row {row}: an id given twice sums past float32")
    return sp.csr_matrix(X, dtype=np.float32)


def check_counts(X: sp.csr_matrix, counts: bool) -> None:
    """With ``counts`` (a model whose TF-IDF was fitted on counts), raise :class:`XCRequestError` naming the first
    row of ``X`` (CSR) holding a stored value that is not a whole number >= 1."""
    bad = np.flatnonzero((X.data < 1) | (X.data != np.rint(X.data))) if counts else ()
    if len(bad):
        row = int(np.searchsorted(X.indptr, bad[0], side="right") - 1)
        raise XCRequestError(f"feature row {row}: value {X.data[bad[0]]:g}: this model's TF-IDF was fitted on counts; "
                             "expected whole numbers >= 1")


def feature_lines(X: sp.spmatrix) -> list[str]:
    """Feature rows as request lines, ``"id:value ..."`` (the inverse of :func:`input_features`)."""
    X = sp.csr_matrix(X)
    return [" ".join(f"{i}:{v:g}" for i, v in zip(X.indices[s:e], X.data[s:e]))
            for s, e in zip(X.indptr[:-1], X.indptr[1:])]


def param_k(params: Mapping[str, Any] | None, default: int) -> int:
    """The request's ``k``: an integer >= 1 (an integral float such as 5.0, or its text, reads as one)."""
    if params is not None and not isinstance(params, Mapping):
        raise XCRequestError(f"params: expected a mapping such as {{\"k\": 10}}, got {type(params).__name__}")
    raw = (params or {}).get("k", default)
    k = None
    if isinstance(raw, (float, np.floating)):
        k = int(raw) if math.isfinite(raw) and float(raw).is_integer() else None
    elif isinstance(raw, str):  # digits, or an integral float's text: not int()'s "5_0" or " +5 "
        k = int(raw.partition(".")[0]) if re.fullmatch(r"\d{1,18}(\.0*)?", raw) else None
    elif not isinstance(raw, (bool, np.bool_)):
        try:
            k = int(raw)
        except (TypeError, ValueError, OverflowError):
            k = None
    if k is None or k < 1:
        raise XCRequestError(f"param k: expected an integer >= 1, got {_shown(raw)}")
    return k
