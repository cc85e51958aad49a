"""The LF raw-text layout: ``trn.json.gz``, ``tst.json.gz``, ``lbl.json.gz`` gzipped JSON lines.

Each line is an object with ``uid``, ``title``, ``content`` and, for points, ``target_ind`` (label ids) with
optional ``target_rel`` (their values); L is the number of lines of ``lbl.json.gz``. A file is read by Arrow's
streaming JSON parser (:func:`read_jsonl_fast`); anything that reader cannot judge sends the file to the
line-by-line reference reader, which returns the same rows or raises :class:`XCFormatError` naming the file and
the 1-based line (docs/decisions.md#ingest-streaming-readers).
"""

from __future__ import annotations

import json
import math
import zlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.json as pj
import scipy.sparse as sp

from xc_dagster.data.accumulators import F32_MAX, Growing, SparseRows
from xc_dagster.data.canonical import XCDataset
from xc_dagster.data.companions import read_filters, require_files
from xc_dagster.data.limits import Expansion
from xc_dagster.data.reader import ReadOptions
from xc_dagster.data.textio import FastPathFailed, iter_lines
from xc_dagster.errors import XCFormatError

LF_FILES = ("trn.json.gz", "tst.json.gz", "lbl.json.gz")
_CONTENT = np.ones(256, dtype=bool)  # by byte: not JSON's whitespace (a line of only that is blank)
_CONTENT[list(b" \t\r\n")] = False


# ------------------------------------------------------------------------------- Arrow fast path

def _compose_texts(cols: list[list[Any]]) -> list[str]:
    """Point texts: the non-empty stripped fields joined by a space (None = absent)."""
    if len(cols) == 1:
        return ["" if v is None else v.strip() for v in cols[0]]
    out = []
    for row in zip(*cols):
        out.append(" ".join(p for p in (("" if v is None else v.strip()) for v in row) if p))
    return out


def read_jsonl_fast(path: Path, fields: Sequence[str], n_labels: int | None,
                    block_size: int = 16 << 20) -> tuple[list[str], Growing | None]:
    """Vectorised LF reader (Arrow's streaming JSON parser over the gzip stream, ``block_size`` bytes at a time).

    Returns the composed texts and, when ``n_labels`` is given, the ``target_ind``/``target_rel`` rows.
    Raises :class:`FastPathFailed` on anything the line-by-line reader has to judge (and word the error of):
    bad gzip/UTF-8/JSON, a missing or null ``title``, a non-string field, bad or out-of-range targets.
    """
    cols = [pa.field("title", pa.string()), pa.field("content", pa.string())]
    if n_labels is not None:
        cols += [pa.field("target_ind", pa.list_(pa.int64())), pa.field("target_rel", pa.list_(pa.float64()))]
    opts = pj.ParseOptions(explicit_schema=pa.schema(cols), unexpected_field_behavior="ignore",
                           newlines_in_values=False)
    texts: list[str] = []
    acc = Growing(path, n_labels, "label", lambda row: _record_line(path, row)) if n_labels is not None else None
    grown = Expansion(path, path.stat().st_size)
    try:
        with pa.input_stream(str(path), compression="gzip") as stream:
            counted = _Counted(stream, grown)
            reader = pj.open_json(pa.PythonFile(counted, mode="r"),
                                  read_options=pj.ReadOptions(block_size=block_size, use_threads=True),
                                  parse_options=opts)
            for batch in reader:
                if batch.num_rows == 0:
                    continue
                if batch.column("title").null_count:
                    raise FastPathFailed
                for f in fields:  # a JSON escape of a lone surrogate decodes to bytes that are no UTF-8
                    batch.column(f).validate(full=True)
                texts.extend(_compose_texts([batch.column(f).to_pylist() for f in fields]))
                if acc is not None:
                    _targets(batch, acc)
        if counted.finish() != len(texts):
            raise FastPathFailed  # not one object per line: the line reader names the line
    except (pa.ArrowException, OSError, EOFError, zlib.error, UnicodeDecodeError, ValueError) as e:
        # the line-by-line reader words the error, also past the expansion cap (it re-reads at most up to the cap):
        # Arrow's threads read ahead by a varying amount, so which of a long line and the cap it meets first here
        # depends on the machine's load, and the user should get the same error for the same file
        raise FastPathFailed from e
    return texts, acc


