"""Label texts as training points (``pretrain.label_points``, ``classifier.label_points``): the extended data,
the Siamese trainer over it, and the hardest-negative trainer (W keeps its L rows, resume is exact)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest
import scipy.sparse as sp
import torch
import torch.nn.functional as F

from tests.tinydata import WORDS, tiny_lf_home
from xc_dagster.catalog import Catalog
from xc_dagster.config import ClassifierParams, PretrainParams
from xc_dagster.data.companions import generic_labels
from xc_dagster.device import seed_everything
from xc_dagster.encoders.bag import create_bag_encoder
from xc_dagster.encoders.loading import load_encoder
from xc_dagster.encoders.tokenizer import load_tokenizer
from xc_dagster.errors import XCConfigError
from xc_dagster.pipeline import StageContext, run_all
from xc_dagster.pipeline.pretrain import label_points_named
from xc_dagster.storage import ArtifactStore
from xc_dagster.training import label_points
from xc_dagster.training.checkpoint import Checkpointer, fingerprint
from xc_dagster.training.classifier import train_classifiers
from xc_dagster.training.label_points import (
    classifier_label_points,
    examples,
    label_neighbours,
    label_point_targets,
    siamese_label_points,
    with_label_rows,
)
from xc_dagster.training.siamese import train_siamese

CPU = torch.device("cpu")


def csr(rows: list[list[int]], L: int) -> sp.csr_matrix:
    r = [i for i, ls in enumerate(rows) for _ in ls]
    c = [l for ls in rows for l in ls]
    return sp.csr_matrix((np.ones(len(c), dtype=np.float32), (r, c)), shape=(len(rows), L))


# ------------------------------------------------------------------------------------------ the data

def test_siamese_label_points_append_label_tokens_and_an_identity_block():
    Y = csr([[0, 2], [1], [2], []], 3)
    p_ids = np.arange(1, 4 * 5 + 1, dtype=np.int32).reshape(4, 5)
    p_len = np.array([5, 3, 4, 1], dtype=np.int32)
    l_ids = np.array([[7, 8, 9], [10, 11, 0], [12, 0, 0]], dtype=np.int32)  # narrower (label_max_len)
    l_len = np.array([3, 2, 1], dtype=np.int32)
    (ids, lens), Yx, rows = siamese_label_points((p_ids, p_len), (l_ids, l_len), Y, np.array([0, 2]))
    assert ids.shape == (7, 5) and ids.dtype == np.int32 and lens.tolist() == [5, 3, 4, 1, 3, 2, 1]
    assert np.array_equal(ids[:4], p_ids) and np.array_equal(ids[4:, :3], l_ids) and not ids[4:, 3:].any()
    assert Yx.shape == (7, 3) and np.array_equal(Yx[:4].toarray(), Y.toarray())
    assert np.array_equal(Yx[4:].toarray(), np.eye(3))
    assert rows.tolist() == [0, 2, 4, 5, 6]  # validation rows stay out; every label is a training point
    assert Y.shape == (4, 3)  # the input is not changed
    with pytest.raises(ValueError, match="label token rows"):
        siamese_label_points((p_ids, p_len), (l_ids[:2], l_len[:2]), Y, np.array([0]))
    # gathered on indexing, in the order asked (repeats and negative rows included), as the stacked array would be
    stacked = np.zeros((7, 5), dtype=np.int32)
    stacked[:4], stacked[4:, :3] = p_ids, l_ids
    for rows in ([6, 0, 5, 0, 3], np.array([[4, 1], [2, 6]]), [-1], slice(2, 6), np.arange(7) % 2 == 0, []):
        assert np.array_equal(ids[rows], stacked[rows]) and np.array_equal(ids[rows, :2], stacked[rows, :2])
    assert ids[[5], 1:].tolist() == [[11, 0, 0, 0]] and len(ids) == 7
    for bad in ([7], np.ones(6, dtype=bool)):
        with pytest.raises(IndexError, match="7 rows"):
            ids[bad]


def test_siamese_label_points_leave_memory_mapped_point_tokens_on_disk(tmp_path):
    """The point tokens stay the memory-mapped array (no stacked copy of the N rows in RAM)."""
    p_ids = np.lib.format.open_memmap(tmp_path / "ids.npy", mode="w+", dtype=np.int32, shape=(4, 5))
    p_ids[:] = np.arange(20).reshape(4, 5)
    (ids, _), _, _ = siamese_label_points((p_ids, np.full(4, 5)), (np.ones((3, 2), np.int32), np.full(3, 2)),
                                          csr([[0], [1], [2], [0]], 3), np.arange(4))
    assert ids.top is p_ids and ids[[3, 4]].tolist() == [[15, 16, 17, 18, 19], [1, 1, 0, 0, 0]]


def test_label_neighbours_exclude_the_label_itself_and_pad():
    E = F.normalize(torch.tensor([[1.0, 0.0], [0.9, 0.1], [0.0, 1.0], [0.6, 0.8]]), dim=-1).numpy()
    nb = label_neighbours(E, 2, CPU)
    S = E @ E.T
    np.fill_diagonal(S, -np.inf)
    assert np.array_equal(nb, np.argsort(-S, axis=1, kind="stable")[:, :2])
    assert label_neighbours(E, 5, CPU)[:, 3:].tolist() == [[-1, -1]] * 4  # only 3 other labels
    assert (label_neighbours(E, 3, CPU) != np.arange(4)[:, None]).all()
    assert label_neighbours(E, 2, CPU, block=1).tolist() == nb.tolist()


def test_classifier_label_points_extend_embeddings_rows_and_shortlist():
    X = np.eye(3, 4, dtype=np.float32)  # 3 points
    E = F.normalize(torch.tensor([[1.0, 0, 0, 0], [0.8, 0.6, 0, 0], [0.1, 0, 1.0, 0], [0, 0.2, 0.6, 0.8]]),
                    dim=-1).numpy()
    Y = csr([[0], [1, 3], [2]], 4)
    sl = np.array([[1, 2], [0, -1], [3, 1]], dtype=np.int32)
    Xx, Yx, rows, slx = classifier_label_points(X, E, Y, np.array([0, 1]), sl, CPU)
    assert Xx.shape == (7, 4) and np.array_equal(Xx[3:], E) and np.array_equal(Xx[:3], X)
    assert np.array_equal(Yx[3:].toarray(), np.eye(4)) and rows.tolist() == [0, 1, 3, 4, 5, 6]
    assert slx.dtype == np.int32 and np.array_equal(slx[:3], sl)
    assert slx[3:].tolist() == [[1, 2], [0, 3], [3, 0], [2, 1]]  # the nearest other labels by E
    _, _, _, no_nb = classifier_label_points(X, E, Y, np.array([0, 1]), sl, CPU, neighbours=False)
    assert (no_nb[3:] == -1).all()
    with pytest.raises(ValueError, match="classifier.label_points"):
        classifier_label_points(X, None, Y, np.array([0]), sl, CPU)
    Yr, rr = with_label_rows(Y, np.array([2]))
    assert Yr.shape == (7, 4) and rr.tolist() == [2, 3, 4, 5, 6]


def test_gandalf_targets_add_the_labels_on_a_share_of_a_labels_points():
    # rows 0-3 train (row 4 is held out: its labels must not count); label 0 is on rows 0, 1, 2, with label 1
    # on 2 of them (share 2/3) and label 2 on 1 (1/3); label 1 on rows 0, 1 with 0 on both (1) and 3 on row 1 (1/2);
    # label 3 on row 1 and 3; label 4 only on the held-out row
    Y = csr([[0, 1], [0, 1, 3], [0, 2], [3], [2, 4]], 5)
    rows = np.array([0, 1, 2, 3])
    want_half = np.eye(5)
    want_half[0, 1] = want_half[1, 0] = want_half[1, 3] = want_half[2, 0] = want_half[3, 0] = 1
    want_half[3, 1] = 1  # label 3: on rows 1, 3; 0 and 1 on one of the two (1/2)
    T = label_point_targets(Y, rows, 0.5)
    assert np.array_equal(T.toarray(), want_half)
    assert np.array_equal(label_point_targets(Y, rows, 0.0).toarray(), np.eye(5))  # Renee: itself only
    want_one = np.eye(5)
    want_one[1, 0] = want_one[2, 0] = 1  # every point of label 1 (and 2) carries label 0
    assert np.array_equal(label_point_targets(Y, rows, 1.0).toarray(), want_one)
    Yx, rx = with_label_rows(Y, rows, T)
    assert np.array_equal(Yx[5:].toarray(), want_half) and rx.tolist() == [0, 1, 2, 3, 5, 6, 7, 8, 9]
    X, E = np.eye(5, 4, dtype=np.float32), F.normalize(torch.rand(5, 4, generator=torch.Generator().manual_seed(0)),
                                                       dim=-1).numpy()
    _, Yc, _, _ = classifier_label_points(X, E, Y, rows, np.zeros((5, 2), np.int64), CPU, min_share=0.5)
    assert np.array_equal(Yc[5:].toarray(), want_half)
    src, Yex = examples(Y, rows, True, 0.5)  # the end-to-end trainer's examples: the same targets
    assert np.array_equal(Yex[4:].toarray(), want_half) and src[4:].tolist() == [-1, -2, -3, -4, -5]
    tok = (np.ones((5, 3), np.int32), np.full(5, 3, np.int32))  # the Siamese trainer's label points: the same
    _, Ys, rs = siamese_label_points(tok, tok, Y, rows, min_share=0.5)
    assert np.array_equal(Ys[5:].toarray(), want_half) and rs.tolist() == rx.tolist()
    for bad in (-0.1, 1.5, True, "half"):
        with pytest.raises(XCConfigError, match="classifier.label_point_cooccurrence"):
            label_point_targets(Y, rows, bad)
    with pytest.raises(XCConfigError, match="needs classifier.label_points=true"):
        train_classifiers(X, E, Y, np.zeros((5, 2), np.int64), rows,
                          ClassifierParams(epochs=1, label_point_cooccurrence=0.5), CPU)


# -------------------------------------------------------------------------------- Siamese pretraining

@pytest.fixture(scope="module")
def texts():
    """24 points naming one or two of 8 label words, tokenized with MiniLM's tokenizer (for the bag encoder);
    the labels' tokens are narrower than the points'."""
    tok = load_tokenizer("minilm")
    rng = np.random.default_rng(0)
    labels = [rng.choice(8, size=int(rng.integers(1, 3)), replace=False) for _ in range(24)]
    r = np.repeat(np.arange(24), [len(lab) for lab in labels])
    Y = sp.csr_matrix((np.ones(len(r), dtype=np.float32), (r, np.concatenate(labels))), shape=(24, 8))

    def tokens(t: list[str], width: int) -> tuple[np.ndarray, np.ndarray]:
        enc = tok(t, padding="max_length", truncation=True, max_length=width, return_tensors="np")
        return enc["input_ids"].astype(np.int32), enc["attention_mask"].sum(1).astype(np.int32)

    return tokens([" ".join(WORDS[j] for j in lab) + f" item {i}" for i, lab in enumerate(labels)], 8), \
        tokens(WORDS[:8], 4), Y


def _siamese(texts, **kw):
    pt, lt, Y = texts
    params = dataclasses.replace(PretrainParams(), **{"batch_size": 6, "chunk_size": 8, "warmup_steps": 1,
                                                      "lr": 1e-2, "amp": "off", "epochs": 2, **kw})
    seed_everything(0)
    enc = load_encoder("bag:16")
    res = train_siamese(enc, pt, lt, Y, np.arange(20), params, CPU, None)
    return res, torch.cat([p.detach().flatten() for p in enc.state_dict().values()])


@pytest.mark.parametrize("sampler", ["random", "ngame"])
def test_siamese_trains_on_label_texts_too(texts, sampler):
    kw = {"sampler": sampler, "curriculum": (1,), "max_cluster_size": 4}
    base, w_base = _siamese(texts, **kw)
    res, w = _siamese(texts, label_points=True, **kw)
    again, w_again = _siamese(texts, label_points=True, **kw)
    if sampler == "random":  # the 20 training points and the 8 label texts
        assert base.points == 2 * 20 and res.points == 2 * (20 + 8) and res.steps == 2 * 5
    else:  # epoch 1 clusters the memory bank, label texts included (batches of clusters vary in count)
        assert res.reclusterings == 1 and res.points > base.points >= 20 + 20 // 2
    assert np.isfinite(res.final_loss)
    assert not torch.equal(w, w_base) and torch.equal(w, w_again) and res.final_loss == again.final_loss


def test_siamese_label_points_with_cooccurring_positives(texts):
    """Gandalf's label points in pretraining: a label's text is also positive for the labels on half its points
    or more (4 such pairs among the 8 labels here), which changes the training; the share needs label points."""
    pt, lt, Y = texts
    extra = label_point_targets(Y, np.arange(20), 0.5).nnz - Y.shape[1]
    assert extra == 4
    renee, w_renee = _siamese(texts, label_points=True)
    res, w = _siamese(texts, label_points=True, label_point_cooccurrence=0.5)
    again, w_again = _siamese(texts, label_points=True, label_point_cooccurrence=0.5)
    assert res.points == renee.points == 2 * (20 + 8) and np.isfinite(res.final_loss)
    assert not torch.equal(w, w_renee) and torch.equal(w, w_again)
    with pytest.raises(XCConfigError, match="pretrain.label_point_cooccurrence: 0.5 needs pretrain.label_points"):
        _siamese(texts, label_point_cooccurrence=0.5)


def test_siamesexml_sampler_refuses_label_points(texts):
    with pytest.raises(XCConfigError, match="pretrain.label_points: expected false with sampler siamesexml"):
        _siamese(texts, sampler="siamesexml", loss="siamesexml", label_points=True)


# ----------------------------------------------------------------------- the hardest-negative trainer

def _zero_shot(seed: int = 0, n: int = 300, L: int = 20, D: int = 16):
    """Points of labels 0..9 only; labels 10..19 have no training point. Label embeddings are close to the
    labels' directions, W starts at random (e.g. a warm start's W that does not know the labels)."""
    g = torch.Generator().manual_seed(seed)
    mu = F.normalize(torch.randn(L, D, generator=g), dim=-1)
    y = torch.randint(0, L // 2, (n,), generator=g)
    X = F.normalize(mu[y] + 0.3 * torch.randn(n, D, generator=g), dim=-1).numpy()
    E = F.normalize(mu + 0.2 * torch.randn(L, D, generator=g), dim=-1).numpy()
    W0 = F.normalize(torch.randn(L, D, generator=g), dim=-1).numpy()
    yt = torch.arange(L // 2, L).repeat(10)
    Xt = F.normalize(mu[yt] + 0.3 * torch.randn(len(yt), D, generator=g), dim=-1).numpy()
    Y = sp.csr_matrix((np.ones(n, dtype=np.float32), (np.arange(n), y.numpy())), shape=(n, L))
    return X, E, W0, Y, np.argsort(-(X @ E.T), axis=1)[:, :8], Xt, yt.numpy()


def test_label_points_teach_w_the_labels_without_training_points():
    X, E, W0, Y, sl, Xt, yt = _zero_shot()
    params = ClassifierParams(epochs=30, batch_size=64, lr=0.02, num_negatives=5, num_positives=1)
    rows = np.arange(len(X))
    W_off, s_off = train_classifiers(X, W0, Y, sl, rows, params, CPU, label_point_emb=E)
    on = dataclasses.replace(params, label_points=True)
    W_on, s_on = train_classifiers(X, W0, Y, sl, rows, on, CPU, label_point_emb=E)
    assert W_on.shape == W_off.shape == (20, 16) and np.allclose(np.linalg.norm(W_on, axis=1), 1, atol=1e-5)
    assert s_off["label_points"] == 0 and s_on["label_points"] == 20
    assert s_on["steps"] == 30 * int(np.ceil((300 + 20) / 64))

    def p1_unseen(W: np.ndarray) -> float:  # test points of the labels without training points, among those
        return float(((Xt @ W[10:].T).argmax(1) + 10 == yt).mean())

    def p1_label_texts(W: np.ndarray) -> float:  # each label's embedding ranks its own w_l first
        return float(((E @ W.T).argmax(1) == np.arange(20)).mean())

    assert p1_unseen(W_on) > p1_unseen(W_off) + 0.2, (p1_unseen(W_off), p1_unseen(W_on))
    assert p1_label_texts(W_on) > p1_label_texts(W_off) + 0.2, (p1_label_texts(W_off), p1_label_texts(W_on))
    W_again, _ = train_classifiers(X, W0, Y, sl, rows, on, CPU, label_point_emb=E)
    assert np.array_equal(W_on, W_again)
    W_ib, s_ib = train_classifiers(X, W0, Y, sl, rows, dataclasses.replace(on, negatives="in-batch"), CPU,
                                   label_point_emb=E)
    assert s_ib["label_points"] == 20 and W_ib.shape == (20, 16)
    with pytest.raises(ValueError, match="classifier.label_points"):
        train_classifiers(X, W0, Y, sl, rows, on, CPU)


class Killed(Exception):
    pass


def test_killed_run_with_label_points_resumes_to_the_same_weights(tmp_path):
    X, E, W0, Y, sl, _, _ = _zero_shot(n=160, seed=1)
    params = ClassifierParams(epochs=4, batch_size=32, lr=0.02, num_negatives=4, negatives="both", cluster_size=8,
                              num_positives=2, label_points=True)
    rows = np.arange(len(X))
    W_full, s_full = train_classifiers(X, W0, Y, sl, rows, params, CPU, label_point_emb=E)
    ckpt = Checkpointer(tmp_path / "ckpt", fingerprint(params.__dict__, X, W0, sl, rows))

    def kill_after_epoch_2(step: int, values: dict) -> None:
        if step == 2:
            raise Killed

    with pytest.raises(Killed):
        train_classifiers(X, W0, Y, sl, rows, params, CPU, kill_after_epoch_2, ckpt, label_point_emb=E)
    W_res, s_res = train_classifiers(X, W0, Y, sl, rows, params, CPU, None, ckpt, label_point_emb=E)
    assert s_res["resumed_from_epoch"] == 2 and s_res["steps"] == s_full["steps"]
    assert np.array_equal(W_res, W_full) and s_res["final_loss"] == s_full["final_loss"]


def test_label_points_with_the_module_iv_residual():
    """With the bag encoder's residual (Module IV) the label points are intermediate embeddings too."""
    H, E, W0, Y, sl, _, _ = _zero_shot(n=120, seed=2)  # H and E play f_E(x), f_E(z)
    params = ClassifierParams(epochs=2, batch_size=32, lr=0.02, num_negatives=4, num_positives=1,
                              residual_lr=0.01, label_points=True)
    out = []
    for _ in range(2):
        enc = create_bag_encoder(50, 16, init="random", seed=0)
        W, summary = train_classifiers(H, W0, Y, sl, np.arange(len(H)), params, CPU, encoder=enc,
                                       label_point_emb=E)
        out.append(W)
        assert not enc.training and summary["label_points"] == 20 and W.shape == (20, 16)
    assert np.array_equal(out[0], out[1])


