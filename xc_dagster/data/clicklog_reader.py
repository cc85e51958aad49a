"""Reading and validating click-log files (the input of :mod:`xc_dagster.data.clicklog`).

A click log is Parquet, CSV or JSON-lines (``.gz`` allowed for CSV/JSONL) with one row per (query, label,
time): ``query`` text, ``label_id`` and/or ``label`` text, ``clicks`` (>= 1, default 1) and ``timestamp``
(ISO-8601 or epoch seconds/milliseconds). Every bad row raises :class:`XCFormatError` naming the file, the row
(1-based file line for CSV/JSONL, with the CSV header as line 1; 1-based row for Parquet) and what was expected.
``query`` and ``label`` must be text (an integer reads as its digits); a JSON ``true``/``false``, object or list is
never read as a number or a timestamp; ``clicks`` and ``label_id`` are at most :data:`MAX_COUNT`; timestamps must
fall in 1677-09-22..2262-04-11.
"""

from __future__ import annotations

import glob
import gzip
import io
import json
import math
import zlib
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd
from pandas.errors import OutOfBoundsDatetime

from xc_dagster.data.archives import COPY_CHUNK
from xc_dagster.data.limits import Expansion
from xc_dagster.errors import XCDatasetNotFound, XCFormatError

COLUMNS = ("query", "label_id", "label", "clicks", "timestamp")
EPOCH_MS_THRESHOLD = 1e11  # |value| >= 1e11 is epoch milliseconds (1973+), below it epoch seconds
MAX_COUNT = 2**53 - 1  # largest clicks / label_id: every integer up to it is exact in float64, and sums stay in int64
_TS_MIN, _TS_MAX = pd.Timestamp.min.tz_localize("UTC"), pd.Timestamp.max.tz_localize("UTC")  # the ns range
_EXTS = {".parquet": "parquet", ".pq": "parquet", ".csv": "csv", ".jsonl": "jsonl", ".ndjson": "jsonl",
         ".json": "jsonl"}


# ------------------------------------------------------------------------------------------ formats

def log_format(path: Path) -> str | None:
    """``parquet``, ``csv`` or ``jsonl`` from the file name (a trailing ``.gz`` allowed for csv/jsonl)."""
    name = path.name.lower()
    gz = name.endswith(".gz")
    if gz:
        name = name[:-3]
    fmt = _EXTS.get(Path(name).suffix)
    if fmt == "parquet" and gz:
        return None
    return fmt


def expand_log_paths(log_paths: Sequence[Path | str], *, literal: bool = False) -> list[Path]:
    """Files, folders (every click-log file below, recursively) and glob patterns -> sorted unique files.

    ``literal``: every item is a path as named, never a pattern (a feed's file may be called ``day[1].csv``).
    """
    out: set[Path] = set()
    for item in log_paths:
        s = str(item)
        if literal:
            hits = [Path(s)]
        elif any(c in s for c in "*?["):
            hits = [Path(h) for h in glob.glob(s, recursive=True)]
            if not hits:
                raise XCDatasetNotFound(f"click logs: the pattern {s} matches no file")
        else:
            hits = [Path(s).expanduser()]
        for p in hits:
            if p.is_dir():
                found = [f for f in p.rglob("*") if f.is_file() and log_format(f) is not None]
                if not found:
                    raise XCDatasetNotFound(f"click logs: the folder {p} holds no .parquet, .csv or .jsonl file")
                out.update(found)
            elif p.is_file():
                if log_format(p) is None:
                    raise XCFormatError(p, None, "a click-log file ending in .parquet, .csv[.gz] or .jsonl[.gz]",
                                        got=p.name)
                out.add(p)
            else:
                raise XCDatasetNotFound(f"click logs: {p} does not exist")
    if not out:
        raise XCDatasetNotFound("click logs: no log file given")
    return sorted(out)


