"""Bounded-memory, chunked parsers of the XC text formats (``idx:val`` rows, BoW rows, LF JSON lines).

A file is read in chunks of ``chunk_lines`` lines (default 64K); each chunk is parsed vectorised (numpy byte
scans + Arrow's C++ number parsers) and appended to growing int32/float32 arrays, so only one chunk of raw
text is ever held. When a chunk fails any check of the fast path it is re-parsed line by line with the
reference (pure Python) rules, which either return the same rows (exotic but valid spellings such as
``1_0:1``) or raise :class:`XCFormatError` naming the file and the exact 1-based line. The fast path only
accepts what the line-by-line rules accept, with the same result (tests compare the two).
"""

from __future__ import annotations

import contextlib
import gzip
import math
import zlib
from collections.abc import Iterator, Sequence
from itertools import islice
from pathlib import Path
from typing import IO, Any

import numpy as np
import pyarrow as pa
import pyarrow.csv as pcsv
import scipy.sparse as sp

from xc_dagster.errors import XCFormatError

DEFAULT_CHUNK_LINES = 65_536
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


class _FastPathFailed(Exception):
    """A chunk the vectorised parser does not accept; it is re-parsed line by line."""


# ------------------------------------------------------------------------------------------- input

def open_binary(path: Path, gz: bool = False) -> IO[bytes]:
    """Open a (possibly gzipped) file for binary line reading."""
    return gzip.open(path, "rb") if gz else open(path, "rb")  # type: ignore[return-value]


def read_header(f: IO[bytes], path: Path) -> str | None:
    """The first line as text (BOM and line end stripped), None for an empty file; bad UTF-8 raises."""
    raw = f.readline()
    if not raw:
        return None
    try:
        s = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise XCFormatError(path, 1, "UTF-8 text", got=f"undecodable bytes at column {e.start + 1}") from e
    return s.lstrip("\ufeff").rstrip("\r\n")


@contextlib.contextmanager
def gzip_errors(path: Path, gz: bool) -> Iterator[None]:
    """Turn a truncated or corrupt gzip stream (and read errors of one) into XCFormatError naming the file."""
    try:
        yield
    except (EOFError, zlib.error, gzip.BadGzipFile) as e:
        raise XCFormatError(path, None, "a complete, valid gzip file", got=f"{type(e).__name__}: {e}") from e
    except OSError as e:
        if gz:
            raise XCFormatError(path, None, "a complete, valid gzip file", got=f"{type(e).__name__}: {e}") from e
        raise


def iter_chunks(f: IO[bytes], path: Path, chunk_lines: int, first_lineno: int,
                gz: bool = False) -> Iterator[tuple[int, bytes, int]]:
    """Yield ``(1-based number of the chunk's first line, bytes, number of lines)``; every line ends in ``\\n``."""
    if chunk_lines < 1:
        raise ValueError("chunk_lines must be >= 1")
    lineno = first_lineno
    with gzip_errors(path, gz):
        while True:
            lines = list(islice(f, chunk_lines))
            if not lines:
                return
            if not lines[-1].endswith(b"\n"):
                lines[-1] += b"\n"
            yield lineno, b"".join(lines), len(lines)
            lineno += len(lines)


def _decode_line(raw: bytes, path: Path, lineno: int) -> str:
    try:
        return raw.decode("utf-8").rstrip("\r\n")
    except UnicodeDecodeError as e:
        raise XCFormatError(path, lineno, "UTF-8 text", got=f"undecodable bytes at column {e.start + 1}") from e


# ------------------------------------------------------------------------------------- accumulator