def test_the_stages_train_on_label_points(tmp_path, monkeypatch):
    """pretrain.label_points and classifier.label_points reach the trainers through the stages: the label texts
    are encoded as points in pretraining, the label embeddings are points of the classifier, W keeps L rows."""
    home = tiny_lf_home(tmp_path, monkeypatch, {
        "ingest.valid_fraction": 0.1, "pretrain.epochs": 1, "pretrain.batch_size": 16, "pretrain.chunk_size": 8,
        "mining.shortlist_size": 8, "classifier.epochs": 2, "classifier.batch_size": 32,
        "classifier.num_negatives": 5})
    spec = Catalog(home.catalog).get("TinyTitles")
    cfg = spec.config({"pretrain.label_points": True, "classifier.label_points": True})
    out = run_all(StageContext(ArtifactStore(home.artifacts), spec, cfg, home.cache),
                  ("ingest", "tokenize", "pretrain", "mining", "classifier"))
    assert out["pretrain"]["points"] == 108 + 20  # the non-validation points and the 20 label texts
    assert out["classifier"]["label_points"] == 20 and out["classifier"]["steps"] == 2 * 4  # (108 + 20) / 32
    W = np.load(ArtifactStore(home.artifacts).stage_dir("TinyTitles", "classifier") / "W.npy")
    assert W.shape == (20, 32)


