"""Reading and validating click-log files (the input of :mod:`xc_dagster.data.clicklog`).

A click log is Parquet, CSV or JSON-lines (``.gz`` allowed for CSV/JSONL) with one row per (query, label,
time): ``query`` text, ``label_id`` and/or ``label`` text, ``clicks`` (>= 1, default 1) and ``timestamp``
(ISO-8601 or epoch seconds/milliseconds). Every bad row raises :class:`XCFormatError` naming the file, the row
(1-based file line for CSV/JSONL, with the CSV header as line 1; 1-based row for Parquet) and what was expected.
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

from xc_dagster.data.archives import COPY_CHUNK
from xc_dagster.data.limits import Expansion
from xc_dagster.errors import XCDatasetNotFound, XCFormatError

COLUMNS = ("query", "label_id", "label", "clicks", "timestamp")
EPOCH_MS_THRESHOLD = 1e11  # |value| >= 1e11 is epoch milliseconds (1973+), below it epoch seconds
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


def expand_log_paths(log_paths: Sequence[Path | str]) -> list[Path]:
    """Files, folders (every click-log file below, recursively) and glob patterns -> sorted unique files."""
    out: set[Path] = set()
    for item in log_paths:
        s = str(item)
        if any(c in s for c in "*?["):
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
    lines = pd.Series(text.lstrip("\ufeff").splitlines(), dtype=object)
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
    except ValueError:
        for i, s in enumerate(body):  # error path only: find the offending line
            try:
                if not isinstance(json.loads(s), dict):
                    raise ValueError
            except ValueError:
                raise XCFormatError(path, int(rows[i]), "a valid JSON object per line", got=s) from None
        raise
    if len(df) != len(rows):
        raise XCFormatError(path, None, "one JSON object per line", got=f"{len(df)} records in {len(rows)} lines")
    return df, rows


# ------------------------------------------------------------------------------------- validation

def _present(s: pd.Series) -> pd.Series:
    """True where a value is given (not null, not an empty/blank string)."""
    txt = s.astype("string").str.strip()
    return (s.notna() & txt.notna() & (txt != "")).fillna(False).astype(bool)


def _integers(s: pd.Series, given: pd.Series) -> tuple[pd.Series, pd.Series]:
    """Numeric values of ``s`` and the mask of given values that are not finite integers."""
    if pd.api.types.is_bool_dtype(s):
        num = pd.Series(np.nan, index=s.index)
    else:
        num = pd.to_numeric(s.where(given), errors="coerce").astype("float64")
    ok = np.isfinite(num) & (num == np.floor(num))
    return num, given & ~ok


def parse_timestamps(s: pd.Series) -> pd.Series:
    """ISO-8601 strings (naive = UTC) or epoch seconds/milliseconds -> UTC timestamps (NaT where invalid)."""
    if pd.api.types.is_datetime64_any_dtype(s):
        ts = s.dt.tz_localize("UTC") if s.dt.tz is None else s.dt.tz_convert("UTC")
        return ts.astype("datetime64[ns, UTC]")
    if pd.api.types.is_bool_dtype(s):
        return pd.Series(pd.NaT, index=s.index, dtype="datetime64[ns, UTC]")
    num = pd.to_numeric(s, errors="coerce").astype("float64")
    ms = num.where(num.abs() >= EPOCH_MS_THRESHOLD, num * 1000.0)
    out = pd.to_datetime(ms.where(np.isfinite(ms)), unit="ms", utc=True, errors="coerce")
    out = out.astype("datetime64[ns, UTC]")
    iso = num.isna() & s.notna()
    if iso.any():
        parsed = pd.to_datetime(s[iso].astype("string").str.strip(), format="ISO8601", utc=True, errors="coerce")
        out[iso] = parsed.astype("datetime64[ns, UTC]")
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
    lid, bad_lid = _integers(lid_raw, has_lid)
    bad_lid = bad_lid | (has_lid & (lid < 0))
    has_clk = _present(clk_raw)
    clk, bad_clk = _integers(clk_raw, has_clk)
    bad_clk = bad_clk | (has_clk & (clk < 1))
    has_ts = _present(ts_raw)
    ts = parse_timestamps(ts_raw.where(has_ts))
    _first_bad(path, rows, [
        (~has_q, "a non-empty 'query'", q_raw),
        (~has_lid & ~has_lab, "a 'label_id' or a 'label' (label text)", lab_raw),
        (bad_lid, "'label_id' to be a non-negative integer", lid_raw),
        (bad_clk, "'clicks' to be a positive integer (>= 1)", clk_raw),
        (~has_ts, "a 'timestamp'", ts_raw),
        (has_ts & ts.isna(), "'timestamp' as ISO-8601 text or epoch seconds/milliseconds", ts_raw),
    ])
    return pd.DataFrame({
        "query": q_raw.astype("string").str.strip(),
        "label_id": lid.where(has_lid).astype("Int64"),
        "label": lab_raw.astype("string").str.strip().where(has_lab),
        "clicks": clk.where(has_clk, 1.0).astype("int64"),
        "ts": ts,
        "row": rows.astype("int64"),
    })
