"""Bounded-memory, chunked parsers of the XC sparse text formats: ``idx:val`` rows, BoW rows, split index tables.

A file is read in chunks of ``chunk_lines`` lines (default 64K); each chunk is parsed vectorised (numpy byte
scans + Arrow's C++ number parsers) and appended to a :class:`~xc_dagster.data.accumulators.Growing`, so only
one chunk of raw text is ever held. A chunk that fails any check of the fast path is re-parsed line by line with
the reference (pure Python) rules, which either return the same rows (exotic but valid spellings such as
``1_0:1``) or raise :class:`XCFormatError` naming the file and the exact 1-based line. The fast path only
accepts what the line-by-line rules accept, with the same result (tests compare the two). Why a vectorised
path with a line-by-line fallback: (docs/decisions.md#ingest-streaming-readers).
"""

from __future__ import annotations

import math
import os
from array import array
from pathlib import Path
from typing import IO

import numpy as np
import pyarrow as pa
import pyarrow.csv as pcsv
import scipy.sparse as sp

from xc_dagster.data.accumulators import F32_MAX, Growing
from xc_dagster.data.limits import MAX_DIM, check_header_rows
from xc_dagster.data.textio import (
    DEFAULT_CHUNK_LINES,
    FastPathFailed,
    decode_line,
    iter_chunks,
    open_binary,
    parse_header,
    read_header,
)
from xc_dagster.errors import XCFormatError

_NL = 10

# bytes the fast paths accept; anything else sends the chunk to the line-by-line parser
_NUM = b"0123456789.eE+-"
_PAIRS_OK = np.zeros(256, dtype=bool)
_PAIRS_OK[np.frombuffer(_NUM + b": \t\r\n", np.uint8)] = True
_BOW_OK = _PAIRS_OK.copy()
_BOW_OK[ord(",")] = True
_BOW_OK[ord("\t")] = False
_TO_NL = bytes.maketrans(b" \t\r", b"\n\n\n")
_IS_DIGIT = np.zeros(256, dtype=bool)
_IS_DIGIT[np.frombuffer(b"0123456789", np.uint8)] = True

_PAIR_OPTS = (
    pcsv.ReadOptions(column_names=["i", "v"], block_size=1 << 22),
    pcsv.ParseOptions(delimiter=":", quote_char=False, escape_char=False, ignore_empty_lines=True),
    pcsv.ConvertOptions(column_types={"i": pa.int64(), "v": pa.float64()}, null_values=[],
                        strings_can_be_null=False, quoted_strings_can_be_null=False),
)
_INT_OPTS = (
    pcsv.ReadOptions(column_names=["i"], block_size=1 << 22),
    pcsv.ParseOptions(delimiter=":", quote_char=False, escape_char=False, ignore_empty_lines=True),
    pcsv.ConvertOptions(column_types={"i": pa.int64()}, null_values=[], strings_can_be_null=False,
                        quoted_strings_can_be_null=False),
)


# ----------------------------------------------------------------------------------- idx:val rows

def _arrow_pairs(buf: bytes, n_cols: int) -> tuple[np.ndarray, np.ndarray]:
    """Parse a buffer of ``i:v`` tokens, one per line (blank lines ignored); raises FastPathFailed."""
    try:
        t = pcsv.read_csv(pa.py_buffer(buf), *_PAIR_OPTS)
    except (pa.ArrowInvalid, pa.ArrowException) as e:
        raise FastPathFailed from e
    i = t.column("i").to_numpy()
    v = t.column("v").to_numpy()
    if len(i) and (i.min() < 0 or i.max() >= n_cols):
        raise FastPathFailed
    if not np.isfinite(v).all() or (np.abs(v) > F32_MAX).any():  # the reference rules name the line
        raise FastPathFailed
    return i, v


