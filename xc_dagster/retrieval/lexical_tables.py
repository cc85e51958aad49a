"""How the lexical classifiers' weights are held while they train: the keys' flat vector, or a dense table.

:class:`KeyTable` holds the weights of the sorted (label, term) keys as a vector and finds a (pair, term)'s weight by
``searchsorted`` (``LexicalClassifier._lookup``); from SPARSE_FROM weights its gradients are sparse, so a step costs
what its batch reads. :class:`DenseTable` holds them as a (labels, terms) table zero off the keys, for models of few
cells (the BoW sets' small vocabularies): a batch's logits are one sparse x dense product. Both give the same
function, losses and steps (tested), so the choice (:func:`trains_dense`) is one of speed only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import scipy.sparse as sp
import torch

from xc_dagster.retrieval.sparse_rows import cap_postings

if TYPE_CHECKING:  # pragma: no cover
    from xc_dagster.retrieval.lexical_classifier import LexicalClassifier

# models of more weights train with sparse gradients (a step costs what its batch reads); smaller ones with dense
# ones, cheaper there (Delicious' 273K weights: 61 s dense against 97 s sparse for 10 passes, AMD EPYC)
SPARSE_FROM = 1 << 21
DENSE_UP_TO = 1 << 24  # (label, term) cells up to which the weights may be a dense table (64 MB; module docstring)
# ... trained so when the table is at most this many times a batch's (pair, term) lookups: every step moves each
# cell (the mask, the square, Adagrad's update), where a keyed step costs what the batch reads
DENSE_READS = 4
DENSE_SCORING_LABELS = 4096  # ... and scoring through it below this many labels: a query costs its terms x L
# products there, against at most ``candidates`` (200) x its terms searchsorted lookups keyed


def csr_tensors(X: sp.csr_matrix) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    X = sp.csr_matrix(X, dtype=np.float32)
    return (torch.from_numpy(X.indptr.astype(np.int64)), torch.from_numpy(X.indices.astype(np.int64)),
            torch.from_numpy(X.data))


def trains_dense(model: "LexicalClassifier", X: sp.csr_matrix, batch_pairs: int) -> bool:
    """Whether ``model`` trains as a :class:`DenseTable` on the rows ``X``: at most DENSE_UP_TO cells, and at most
    DENSE_READS times a batch's (pair, term) lookups (``batch_pairs`` pairs of X's mean terms per row)."""
    reads = batch_pairs * X.nnz / max(X.shape[0], 1)
    return model.num_labels * model.num_terms <= min(DENSE_UP_TO, DENSE_READS * reads)


def scores_dense(model: "LexicalClassifier") -> bool:
    """Whether ``model`` scores pairs through its :meth:`DenseTable.of` (DENSE_UP_TO, DENSE_SCORING_LABELS)."""
    return model.num_labels * model.num_terms <= DENSE_UP_TO and model.num_labels <= DENSE_SCORING_LABELS


def weights_by_term(model: "LexicalClassifier", cap: int) -> sp.csr_matrix:
    """``model``'s weights as a (terms, labels) CSR, each term keeping its ``cap`` largest (0: all): the product
    that finds a query's own top labels (:meth:`LexicalClassifier.top_labels`)."""
    keys = model.keys.numpy()
    return cap_postings(sp.csr_matrix((model.weights.numpy(), (keys % model.num_terms, keys // model.num_terms)),
                                      shape=(model.num_terms, model.num_labels)), cap)


class KeyTable:
    """The weights as the keys' flat vector: a batch's logits by :meth:`LexicalClassifier._lookup`."""

    def __init__(self, model: "LexicalClassifier", X: sp.csr_matrix):
        self.model, self.X = model, csr_tensors(X)
        self.weights = model.weights[:, None].clone().requires_grad_(True)  # (keys, 1): an embedding table
        self.sparse = len(model.keys) >= SPARSE_FROM

    def logits(self, points: np.ndarray, rows: np.ndarray, labels: np.ndarray,
               bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(w_l . x_r + b_l of each pair, the L2 sum of the weights the pairs read, once per reading)."""
        lab = torch.from_numpy(labels)
        logits, read = self.model._logits(self.model._lookup(self.X, torch.from_numpy(rows), lab), lab,
                                          self.weights, bias, self.sparse)
        return logits, (read ** 2).sum()

    def values(self) -> torch.Tensor:
        return self.weights.detach()[:, 0].clone()


class DenseTable:
    """The weights as a dense (labels, terms) table, zero off the keys (the mask holds the gradient there at 0):
    a batch's logits by one sparse x dense product, the same function as :class:`KeyTable`'s."""

    def __init__(self, model: "LexicalClassifier", X: sp.csr_matrix):
        if not X.has_canonical_format:  # sorted, no duplicates: its rows' COO is coalesced as it is
            X = X.copy()
            X.sum_duplicates()
        self.keys, self.X = model.keys, X
        self.mask = torch.zeros(model.num_labels * model.num_terms)
        self.mask[model.keys] = 1.0
        self.mask = self.mask.view(model.num_labels, model.num_terms)
        self.weights = self.of(model).requires_grad_(True)
        self.sparse, self.local = False, np.zeros(X.shape[0], dtype=np.int64)

    @staticmethod
    def of(model: "LexicalClassifier") -> torch.Tensor:
        """The model's weights as a (labels, terms) table, zero off its keys."""
        table = torch.zeros(model.num_labels * model.num_terms)
        table[model.keys] = model.weights
        return table.view(model.num_labels, model.num_terms)

    def logits(self, points: np.ndarray, rows: np.ndarray, labels: np.ndarray,
               bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.local[points] = np.arange(len(points))
        XB = self.X[points].tocoo()
        at = torch.from_numpy(np.vstack([XB.row, XB.col]).astype(np.int64))
        x, ones = (torch.sparse_coo_tensor(at, v, XB.shape, is_coalesced=True, check_invariants=False)
                   for v in (torch.from_numpy(XB.data), torch.ones(XB.nnz)))
        W = self.weights * self.mask
        pair, lab = torch.from_numpy(self.local[rows]), torch.from_numpy(labels)
        logits = torch.sparse.mm(x, W.T)[pair, lab] + bias[lab, 0]
        return logits, torch.sparse.mm(ones, (W * W).T)[pair, lab].sum()  # a weight's square once per reading

    def values(self) -> torch.Tensor:
        return self.weights.detach().reshape(-1)[self.keys].clone()
