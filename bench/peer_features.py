"""The features the peers of ``bench/peers_bench.py`` train on, and the file format Omikuji reads."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import scipy.sparse as sp

from xc_dagster.data import XCDataset
from xc_dagster.retrieval.tfidf import are_counts, nonzero, transformer


def tfidf_features(ds: XCDataset, min_df: int) -> tuple[sp.csr_matrix, sp.csr_matrix, dict[str, Any]]:
    """TF-IDF train/test features fitted on train: word 1-2 grams of the texts, or the BoW features."""
    from sklearn.feature_extraction.text import TfidfVectorizer

    if ds.X_train is not None:  # weighted as the pipeline's lexical source weighs them (counts or real values)
        Xtr, Xte = nonzero(ds.X_train), nonzero(ds.X_test)
        values = not are_counts(Xtr)
        tf = transformer(values)
        Xtr = tf.fit_transform(Xtr)
        Xte = tf.transform(Xte)
        info = {"features": "shipped BoW features, " + ("real values, l2" if values
                                                        else "TfidfTransformer(sublinear_tf, l2)")}
    else:
        vec = TfidfVectorizer(ngram_range=(1, 2), sublinear_tf=True, min_df=min_df, norm="l2", dtype=np.float32)
        Xtr = vec.fit_transform(ds.train_texts)
        Xte = vec.transform(ds.test_texts)
        info = {"features": f"TfidfVectorizer(ngram_range=(1, 2), sublinear_tf, min_df={min_df}, l2)"}
    Xtr = sp.csr_matrix(Xtr, dtype=np.float32)
    Xte = sp.csr_matrix(Xte, dtype=np.float32)
    Xtr.sort_indices()
    Xte.sort_indices()
    info.update({"n_features": int(Xtr.shape[1]), "train_nnz_per_row": float(Xtr.nnz / max(Xtr.shape[0], 1)),
                 "train_empty_rows": int((np.diff(Xtr.indptr) == 0).sum()),
                 "test_empty_rows": int((np.diff(Xte.indptr) == 0).sum())})
    return Xtr, Xte, info


def write_xc_file(path: Path, X: sp.csr_matrix, Y: sp.csr_matrix) -> None:
    """The XC / Omikuji text format: header ``N D L``, then ``l1,l2 f:v f:v`` per row."""
    with open(path, "w") as f:
        f.write(f"{X.shape[0]} {X.shape[1]} {Y.shape[1]}\n")
        for i in range(X.shape[0]):
            labs = ",".join(map(str, Y.indices[Y.indptr[i]:Y.indptr[i + 1]]))
            s, e = X.indptr[i], X.indptr[i + 1]
            feats = " ".join(f"{j}:{v:.6g}" for j, v in zip(X.indices[s:e], X.data[s:e]))
            f.write(f"{labs} {feats}\n" if feats else f"{labs}\n")  # Omikuji rejects a trailing space