def _fast_pairs_chunk(block: bytes, n_cols: int, checked: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Vectorised parse of lines of ``idx:val`` tokens: (per-line counts, indices, values)."""
    arr = np.frombuffer(block, np.uint8)
    if not checked and not _PAIRS_OK[arr].all():
        raise FastPathFailed
    nl = np.flatnonzero(arr == _NL)
    colons = np.flatnonzero(arr == ord(":"))
    counts = np.diff(np.searchsorted(colons, nl), prepend=0)
    if len(colons) == 0:
        if (_IS_DIGIT[arr]).any() or (arr == ord(".")).any() or (arr == ord("-")).any():
            raise FastPathFailed  # tokens without a colon
        return counts, np.zeros(0, np.int64), np.zeros(0, np.float64)
    i, v = _arrow_pairs(block.translate(_TO_NL), n_cols)
    if len(i) != len(colons):
        raise FastPathFailed
    return counts, i, v


def _slow_pairs_line(acc: Growing, s: str, lineno: int, idx: array, val: array) -> int:
    """Reference rules for one line of ``idx:val`` tokens; appends to idx/val, returns the count."""
    n = acc.n_cols
    k = 0
    for tok in s.split():
        a, sep, b = tok.partition(":")
        try:
            ii, vv = int(a), float(b)
        except ValueError:
            raise acc.bad(lineno, tok) from None
        if not sep or not 0 <= ii < n or not math.isfinite(vv) or abs(vv) > F32_MAX:
            raise acc.bad(lineno, tok)
        idx.append(ii)
        val.append(vv)
        k += 1
    return k


def _entries() -> tuple[array, array]:
    """The line-by-line rules' (index, value) entries of a chunk: typed arrays of 8 bytes an item (a list would hold
    a pointer and a Python object each, 4-5x that for a chunk of short tokens)."""
    return array("q"), array("d")


def _slow_pairs_chunk(acc: Growing, block: bytes, lineno: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    counts, (idx, val) = array("q"), _entries()
    for j, raw in enumerate(block.split(b"\n")[:-1]):
        counts.append(_slow_pairs_line(acc, decode_line(raw, acc.path, lineno + j), lineno + j, idx, val))
    return np.frombuffer(counts, np.int64), np.frombuffer(idx, np.int64), np.frombuffer(val, np.float64)


def parse_pairs_rows(f: IO[bytes], acc: Growing, first_lineno: int, max_rows: int,
                     chunk_lines: int = DEFAULT_CHUNK_LINES, expected: str = "") -> None:
    """Stream the rest of ``f`` (lines of ``idx:val``) into ``acc``; more than ``max_rows`` lines raises."""
    for lineno, block, n in iter_chunks(f, acc.path, chunk_lines, first_lineno):
        if acc.n_rows + n > max_rows:
            raise XCFormatError(acc.path, first_lineno + max_rows, expected, got="more rows")
        try:
            counts, i, v = _fast_pairs_chunk(block, acc.n_cols)
        except FastPathFailed:
            counts, i, v = _slow_pairs_chunk(acc, block, lineno)
        acc.append(counts, i, v)


def _after_header(row: int) -> int:
    """The file line of a 0-based data row of a file whose rows follow its header line one a line."""
    return row + 2


def _bytes_left(f: IO[bytes]) -> int:
    """Bytes of a plain file after the current position."""
    return os.fstat(f.fileno()).st_size - f.tell()


def read_sparse_file(path: Path, chunk_lines: int = DEFAULT_CHUNK_LINES, what: str = "") -> sp.csr_matrix:
    """A split-sparse file: header ``rows cols`` then exactly ``rows`` lines of ``idx:val`` pairs; ``what``: "label"
    for a label file (its values relevances: ``accumulators.canonical``), default feature (``*Xf*``) or column."""
    with open_binary(path) as f:
        n_rows, n_cols = parse_header(path, read_header(f, path), ("rows", "cols"))
        check_header_rows(path, "rows", n_rows, _bytes_left(f))
        acc = Growing(path, n_cols, what or ("feature" if "Xf" in path.name else "column"), _after_header)
        expected = f"{n_rows} rows after the header (header 'rows cols')"
        parse_pairs_rows(f, acc, 2, n_rows, chunk_lines, expected)
    if acc.n_rows != n_rows:
        raise XCFormatError(path, 1, expected, got=f"{acc.n_rows} rows")
    return acc.to_csr()


# ---------------------------------------------------------------------------------------- BoW rows

def _range_mask(n: int, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """Boolean mask of length n, True on the disjoint half-open ranges [starts, ends) (distinct bounds)."""
    d = np.zeros(n + 1, dtype=np.int8)
    d[starts] += 1
    d[ends] -= 1
    return np.cumsum(d[:-1], dtype=np.int8) > 0


def _fast_bow_chunk(block: bytes, D: int, L: int) -> tuple[np.ndarray, ...]:
    """Vectorised parse of BoW lines: (label counts, label ids, feature counts, feature ids, values)."""
    arr = np.frombuffer(block, np.uint8)
    if not _BOW_OK[arr].all():
        raise FastPathFailed
    cr = np.flatnonzero(arr == ord("\r"))
    if len(cr):
        if (arr[cr + 1] != _NL).any():
            raise FastPathFailed
        arr = arr.copy()
        arr[cr] = ord(" ")  # a CR before LF is stripped, like rstrip("\r\n")
    n = len(arr)
    nl = np.flatnonzero(arr == _NL)
    starts = np.concatenate(([0], nl[:-1] + 1))
    first = arr[starts]
    has_head = (first != ord(" ")) & (first != _NL)
    spaces = np.flatnonzero(arr == ord(" "))
    colons = np.flatnonzero(arr == ord(":"))
    head_end = np.minimum(np.append(spaces, n)[np.searchsorted(spaces, starts)], nl)
    first_colon = np.append(colons, n)[np.searchsorted(colons, starts)]
    lab = has_head & (first_colon >= head_end)  # first space-separated field without ':' = label list
    ls, le = starts[lab], head_end[lab]
    mask = _range_mask(n, ls, le)
    commas = np.flatnonzero(arr == ord(","))
    if len(commas) and not (mask[commas].all() and _IS_DIGIT[arr[commas - 1]].all()
                            and _IS_DIGIT[arr[commas + 1]].all()):
        raise FastPathFailed  # commas outside the label list, or empty label ids
    lab_counts = np.zeros(len(starts), np.int64)
    lab_counts[lab] = np.searchsorted(commas, le) - np.searchsorted(commas, ls) + 1
    if lab.any():
        lbuf = arr[_range_mask(n, ls, le + 1)]  # each label list with the space / newline that ends it
        if (lbuf == ord(":")).any():
            raise FastPathFailed
        lbuf = lbuf.copy()
        lbuf[(lbuf == ord(",")) | (lbuf == ord(" "))] = _NL
        if not (_IS_DIGIT[lbuf] | (lbuf == _NL)).all():
            raise FastPathFailed
        try:
            t = pcsv.read_csv(pa.py_buffer(lbuf.tobytes()), *_INT_OPTS)
        except (pa.ArrowInvalid, pa.ArrowException) as e:
            raise FastPathFailed from e
        lab_ids = t.column("i").to_numpy()
        if len(lab_ids) != lab_counts.sum() or (len(lab_ids) and (lab_ids.min() < 0 or lab_ids.max() >= L)):
            raise FastPathFailed
        fa = arr.copy()
        fa[mask] = ord(" ")
        feat = fa.tobytes()
    else:
        lab_ids = np.zeros(0, np.int64)
        feat = arr.tobytes()
    fc, fi, fv = _fast_pairs_chunk(feat, D, checked=True)
    return lab_counts, lab_ids, fc, fi, fv


def _slow_bow_chunk(X: Growing, Y: Growing, block: bytes, lineno: int) -> None:
    lab_counts, lab_ids, counts, (idx, val) = array("q"), array("q"), array("q"), _entries()
    for j, raw in enumerate(block.split(b"\n")[:-1]):
        ln = lineno + j
        s = decode_line(raw, X.path, ln)
        labels, feats = "", s
        if s and not s[0].isspace():
            head, _, rest = s.partition(" ")
            if ":" not in head:
                labels, feats = head, rest
        ids: list[int] = []
        if labels:
            try:
                ids = [int(t) for t in labels.split(",")]
            except ValueError:
                raise XCFormatError(X.path, ln, "comma-separated integer label ids before the features",
                                    got=labels) from None
        for i in ids:
            if not 0 <= i < Y.n_cols:
                raise XCFormatError(Y.path, ln, f"label ids in [0, {Y.n_cols})", got=str(i))
        lab_counts.append(len(ids))
        lab_ids.extend(ids)
        counts.append(_slow_pairs_line(X, feats, ln, idx, val))
    Y.append(np.frombuffer(lab_counts, np.int64), np.frombuffer(lab_ids, np.int64), np.ones(len(lab_ids), np.float32))
    X.append(np.frombuffer(counts, np.int64), np.frombuffer(idx, np.int64), np.frombuffer(val, np.float64))


def read_bow_file(path: Path, chunk_lines: int = DEFAULT_CHUNK_LINES) -> tuple[sp.csr_matrix, sp.csr_matrix]:
    """One BoW file -> (X, Y): header ``N D L``, then N rows ``l1,l2,... f:v f:v ...``."""
    with open_binary(path) as f:
        N, D, L = parse_header(path, read_header(f, path), ("N", "D", "L"))
        check_header_rows(path, "N", N, _bytes_left(f))
        X = Growing(path, D, "feature", _after_header)
        Y = Growing(path, L, "label", _after_header)
        for lineno, block, n in iter_chunks(f, path, chunk_lines, 2):
            if Y.n_rows + n > N:
                raise XCFormatError(path, 2 + N, f"{N} rows after the header 'N D L'", got="more rows")
            try:
                lc, li, fc, fi, fv = _fast_bow_chunk(block, D, L)
            except FastPathFailed:
                _slow_bow_chunk(X, Y, block, lineno)
                continue
            Y.append(lc, li, np.ones(len(li), np.float32))
            X.append(fc, fi, fv)
    if Y.n_rows != N:
        raise XCFormatError(path, 1, f"{N} rows after the header 'N D L'", got=f"{Y.n_rows} rows")
    return X.to_csr(), Y.to_csr()


# --------------------------------------------------------------------------------- integer tables

def read_int_table(path: Path, chunk_lines: int = DEFAULT_CHUNK_LINES) -> tuple[np.ndarray, np.ndarray]:
    """A whitespace-separated rectangular table of non-negative integers (no header; blank lines skipped) as int64
    (rows, cols), with the 1-based file line of each row (for errors about its values)."""
    parts: list[np.ndarray] = []
    lines: list[int] = []
    ncols = -1
    with open_binary(path) as f:
        for lineno, block, _ in iter_chunks(f, path, chunk_lines, 1):
            rows = []
            for j, raw in enumerate(block.split(b"\n")[:-1]):
                s = decode_line(raw, path, lineno + j)
                toks = (s.lstrip("\ufeff") if lineno + j == 1 else s).split()  # a BOM, as the other files
                if not toks:
                    continue  # blank lines carry no index
                try:
                    vals = [int(t) for t in toks]
                except ValueError:
                    raise XCFormatError(path, lineno + j, "whitespace-separated integer indices", got=s) from None
                if ncols == -1:
                    ncols = len(vals)
                if len(vals) != ncols:
                    raise XCFormatError(path, lineno + j, f"{ncols} columns (one per split), as on line 1",
                                        got=f"{len(vals)} columns")
                if any(v < 0 or v > MAX_DIM for v in vals):  # larger: no row of any file, nor an int64
                    raise XCFormatError(path, lineno + j, f"indices in [0, {MAX_DIM}]", got=s[:200])
                rows.append(vals)
                lines.append(lineno + j)
            if rows:
                parts.append(np.array(rows, dtype=np.int64).reshape(-1, ncols))
    if not parts:
        raise XCFormatError(path, 1, "a table of row indices (one column per split)", got="an empty file")
    return np.concatenate(parts), np.asarray(lines, dtype=np.int64)
