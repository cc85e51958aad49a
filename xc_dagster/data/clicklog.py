"""Click logs -> an LF raw-text dataset partition over a time window (see ``docs/CLICKLOGS.md``).

A click log is Parquet, CSV or JSON-lines (``.gz`` allowed for CSV/JSONL) with one row per (query, label,
time): ``query`` text, ``label_id`` and/or ``label`` text, ``clicks`` (>= 1, default 1) and ``timestamp``
(ISO-8601 or epoch seconds/milliseconds). :func:`build_click_dataset` keeps the rows of ``[start, end)``,
aggregates them by query text (queries become points, labels clicked at least ``min_clicks`` times their
positives, the click counts their ``target_rel``), gives new label texts new ids appended to the previous
window's ``label_map.json`` (ids never change across windows), splits train/test by time (the latest
queries are the test set) and writes ``trn.json.gz``, ``tst.json.gz``, ``lbl.json.gz`` and ``label_map.json``
atomically, a folder that :func:`xc_dagster.data.read_dataset` reads unchanged (layout ``lf-raw``).

Every bad row raises :class:`XCFormatError` naming the file, the row (1-based file line for CSV/JSONL, with
the CSV header as line 1; 1-based row for Parquet) and what was expected.
"""

from __future__ import annotations

import glob
import gzip
import io
import json
import math
import zlib
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from xc_dagster.errors import XCConfigError, XCDatasetNotFound, XCError, XCFormatError
from xc_dagster.storage import atomic_dir

COLUMNS = ("query", "label_id", "label", "clicks", "timestamp")
LABEL_MAP = "label_map.json"
SUMMARY = "clicklog.json"
MAP_FORMAT = "xc-dagster-label-map"
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
                df = pd.read_csv(path, dtype=str, keep_default_na=False, na_values=[""], skip_blank_lines=False,
                                 compression="gzip" if gz else None, encoding="utf-8")
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


def _read_jsonl(path: Path, gz: bool) -> tuple[pd.DataFrame, np.ndarray]:
    data = gzip.open(path, "rb").read() if gz else path.read_bytes()
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


# -------------------------------------------------------------------------------------- label map

