"""Click logs -> an LF raw-text dataset partition over a time window (see ``docs/CLICKLOGS.md``).

:func:`build_click_dataset` reads click-log files (:mod:`xc_dagster.data.clicklog_reader`), keeps the rows of
``[start, end)``, aggregates them by query text (queries become points, labels clicked at least ``min_clicks``
times their positives, the click counts their ``target_rel``), gives new label texts new ids appended to the
previous window's ``label_map.json`` (ids never change across windows), splits train/test by time (the latest
queries are the test set) and writes ``trn.json.gz``, ``tst.json.gz``, ``lbl.json.gz`` and ``label_map.json``
atomically, a folder that :func:`xc_dagster.data.layouts.read_dataset` reads unchanged (layout ``lf-raw``).
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from xc_dagster.data.clicklog_reader import MAX_COUNT, expand_log_paths, read_click_log
from xc_dagster.errors import XCConfigError, XCDatasetNotFound, XCError, XCFormatError
from xc_dagster.storage import atomic_dir

LABEL_MAP = "label_map.json"
SUMMARY = "clicklog.json"
MAP_FORMAT = "xc-dagster-label-map"


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


def _check_options(test_fraction: float, min_clicks: int, start: datetime | None,
                   end: datetime | None) -> tuple[pd.Timestamp | None, pd.Timestamp | None]:
    """Validate the build options; returns the window bounds in UTC."""
    if not 0.0 < float(test_fraction) < 1.0:
        raise XCConfigError(f"test_fraction must be in (0, 1), got {test_fraction}")
    if int(min_clicks) < 1:
        raise XCConfigError(f"min_clicks must be >= 1, got {min_clicks}")
    t_start, t_end = _utc(start), _utc(end)
    if t_start is not None and t_end is not None and t_start >= t_end:
        raise XCConfigError(f"the window start {t_start} is not before its end {t_end}")
    return t_start, t_end


def _read_window(files: list[Path], t_start: pd.Timestamp | None,
                 t_end: pd.Timestamp | None) -> tuple[pd.DataFrame, int]:
    """The rows of every file (``file`` = its index in ``files``) inside ``[t_start, t_end)``, and the rows read."""
    frames = [read_click_log(p).assign(file=i) for i, p in enumerate(files)]
    log = pd.concat(frames, ignore_index=True)
    n_read = len(log)
    keep = pd.Series(True, index=log.index)
    if t_start is not None:
        keep &= log["ts"] >= t_start
    if t_end is not None:
        keep &= log["ts"] < t_end
    return log[keep].reset_index(drop=True), n_read


def _assign_label_ids(log: pd.DataFrame, files: list[Path], old_texts: list[str],
                      label_map: Path | str | None) -> list[str]:
    """Set ``log["lid"]``: a given label_id must be in the previous map; texts map to known ids or become new
    labels (ids after the previous ones, by first click time then text). Returns the new label texts."""
    n_old = len(old_texts)
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
    return new_texts


def _check_click_sums(log: pd.DataFrame, files: list[Path]) -> None:
    """Refuse a (query, label) whose clicks in the window pass MAX_COUNT (an int64 sum of them could wrap and
    drop the query as under min_clicks), naming the row where its running total passes it."""
    clicks = log["clicks"].astype("float64")
    if clicks.sum() <= MAX_COUNT:  # no sum can pass it
        return
    # float64 running totals are exact below 2**53, so the first one past MAX_COUNT is found exactly
    over = (clicks.groupby([log["query"], log["lid"]], sort=False).cumsum() > MAX_COUNT).to_numpy()
    if over.any():
        i = int(np.argmax(over))
        raise XCFormatError(files[int(log["file"].iat[i])], int(log["row"].iat[i]),
                            f"the 'clicks' of query {log['query'].iat[i]!r} on label {int(log['lid'].iat[i])} in "
                            f"the window to total at most {MAX_COUNT}",
                            got=f"this row's {log['clicks'].iat[i]} clicks take the total past it")


def _total(clicks: pd.Series) -> int:
    """The exact sum of click counts (Python ints when an int64 sum could wrap)."""
    return int(clicks.sum()) if float(clicks.astype("float64").sum()) < 2.0**62 else sum(map(int, clicks))


def _split_queries(log: pd.DataFrame, min_clicks: int, test_fraction: float,
                   files: list[Path], window: str) -> tuple[pd.Series, pd.DataFrame, pd.DataFrame]:
    """One point per query, positives = labels with >= min_clicks clicks in the window; deterministic time
    split: queries ordered by (first click, text), the last ``test_fraction`` go to test.

    Returns the first click of every query, the (query, lid, clicks, pos) positives and the kept queries
    (query, first_ts, split, pos).
    """
    first = log.groupby("query", sort=True)["ts"].min()
    pairs = log.groupby(["query", "lid"], sort=True)["clicks"].sum().reset_index()
    pairs = pairs[pairs["clicks"] >= int(min_clicks)]
    queries = first[first.index.isin(pairs["query"].unique())].reset_index()
    queries.columns = ["query", "first_ts"]
    n_q = len(queries)
    if n_q < 2:
        raise XCError(f"click logs {', '.join(map(str, files[:3]))}: the window {window} has "
                      f"{n_q} quer{'y' if n_q == 1 else 'ies'} with >= {min_clicks} clicks; "
                      "a dataset needs at least 2 (one train, one test)")
    queries = queries.sort_values(["first_ts", "query"], kind="stable").reset_index(drop=True)
    n_test = min(max(int(round(float(test_fraction) * n_q)), 1), n_q - 1)
    queries["split"] = np.where(np.arange(n_q) >= n_q - n_test, "tst", "trn")
    queries["pos"] = np.arange(n_q)
    pairs = pairs.merge(queries[["query", "pos"]], on="query").sort_values(["pos", "lid"], kind="stable")
    return first, pairs, queries


def _point_table(queries: pd.DataFrame, pairs: pd.DataFrame) -> pd.DataFrame:
    """The LF point records (uid, title, content, target_ind, target_rel) with their split and first click."""
    agg = pairs.groupby("pos", sort=True).agg(target_ind=("lid", list), target_rel=("clicks", list))
    points = queries.join(agg, on="pos")
    uid = pd.util.hash_pandas_object(points["query"].astype(str), index=False).map("q{:016x}".format)
    return pd.DataFrame({"uid": uid, "title": points["query"].astype(str), "content": "",
                         "target_ind": points["target_ind"], "target_rel": points["target_rel"],
                         "split": points["split"], "first_ts": points["first_ts"]})


def _label_table(label_texts: list[str]) -> pd.DataFrame:
    L = len(label_texts)
    return pd.DataFrame({"uid": [f"L{i}" for i in range(L)], "title": label_texts, "content": "",
                         "target_ind": [[] for _ in range(L)], "target_rel": [[] for _ in range(L)]})


def build_click_dataset(log_paths: Sequence[Path | str], out_folder: Path, *, start: datetime | None = None,
                        end: datetime | None = None, label_map: Path | str | None = None,
                        test_fraction: float = 0.2, min_clicks: int = 1, literal_paths: bool = False) -> dict[str, Any]:
    """Turn click logs over ``[start, end)`` into an LF raw-text dataset folder; returns a summary.

    ``label_map``: the previous window's ``label_map.json`` (or its folder); its ids are kept and new label
    texts are appended after them, ordered by first click time then text. ``literal_paths``: the paths are
    files or folders as named, never glob patterns (a file may be called ``day[1].csv``).
    """
    t_start, t_end = _check_options(test_fraction, min_clicks, start, end)
    files = expand_log_paths(log_paths, literal=literal_paths)
    old_texts = load_label_map(label_map)
    n_old = len(old_texts)
    log, n_read = _read_window(files, t_start, t_end)
    new_texts = _assign_label_ids(log, files, old_texts, label_map)
    label_texts = old_texts + new_texts
    _check_click_sums(log, files)
    first, pairs, queries = _split_queries(log, min_clicks, test_fraction, files, window_id(start, end))
    points = _point_table(queries, pairs)
    labels = _label_table(label_texts)

    n_q = len(queries)
    trn, tst = points[points["split"] == "trn"], points[points["split"] == "tst"]
    cols = ["uid", "title", "content", "target_ind", "target_rel"]
    window = {"start": None if t_start is None else t_start.isoformat(),
              "end": None if t_end is None else t_end.isoformat(), "id": window_id(start, end)}
    summary: dict[str, Any] = {
        "window": window, "files": [str(f) for f in files], "rows_read": n_read, "rows_in_window": len(log),
        "clicks_in_window": _total(log["clicks"]), "n_queries": n_q, "n_train": len(trn), "n_test": len(tst),
        "n_labels": len(label_texts), "n_previous_labels": n_old, "n_new_labels": len(new_texts),
        "n_positives": len(pairs), "n_queries_dropped": int(first.shape[0] - n_q), "min_clicks": int(min_clicks),
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