def test_ngame_label_points_only_where_labels_have_names(tmp_path, monkeypatch):
    """ngame trains on label points by default; placeholder label names (a layout without Y.txt) or the siamesexml
    sampler leave them out unless the user set pretrain.label_points, and real names keep them."""
    home = tiny_lf_home(tmp_path, monkeypatch, {})
    cfg = Catalog(home.catalog).get("TinyTitles").config()
    assert cfg.pretrain.label_points and cfg.pretrain.label_point_cooccurrence == 0.5
    said = []

    def ctx(texts, config, ingest=None):  # ingest: the ingest summary (None: one from before it kept label_names)
        read = SimpleNamespace(label_texts=lambda: texts, summary=lambda stage, missing_ok=False: ingest)
        return SimpleNamespace(cfg=config, name="T", info=said.append, read=read)

    kept = label_points_named(ctx(["cat", "dog", "fish"], cfg), cfg.pretrain)
    dropped = label_points_named(ctx(generic_labels(3), cfg), cfg.pretrain)
    assert kept.label_points and kept.label_point_cooccurrence == 0.5
    assert not dropped.label_points and dropped.label_point_cooccurrence == 0 and "placeholder names" in said[0]
    # the ingest summary's record wins over the texts (it is read, the texts are not compared)
    assert not label_points_named(ctx(["cat", "dog", "fish"], cfg, {"label_names": False}), cfg.pretrain).label_points
    assert label_points_named(ctx(generic_labels(3), cfg, {"label_names": True}), cfg.pretrain).label_points
    del said[1]
    explicit = Catalog(home.catalog).get("TinyTitles").config({"pretrain.label_points": True})
    assert label_points_named(ctx(generic_labels(3), explicit), explicit.pretrain).label_points and len(said) == 1
    label_batches = Catalog(home.catalog).get("TinyTitles").config({"pretrain.sampler": "siamesexml"})
    assert not label_points_named(ctx(["cat", "dog", "fish"], label_batches), label_batches.pretrain).label_points
    assert "siamesexml sampler" in said[1]


def test_label_neighbours_of_many_labels_come_from_hnsw_with_high_recall(monkeypatch):
    rng = np.random.default_rng(0)
    emb = rng.standard_normal((2000, 16)).astype(np.float32)
    emb /= np.linalg.norm(emb, axis=1, keepdims=True)
    exact = label_points.label_neighbours(emb, 10)
    monkeypatch.setattr(label_points, "EXACT_MAX_LABELS", 100)
    approx = label_points.label_neighbours(emb, 10)
    assert approx.shape == (2000, 10) and not (approx == np.arange(2000)[:, None]).any()  # never itself
    recall = np.mean([len(set(a) & set(e)) / 10 for a, e in zip(approx, exact)])
    assert recall > 0.95