def _read_raw(path: Path, fmt: str) -> tuple[pd.DataFrame, np.ndarray]:
    """The file's table (as read) and the 1-based line/row number of each of its rows."""
    gz = path.name.lower().endswith(".gz")
    try:
        if fmt == "parquet":
            try:
                df = pd.read_parquet(path)
            except Exception as e:  # pyarrow raises several types on corrupt files
                raise XCFormatError(path, None, "a valid Parquet file", got=f"{type(e).__name__}: {e}") from e
            return df.reset_index(drop=True), np.arange(1, len(df) + 1)
        if fmt == "csv":
            try:
                df = pd.read_csv(io.BytesIO(_unpacked(path)) if gz else path, dtype=str, keep_default_na=False,
                                 na_values=[""], skip_blank_lines=False, encoding="utf-8")
            except pd.errors.EmptyDataError:
                raise XCFormatError(path, 1, "a CSV header naming the columns query, timestamp, label_id/label",
                                    got="an empty file") from None
            except pd.errors.ParserError as e:
                raise XCFormatError(path, None, "well-formed CSV", got=str(e)) from e
            rows = np.arange(2, len(df) + 2)
            blank = df.isna().all(axis=1).to_numpy()
            return df[~blank].reset_index(drop=True), rows[~blank]
        return _read_jsonl(path, gz)
    except UnicodeDecodeError as e:
        raise XCFormatError(path, None, "UTF-8 text", got=f"undecodable bytes at offset {e.start}") from e
    except (EOFError, zlib.error, gzip.BadGzipFile) as e:
        raise XCFormatError(path, None, "a complete, valid gzip file", got=f"{type(e).__name__}: {e}") from e


def _unpacked(path: Path) -> bytes:
    """A ``.gz`` log's bytes, refused once they pass the input limits' expansion cap (a decompression bomb):
    docs/decisions.md#ingest-input-limits."""
    expansion, parts = Expansion(path, path.stat().st_size), []
    with gzip.open(path, "rb") as fh:
        while chunk := fh.read(COPY_CHUNK):
            expansion.add(len(chunk))
            parts.append(chunk)
    return b"".join(parts)


def _read_jsonl(path: Path, gz: bool) -> tuple[pd.DataFrame, np.ndarray]:
    data = _unpacked(path) if gz else path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[:e.start].count(b"\n") + 1
        raise XCFormatError(path, line, "UTF-8 text", got=f"undecodable bytes at byte {e.start}") from e
    # "\n" only: str.splitlines() also splits at U+2028 and other breaks that JSON strings may hold raw
    lines = pd.Series(text.lstrip("\ufeff").split("\n"), dtype=object)
    stripped = lines.str.strip()
    keep = (stripped != "").to_numpy()
    rows = np.flatnonzero(keep) + 1
    body = stripped[keep]
    not_obj = ~(body.str.startswith("{") & body.str.endswith("}")).to_numpy()
    if not_obj.any():
        i = int(np.argmax(not_obj))
        raise XCFormatError(path, int(rows[i]), "a JSON object per line", got=str(body.iloc[i]))
    if len(body) == 0:
        return pd.DataFrame(), rows
    try:
        df = pd.read_json(io.StringIO("\n".join(body)), lines=True, dtype=False)
    except ValueError as e:
        df = _jsonl_records(path, body, rows, e)
    if len(df) != len(rows):
        raise XCFormatError(path, None, "one JSON object per line", got=f"{len(df)} records in {len(rows)} lines")
    return df, rows


def _jsonl_records(path: Path, body: pd.Series, rows: np.ndarray, error: ValueError) -> pd.DataFrame:
    """The lines parsed one by one, when pandas cannot read them (an invalid line, or a number past 64 bits):
    names the first line that is no JSON object, else returns the table (values are checked later)."""
    records = []
    for i, s in enumerate(body):
        try:
            rec = json.loads(s)
        except ValueError:
            rec = None
        if not isinstance(rec, dict):
            raise XCFormatError(path, int(rows[i]), "a valid JSON object per line", got=s) from None
        records.append(rec)
    try:
        return pd.DataFrame.from_records(records)
    except (ValueError, TypeError, OverflowError) as e:
        raise XCFormatError(path, None, "JSON lines of plain values", got=f"{type(error).__name__}: {error}; "
                                                                          f"{type(e).__name__}: {e}") from e


# ------------------------------------------------------------------------------------- validation

def _present(s: pd.Series) -> pd.Series:
    """True where a value is given (not null, not an empty/blank string)."""
    txt = s.astype("string").str.strip()
    return (s.notna() & txt.notna() & (txt != "")).fillna(False).astype(bool)