class _Counted:
    """A reader of an Arrow stream that counts what it hands out against an expansion cap, and its non-blank lines
    (Arrow reads from it through ``pa.PythonFile``): Arrow's parser takes two objects on one line, or one over
    several, as readily as one per line, which the layout is (``lines`` must equal the records read)."""

    def __init__(self, stream: pa.NativeFile, grown: Expansion):
        self._stream, self._grown, self.closed = stream, grown, False
        self.lines, self._open = 0, False  # non-blank lines ended so far; whether the current one has content

    def read(self, n: int = -1) -> bytes:
        data = self._stream.read(n)
        self._grown.add(len(data))
        arr = np.frombuffer(data, np.uint8)
        for s in range(0, len(arr), 1 << 20):  # 1 MB at a time: the running counts stay small
            self._count(arr[s:s + (1 << 20)])
        return data

    def _count(self, arr: np.ndarray) -> None:
        ends = np.flatnonzero(arr == 10)
        content = np.cumsum(_CONTENT[arr], dtype=np.int32)  # non-whitespace bytes up to each byte
        if len(ends):
            upto = content[ends]
            seen = np.diff(upto, prepend=0) > 0  # each ended line: content since the previous line end
            seen[0] |= self._open
            self.lines += int(seen.sum())
            self._open = bool(content[-1] > upto[-1])
        else:
            self._open |= bool(content[-1] > 0)

    def finish(self) -> int:
        """The non-blank lines read, a last one without a line end included (call at the end of the stream)."""
        self.lines, self._open = self.lines + self._open, False
        return self.lines

    def readable(self) -> bool:
        return True

    def close(self) -> None:
        self.closed = True


def _targets(batch: pa.RecordBatch, acc: Growing) -> None:
    """Append one batch's ``target_ind`` (with ``target_rel`` values, 1.0 when absent) to ``acc``."""
    ind = batch.column("target_ind")
    if ind.null_count:
        raise FastPathFailed
    ids = ind.flatten()
    if ids.null_count:
        raise FastPathFailed
    counts = pc.list_value_length(ind).to_numpy(zero_copy_only=False).astype(np.int64)
    ids_np = ids.to_numpy(zero_copy_only=False)
    if len(ids_np) and (ids_np.min() < 0 or ids_np.max() >= acc.n_cols):
        raise FastPathFailed
    rel = batch.column("target_rel")
    vals = np.ones(len(ids_np), dtype=np.float64)
    if rel.null_count < len(rel):
        present = ~rel.is_null().to_numpy(zero_copy_only=False)
        rl = pc.list_value_length(rel).to_numpy(zero_copy_only=False)
        if (rl[present] != counts[present]).any():
            raise FastPathFailed
        rv = rel.flatten()
        if rv.null_count:
            raise FastPathFailed
        rv_np = rv.to_numpy(zero_copy_only=False)
        if not np.isfinite(rv_np).all() or (rv_np < 0).any() or (rv_np > F32_MAX).any():
            raise FastPathFailed
        if len(rv_np) == len(vals):
            vals = rv_np
        else:
            vals[np.repeat(present, counts)] = rv_np
    acc.append(counts, ids_np, vals)


# ------------------------------------------------------------------------ line-by-line reference

def _record_line(path: Path, row: int) -> int | None:
    """The 1-based file line of the 0-based record ``row`` (blank lines hold none), read again: for an error only."""
    for lineno, s in _nonblank_lines(path):
        if row == 0:
            return lineno
        row -= 1
    return None


def _nonblank_lines(path: Path) -> Iterator[tuple[int, str]]:
    return ((lineno, s) for lineno, s in iter_lines(path, gz=True) if s.strip())


def _compose(rec: dict[str, Any], fields: Sequence[str], path: Path, lineno: int) -> str:
    """Point text = the non-empty requested fields joined by a space."""
    parts = []
    for f in fields:
        v = rec.get(f)
        if v is None:
            continue
        if not isinstance(v, str):
            raise XCFormatError(path, lineno, f"'{f}' to be a string", got=type(v).__name__)
        try:
            v.encode("utf-8")
        except UnicodeEncodeError as e:  # a JSON escape of a lone surrogate: no text can be written of it
            raise XCFormatError(path, lineno, f"'{f}' to be text (UTF-8 encodable)",
                                got=f"a lone surrogate {v[e.start]!r} at character {e.start + 1}") from None
        v = v.strip()
        if v:
            parts.append(v)
    return " ".join(parts)


