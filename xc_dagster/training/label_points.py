"""Label texts as extra training points (Renee, ASTRA): each label's own text is a training point whose single
positive is that label -- or, with a co-occurrence share (Gandalf, Kharbanda et al., KDD 2023), whose positives are
that label and the labels on at least that share of its training points (``label_point_targets``).

The N points keep their rows and label l becomes row N + l: the label matrix gains an identity block below and
the training rows gain N .. N + L - 1 (``with_label_rows``). ``siamese_label_points`` extends the Siamese
trainer's point tokens with the label tokens (``pretrain.label_points``); ``classifier_label_points`` extends
the hardest-negative trainer's point embeddings with the label embeddings and its shortlist with each label's
nearest other labels by embedding (``label_neighbours``; ``classifier.label_points``). The BCE trainer over
sampled negatives takes its examples from ``examples``.
"""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp
import torch

from xc_dagster.config.bounds import is_finite_number
from xc_dagster.encoders.bag import BagOfEmbeddingsEncoder, embed_from_intermediate
from xc_dagster.errors import XCConfigError
from xc_dagster.retrieval.ann import LabelIndex, exact_topk
from xc_dagster.retrieval.cooccurrence import CooccurrenceSettings, LabelCooccurrence

MAX_COOCCURRING = 100  # G's entries kept per label (its largest): a label point's positives beyond itself at most
EXACT_MAX_LABELS = 50_000  # above this, label neighbours come from an HNSW index: exact search is L^2 D

Tokens = tuple[np.ndarray, np.ndarray]  # token ids (N, T), lengths (N,)


def check_label_point_share(label_points: bool, share: float, stage: str = "classifier") -> None:
    """Raise XCConfigError unless ``<stage>.label_point_cooccurrence`` is a share in [0, 1], > 0 only with
    ``<stage>.label_points``."""
    if not is_finite_number(share) or not 0.0 <= float(share) <= 1.0:
        raise XCConfigError(f"{stage}.label_point_cooccurrence: expected a share in [0, 1], got {share!r}")
    if share > 0 and not label_points:
        raise XCConfigError(f"{stage}.label_point_cooccurrence: {share} needs {stage}.label_points=true "
                            "(the label points it gives co-occurring positives)")


def label_point_targets(Y: sp.csr_matrix, rows: np.ndarray, min_share: float = 0.0) -> sp.csr_matrix:
    """The label points' positives, L x L binary CSR: the identity (Renee: label l's point is positive for l) and,
    with ``min_share`` > 0, Gandalf's co-occurring labels: every h on at least ``min_share`` of the training
    points (``Y[rows]``) that carry l, G[l, h] = #(points with l and h) / #(points with l) >= min_share (G as the
    ``cooccurrence`` source builds it, its ``MAX_COOCCURRING`` largest entries per label)."""
    check_label_point_share(True, min_share)
    L = Y.shape[1]
    eye = sp.identity(L, dtype=np.float32, format="csr")
    if min_share <= 0:
        return eye
    G = LabelCooccurrence.fit(sp.csr_matrix(Y)[np.asarray(rows, dtype=np.int64)],
                              CooccurrenceSettings(max_entries=MAX_COOCCURRING)).matrix
    G.data = (G.data >= float(min_share) - 1e-12).astype(np.float32)  # shares computed as k / n: exact up to fp
    G.eliminate_zeros()
    T = (eye + G.astype(np.float32)).tocsr()
    T.sort_indices()
    return T