def load_label_map(path: Path | str | None) -> list[str]:
    """Label texts by id from a ``label_map.json`` (or a previous window folder holding one); [] for None.

    Accepts ``{"labels": {text: id}}`` (as written here) or a bare ``{text: id}`` object; the ids must be
    exactly 0..N-1.
    """
    if path is None:
        return []
    p = Path(path)
    if p.is_dir():
        p = p / LABEL_MAP
    if not p.is_file():
        raise XCDatasetNotFound(f"label map {p} does not exist")
    try:
        raw = json.loads(p.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise XCFormatError(p, None, "a JSON object {\"labels\": {label text: id}}", got=str(e)) from e
    m = raw.get("labels") if isinstance(raw, dict) and isinstance(raw.get("labels"), dict) else raw
    if not isinstance(m, dict) or any(type(v) is not int for v in m.values()):
        raise XCFormatError(p, None, "a JSON object {\"labels\": {label text: integer id}}", got=str(raw)[:200])
    texts: list[str | None] = [None] * len(m)
    for text, i in m.items():
        if not 0 <= i < len(m) or texts[i] is not None:
            raise XCFormatError(p, None, f"label ids 0..{len(m) - 1}, each once", got=f"{text!r}: {i}")
        texts[i] = text
    return [t for t in texts if t is not None]


def _write_label_map(path: Path, texts: list[str], window: dict[str, Any]) -> None:
    body = {"format": MAP_FORMAT, "version": 1, "num_labels": len(texts), "window": window,
            "labels": {t: i for i, t in enumerate(texts)}}
    path.write_text(json.dumps(body, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")


# ----------------------------------------------------------------------------------------- build

def _utc(t: datetime | str | None) -> pd.Timestamp | None:
    if t is None:
        return None
    ts = pd.Timestamp(t)
    return ts.tz_localize("UTC") if ts.tzinfo is None else ts.tz_convert("UTC")


def parse_time(text: str) -> datetime:
    """An ISO-8601 command-line time (naive = UTC)."""
    try:
        t = datetime.fromisoformat(text.strip())
    except ValueError:
        raise XCConfigError(f"time {text!r}: expected ISO-8601, e.g. 2024-05-01 or 2024-05-01T12:00:00Z") from None
    return t.replace(tzinfo=timezone.utc) if t.tzinfo is None else t.astimezone(timezone.utc)


def window_id(start: datetime | None, end: datetime | None) -> str:
    """Folder name of a window, e.g. ``20240501T000000Z_20240601T000000Z`` (``begin``/``end`` when open)."""
    def fmt(t: datetime | None, open_name: str) -> str:
        u = _utc(t)
        return open_name if u is None else u.strftime("%Y%m%dT%H%M%SZ")
    return f"{fmt(start, 'begin')}_{fmt(end, 'end')}"


def _gz_lines(path: Path, df: pd.DataFrame) -> None:
    """``df`` as gzipped JSON lines, byte-reproducible (gzip mtime 0)."""
    text = df.to_json(orient="records", lines=True, force_ascii=False) if len(df) else ""
    if text and not text.endswith("\n"):
        text += "\n"
    with open(path, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0, filename="") as f:
        f.write(text.encode("utf-8"))


def build_click_dataset(log_paths: Sequence[Path | str], out_folder: Path, *, start: datetime | None = None,
                        end: datetime | None = None, label_map: Path | str | None = None,
                        test_fraction: float = 0.2, min_clicks: int = 1) -> dict[str, Any]:
    """Turn click logs over ``[start, end)`` into an LF raw-text dataset folder; returns a summary.

    ``label_map``: the previous window's ``label_map.json`` (or its folder); its ids are kept and new label
    texts are appended after them, ordered by first click time then text.
    """
    if not 0.0 < float(test_fraction) < 1.0:
        raise XCConfigError(f"test_fraction must be in (0, 1), got {test_fraction}")
    if int(min_clicks) < 1:
        raise XCConfigError(f"min_clicks must be >= 1, got {min_clicks}")
    t_start, t_end = _utc(start), _utc(end)
    if t_start is not None and t_end is not None and t_start >= t_end:
        raise XCConfigError(f"the window start {t_start} is not before its end {t_end}")
    files = expand_log_paths(log_paths)
    old_texts = load_label_map(label_map)
    n_old = len(old_texts)

    frames = [read_click_log(p).assign(file=i) for i, p in enumerate(files)]
    log = pd.concat(frames, ignore_index=True)
    n_read = len(log)
    keep = pd.Series(True, index=log.index)
    if t_start is not None:
        keep &= log["ts"] >= t_start
    if t_end is not None:
        keep &= log["ts"] < t_end
    log = log[keep].reset_index(drop=True)

    # label ids: a given label_id must be in the previous map; texts map to known ids or become new labels
    by_id = log["label_id"].notna()
    unknown = (log["label_id"] >= n_old).fillna(False).to_numpy(dtype=bool)
    if unknown.any():
        i = int(np.argmax(unknown))
        where = f"ids 0..{n_old - 1} of {label_map}" if n_old else "no ids: no previous label map was given"
        raise XCFormatError(files[int(log["file"].iat[i])], int(log["row"].iat[i]),
                            f"a 'label_id' in the label map ({where})", got=str(log["label_id"].iat[i]))
    text_to_id = pd.Series(np.arange(n_old, dtype=np.int64), index=pd.Index(old_texts, dtype=object))
    ids = log["label_id"].astype("float64")
    by_text = ~by_id
    ids[by_text] = log.loc[by_text, "label"].astype(object).map(text_to_id).astype("float64")
    new = log.loc[by_text & ids.isna(), ["label", "ts"]]
    first_seen = new.groupby("label", sort=True)["ts"].min().reset_index().sort_values(["ts", "label"],
                                                                                         kind="stable")
    new_texts = first_seen["label"].astype(str).tolist()
    if new_texts:
        new_ids = pd.Series(np.arange(n_old, n_old + len(new_texts), dtype=np.int64),
                            index=pd.Index(new_texts, dtype=object))
        miss = by_text & ids.isna()
        ids[miss] = log.loc[miss, "label"].astype(object).map(new_ids).astype("float64")
    log["lid"] = ids.astype("int64")
    label_texts = old_texts + new_texts
    L = len(label_texts)

    # aggregate: one point per query, positives = labels with >= min_clicks clicks in the window
    first = log.groupby("query", sort=True)["ts"].min()
    pairs = log.groupby(["query", "lid"], sort=True)["clicks"].sum().reset_index()
    pairs = pairs[pairs["clicks"] >= int(min_clicks)]
    queries = first[first.index.isin(pairs["query"].unique())].reset_index()
    queries.columns = ["query", "first_ts"]
    n_q = len(queries)
    if n_q < 2:
        raise XCError(f"click logs {', '.join(map(str, files[:3]))}: the window {window_id(start, end)} has "
                      f"{n_q} quer{'y' if n_q == 1 else 'ies'} with >= {min_clicks} clicks; "
                      "a dataset needs at least 2 (one train, one test)")
    # deterministic time split: order by (first click, text); the last test_fraction go to test
    queries = queries.sort_values(["first_ts", "query"], kind="stable").reset_index(drop=True)
    n_test = min(max(int(round(float(test_fraction) * n_q)), 1), n_q - 1)
    queries["split"] = np.where(np.arange(n_q) >= n_q - n_test, "tst", "trn")
    queries["pos"] = np.arange(n_q)
    pairs = pairs.merge(queries[["query", "pos"]], on="query").sort_values(["pos", "lid"], kind="stable")
    agg = pairs.groupby("pos", sort=True).agg(target_ind=("lid", list), target_rel=("clicks", list))
    points = queries.join(agg, on="pos")
    uid = pd.util.hash_pandas_object(points["query"].astype(str), index=False).map("q{:016x}".format)
    points = pd.DataFrame({"uid": uid, "title": points["query"].astype(str), "content": "",
                           "target_ind": points["target_ind"], "target_rel": points["target_rel"],
                           "split": points["split"], "first_ts": points["first_ts"]})
    labels = pd.DataFrame({"uid": [f"L{i}" for i in range(L)], "title": label_texts, "content": "",
                           "target_ind": [[] for _ in range(L)], "target_rel": [[] for _ in range(L)]})

    trn, tst = points[points["split"] == "trn"], points[points["split"] == "tst"]
    cols = ["uid", "title", "content", "target_ind", "target_rel"]
    window = {"start": None if t_start is None else t_start.isoformat(),
              "end": None if t_end is None else t_end.isoformat(), "id": window_id(start, end)}
    summary: dict[str, Any] = {
        "window": window, "files": [str(f) for f in files], "rows_read": n_read, "rows_in_window": len(log),
        "clicks_in_window": int(log["clicks"].sum()), "n_queries": n_q, "n_train": len(trn), "n_test": len(tst),
        "n_labels": L, "n_previous_labels": n_old, "n_new_labels": len(new_texts), "n_positives": len(pairs),
        "n_queries_dropped": int(first.shape[0] - n_q), "min_clicks": int(min_clicks),
        "test_fraction": float(test_fraction),
        "split_time": tst["first_ts"].min().isoformat(), "out": str(Path(out_folder)),
    }
    with atomic_dir(Path(out_folder)) as tmp:
        _gz_lines(tmp / "trn.json.gz", trn[cols])
        _gz_lines(tmp / "tst.json.gz", tst[cols])
        _gz_lines(tmp / "lbl.json.gz", labels)
        _write_label_map(tmp / LABEL_MAP, label_texts, window)
        (tmp / SUMMARY).write_text(json.dumps(summary, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    return summary
