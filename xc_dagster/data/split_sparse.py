"""The split sparse layout: ``{trn,tst}_X_{Xf,Y}.txt`` sparse matrices plus optional label features and texts.

Every matrix file has the header ``rows cols`` and one row of ``idx:val`` pairs per line (parsed by
:func:`xc_dagster.data.streaming.read_sparse_file`). ``trn_X_Y.txt`` / ``tst_X_Y.txt`` are required; the
features ``trn_X_Xf.txt``, ``tst_X_Xf.txt``, ``lbl_X_Xf.txt`` (or ``Yf.txt``) and the raw-text companions
``trn_X.txt``, ``tst_X.txt``, ``Y.txt`` (one text per line) are optional.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import scipy.sparse as sp

from xc_dagster.data.canonical import XCDataset
from xc_dagster.data.companions import generic_labels, read_filters, require_files
from xc_dagster.data.limits import check_used_columns
from xc_dagster.data.reader import ReadOptions
from xc_dagster.data.streaming import read_sparse_file
from xc_dagster.data.textio import DEFAULT_CHUNK_LINES, optional_file, read_text_lines
from xc_dagster.errors import XCFormatError

REQUIRED = ("trn_X_Y.txt", "tst_X_Y.txt")


def _check_rows(path: Path, m: sp.csr_matrix, n: int, what: str) -> None:
    if m.shape[0] != n:
        raise XCFormatError(path, 1, f"{n} rows ({what})", got=f"{m.shape[0]} rows")


def _check_feature_columns(folder: Path, features: dict[str, sp.csr_matrix]) -> None:
    """The feature files agree on their column count D, and their rows use all but a bounded few of them."""
    if not features:
        return
    first, m0 = next(iter(features.items()))
    D = m0.shape[1]
    for name, m in features.items():
        if m.shape[1] != D:
            raise XCFormatError(folder / name, 1, f"{D} feature columns, as in {first}", got=str(m.shape[1]))
    check_used_columns(folder / first, "cols", D, [m.indices for m in features.values()])


def read_split_sparse(folder: Path, chunk_lines: int = DEFAULT_CHUNK_LINES,
                      layout: str = "split-sparse") -> XCDataset:
    """Split sparse layout: ``{trn,tst}_X_Y.txt`` required, features and raw-text companions optional."""
    require_files(folder, REQUIRED, layout)
    trn_y = folder / "trn_X_Y.txt"
    Y_train = read_sparse_file(trn_y, chunk_lines, "label")
    tst_y = folder / "tst_X_Y.txt"
    Y_test = read_sparse_file(tst_y, chunk_lines, "label")
    n_tr, n_te, L = Y_train.shape[0], Y_test.shape[0], Y_train.shape[1]
    if Y_test.shape[1] != L:
        raise XCFormatError(tst_y, 1, f"{L} label columns, as in trn_X_Y.txt", got=str(Y_test.shape[1]))

    def opt_matrix(name: str, n: int, what: str) -> sp.csr_matrix | None:
        p = folder / name
        if not optional_file(p):
            return None
        m = read_sparse_file(p, chunk_lines)
        _check_rows(p, m, n, what)
        return m

    X_train = opt_matrix("trn_X_Xf.txt", n_tr, "one per training point")
    X_test = opt_matrix("tst_X_Xf.txt", n_te, "one per test point")
    lbl_name = "lbl_X_Xf.txt" if optional_file(folder / "lbl_X_Xf.txt") else "Yf.txt"
    X_label = opt_matrix(lbl_name, L, "one per label")
    features = {name: m for name, m in
                (("trn_X_Xf.txt", X_train), ("tst_X_Xf.txt", X_test), (lbl_name, X_label)) if m is not None}
    _check_feature_columns(folder, features)
    if X_label is None and not optional_file(folder / "Y.txt"):  # L comes from the header alone
        check_used_columns(trn_y, "cols", L, [Y_train.indices, Y_test.indices])

    def texts(name: str, n: int, what: str, default: Callable[[], list[str]]) -> list[str]:
        p = folder / name
        return read_text_lines(p, n, what) if optional_file(p) else default()

    f_train, f_test = read_filters(folder, n_tr, n_te, L)
    return XCDataset(
        train_texts=texts("trn_X.txt", n_tr, "training text", lambda: [""] * n_tr),
        test_texts=texts("tst_X.txt", n_te, "test text", lambda: [""] * n_te),
        label_texts=texts("Y.txt", L, "label text", lambda: generic_labels(L)),
        Y_train=Y_train, Y_test=Y_test, filter_train=f_train, filter_test=f_test,
        X_train=X_train, X_test=X_test, X_label=X_label, layout=layout)


class SplitSparseLayout:
    """``split-sparse``: found when ``trn_X_Y.txt`` and ``tst_X_Y.txt`` are there."""

    def detect(self, folder: Path, names: Sequence[str]) -> bool:
        return all(n in names for n in REQUIRED)

    def read(self, folder: Path, opts: ReadOptions) -> XCDataset:
        return read_split_sparse(folder, opts.chunk_lines)