def with_label_rows(Y: sp.csr_matrix, rows: np.ndarray,
                    targets: sp.csr_matrix | None = None) -> tuple[sp.csr_matrix, np.ndarray]:
    """``Y`` (N x L) with the label points' L x L ``targets`` below (default the identity: row N + l is label l's
    text, positive l; :func:`label_point_targets`) and ``rows`` followed by N .. N + L - 1."""
    Y = Y.tocsr()
    N, L = Y.shape
    below = sp.identity(L, dtype=Y.dtype, format="csr") if targets is None else targets.astype(Y.dtype)
    if below.shape != (L, L):
        raise ValueError(f"with_label_rows: label point targets {below.shape} for {L} labels")
    Yx = sp.vstack([Y, below], format="csr")
    return Yx, np.concatenate([np.asarray(rows, dtype=np.int64), N + np.arange(L, dtype=np.int64)])


class StackedTokens:
    """Two token-id arrays read as one (len(top) + len(bottom), T): row i < len(top) is ``top``'s, row
    len(top) + j is ``bottom``'s row j, zero-padded to the wider width. Rows are gathered on indexing
    (``ids[rows]``, ``ids[rows, :width]``), so memory-mapped point tokens stay on disk: no copy of the N point
    rows for the L label points."""

    ndim = 2

    def __init__(self, top: np.ndarray, bottom: np.ndarray):
        self.top, self.bottom = top, bottom
        self.shape = (len(top) + len(bottom), max(top.shape[1], bottom.shape[1]))
        self.dtype = np.result_type(top.dtype, bottom.dtype)

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, key):
        rows, cols = key if isinstance(key, tuple) else (key, slice(None))
        if not isinstance(cols, (slice, int, np.integer)):
            raise IndexError("StackedTokens: columns by a slice or an int only")
        if isinstance(rows, slice):
            rows = np.arange(*rows.indices(self.shape[0]))
        rows = np.asarray(rows)
        if rows.dtype == bool:
            if rows.shape != (self.shape[0],):
                raise IndexError(f"boolean index of {rows.shape} for {self.shape[0]} rows")
            rows = np.flatnonzero(rows)
        flat = rows.reshape(-1).astype(np.int64)
        flat = np.where(flat < 0, flat + self.shape[0], flat)
        if len(flat) and (flat.min() < 0 or flat.max() >= self.shape[0]):
            raise IndexError(f"row index out of range for {self.shape[0]} rows")
        out = np.zeros((len(flat), self.shape[1]), dtype=self.dtype)
        n = len(self.top)
        for part, sel, start in ((self.top, flat < n, 0), (self.bottom, flat >= n, n)):
            if sel.any():
                out[sel, :part.shape[1]] = part[flat[sel] - start]
        return out.reshape(*rows.shape, self.shape[1])[..., cols]


def siamese_label_points(point_tokens: Tokens, label_tokens: Tokens, Y: sp.csr_matrix, rows: np.ndarray,
                         min_share: float = 0.0) -> tuple[Tokens, sp.csr_matrix, np.ndarray]:
    """The Siamese trainer's (tokens, Y, rows) with every label's text appended as a point: the token ids read as
    one array (``StackedTokens``: the narrower array zero-padded to the wider one's width, no copy; lengths mask
    the padding) and Y and the rows extended by ``with_label_rows``, the label points' positives
    :func:`label_point_targets` at ``min_share``."""
    (p_ids, p_len), (l_ids, l_len) = point_tokens, label_tokens
    if len(p_ids) != Y.shape[0] or len(l_ids) != Y.shape[1]:
        raise ValueError(f"siamese_label_points: {len(p_ids)} point and {len(l_ids)} label token rows for a "
                         f"{Y.shape[0]} x {Y.shape[1]} label matrix")
    lens = np.concatenate([p_len, l_len]).astype(np.result_type(p_len.dtype, l_len.dtype))
    Yx, rows_x = with_label_rows(Y, rows, label_point_targets(Y, rows, min_share))
    return (StackedTokens(p_ids, l_ids), lens), Yx, rows_x


