"""Sparse-row accumulators the readers append parsed rows to, with one CSR build at the end.

:class:`Growing` takes whole chunks of rows as arrays (the chunked parsers of :mod:`xc_dagster.data.streaming`
and the LF Arrow reader); :class:`SparseRows` takes one row at a time (the LF line-by-line reader).
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import scipy.sparse as sp

from xc_dagster.data.limits import MAX_DIM
from xc_dagster.errors import XCFormatError

F32_MAX = float(np.finfo(np.float32).max)  # values are kept as float32: a larger one would become inf
LineOf = Callable[[int], "int | None"]  # a 0-based data row -> its 1-based file line (None: not known)


class Growing:
    """Rows appended chunk by chunk as int32 indices (int64 past 2**31 - 1 columns, so that ids never wrap) /
    float32 values; one CSR build at the end."""

    def __init__(self, path: Path, n_cols: int, what: str, line_of: LineOf | None = None):
        self.path, self.n_cols, self.what, self.line_of = path, n_cols, what, line_of
        self._idx_dtype = np.int32 if n_cols <= MAX_DIM else np.int64
        self._counts: list[np.ndarray] = []
        self._idx: list[np.ndarray] = []
        self._val: list[np.ndarray] = []
        self.n_rows = 0
        self.nnz = 0

    def append(self, counts: np.ndarray, idx: np.ndarray, val: np.ndarray) -> None:
        """Append rows: ``counts[r]`` entries each, flattened in ``idx``/``val``."""
        self._counts.append(np.asarray(counts, dtype=np.int64))
        self._idx.append(np.asarray(idx, dtype=self._idx_dtype))
        self._val.append(np.asarray(val, dtype=np.float32))
        self.n_rows += len(counts)
        self.nnz += len(idx)

    def bad(self, lineno: int, got: str) -> XCFormatError:
        """The error of a malformed ``idx:val`` token."""
        return XCFormatError(self.path, lineno,
                             f"{self.what} entries 'index:value' with an integer index in [0, {self.n_cols}) "
                             f"and a finite number value within float32's range (|value| <= {F32_MAX:.4g})",
                             got=got)

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
        wide = self.nnz > MAX_DIM or idx.dtype == np.int64
        if wide:
            idx = idx.astype(np.int64)
        m = sp.csr_matrix((val, idx, indptr if wide else indptr.astype(np.int32)),
                          shape=(self.n_rows, self.n_cols))
        return canonical(m, self.path, self.what, self.line_of)


class SparseRows:
    """Rows of (index, value) entries appended one at a time into flat arrays, then one vectorised CSR build."""

    def __init__(self, path: Path, n_cols: int, what: str):
        self.path, self.n_cols, self.what = path, n_cols, what
        self.lines = array("q")  # each row's 1-based file line, for the errors of ``canonical``
        self.indptr = array("q", [0])
        self.indices = array("q")
        self.data = array("d")

    @property
    def n_rows(self) -> int:
        return len(self.indptr) - 1

    def add_ids(self, ids: Sequence[int], vals: Sequence[float] | None, lineno: int) -> None:
        """Append one row of already-parsed ids (values default to 1.0); checks the id range."""
        n = self.n_cols
        for i in ids:
            if not 0 <= i < n:
                raise XCFormatError(self.path, lineno, f"{self.what} ids in [0, {n})", got=str(i))
        self.indices.extend(ids)
        if vals is None:
            self.data.extend([1.0] * len(ids))
        else:
            self.data.extend(vals)
        self.indptr.append(len(self.indices))
        self.lines.append(lineno)

    def to_csr(self) -> sp.csr_matrix:
        """The accumulated rows as a canonical (sorted, duplicates summed) float32 CSR matrix."""
        m = sp.csr_matrix(
            (np.frombuffer(self.data, dtype=np.float64).astype(np.float32),
             np.frombuffer(self.indices, dtype=np.int64),
             np.frombuffer(self.indptr, dtype=np.int64)),
            shape=(self.n_rows, self.n_cols))
        return canonical(m, self.path, self.what, self.lines.__getitem__)


def canonical(m: sp.csr_matrix, path: Path, what: str, line_of: LineOf | None = None) -> sp.csr_matrix:
    """``m`` with sorted indices and repeated entries summed, each sum within float32's range; a ``what`` of
    "label" holds relevances: a negative one is refused, a 0 (given, or below float32's smallest) is no label and
    dropped, so that no stage reads a stored 0 as a positive. ``line_of(row)``: the 1-based file line of a 0-based
    data row, which the errors name (without it, the data row)."""
    if what == "label" and (m.data < 0).any():  # each value, as the LF readers judge target_rel (not their sum)
        _refuse(m, m.data < 0, path, line_of, "label values (relevances) >= 0; 0 is no label", "a negative value")
    m.sum_duplicates()
    if not np.isfinite(m.data).all():  # values, or repeated entries of one column summed, past float32's range
        _refuse(m, ~np.isfinite(m.data), path, line_of, f"{what} values whose sum per (row, column) fits float32 "
                f"(|sum| <= {F32_MAX:.4g})", "an overflow")
    if what == "label":
        m.eliminate_zeros()
    return m


def _refuse(m: sp.csr_matrix, bad: np.ndarray, path: Path, line_of: LineOf | None, expected: str, got: str) -> None:
    """Raise the error of the first stored entry flagged in ``bad``: its file line, and its 1-based data row."""
    row = int(np.searchsorted(m.indptr, int(np.flatnonzero(bad)[0]), side="right")) - 1
    raise XCFormatError(path, None if line_of is None else line_of(row), expected,
                        got=f"{got} in data row {row + 1} (1-based)")
