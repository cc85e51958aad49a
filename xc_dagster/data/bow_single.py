"""The XC repository's single-file BoW layout: ``<Name>_data.txt`` plus split index tables.

``<Name>_data.txt`` holds every point (header ``N D L``, rows ``l1,l2 f:v ...`` as in the legacy BoW files).
``<name>_trSplit.txt`` / ``<name>_tstSplit.txt`` are whitespace-separated tables with one column per random
split and one row per train (test) point, giving row indices into the data file. The XC repository ships them
1-based (they come from its MATLAB tooling); a table holding a 0 anywhere (in either file) is read as 0-based.
``split`` picks the column (0-based). ``Y.txt`` names labels; ``X_vocab.txt`` or ``vocab.txt`` rebuilds texts.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from xc_dagster.data.canonical import XCDataset
from xc_dagster.data.companions import bow_texts, check_bow_columns, read_filters
from xc_dagster.data.reader import ReadOptions
from xc_dagster.data.streaming import read_bow_file, read_int_table
from xc_dagster.data.textio import DEFAULT_CHUNK_LINES
from xc_dagster.errors import XCConfigError, XCFormatError

VOCAB_NAMES = ("X_vocab.txt", "vocab.txt")


def find_files(folder: Path) -> tuple[Path, Path, Path] | None:
    """``(data, trSplit, tstSplit)`` when the folder holds exactly one of each (names case-insensitive), else None."""
    files = [p for p in Path(folder).iterdir() if p.is_file()]

    def one(suffix: str) -> Path | None:
        hits = [p for p in files if p.name.lower().endswith(suffix)]
        return hits[0] if len(hits) == 1 else None

    data, tr, ts = one("_data.txt"), one("_trsplit.txt"), one("_tstsplit.txt")
    if data is None or tr is None or ts is None:
        return None
    return data, tr, ts


def _rows(table: tuple[np.ndarray, np.ndarray], path: Path, split: int, base: int, n: int) -> np.ndarray:
    """Column ``split`` of an index table (with its rows' file lines: ``read_int_table``) as 0-based rows, every
    one checked to be in [0, n) and to appear once."""
    table, lines = table
    if split >= table.shape[1]:
        raise XCFormatError(path, 1, f"a column for split {split} (splits are 0-based columns)",
                            got=f"{table.shape[1]} columns")
    rows = table[:, split] - base
    bad = np.flatnonzero((rows < 0) | (rows >= n))
    if len(bad):
        r = int(bad[0])
        raise XCFormatError(path, int(lines[r]), f"{base}-based row indices in [{base}, {n + base}) of the data "
                                                 f"file ({n} points)", got=str(int(table[r, split])))
    first = np.zeros(len(rows), dtype=bool)
    first[np.unique(rows, return_index=True)[1]] = True
    if not first.all():  # a point twice in one split would weigh twice (and be counted twice by the metrics)
        r = int(np.flatnonzero(~first)[0])
        raise XCFormatError(path, int(lines[r]), f"each row index once in split column {split}",
                            got=f"{int(table[r, split])} again")
    return rows


def _disjoint(tr: np.ndarray, ts: np.ndarray, ts_table: tuple[np.ndarray, np.ndarray], path: Path,
              split: int, base: int) -> None:
    """Refuse test rows that are also training rows: the model would be evaluated on points it trained on."""
    both = np.flatnonzero(np.isin(ts, tr))
    if len(both):
        r = int(both[0])
        raise XCFormatError(path, int(ts_table[1][r]), f"test rows that are not training rows (split column {split})",
                            got=f"{int(ts[r]) + base}, also in the training split")


def read_bow_single(folder: Path, split: int = 0,
                    chunk_lines: int = DEFAULT_CHUNK_LINES) -> XCDataset:
    """Read ``<Name>_data.txt`` and take the train/test rows of split column ``split``."""
    folder = Path(folder)
    if isinstance(split, bool) or not isinstance(split, (int, np.integer)) or split < 0:
        raise XCConfigError(f"split must be a non-negative integer (a column of the split tables), got {split!r}")
    found = find_files(folder)
    if found is None:
        raise XCFormatError(folder, None, "exactly one <Name>_data.txt, one <name>_trSplit.txt and one "
                                          "<name>_tstSplit.txt (bow-single layout)",
                            got=", ".join(sorted(p.name for p in folder.iterdir()))[:200])
    data, trp, tsp = found
    X, Y = read_bow_file(data, chunk_lines)
    check_bow_columns(folder, data, (Y,), (X,), VOCAB_NAMES)
    tr_tab = read_int_table(trp, chunk_lines)
    ts_tab = read_int_table(tsp, chunk_lines)
    base = 0 if (tr_tab[0] == 0).any() or (ts_tab[0] == 0).any() else 1
    n = X.shape[0]
    tr, ts = _rows(tr_tab, trp, int(split), base, n), _rows(ts_tab, tsp, int(split), base, n)
    _disjoint(tr, ts, ts_tab, tsp, int(split), base)
    X_train, X_test, Y_train, Y_test = X[tr], X[ts], Y[tr], Y[ts]
    L = Y.shape[1]
    label_texts, (train_texts, test_texts), words = bow_texts(folder, X_train, X_test, L, VOCAB_NAMES)
    f_train, f_test = read_filters(folder, len(tr), len(ts), L)
    return XCDataset(
        train_texts=train_texts, test_texts=test_texts, label_texts=label_texts,
        Y_train=Y_train.tocsr(), Y_test=Y_test.tocsr(), filter_train=f_train, filter_test=f_test,
        X_train=X_train.tocsr(), X_test=X_test.tocsr(), feature_words=words, layout="bow-single")


class BowSingleLayout:
    """``bow-single``: found when the folder holds one ``<Name>_data.txt``, ``_trSplit.txt`` and ``_tstSplit.txt``."""

    def detect(self, folder: Path, names: Sequence[str]) -> bool:
        return find_files(folder) is not None

    def read(self, folder: Path, opts: ReadOptions) -> XCDataset:
        return read_bow_single(folder, split=opts.split, chunk_lines=opts.chunk_lines)
