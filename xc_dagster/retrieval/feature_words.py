"""A BoW dataset's feature words (one word per feature column) read as term sets: the lexical source's input when
it serves raw text over shipped features (``xc_dagster.retrieval.lexical``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import scipy.sparse as sp


def _split_words(text: str) -> list[str]:
    """A text's pieces as ``xc_dagster.data.companions`` joins feature words into a point's text: split on single
    spaces (empty pieces match no term)."""
    return text.split(" ")


def _counter(terms: list[str]) -> Any:
    from sklearn.feature_extraction.text import CountVectorizer

    return CountVectorizer(vocabulary=terms, binary=True, lowercase=False, analyzer=_split_words, dtype=np.float32)


def _binary(X: sp.spmatrix) -> sp.csr_matrix:
    """``X`` as 0/1 float32 CSR: every stored entry (an explicit 0 too, as a rebuilt text names its word) is 1."""
    X = sp.csr_matrix(X, dtype=np.float32, copy=True)
    X.sum_duplicates()
    X.data[:] = 1.0
    return X


class FeatureWords:
    """A feature vocabulary (one word per feature column) and the binary term rows of feature rows and texts.

    The terms are the words' distinct non-empty pieces (split on single spaces), by first appearance: the words
    themselves when each is one distinct piece (the usual case, no remapping). A feature row's terms are those of
    its stored entries' words, a text's those of its pieces, so a text joined from a row's words has its terms."""

    def __init__(self, words: Sequence[str]):
        self.words = [str(w) for w in words]
        if len(set(self.words)) == len(self.words) and not any(" " in w or not w for w in self.words):
            self.terms, self.map = self.words, None
        else:  # repeated, empty or multi-piece words: each feature column -> its words' terms
            pieces = [[t for t in w.split(" ") if t] for w in self.words]
            self.terms = list(dict.fromkeys(t for ps in pieces for t in ps))
            col = {t: j for j, t in enumerate(self.terms)}
            indptr = np.cumsum([0] + [len(ps) for ps in pieces])
            indices = np.fromiter((col[t] for ps in pieces for t in ps), dtype=np.int64, count=int(indptr[-1]))
            self.map = _binary(sp.csr_matrix((np.ones(len(indices), dtype=np.float32), indices, indptr),
                                             shape=(len(self.words), len(self.terms))))
        self._counter = _counter(self.terms) if self.terms else None

    def of_features(self, X: sp.spmatrix) -> sp.csr_matrix:
        """(rows, terms) 0/1 rows of feature rows (``len(words)`` columns)."""
        B = _binary(X)
        return B if self.map is None else _binary(B @ self.map)

    def of_texts(self, texts: Sequence[str]) -> sp.csr_matrix:
        """(texts, terms) 0/1 rows of raw texts: the terms among their single-space pieces (case kept)."""
        texts = list(texts)
        if not texts or self._counter is None:  # sklearn refuses zero rows
            return sp.csr_matrix((len(texts), len(self.terms)), dtype=np.float32)
        return _binary(self._counter.transform(texts))
