"""The lexical source's TF-IDF models (scikit-learn's): a vectorizer of raw texts, a transformer of shipped
feature rows.

Imported lazily: scikit-learn takes about a second to import, and only fitting or loading a lexical index needs it.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import scipy.sparse as sp

from xc_dagster.config.bounds import is_finite_number
from xc_dagster.errors import XCConfigError

# TfidfVectorizer settings besides min_df (recorded in lexical.json, so a load rebuilds the same analyzer)
VECTORIZER = {"sublinear_tf": True, "ngram_range": [1, 2], "lowercase": True, "token_pattern": r"(?u)\b\w\w+\b"}
# the char n-gram block of ``WordsAndChars``: 3-5 grams inside word boundaries (a word's inflections and compounds
# share them: "protozoal" / "protozoan", "chestnut" / "chestnuts")
CHARS = {"sublinear_tf": True, "ngram_range": [3, 5], "lowercase": True, "analyzer": "char_wb"}
WORD, CHAR = "w ", "c "  # prefixes of the two blocks' terms in a saved vocabulary


def vectorizer(base: dict[str, Any] = VECTORIZER, **kw: Any) -> Any:
    """The vectorizer of raw texts: ``base`` (``VECTORIZER``, ``CHARS``) with ``kw`` (min_df, a fitted
    vocabulary)."""
    from sklearn.feature_extraction.text import TfidfVectorizer

    settings = {**base, **kw}
    settings["ngram_range"] = tuple(settings["ngram_range"])
    return TfidfVectorizer(dtype=np.float32, **settings)


def transformer(values: bool = False) -> Any:
    """scikit-learn's TF-IDF of feature rows: counts get sublinear tf and idf; real values (``values``: features
    already weighted, as the XC repository's TF-IDF rows, or dense descriptors) are only L2-normalised, since
    1 + log(v) turns a value under 1 negative (and an explicit 0 into -inf)."""
    from sklearn.feature_extraction.text import TfidfTransformer

    return TfidfTransformer(use_idf=False) if values else TfidfTransformer(sublinear_tf=True)


def nonzero(X: sp.spmatrix) -> sp.csr_matrix:
    """``X`` as CSR without explicitly stored zeros (a BoW file may write ``f:0``)."""
    X = sp.csr_matrix(X, copy=True)
    X.eliminate_zeros()
    return X


def are_counts(X: sp.csr_matrix) -> bool:
    """Whether every stored value of feature rows is a positive integer (word counts, binary BoW)."""
    d = X.data[X.data != 0]
    return bool(len(d) == 0 or (d.min() >= 1 and np.array_equal(d, np.rint(d))))


class WordsAndChars:
    """TF-IDF of word 1-2 grams beside TF-IDF of char 3-5 grams of the same texts (``CHARS``; PECOS's union of
    vectorizers), each block L2-normalised, the char block weighed ``weight``, the row L2-normalised again: to the
    lexical classifiers a word a query shares with a label only in part (an inflection, a compound) still counts
    (the other parts read the word block: :func:`word_postings`). The blocks' terms are one vocabulary, ``WORD`` /
    ``CHAR`` prefixed, the words first."""

    use_idf = True

    def __init__(self, words: Any, chars: Any, weight: float):
        self.words, self.chars, self.weight = words, chars, float(weight)

    @property
    def min_df(self) -> int:
        return int(self.words.min_df)

    def build_analyzer(self) -> Any:  # marks a model of raw texts (``LexicalIndex.input``)
        return self.words.build_analyzer()

    @property
    def vocabulary_(self) -> dict[str, int]:
        n = len(self.words.vocabulary_)
        return {**{WORD + t: i for t, i in self.words.vocabulary_.items()},
                **{CHAR + t: n + i for t, i in self.chars.vocabulary_.items()}}

    @property
    def idf_(self) -> np.ndarray:
        return np.concatenate([self.words.idf_, self.chars.idf_])

    @idf_.setter
    def idf_(self, idf: np.ndarray) -> None:
        n = len(self.words.vocabulary)
        if len(idf) != n + len(self.chars.vocabulary):
            raise ValueError(f"{len(idf)} idf values for {n} + {len(self.chars.vocabulary)} terms")
        self.words.idf_, self.chars.idf_ = idf[:n], idf[n:]

    def transform(self, texts: Any) -> sp.csr_matrix:
        from sklearn.preprocessing import normalize

        texts = list(texts)
        blocks = [self.words.transform(texts), self.chars.transform(texts) * np.float32(self.weight)]
        return normalize(sp.hstack(blocks, format="csr", dtype=np.float32), copy=False)

    @classmethod
    def load(cls, vocabulary: list[str], weight: float, words: dict[str, Any], chars: dict[str, Any]) -> WordsAndChars:
        """The model of a saved vocabulary (``WORD`` / ``CHAR`` terms; its ``idf_`` is set after), each block's
        vectorizer built from its recorded settings ``words`` / ``chars``."""
        terms = {p: [t[len(p):] for t in vocabulary if t.startswith(p)] for p in (WORD, CHAR)}
        if terms[WORD] + terms[CHAR] != [t[len(WORD):] for t in vocabulary]:  # WORD and CHAR are of one length
            raise ValueError(f"a words-and-chars vocabulary holds {WORD!r} terms, then {CHAR!r} ones")
        return cls(vectorizer(words, vocabulary=terms[WORD]), vectorizer(chars, vocabulary=terms[CHAR]), weight)


def word_block(model: Any, X: sp.csr_matrix) -> sp.csr_matrix:
    """``X`` (rows of ``model``, the same shape) without a :class:`WordsAndChars` model's char entries: the label
    rows, which only the label-text part reads (:func:`word_postings`), so their char block (several times the
    word entries) is neither held nor saved. Other models' rows: ``X``."""
    if not isinstance(model, WordsAndChars):
        return X
    out = sp.csr_matrix(X[:, :len(model.words.vocabulary_)], dtype=np.float32)
    out.resize(X.shape)
    return out