def _not_plain(s: pd.Series) -> pd.Series:
    """True at JSON true/false, objects and lists in an object column: never read as a number or a time."""
    plain = ("string", "integer", "floating", "mixed-integer-float", "empty")
    if s.dtype != object or pd.api.types.infer_dtype(s, skipna=True) in plain:
        return pd.Series(False, index=s.index)
    return s.map(lambda v: isinstance(v, (bool, np.bool_, dict, list))).astype(bool)


def _not_text(s: pd.Series, given: pd.Series) -> pd.Series:
    """Given values that are neither strings nor integers (read as their decimal text: numeric label names in a
    Parquet int column or JSON): a float (42.0 would be the text "42.0"), true/false, an object or a list."""
    if isinstance(s.dtype, pd.StringDtype) or (pd.api.types.is_integer_dtype(s) and not pd.api.types.is_bool_dtype(s)):
        return pd.Series(False, index=s.index)
    obj = s.astype(object)
    if pd.api.types.infer_dtype(obj, skipna=True) in ("string", "integer", "empty"):
        return pd.Series(False, index=s.index)
    return given & ~obj.map(lambda v: isinstance(v, (str, int, np.integer)) and not isinstance(v, (bool, np.bool_))
                            ).astype(bool)


def _integers(s: pd.Series, given: pd.Series) -> tuple[pd.Series, pd.Series]:
    """Numeric values of ``s`` and the mask of given values that are not finite integers up to MAX_COUNT."""
    if pd.api.types.is_bool_dtype(s):
        num = pd.Series(np.nan, index=s.index)
    else:
        num = pd.to_numeric(s.where(given & ~_not_plain(s)), errors="coerce").astype("float64")
    ok = np.isfinite(num) & (num == np.floor(num)) & (num.abs() <= MAX_COUNT)
    return num.where(ok), given & ~ok


def _ns(ts: pd.Series) -> pd.Series:
    """UTC timestamps of any resolution -> nanoseconds, NaT outside that range (1677-09-22..2262-04-11)."""
    return ts.where((ts >= _TS_MIN) & (ts <= _TS_MAX)).astype("datetime64[ns, UTC]")


def _iso_times(text: pd.Series) -> pd.Series:
    """ISO-8601 texts -> UTC (NaT where invalid); a text must start with a digit (pandas would take ``now``)."""
    text = text.where(text.str.match(r"[+-]?\d").fillna(False).astype(bool))
    try:
        return _ns(pd.to_datetime(text, format="ISO8601", utc=True, errors="coerce"))
    except (OutOfBoundsDatetime, OverflowError, ValueError):  # a year pandas cannot hold: parse one by one
        return pd.Series([_one_iso(v) for v in text], index=text.index, dtype="datetime64[ns, UTC]")


def _one_iso(v: object) -> pd.Timestamp:
    """One ISO text -> UTC, NaT where invalid or outside the ns range (the slow path of :func:`_iso_times`)."""
    try:
        t = pd.to_datetime(v, format="ISO8601", utc=True, errors="coerce") if isinstance(v, str) else pd.NaT
    except (OutOfBoundsDatetime, OverflowError, ValueError):
        return pd.NaT
    return t if t is not pd.NaT and _TS_MIN <= t <= _TS_MAX else pd.NaT


def parse_timestamps(s: pd.Series) -> pd.Series:
    """ISO-8601 strings (naive = UTC) or epoch seconds/milliseconds -> UTC timestamps in ns (NaT where invalid,
    out of the ns range, or a JSON true/false, object or list)."""
    if pd.api.types.is_datetime64_any_dtype(s):
        return _ns(s.dt.tz_localize("UTC") if s.dt.tz is None else s.dt.tz_convert("UTC"))
    if pd.api.types.is_bool_dtype(s):
        return pd.Series(pd.NaT, index=s.index, dtype="datetime64[ns, UTC]")
    s = s.where(~_not_plain(s))
    num = pd.to_numeric(s, errors="coerce").astype("float64")
    ms = num.where(num.abs() >= EPOCH_MS_THRESHOLD, num * 1000.0)
    ms = ms.where(np.isfinite(ms) & (ms.abs() < 9.2e15))  # past 2262 either way; keeps to_datetime in range
    out = _ns(pd.to_datetime(ms, unit="ms", utc=True, errors="coerce"))
    iso = num.isna() & s.notna()
    if iso.any():
        out[iso] = _iso_times(s[iso].astype("string").str.strip())
    return out


