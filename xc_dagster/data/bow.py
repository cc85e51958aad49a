"""The legacy BoW layout: one ``*train*.txt`` and one ``*test*.txt``, each with header ``N D L``.

Rows are ``l1,l2,... f:v f:v ...`` (label ids, then feature ``index:value`` pairs), parsed by
:func:`xc_dagster.data.streaming.read_bow_file`. ``Y.txt`` names the labels and ``X_vocab.txt`` rebuilds point
texts from the features (:func:`xc_dagster.data.companions.bow_texts`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from xc_dagster.data.canonical import XCDataset
from xc_dagster.data.companions import bow_texts, check_bow_columns, read_filters
from xc_dagster.data.reader import ReadOptions
from xc_dagster.data.streaming import read_bow_file
from xc_dagster.data.textio import DEFAULT_CHUNK_LINES, first_line, parse_header
from xc_dagster.errors import XCFormatError


def find_files(folder: Path) -> tuple[Path, Path] | None:
    """The (train, test) pair of a BoW folder, or None; a lone pair with a bad header raises."""
    txt = sorted(p for p in folder.iterdir() if p.is_file() and p.name.lower().endswith(".txt")
                 and not p.name.lower().startswith("filter_labels"))
    train = [p for p in txt if "train" in p.name.lower()]
    test = [p for p in txt if "test" in p.name.lower()]
    if len(train) != 1 or len(test) != 1 or train[0] == test[0]:
        return None
    parse_header(train[0], first_line(train[0]), ("N", "D", "L"))
    return train[0], test[0]


def read_bow(folder: Path, chunk_lines: int = DEFAULT_CHUNK_LINES) -> XCDataset:
    """Legacy BoW layout; texts are rebuilt from ``X_vocab.txt`` when present, labels named by ``Y.txt``."""
    pair = find_files(folder)
    if pair is None:
        raise XCFormatError(folder, None, "exactly one *train*.txt and one *test*.txt file (BoW layout)",
                            got=", ".join(sorted(p.name for p in folder.iterdir()))[:200])
    trn, tst = pair
    X_train, Y_train = read_bow_file(trn, chunk_lines)
    X_test, Y_test = read_bow_file(tst, chunk_lines)
    D, L = X_train.shape[1], Y_train.shape[1]
    if (X_test.shape[1], Y_test.shape[1]) != (D, L):
        raise XCFormatError(tst, 1, f"the same D and L as {trn.name} ({D} {L})",
                            got=f"{X_test.shape[1]} {Y_test.shape[1]}")
    check_bow_columns(folder, trn, (Y_train, Y_test), (X_train, X_test))
    label_texts, (train_texts, test_texts), words = bow_texts(folder, X_train, X_test, L)
    f_train, f_test = read_filters(folder, X_train.shape[0], X_test.shape[0], L)
    return XCDataset(
        train_texts=train_texts, test_texts=test_texts, label_texts=label_texts,
        Y_train=Y_train, Y_test=Y_test, filter_train=f_train, filter_test=f_test,
        X_train=X_train, X_test=X_test, feature_words=words, layout="bow")


class BowLayout:
    """``bow``: found when the folder holds exactly one ``*train*.txt`` and one ``*test*.txt``."""

    def detect(self, folder: Path, names: Sequence[str]) -> bool:
        return find_files(folder) is not None

    def read(self, folder: Path, opts: ReadOptions) -> XCDataset:
        return read_bow(folder, opts.chunk_lines)
