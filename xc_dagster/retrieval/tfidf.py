"""The lexical source's TF-IDF models (scikit-learn's): a vectorizer of raw texts, a transformer of shipped
feature rows.

Imported lazily: scikit-learn takes about a second to import, and only fitting or loading a lexical index needs it.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import scipy.sparse as sp

from xc_dagster.errors import XCConfigError

# TfidfVectorizer settings besides min_df (recorded in lexical.json, so a load rebuilds the same analyzer)
VECTORIZER = {"sublinear_tf": True, "ngram_range": [1, 2], "lowercase": True, "token_pattern": r"(?u)\b\w\w+\b"}


def vectorizer(**kw: Any) -> Any:
    """The vectorizer of raw texts: ``VECTORIZER`` with ``kw`` (min_df, a fitted vocabulary)."""
    from sklearn.feature_extraction.text import TfidfVectorizer

    settings = {**VECTORIZER, **kw}
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


def fit_texts(texts: list[str], min_df: int) -> Any:
    """The vectorizer fitted on ``texts``; min_df 1 when ``min_df`` leaves no term (tiny corpora). A corpus
    without any term is a config error."""
    for df in dict.fromkeys((min_df, 1)):
        try:
            return vectorizer(min_df=df).fit(texts)
        except ValueError:  # "no terms remain" / "empty vocabulary" / fewer documents than min_df
            continue
    raise XCConfigError("index.sources: the lexical source found no term (words of 2+ characters) in the "
                        "training points' and labels' texts")
