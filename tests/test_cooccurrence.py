"""The cooccurrence shortlist source (Gandalf's label points voting at inference): hand-computed co-occurrence and
votes, bounded blocks, its file, the shortlist and the fusion with it, and a learned gain on data where the
labels of a query are those co-occurring with its nearest label."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp

from xc_dagster.config import FusionParams
from xc_dagster.errors import XCConfigError, XCError
from xc_dagster.evaluation.metrics import inverse_propensity, precision
from xc_dagster.retrieval.cooccurrence import CooccurrenceSettings, LabelCooccurrence
from xc_dagster.retrieval.files import COOCCURRENCE_FILE
from xc_dagster.retrieval.fusion import fit_alpha
from xc_dagster.retrieval.shortlist import ShortlistSources, build_sources, retrieve, topk_from_scores
from xc_dagster.retrieval.source_files import load_sources, save_sources

Y_HAND = sp.csr_matrix(np.array([[1, 1, 0, 0], [1, 1, 1, 0], [0, 1, 1, 0], [1, 0, 0, 1]], dtype=np.float32))
# G[h, l] = #(points with h and l) / #(points with h), diagonal 0
G_HAND = np.array([[0, 2 / 3, 1 / 3, 1 / 3], [2 / 3, 0, 2 / 3, 0], [1 / 2, 1, 0, 0], [1, 0, 0, 0]])


def test_cooccurrence_hand_computed_in_any_blocks():
    for block in (1, 3, 1 << 20):  # a label per block, a few, all at once: the same matrix
        g = LabelCooccurrence.fit(Y_HAND, CooccurrenceSettings(2, 1.0, 100), block_entries=block)
        np.testing.assert_allclose(g.matrix.toarray(), G_HAND)
    Y = Y_HAND.copy()
    Y.data[:] = 0.5  # relevance values count as 1
    np.testing.assert_allclose(LabelCooccurrence.fit(Y, CooccurrenceSettings()).matrix.toarray(), G_HAND)


def test_cooccurrence_rows_keep_their_largest_entries():
    g = LabelCooccurrence.fit(Y_HAND, CooccurrenceSettings(max_entries=1))
    # label 0 keeps 2/3 (label 1); label 1's tie 2/3 | 2/3 keeps the smaller column
    np.testing.assert_allclose(g.matrix.toarray(), [[0, 2 / 3, 0, 0], [2 / 3, 0, 0, 0], [0, 1, 0, 0], [1, 0, 0, 0]])


def test_votes_hand_computed():
    g = LabelCooccurrence.fit(Y_HAND, CooccurrenceSettings(2, 1.0, 100))
    V = g.votes(np.array([[0, 2, 3], [3, -1, -1]]), np.array([[0.5, 0.25, 0.1], [1.0, 0, 0]], dtype=np.float32))
    # the first K = 2 neighbours vote sim * G[h] / K
    np.testing.assert_allclose(V.toarray(), [(0.5 * G_HAND[0] + 0.25 * G_HAND[2]) / 2, G_HAND[3] / 2])
    g2 = LabelCooccurrence(g.matrix, CooccurrenceSettings(1, 2.0, 100))
    np.testing.assert_allclose(g2.votes(np.array([[2, 0]]), np.array([[-0.5, 0.9]], dtype=np.float32)).toarray(),
                               [np.zeros(4)])  # a negative similarity votes max(sim, 0) ** p = 0


def test_settings_and_file_errors_name_their_field(tmp_path):
    for kwargs, field in (({"neighbours": 0}, "index.cooccurrence_neighbours"),
                          ({"power": -1.0}, "index.cooccurrence_power"),
                          ({"max_entries": 2.5}, "index.cooccurrence_max_entries")):
        with pytest.raises(XCConfigError, match=field):
            CooccurrenceSettings(**kwargs).check()
    g = LabelCooccurrence.fit(Y_HAND, CooccurrenceSettings(2, 3.0, 7))
    g.save(tmp_path)
    back = LabelCooccurrence.load(tmp_path)
    np.testing.assert_allclose(back.matrix.toarray(), g.matrix.toarray(), rtol=1e-6)
    assert back.settings == CooccurrenceSettings(2, 3.0, 7)
    (tmp_path / COOCCURRENCE_FILE).write_bytes(b"not a zip")
    with pytest.raises(XCError, match=COOCCURRENCE_FILE):
        LabelCooccurrence.load(tmp_path)


def _hierarchy(seed: int = 0, groups: int = 40, children: int = 6, dim: int = 32):
    """Labels 0..groups-1 are parents, the others children; a point is near its own child label and carries the
    child's parent (and, in training, the child too): its parent's embedding is unrelated to it."""
    rng = np.random.default_rng(seed)
    L = groups * (1 + children)
    E = rng.standard_normal((L, dim)).astype(np.float32)
    E /= np.linalg.norm(E, axis=1, keepdims=True)
    child = np.arange(groups, L)
    parent = (child - groups) // children

    def points(n: int, noise: float) -> tuple[np.ndarray, np.ndarray]:
        c = rng.choice(child, n)
        q = E[c] + noise * rng.standard_normal((n, dim)).astype(np.float32)
        return (q / np.linalg.norm(q, axis=1, keepdims=True)).astype(np.float32), c

    q_tr, c_tr = points(2000, 0.05)
    rows = np.repeat(np.arange(len(c_tr)), 2)
    Y_tr = sp.csr_matrix((np.ones(len(rows), np.float32), (rows, np.stack([c_tr, parent[c_tr - groups]], 1).ravel())),
                         shape=(len(c_tr), L))
    q_te, c_te = points(400, 0.05)
    Y_te = sp.csr_matrix((np.ones(len(c_te), np.float32), (np.arange(len(c_te)), parent[c_te - groups])),
                         shape=(len(c_te), L))
    return E, Y_tr, q_te, Y_te


def test_shortlist_and_fusion_gain_from_cooccurrence(tmp_path):
    """The test points' labels are their nearest label's parent: the embedding score misses them (P@1 near 0),
    the co-occurrence votes find them, the fusion weighs them (e > 0) and the fused P@1 passes 0.9; the shortlist
    with the source holds its candidates and scores, and reads back the same from its files."""
    E, Y_tr, q, Y_te = _hierarchy()
    graph = LabelCooccurrence.fit(Y_tr, CooccurrenceSettings(neighbours=3, power=4.0))
    W = E.copy()
    plain = build_sources(("W", "label"), W, E, None, None, None, "text", "exact", 16, 40, 40)
    with_cooc = build_sources(("W", "label", "cooccurrence"), W, E, None, None, None, "text", "exact", 16, 40, 40,
                              cooccurrence=graph)
    assert with_cooc.names == ("W", "label", "cooccurrence")
    sl0, sl1 = retrieve(q, plain, 5), retrieve(q, with_cooc, 5)
    assert sl0.cooc is None and sl1.cooc.shape == sl1.ids.shape
    # every candidate's co-occurrence score is the votes' value, whichever source proposed it
    V = graph.votes(*reversed(with_cooc.indexes["label"].search(q, 5))).toarray()
    ok = sl1.ids >= 0
    np.testing.assert_allclose(sl1.cooc[ok], V[np.nonzero(ok)[0], sl1.ids[ok]], rtol=1e-6)
    parents = Y_te.indices
    assert (sl0.ids == parents[:, None]).any(1).mean() < 0.2  # the plain shortlist rarely holds the parent
    assert (sl1.ids == parents[:, None]).any(1).mean() > 0.95

    params, ip = FusionParams(), inverse_propensity(Y_tr)
    base = fit_alpha(sl0, Y_te, params, ip, None)
    fused = fit_alpha(sl1, Y_te, params, ip, None)
    assert base.cooccurrence_weight == 0.0 and fused.cooccurrence_weight > 0
    p0 = precision(topk_from_scores(sl0.ids, base.score(sl0, ip), 5)[0], Y_te, (1,))["precision_at_1"]
    p1 = precision(topk_from_scores(sl1.ids, fused.score(sl1, ip), 5)[0], Y_te, (1,))["precision_at_1"]
    assert p0 < 0.1 and p1 > 0.9

    save_sources(with_cooc, tmp_path, None)
    back = load_sources(tmp_path, with_cooc.names, "text", "exact", 40, W, E)
    sl2 = retrieve(q, back, 5)
    np.testing.assert_array_equal(sl2.ids, sl1.ids)
    np.testing.assert_allclose(sl2.cooc, sl1.cooc, rtol=1e-6)


def test_fusion_leaves_uninformative_votes_out():
    """Votes that carry nothing about the targets get weight 0: the fit without them is kept."""
    E, Y_tr, q, Y_te = _hierarchy(seed=1)
    rng = np.random.default_rng(2)
    shuffled = sp.csr_matrix(Y_tr.toarray()[:, rng.permutation(Y_tr.shape[1])])  # co-occurrence of other labels
    src = build_sources(("W", "label", "cooccurrence"), E, E, None, None, None, "text", "exact", 16, 40, 40,
                        cooccurrence=LabelCooccurrence.fit(shuffled, CooccurrenceSettings()))
    sl = retrieve(q, src, 5)
    Y_self = sp.csr_matrix((np.ones(len(q), np.float32), (np.arange(len(q)), sl.ids[:, 0])), shape=Y_te.shape)
    # the nearest label is the target: votes only hurt
    fit = fit_alpha(sl, Y_self, FusionParams(), inverse_propensity(Y_tr), None)
    assert fit.cooccurrence_weight == 0.0
    assert dict(fit.cooccurrence_grid)[0.0] == fit.objective_value


def test_cooccurrence_needs_the_label_source():
    g = LabelCooccurrence.fit(Y_HAND, CooccurrenceSettings())
    E = np.eye(4, dtype=np.float32)
    with pytest.raises(XCConfigError, match="add label"):
        ShortlistSources(E, E, {}, cooccurrence=g)