def label_neighbours(label_emb: np.ndarray, k: int, device: torch.device | None = None,
                     block: int = 0) -> np.ndarray:
    """Each label's ``k`` nearest other labels by inner product of ``label_emb`` (exact, in blocks of
    ``block`` labels, 0 = as many as keep a block's scores near 2^28; ties by label id): (L, k) int64, -1 padded
    where fewer than k other labels exist. Costs L^2 D multiply-adds, on ``device``; above
    ``EXACT_MAX_LABELS`` labels an HNSW index answers instead (O(L log L))."""
    if len(label_emb) > EXACT_MAX_LABELS:
        ids = LabelIndex("hnsw", label_emb).search(np.ascontiguousarray(label_emb, dtype=np.float32), k + 1)[1]
    else:
        block = block or max(1, min(4096, (1 << 28) // max(len(label_emb), 1)))
        _, ids = exact_topk(label_emb, label_emb, k + 1, block, device)
    is_self = ids == np.arange(len(ids), dtype=np.int64)[:, None]
    order = np.argsort(is_self, axis=1, kind="stable")  # the label itself last, the others in rank order
    return np.take_along_axis(ids, order, 1)[:, :k]


def classifier_label_points(point_emb: np.ndarray, label_point_emb: np.ndarray | None, Y: sp.csr_matrix,
                            rows: np.ndarray, shortlist: np.ndarray, device: torch.device,
                            encoder: BagOfEmbeddingsEncoder | None = None, neighbours: bool = True,
                            min_share: float = 0.0) -> tuple[np.ndarray, sp.csr_matrix, np.ndarray, np.ndarray]:
    """The hardest-negative trainer's (point embeddings, Y, rows, shortlist) with every label as a point.

    ``label_point_emb`` (L, D): the labels' embeddings in ``point_emb``'s space (with ``encoder``, SiameseXML
    Module IV: the intermediate embeddings f_E(z_l)). A label point's shortlist row holds its
    ``shortlist.shape[1]`` nearest other labels by the final label embedding (with ``encoder``: N(R(f_E(z_l)))
    at the start of training); -1 padding without ``neighbours`` (a negative pool that reads no shortlist). Its
    positives: :func:`label_point_targets` with ``min_share`` (``classifier.label_point_cooccurrence``).
    """
    L = Y.shape[1]
    if label_point_emb is None or label_point_emb.shape != (L, point_emb.shape[1]):
        got = None if label_point_emb is None else label_point_emb.shape
        raise ValueError(f"classifier.label_points: need the labels' embeddings ({L}, {point_emb.shape[1]}), "
                         f"got {got}")
    k = shortlist.shape[1]
    nearest = np.full((L, k), -1, dtype=np.int64)
    if neighbours and k > 0:
        final = label_point_emb
        if encoder is not None:
            final = embed_from_intermediate(encoder.to(device), label_point_emb, device)
        nearest = label_neighbours(final, k, device)
    X = np.concatenate([np.asarray(point_emb, dtype=np.float32), np.asarray(label_point_emb, dtype=np.float32)])
    Yx, rows_x = with_label_rows(Y, rows, label_point_targets(Y, rows, min_share))
    return X, Yx, rows_x, np.concatenate([shortlist, nearest.astype(shortlist.dtype)])


def examples(Y: sp.csr_matrix, train_rows: np.ndarray, label_points: bool,
             min_share: float = 0.0) -> tuple[np.ndarray, sp.csr_matrix]:
    """The training examples' source rows (>= 0: point row; < 0: label -1 - id) and their label matrix (a label
    point's positives: ``label_point_targets`` with ``min_share``)."""
    Y = Y.tocsr()
    rows = np.asarray(train_rows, dtype=np.int64)
    rows = rows[np.diff(Y.indptr)[rows] > 0]
    parts = [Y[rows].astype(np.float32)]
    src = [rows]
    if label_points:
        L = Y.shape[1]
        parts.append(label_point_targets(Y, rows, min_share))
        src.append(-1 - np.arange(L, dtype=np.int64))
    Yex = sp.vstack(parts, format="csr")
    Yex.sort_indices()
    return np.concatenate(src), Yex
