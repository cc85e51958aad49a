"""The pre-tokenized layout: ``{trn_doc,tst_doc,lbl}_{input_ids,attention_mask}.npy`` with label files.

The label matrices come from the split-sparse files ``trn_X_Y.txt`` / ``tst_X_Y.txt`` (required); features,
raw texts (``trn_X.txt``, ``tst_X.txt``, ``Y.txt``; "" when absent) and filter files are read as in the
split-sparse layout. ``trn_doc``/``tst_doc`` arrays are required, ``lbl`` ones optional; each pair must be
2-D integer arrays of one shape with one row per point (label).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from xc_dagster.data.canonical import XCDataset
from xc_dagster.data.reader import ReadOptions
from xc_dagster.data.split_sparse import REQUIRED, read_split_sparse
from xc_dagster.data.textio import DEFAULT_CHUNK_LINES
from xc_dagster.errors import XCFormatError

PREFIXES = ("trn_doc", "tst_doc", "lbl")
_KINDS = ("input_ids", "attention_mask")


def is_tokenized(folder: Path) -> bool:
    """True when the folder holds any ``trn_doc``/``tst_doc`` token array."""
    return any((Path(folder) / f"{p}_{k}.npy").is_file() for p in PREFIXES[:2] for k in _KINDS)


def _load(path: Path) -> np.ndarray:
    """A 2-D integer array; its header is checked against the file's size (memory-mapped first) before any
    memory is allocated for it."""
    try:
        mapped = np.load(path, mmap_mode="r", allow_pickle=False)  # a shape the file cannot hold raises here
    except (ValueError, OSError, EOFError) as e:
        raise XCFormatError(path, None, "a complete NumPy .npy array (no pickled objects) whose header's shape "
                                        "the file holds", got=f"{type(e).__name__}: {e}") from e
    if not isinstance(mapped, np.ndarray) or mapped.ndim != 2 or mapped.dtype.kind not in "iub":
        got = f"{getattr(mapped, 'ndim', '?')}-D {getattr(mapped, 'dtype', type(mapped).__name__)}"
        raise XCFormatError(path, None, "a 2-D integer array (rows x max_len)", got=got)
    try:
        return np.array(mapped)
    except MemoryError:  # the file holds the bytes (e.g. a sparse file) but they do not fit in memory
        raise XCFormatError(path, None, "an array that fits in memory",
                            got=f"{mapped.shape} {mapped.dtype} ({mapped.nbytes:,} bytes)") from None


def _pair(folder: Path, prefix: str, n_rows: int, rows_of: str,
          required: bool) -> tuple[np.ndarray, np.ndarray] | None:
    ids_p, mask_p = (folder / f"{prefix}_{k}.npy" for k in _KINDS)
    if not ids_p.is_file() and not mask_p.is_file() and not required:
        return None
    for p in (ids_p, mask_p):
        if not p.is_file():
            raise XCFormatError(p, None, f"{ids_p.name} and {mask_p.name} together (tokenized layout)",
                                got="missing")
    ids, mask = _load(ids_p), _load(mask_p)
    if mask.shape != ids.shape:
        raise XCFormatError(mask_p, None, f"the shape of {ids_p.name} {ids.shape}", got=str(mask.shape))
    if ids.shape[0] != n_rows:
        raise XCFormatError(ids_p, None, f"{n_rows} rows, one per row of {rows_of}", got=f"{ids.shape[0]} rows")
    return ids, mask


def read_tokenized(folder: Path, chunk_lines: int = DEFAULT_CHUNK_LINES) -> XCDataset:
    """Token arrays plus the split-sparse label files into one :class:`XCDataset` (layout ``tokenized``)."""
    folder = Path(folder)
    missing = [n for n in REQUIRED if not (folder / n).is_file()]
    if missing:
        raise XCFormatError(folder, None, "the label files trn_X_Y.txt and tst_X_Y.txt next to the token arrays "
                                          "(tokenized layout)", got="missing " + ", ".join(missing))
    ds = read_split_sparse(folder, chunk_lines, layout="tokenized")
    ds.train_tokens = _pair(folder, "trn_doc", ds.num_train, "trn_X_Y.txt", True)
    ds.test_tokens = _pair(folder, "tst_doc", ds.num_test, "tst_X_Y.txt", True)
    ds.label_tokens = _pair(folder, "lbl", ds.num_labels, "the label columns of trn_X_Y.txt", False)
    return ds


class TokenizedLayout:
    """``tokenized``: found when any ``trn_doc``/``tst_doc`` token array is there (checked before split-sparse)."""

    def detect(self, folder: Path, names: Sequence[str]) -> bool:
        return is_tokenized(folder)

    def read(self, folder: Path, opts: ReadOptions) -> XCDataset:
        return read_tokenized(folder, chunk_lines=opts.chunk_lines)