def _first_bad(path: Path, rows: np.ndarray, checks: list[tuple[pd.Series, str, pd.Series]]) -> None:
    """Raise for the earliest row failing any check (``(mask, expected, shown value)``, in check order)."""
    best: tuple[int, int] | None = None
    for k, (mask, _, _) in enumerate(checks):
        m = mask.to_numpy(dtype=bool)
        if m.any():
            i = int(np.argmax(m))
            if best is None or i < best[0]:
                best = (i, k)
    if best is not None:
        i, k = best
        _, expected, shown = checks[k]
        v = shown.iloc[i]
        raise XCFormatError(path, int(rows[i]), expected, got="nothing" if v is None or v is pd.NA or
                            (isinstance(v, float) and math.isnan(v)) else str(v))


def read_click_log(path: Path | str) -> pd.DataFrame:
    """One click-log file -> validated columns ``query``, ``label_id`` (Int64), ``label``, ``clicks``
    (int64), ``ts`` (UTC) and ``row`` (the line/row number errors name)."""
    path = Path(path)
    fmt = log_format(path)
    if fmt is None:
        raise XCFormatError(path, None, "a click-log file ending in .parquet, .csv[.gz] or .jsonl[.gz]",
                            got=path.name)
    df, rows = _read_raw(path, fmt)
    header_line = 1 if fmt == "csv" else None
    cols = [str(c) for c in df.columns]
    df.columns = cols
    if len(df) and "query" not in cols:
        raise XCFormatError(path, header_line, "a 'query' column", got="columns " + ", ".join(cols))
    if len(df) and "timestamp" not in cols:
        raise XCFormatError(path, header_line, "a 'timestamp' column", got="columns " + ", ".join(cols))
    if len(df) and "label_id" not in cols and "label" not in cols:
        raise XCFormatError(path, header_line, "a 'label_id' or a 'label' column", got="columns " + ", ".join(cols))
    n = len(df)
    none = pd.Series([None] * n, index=df.index, dtype=object)
    q_raw, lid_raw = df.get("query", none), df.get("label_id", none)
    lab_raw, clk_raw, ts_raw = df.get("label", none), df.get("clicks", none), df.get("timestamp", none)

    has_q, has_lid, has_lab = _present(q_raw), _present(lid_raw), _present(lab_raw)
    bad_q, bad_lab = _not_text(q_raw, has_q), _not_text(lab_raw, has_lab)
    lid, bad_lid = _integers(lid_raw, has_lid)
    bad_lid = bad_lid | (has_lid & (lid < 0))
    has_clk = _present(clk_raw)
    clk, bad_clk = _integers(clk_raw, has_clk)
    bad_clk = bad_clk | (has_clk & (clk < 1))
    has_ts = _present(ts_raw)
    ts = parse_timestamps(ts_raw.where(has_ts))
    _first_bad(path, rows, [
        (~has_q, "a non-empty 'query'", q_raw),
        (bad_q, "'query' as text (a string)", q_raw),
        (~has_lid & ~has_lab, "a 'label_id' or a 'label' (label text)", lab_raw),
        (bad_lab, "'label' as text (a string)", lab_raw),
        (bad_lid, f"'label_id' to be a non-negative integer (at most {MAX_COUNT})", lid_raw),
        (bad_clk, f"'clicks' to be a positive integer (>= 1, at most {MAX_COUNT})", clk_raw),
        (~has_ts, "a 'timestamp'", ts_raw),
        (has_ts & ts.isna(), "'timestamp' as ISO-8601 text or epoch seconds/milliseconds, "
                             "from 1677-09-22 to 2262-04-11", ts_raw),
    ])
    return pd.DataFrame({
        "query": q_raw.astype("string").str.strip(),
        "label_id": lid.where(has_lid).astype("Int64"),
        "label": lab_raw.astype("string").str.strip().where(has_lab),
        "clicks": clk.where(has_clk, 1.0).astype("int64"),
        "ts": ts,
        "row": rows.astype("int64"),
    })