class Growing:
    """Rows appended chunk by chunk as int32 indices / float32 values; one CSR build at the end."""

    def __init__(self, path: Path, n_cols: int, what: str):
        self.path, self.n_cols, self.what = path, n_cols, what
        self._counts: list[np.ndarray] = []
        self._idx: list[np.ndarray] = []
        self._val: list[np.ndarray] = []
        self.n_rows = 0
        self.nnz = 0

    def append(self, counts: np.ndarray, idx: np.ndarray, val: np.ndarray) -> None:
        """Append rows: ``counts[r]`` entries each, flattened in ``idx``/``val``."""
        self._counts.append(np.asarray(counts, dtype=np.int64))
        self._idx.append(np.asarray(idx, dtype=np.int32))
        self._val.append(np.asarray(val, dtype=np.float32))
        self.n_rows += len(counts)
        self.nnz += len(idx)

    def bad(self, lineno: int, got: str) -> XCFormatError:
        """The error of a malformed ``idx:val`` token."""
        return XCFormatError(self.path, lineno,
                             f"{self.what} entries 'index:value' with an integer index in [0, {self.n_cols}) "
                             "and a finite number value", got=got)

    def to_csr(self) -> sp.csr_matrix:
        """The rows as a canonical (sorted, duplicates summed) float32 CSR matrix."""
        indptr = np.zeros(self.n_rows + 1, dtype=np.int64)
        if self._counts:
            np.cumsum(np.concatenate(self._counts), out=indptr[1:])
        self._counts = []
        idx = np.concatenate(self._idx) if self._idx else np.zeros(0, np.int32)
        self._idx = []
        val = np.concatenate(self._val) if self._val else np.zeros(0, np.float32)
        self._val = []
        if self.nnz >= 2**31:
            idx = idx.astype(np.int64)
        m = sp.csr_matrix((val, idx, indptr if self.nnz >= 2**31 else indptr.astype(np.int32)),
                          shape=(self.n_rows, self.n_cols))
        m.sum_duplicates()
        return m


# ----------------------------------------------------------------------------------- idx:val rows

def _arrow_pairs(buf: bytes, n_cols: int) -> tuple[np.ndarray, np.ndarray]:
    """Parse a buffer of ``i:v`` tokens, one per line (blank lines ignored); raises _FastPathFailed."""
    try:
        t = pcsv.read_csv(pa.py_buffer(buf), *_PAIR_OPTS)
    except (pa.ArrowInvalid, pa.ArrowException) as e:
        raise _FastPathFailed from e
    i = t.column("i").to_numpy()
    v = t.column("v").to_numpy()
    if len(i) and (i.min() < 0 or i.max() >= n_cols):
        raise _FastPathFailed
    if not np.isfinite(v).all():
        raise _FastPathFailed
    return i, v