def _read_jsonl(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """Records of a gzipped JSON-lines file; each must be an object with a string ``title``."""
    for lineno, s in _nonblank_lines(path):  # blank lines are skipped (as Arrow's reader does)
        try:
            rec = json.loads(s)
        except (ValueError, RecursionError) as e:
            raise XCFormatError(path, lineno, "a valid JSON object per line", got=s) from e
        if not isinstance(rec, dict):
            raise XCFormatError(path, lineno, "a JSON object per line", got=s)
        if "title" not in rec:
            raise XCFormatError(path, lineno, "a 'title' field", got=s)
        yield lineno, rec


def _line_targets(rec: dict[str, Any], path: Path, lineno: int) -> tuple[list[int], list[float] | None]:
    """``target_ind`` and ``target_rel`` (None when absent) of one record, checked."""
    ind = rec.get("target_ind")
    if not isinstance(ind, list) or any(type(i) is not int for i in ind):
        raise XCFormatError(path, lineno, "'target_ind' to be a list of integers", got=json.dumps(ind)[:200])
    rel = rec.get("target_rel")
    if rel is not None:
        try:
            if not isinstance(rel, list) or any(type(r) not in (int, float) for r in rel):
                raise ValueError
            rel = [float(r) for r in rel]
            if not all(math.isfinite(r) and 0 <= r <= F32_MAX for r in rel):
                raise ValueError
        except (ValueError, OverflowError):
            raise XCFormatError(path, lineno, "'target_rel' to be a list of relevances: finite numbers >= 0 "
                                f"(0: no label) within float32's range (<= {F32_MAX:.4g})",
                                got=json.dumps(rel)[:200]) from None
        if len(rel) != len(ind):
            raise XCFormatError(path, lineno, f"'target_rel' of the same length as 'target_ind' ({len(ind)})",
                                got=f"length {len(rel)}")
    return ind, rel


def read_lf_points(path: Path, n_labels: int, fields: Sequence[str],
                   fast: bool = True) -> tuple[list[str], sp.csr_matrix]:
    """Texts and label rows of ``trn``/``tst.json.gz``: the vectorised reader, else line by line."""
    if fast:
        try:
            texts, acc = read_jsonl_fast(path, fields, n_labels)
        except FastPathFailed:
            pass
        else:
            if not texts:
                raise XCFormatError(path, 1, "at least one JSON line", got="an empty file")
            assert acc is not None
            return texts, acc.to_csr()
    texts: list[str] = []
    rows = SparseRows(path, n_labels, "label")
    for lineno, rec in _read_jsonl(path):
        texts.append(_compose(rec, fields, path, lineno))
        ind, rel = _line_targets(rec, path, lineno)
        rows.add_ids(ind, rel, lineno)
    if not texts:
        raise XCFormatError(path, 1, "at least one JSON line", got="an empty file")
    return texts, rows.to_csr()


def _read_lf_labels(path: Path, fields: Sequence[str], fast: bool = True) -> list[str]:
    if fast:
        try:
            return read_jsonl_fast(path, fields, None)[0]
        except FastPathFailed:
            pass
    return [_compose(rec, fields, path, n) for n, rec in _read_jsonl(path)]


# ---------------------------------------------------------------------------------------- layout

def read_lf_raw(folder: Path, text_fields: Sequence[str], label_text_fields: Sequence[str],
                fast: bool = True) -> XCDataset:
    """LF raw-text layout: L = number of lines of ``lbl.json.gz``; ``fast=False`` forces the line-by-line reader."""
    require_files(folder, LF_FILES, "lf-raw")
    lbl_path = folder / "lbl.json.gz"
    label_texts = _read_lf_labels(lbl_path, label_text_fields, fast)
    L = len(label_texts)
    if L == 0:
        raise XCFormatError(lbl_path, 1, "at least one label line", got="an empty file")
    train_texts, Y_train = read_lf_points(folder / "trn.json.gz", L, text_fields, fast)
    test_texts, Y_test = read_lf_points(folder / "tst.json.gz", L, text_fields, fast)
    f_train, f_test = read_filters(folder, len(train_texts), len(test_texts), L)
    return XCDataset(
        train_texts=train_texts, test_texts=test_texts, label_texts=label_texts,
        Y_train=Y_train, Y_test=Y_test, filter_train=f_train, filter_test=f_test, layout="lf-raw")


class LFRawLayout:
    """``lf-raw``: found when ``trn.json.gz``, ``tst.json.gz`` and ``lbl.json.gz`` are all there."""

    def detect(self, folder: Path, names: Sequence[str]) -> bool:
        return all(n in names for n in LF_FILES)

    def read(self, folder: Path, opts: ReadOptions) -> XCDataset:
        return read_lf_raw(folder, opts.text_fields, opts.label_text_fields)
