"""The lexical source on dense feature rows: its kNN as one dense product per block (dense postings), ranked as the
sparse products rank, and the classifiers' dense (labels, terms) table."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import scipy.sparse as sp

import xc_dagster.retrieval.lexical_tables as tables
from xc_dagster.retrieval import sparse_rows
from xc_dagster.retrieval.lexical import LexicalIndex
from xc_dagster.retrieval.lexical_classifier import ClassifierSettings
from xc_dagster.retrieval.sparse_rows import dense_postings, dense_topk, sparse_topk


@pytest.mark.parametrize("k", [1, 3, 12, 40])
def test_dense_topk_equals_sparse_topk_of_the_positive_entries(k):
    rng = np.random.default_rng(0)
    D = np.ceil(rng.normal(size=(30, 25)) * 2).astype(np.float32) / 2  # ties, zeros and negatives
    D[3] = 0.0  # a row with nothing positive
    got = dense_topk(D, k)
    want = sparse_topk(sp.csr_matrix(np.where(D > 0, D, 0)), k)
    assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])
    assert (got[0][3] == -1).all() and got[0].shape == (30, k)


def _dense_rows(n: int, terms: int, labels: int, seed: int) -> tuple[sp.csr_matrix, sp.csr_matrix]:
    """Feature rows where nearly every term is in nearly every row (Mediamill's shape), and each point's label a
    function of its strongest term (real values: no two cosines tie, so both products rank alike)."""
    rng = np.random.default_rng(seed)
    X = rng.random((n, terms))
    X[rng.random((n, terms)) < 0.05] = 0.0
    y = X.argmax(axis=1) % labels
    Y = sp.csr_matrix((np.ones(n, np.float32), (np.arange(n), y)), shape=(n, labels))
    return sp.csr_matrix(X.astype(np.float32)), Y


def test_dense_feature_rows_take_dense_postings_and_score_as_the_sparse_products(monkeypatch):
    X, Y = _dense_rows(300, 12, 6, 0)
    Xq, _ = _dense_rows(40, 12, 6, 1)
    dense = LexicalIndex.fit(X, None, Y, 7, 1, None)
    assert dense._points_dense is not None and dense._points_dense.shape == (12, 300)
    monkeypatch.setattr(sparse_rows, "DENSE_GAIN", 0)  # the same index with sparse products
    sparse = LexicalIndex.fit(X, None, Y, 7, 1, None)
    assert sparse._points_dense is None
    Q = dense.transform(Xq)
    held = np.arange(0, 300, 9)
    for kw in ({}, {"excluded": held}, {"own": np.r_[np.arange(20), -np.ones(20, int)]}):
        np.testing.assert_allclose(dense.scores(Q, **kw).toarray(), sparse.scores(Q, **kw).toarray(), atol=1e-6)
        a, b = dense.nearest(Q, None if "excluded" not in kw else np.isin(np.arange(300), held), kw.get("own"))
        c, d = sparse.nearest(Q, None if "excluded" not in kw else np.isin(np.arange(300), held), kw.get("own"))
        assert np.array_equal(a, c)  # the same neighbours
        np.testing.assert_allclose(b, d, atol=1e-6)
    own, _ = dense.nearest(dense.points[:20], own=np.arange(20))
    assert not (own == np.arange(20)[:, None]).any()
    # blocks are sized by the dense product's cells: every query costs the points
    np.testing.assert_array_equal(dense.query_work(Q), np.full(40, 300))


def test_sparse_rows_keep_sparse_products(monkeypatch):
    """Bag-of-words rows (a few of many terms each) cost less as sparse products: no dense copy."""
    rng = np.random.default_rng(2)
    X = sp.random(400, 300, density=0.02, random_state=3, format="csr", dtype=np.float32)
    X.data[:] = 1.0
    assert dense_postings(sp.csr_matrix(X.T)) is None
    full = sp.csr_matrix(rng.random((50, 400)).astype(np.float32))
    assert dense_postings(full) is not None
    monkeypatch.setattr(sparse_rows, "DENSE_MAX_CELLS", 50 * 400 - 1)  # a dense copy past the memory bound: none
    assert dense_postings(full) is None


def test_the_dense_classifier_table_trains_the_keyed_model(monkeypatch):
    """A model of few (label, term) cells trains as a dense table: the same weights, biases and passes as the keys
    looked up, on dense feature rows (where lookups were slow)."""
    X, Y = _dense_rows(400, 12, 6, 4)
    index = LexicalIndex.fit(X[:300], None, Y[:300], 5, 1, None)
    settings = ClassifierSettings(epochs=3, hard_negatives=2, random_negatives=3, solver="sgd")
    valid = (index.transform(X[300:]), Y[300:])
    a = index.fit_classifier(np.arange(300), settings, valid)
    monkeypatch.setattr(tables, "DENSE_UP_TO", 0)
    b = index.fit_classifier(np.arange(300), settings, valid)
    np.testing.assert_allclose(a.weights.numpy(), b.weights.numpy(), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(a.bias.numpy(), b.bias.numpy(), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(a.history, b.history, atol=1e-6)
    assert np.abs(a.weights.numpy()).max() > 0.1


def test_the_dense_table_is_taken_where_it_is_cheaper_than_the_lookups():
    """A step of the dense table moves every cell; a keyed one costs its batch's (pair, term) lookups: the table is
    taken up to DENSE_READS times those (Mediamill's shape: 12K cells against 4,096 pairs x 120 terms), not where the
    labels outnumber what a batch reads (Delicious': 491K cells against 4,096 x 18)."""
    def shape(labels: int, terms: int, per_row: int) -> tuple[SimpleNamespace, sp.csr_matrix]:
        X = sp.csr_matrix((np.ones(10 * per_row), np.tile(np.arange(per_row), 10), np.arange(11) * per_row),
                          shape=(10, terms))
        return SimpleNamespace(num_labels=labels, num_terms=terms), X

    assert tables.trains_dense(*shape(101, 120, 120), 4096) and tables.scores_dense(shape(101, 120, 120)[0])
    assert not tables.trains_dense(*shape(983, 500, 18), 4096)
    assert tables.trains_dense(*shape(159, 1836, 69), 4096)  # Bibtex: 292K cells, 283K reads
    assert not tables.scores_dense(SimpleNamespace(num_labels=5000, num_terms=100))  # too many labels per query