def word_postings(model: Any, X: sp.csr_matrix) -> sp.csr_matrix:
    """The term-major (terms, rows) CSR of the TF-IDF rows ``X`` that the label-text and kNN parts read: of a
    :class:`WordsAndChars` model's rows the word block alone, times 1 + w^2, so that a product of two is the cosine
    of their word rows (a row with words has chars too, its word block its word row / sqrt(1 + w^2)); the char block
    is the classifiers' (decisions.md#lexical-char-ngrams). Other models': the whole rows."""
    if not isinstance(model, WordsAndChars):
        return sp.csr_matrix(X.T, dtype=np.float32)
    # the word columns sliced before the transpose: the char entries (most of a row's) are never copied or sorted
    return sp.csr_matrix((word_block(model, X) * np.float32(1.0 + model.weight ** 2)).T)


def text_settings(model: Any) -> dict[str, Any]:
    """What ``lexical.json`` records of a fitted text model, for :func:`load_text_model`: each vectorizer's settings
    as fitted (min_df after a fallback), so that a load rebuilds the same analyzers."""
    out: dict[str, Any] = {"vectorizer": {**VECTORIZER, "min_df": int(model.min_df)}}
    if isinstance(model, WordsAndChars):
        out.update(char_weight=model.weight, char_vectorizer={**CHARS, "min_df": int(model.chars.min_df)})
    return out


def load_text_model(config: dict[str, Any], vocabulary: list[str]) -> Any:
    """The text model :func:`text_settings` recorded (before the char block: ``VECTORIZER`` alone)."""
    settings = config.get("vectorizer", VECTORIZER)
    if config.get("char_weight"):
        chars = config.get("char_vectorizer", {**CHARS, "min_df": settings.get("min_df", 1)})
        return WordsAndChars.load(vocabulary, config["char_weight"], settings, chars)
    return vectorizer(**settings, vocabulary=vocabulary)


def check_char_weight(weight: Any) -> float:
    """``index.lexical_char_weight`` as a float if it is a finite number >= 0, else an error naming it."""
    if not is_finite_number(weight) or weight < 0:
        raise XCConfigError(f"index.lexical_char_weight: expected a number >= 0 (0: words only), got {weight!r}")
    return float(weight)


def fit_texts(texts: list[str], min_df: int, char_weight: float = 0.0) -> Any:
    """The vectorizer fitted on ``texts``; min_df 1 when ``min_df`` leaves no term (tiny corpora). A corpus
    without any term is a config error. ``char_weight`` > 0: :class:`WordsAndChars` with that weight."""
    char_weight = check_char_weight(char_weight)
    for df in dict.fromkeys((min_df, 1)):
        try:
            words = vectorizer(min_df=df).fit(texts)
            return WordsAndChars(words, vectorizer(CHARS, min_df=df).fit(texts), char_weight) if char_weight \
                else words
        except ValueError:  # "no terms remain" / "empty vocabulary" / fewer documents than min_df
            continue
    raise XCConfigError("index.sources: the lexical source found no term (words of 2+ characters) in the "
                        "training points' and labels' texts")