def _fast_pairs_chunk(block: bytes, n_cols: int, checked: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Vectorised parse of lines of ``idx:val`` tokens: (per-line counts, indices, values)."""
    arr = np.frombuffer(block, np.uint8)
    if not checked and not _PAIRS_OK[arr].all():
        raise _FastPathFailed
    nl = np.flatnonzero(arr == _NL)
    colons = np.flatnonzero(arr == ord(":"))
    counts = np.diff(np.searchsorted(colons, nl), prepend=0)
    if len(colons) == 0:
        if (_IS_DIGIT[arr]).any() or (arr == ord(".")).any() or (arr == ord("-")).any():
            raise _FastPathFailed  # tokens without a colon
        return counts, np.zeros(0, np.int64), np.zeros(0, np.float64)
    i, v = _arrow_pairs(block.translate(_TO_NL), n_cols)
    if len(i) != len(colons):
        raise _FastPathFailed
    return counts, i, v


def _slow_pairs_line(acc: Growing, s: str, lineno: int, idx: list[int], val: list[float]) -> int:
    """Reference rules for one line of ``idx:val`` tokens; appends to idx/val, returns the count."""
    n = acc.n_cols
    k = 0
    for tok in s.split():
        a, sep, b = tok.partition(":")
        try:
            ii, vv = int(a), float(b)
        except ValueError:
            raise acc.bad(lineno, tok) from None
        if not sep or not 0 <= ii < n or not math.isfinite(vv):
            raise acc.bad(lineno, tok)
        idx.append(ii)
        val.append(vv)
        k += 1
    return k


def _slow_pairs_chunk(acc: Growing, block: bytes, lineno: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    counts: list[int] = []
    idx: list[int] = []
    val: list[float] = []
    for j, raw in enumerate(block.split(b"\n")[:-1]):
        counts.append(_slow_pairs_line(acc, _decode_line(raw, acc.path, lineno + j), lineno + j, idx, val))
    return np.array(counts, np.int64), np.array(idx, np.int64), np.array(val, np.float64)


def parse_pairs_rows(f: IO[bytes], acc: Growing, first_lineno: int, max_rows: int,
                     chunk_lines: int = DEFAULT_CHUNK_LINES, expected: str = "") -> None:
    """Stream the rest of ``f`` (lines of ``idx:val``) into ``acc``; more than ``max_rows`` lines raises."""
    for lineno, block, n in iter_chunks(f, acc.path, chunk_lines, first_lineno):
        if acc.n_rows + n > max_rows:
            raise XCFormatError(acc.path, first_lineno + max_rows, expected, got="more rows")
        try:
            counts, i, v = _fast_pairs_chunk(block, acc.n_cols)
        except _FastPathFailed:
            counts, i, v = _slow_pairs_chunk(acc, block, lineno)
        acc.append(counts, i, v)


def read_sparse_file(path: Path, chunk_lines: int = DEFAULT_CHUNK_LINES) -> sp.csr_matrix:
    """A split-sparse file: header ``rows cols`` then exactly ``rows`` lines of ``idx:val`` pairs."""
    from xc_dagster.data.layouts import _parse_header

    with open_binary(path) as f:
        n_rows, n_cols = _parse_header(path, read_header(f, path), ("rows", "cols"))
        acc = Growing(path, n_cols, "feature" if "Xf" in path.name else "column")
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
        raise _FastPathFailed
    cr = np.flatnonzero(arr == ord("\r"))
    if len(cr):
        if (arr[cr + 1] != _NL).any():
            raise _FastPathFailed
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
        raise _FastPathFailed  # commas outside the label list, or empty label ids
    lab_counts = np.zeros(len(starts), np.int64)
    lab_counts[lab] = np.searchsorted(commas, le) - np.searchsorted(commas, ls) + 1
    if lab.any():
        lbuf = arr[_range_mask(n, ls, le + 1)]  # each label list with the space / newline that ends it
        if (lbuf == ord(":")).any():
            raise _FastPathFailed
        lbuf = lbuf.copy()
        lbuf[(lbuf == ord(",")) | (lbuf == ord(" "))] = _NL
        if not (_IS_DIGIT[lbuf] | (lbuf == _NL)).all():
            raise _FastPathFailed
        try:
            t = pcsv.read_csv(pa.py_buffer(lbuf.tobytes()), *_INT_OPTS)
        except (pa.ArrowInvalid, pa.ArrowException) as e:
            raise _FastPathFailed from e
        lab_ids = t.column("i").to_numpy()
        if len(lab_ids) != lab_counts.sum() or (len(lab_ids) and (lab_ids.min() < 0 or lab_ids.max() >= L)):
            raise _FastPathFailed
        fa = arr.copy()
        fa[mask] = ord(" ")
        feat = fa.tobytes()
    else:
        lab_ids = np.zeros(0, np.int64)
        feat = arr.tobytes()
    fc, fi, fv = _fast_pairs_chunk(feat, D, checked=True)
    return lab_counts, lab_ids, fc, fi, fv


def _slow_bow_chunk(X: Growing, Y: Growing, block: bytes, lineno: int) -> None:
    lab_counts: list[int] = []
    lab_ids: list[int] = []
    counts: list[int] = []
    idx: list[int] = []
    val: list[float] = []
    for j, raw in enumerate(block.split(b"\n")[:-1]):
        ln = lineno + j
        s = _decode_line(raw, X.path, ln)
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
    Y.append(np.array(lab_counts), np.array(lab_ids, np.int64), np.ones(len(lab_ids), np.float32))
    X.append(np.array(counts), np.array(idx, np.int64), np.array(val, np.float64))


def read_bow_file(path: Path, chunk_lines: int = DEFAULT_CHUNK_LINES) -> tuple[sp.csr_matrix, sp.csr_matrix]:
    """One BoW file -> (X, Y): header ``N D L``, then N rows ``l1,l2,... f:v f:v ...``."""
    from xc_dagster.data.layouts import _parse_header

    with open_binary(path) as f:
        N, D, L = _parse_header(path, read_header(f, path), ("N", "D", "L"))
        X = Growing(path, D, "feature")
        Y = Growing(path, L, "label")
        for lineno, block, n in iter_chunks(f, path, chunk_lines, 2):
            if Y.n_rows + n > N:
                raise XCFormatError(path, 2 + N, f"{N} rows after the header 'N D L'", got="more rows")
            try:
                lc, li, fc, fi, fv = _fast_bow_chunk(block, D, L)
            except _FastPathFailed:
                _slow_bow_chunk(X, Y, block, lineno)
                continue
            Y.append(lc, li, np.ones(len(li), np.float32))
            X.append(fc, fi, fv)
    if Y.n_rows != N:
        raise XCFormatError(path, 1, f"{N} rows after the header 'N D L'", got=f"{Y.n_rows} rows")
    return X.to_csr(), Y.to_csr()


# --------------------------------------------------------------------------------- integer tables

def read_int_table(path: Path, chunk_lines: int = DEFAULT_CHUNK_LINES) -> np.ndarray:
    """A whitespace-separated rectangular table of non-negative integers (no header) as int64 (rows, cols)."""
    parts: list[np.ndarray] = []
    ncols = -1
    with open_binary(path) as f:
        for lineno, block, _ in iter_chunks(f, path, chunk_lines, 1):
            rows = []
            for j, raw in enumerate(block.split(b"\n")[:-1]):
                s = _decode_line(raw, path, lineno + j)
                toks = s.split()
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
                if any(v < 0 for v in vals):
                    raise XCFormatError(path, lineno + j, "non-negative indices", got=s)
                rows.append(vals)
            if rows:
                parts.append(np.array(rows, dtype=np.int64).reshape(-1, ncols))
    if not parts:
        raise XCFormatError(path, 1, "a table of row indices (one column per split)", got="an empty file")
    return np.concatenate(parts)




# -------------------------------------------------------------------------------- LF JSON lines

class FastPathFailed(_FastPathFailed):
    """Public alias: the vectorised LF reader could not take the file; use the line-by-line reader."""


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
    try:
        import pyarrow.json as pj
        open_json = pj.open_json
    except (ImportError, AttributeError) as e:  # pyarrow < 19
        raise FastPathFailed from e
    cols = [pa.field("title", pa.string()), pa.field("content", pa.string())]
    if n_labels is not None:
        cols += [pa.field("target_ind", pa.list_(pa.int64())), pa.field("target_rel", pa.list_(pa.float64()))]
    opts = pj.ParseOptions(explicit_schema=pa.schema(cols), unexpected_field_behavior="ignore",
                           newlines_in_values=False)
    texts: list[str] = []
    acc = Growing(path, n_labels, "label") if n_labels is not None else None
    try:
        with pa.input_stream(str(path), compression="gzip") as stream:
            reader = open_json(stream, read_options=pj.ReadOptions(block_size=block_size, use_threads=True),
                               parse_options=opts)
            for batch in reader:
                if batch.num_rows == 0:
                    continue
                if batch.column("title").null_count:
                    raise FastPathFailed
                texts.extend(_compose_texts([batch.column(f).to_pylist() for f in fields]))
                if acc is not None:
                    _targets(batch, acc)
    except (pa.ArrowException, OSError, EOFError, zlib.error, UnicodeDecodeError, ValueError) as e:
        raise FastPathFailed from e
    return texts, acc


def _targets(batch: pa.RecordBatch, acc: Growing) -> None:
    """Append one batch's ``target_ind`` (with ``target_rel`` values, 1.0 when absent) to ``acc``."""
    import pyarrow.compute as pc

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
        if not np.isfinite(rv_np).all():
            raise FastPathFailed
        if len(rv_np) == len(vals):
            vals = rv_np
        else:
            vals[np.repeat(present, counts)] = rv_np
    acc.append(counts, ids_np, vals)
