"""Files several XC layouts share, read the same way by every layout reader.

- ``filter_labels_{train,test}.txt``: ``row label`` pairs (0-based) removed from evaluation; read for every
  layout when present (:func:`read_filters`);
- ``Y.txt``: one label name per line; ``X_vocab.txt`` / ``vocab.txt``: one feature word per line, from which
  the BoW layouts rebuild point texts (:func:`bow_texts`) and which they keep as the dataset's feature words
  (:func:`read_feature_words`);
- the check that a layout's required files are present (:func:`require_files`).
"""

from __future__ import annotations

from array import array
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import scipy.sparse as sp

from xc_dagster.data.canonical import empty_pairs
from xc_dagster.data.limits import check_used_columns
from xc_dagster.data.textio import iter_lines, optional_file, read_text_lines
from xc_dagster.errors import XCFormatError


def require_files(folder: Path, names: Sequence[str], layout: str) -> None:
    """Raise naming the missing ones unless every file of ``names`` is in ``folder``."""
    missing = [n for n in names if not (folder / n).is_file()]
    if missing:
        raise XCFormatError(folder, None, f"the {layout} files {', '.join(names)}",
                            got="missing " + ", ".join(missing))


def read_filters(folder: Path, n_train: int, n_test: int, n_labels: int) -> tuple[np.ndarray, np.ndarray]:
    """``filter_labels_train.txt`` / ``filter_labels_test.txt`` of a folder (empty when absent)."""
    return (_read_filter(folder / "filter_labels_train.txt", n_train, n_labels),
            _read_filter(folder / "filter_labels_test.txt", n_test, n_labels))


def _read_filter(path: Path, n_rows: int, n_labels: int) -> np.ndarray:
    """``row label`` pairs (0-based) of a filter file; an absent file gives an empty (0, 2) array."""
    if not optional_file(path):
        return empty_pairs()
    flat = array("q")
    for lineno, s in iter_lines(path):
        parts = s.split()
        if not parts:
            continue
        try:
            if len(parts) != 2:
                raise ValueError
            r, c = int(parts[0]), int(parts[1])
        except ValueError:
            raise XCFormatError(path, lineno, "two integers 'row label' per line", got=s) from None
        if not 0 <= r < n_rows:
            raise XCFormatError(path, lineno, f"a row id in [0, {n_rows})", got=s)
        if not 0 <= c < n_labels:
            raise XCFormatError(path, lineno, f"a label id in [0, {n_labels})", got=s)
        flat.append(r)
        flat.append(c)
    return np.frombuffer(flat, dtype=np.int64).reshape(-1, 2).copy()


def check_bow_columns(folder: Path, path: Path, Ys: Sequence[sp.csr_matrix], Xs: Sequence[sp.csr_matrix],
                      vocab_names: Sequence[str] = ("X_vocab.txt",)) -> None:
    """The ``L`` and ``D`` of a BoW header (of ``path``) against the columns the rows use, unless ``Y.txt`` or a
    vocabulary file lists them (docs/decisions.md#ingest-input-limits)."""
    if not (folder / "Y.txt").is_file():
        check_used_columns(path, "L", Ys[0].shape[1], [Y.indices for Y in Ys])
    if not any((folder / name).is_file() for name in vocab_names):
        check_used_columns(path, "D", Xs[0].shape[1], [X.indices for X in Xs])


def generic_labels(n: int) -> list[str]:
    """Placeholder label names ``label 0`` ... when a layout has no ``Y.txt``."""
    return [f"label {i}" for i in range(n)]


def points_have_text(ingest: Mapping[str, Any]) -> bool:
    """Whether an ingest summary's training points give the encoder anything to read: a pre-tokenized layout, or
    some point with text (``train_texts``; a BoW layout without its vocabulary has none). Summaries from before
    the count say yes."""
    return ingest.get("layout") == "tokenized" or ingest.get("train_texts", 1) > 0


def lexical_alone(point_texts: bool, point_features: bool, sources: Sequence[str], sources_set: bool) -> bool:
    """Whether a model is its lexical source alone (docs/decisions.md#lexical-only-without-text): no training point
    has text (every point embeds as the one empty input: the dense scores are per-label constants), the layout
    shipped BoW features for the lexical source to read, and the strategy's ``index.sources`` name it (the user's,
    ``sources_set``, only when it is that source alone: other sources set are kept with their scores)."""
    return (not point_texts and point_features and "lexical" in sources
            and (not sources_set or tuple(sources) == ("lexical",)))


def text_hint(layout: str) -> str:
    """What gives the points of a ``layout`` their texts, for a dataset that has none."""
    if layout == "split-sparse":
        return "trn_X.txt and tst_X.txt (one text per line) give the points their texts"
    return "X_vocab.txt (or vocab.txt: one word per feature column) rebuilds the points' texts from their features"


def has_label_names(label_texts: list[str]) -> bool:
    """Whether the labels have names of their own: not the placeholders ``generic_labels`` gives a layout without
    ``Y.txt`` ("label 17" says nothing of a label)."""
    return label_texts != generic_labels(len(label_texts))


def _texts_from_vocab(X: sp.csr_matrix, vocab: np.ndarray) -> list[str]:
    """Each row's feature words, by descending feature value (ties by feature id), joined by spaces."""
    rows = np.repeat(np.arange(X.shape[0]), np.diff(X.indptr))
    order = np.lexsort((X.indices, -X.data, rows))
    words = vocab[X.indices[order]]
    bounds = X.indptr
    return [" ".join(words[bounds[r]:bounds[r + 1]]) for r in range(X.shape[0])]


def read_feature_words(folder: Path, num_features: int,
                       vocab_names: Sequence[str] = ("X_vocab.txt",)) -> list[str] | None:
    """One word per feature column, from the first vocabulary file of ``vocab_names`` in ``folder``; None when
    there is none."""
    for name in vocab_names:
        path = folder / name
        if optional_file(path):
            return read_text_lines(path, num_features, "feature word")
    return None


def bow_texts(folder: Path, X_train: sp.csr_matrix, X_test: sp.csr_matrix, L: int,
              vocab_names: Sequence[str] = ("X_vocab.txt",)
              ) -> tuple[list[str], tuple[list[str], list[str]], list[str] | None]:
    """Label names from ``Y.txt`` (else generic), point texts rebuilt from the first vocabulary file found, and
    that vocabulary (one word per feature column; None, and empty texts, when there is none)."""
    y_txt = folder / "Y.txt"
    label_texts = read_text_lines(y_txt, L, "label name") if optional_file(y_txt) else generic_labels(L)
    words = read_feature_words(folder, X_train.shape[1], vocab_names)
    if words is None:
        return label_texts, ([""] * X_train.shape[0], [""] * X_test.shape[0]), None
    vocab = np.array(words, dtype=object)
    return label_texts, (_texts_from_vocab(X_train, vocab), _texts_from_vocab(X_test, vocab)), words
