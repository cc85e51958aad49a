"""NGAME's balanced hierarchical 2-means: balance, quality on planted clusters, batching."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import scipy.sparse as sp
import torch

from tests.tinydata import WORDS, write_tiny_encoder
from xc_dagster.catalog import DatasetSpec
from xc_dagster.config import PretrainParams
from xc_dagster.encoders.encode import encode_tokens
from xc_dagster.encoders.loading import load_encoder
from xc_dagster.encoders.tokenizer import load_tokenizer
from xc_dagster.errors import XCConfigError
from xc_dagster.sampling import batches
from xc_dagster.sampling.batches import NGAMESampler, curriculum_cluster_size
from xc_dagster.sampling.clustering import balanced_clusters, cluster_batches
from xc_dagster.training import siamese
from xc_dagster.training.losses import PAIR_LOSSES, point_batch_loss


def _planted(n_clusters: int, per: int, dim: int = 16, noise: float = 0.05, seed: int = 0):
    rng = np.random.default_rng(seed)
    centers = rng.standard_normal((n_clusters, dim))
    truth = np.repeat(np.arange(n_clusters), per)
    X = centers[truth] + noise * rng.standard_normal((len(truth), dim))
    X /= np.linalg.norm(X, axis=1, keepdims=True)
    perm = rng.permutation(len(truth))
    return X[perm].astype(np.float32), truth[perm]


def test_sizes_within_one_and_every_point_assigned():
    X = np.random.default_rng(1).standard_normal((1003, 8)).astype(np.float32)
    lab = balanced_clusters(X, cluster_size=10, seed=0)
    sizes = np.bincount(lab)
    assert lab.shape == (1003,) and sizes.sum() == 1003
    assert sizes.max() <= 10 and sizes.max() - sizes.min() <= 1
    assert len(sizes) == 128  # 1003 -> 502/501 -> ... 7 levels down to 8 points per cluster


def test_recovers_planted_clusters():
    X, truth = _planted(n_clusters=16, per=32)
    lab = balanced_clusters(X, cluster_size=32, seed=0)
    # each found cluster is pure: all its points come from one planted cluster
    purity = np.mean([np.bincount(truth[lab == c]).max() / np.sum(lab == c) for c in np.unique(lab)])
    assert purity >= 0.95


def test_deterministic_and_trivial_sizes():
    X, _ = _planted(8, 20)
    assert np.array_equal(balanced_clusters(X, 16, seed=3), balanced_clusters(X, 16, seed=3))
    assert np.array_equal(balanced_clusters(X, 1), np.arange(len(X)))


def test_cluster_batches_cover_rows_once_in_whole_clusters():
    lab = np.repeat(np.arange(10), 5)  # 10 clusters of 5
    rows = np.arange(50)[np.arange(50) % 7 != 0]  # some rows held out
    batches = cluster_batches(lab, rows, batch_size=12, rng=np.random.default_rng(0))
    allrows = np.concatenate(batches)
    assert sorted(allrows.tolist()) == sorted(rows.tolist())
    for b in batches:  # a batch holds whole clusters (restricted to rows)
        for c in np.unique(lab[b]):
            assert set(b[lab[b] == c]) == set(rows[lab[rows] == c])


def test_curriculum_doubles_cluster_size_on_schedule():
    sched = (10, 20, 25)
    assert [curriculum_cluster_size(e, sched, 64) for e in (0, 9, 10, 19, 20, 25, 300)] == [1, 1, 2, 2, 4, 8, 8]
    assert curriculum_cluster_size(300, sched, 4) == 4


def test_ngame_sampler_uses_memory_bank_clusters_and_reclusters_every_tau():
    X, truth = _planted(n_clusters=8, per=8, dim=8)
    p = PretrainParams(sampler="ngame", curriculum=(1,), max_cluster_size=8, cluster_every=2, batch_size=16)
    rows = np.arange(len(X))
    s = NGAMESampler(len(X), 8, p, rows)
    rng = np.random.default_rng(0)
    first = list(s.epoch(0, rng))  # C = 1: random batches, bank filled by the forward passes
    assert s.reclusterings == 0 and sorted(np.concatenate(first).tolist()) == rows.tolist()
    for b in first:
        s.observe(b, torch.from_numpy(X[b]))
    ep1 = list(s.epoch(1, rng))  # C = 2 -> 8: cluster from the bank
    assert s.reclusterings == 1 and s.size == 2
    p2 = PretrainParams(sampler="ngame", curriculum=(1, 1, 1), max_cluster_size=8, cluster_every=2, batch_size=16)
    s2 = NGAMESampler(len(X), 8, p2, rows)
    s2.bank[:] = X
    clustered = list(s2.epoch(1, rng))  # C = 8: clusters recover the planted groups
    assert s2.size == 8
    for b in clustered:  # each batch = 2 clusters of 8 -> at most 2 planted groups (pure clusters)
        assert len(np.unique(truth[b])) <= 3
    list(s2.epoch(2, rng))
    list(s2.epoch(3, rng))
    assert s2.reclusterings == 2  # epoch 1 (first), epoch 2 (tau = 2); not epoch 3
    assert ep1


def _tiny_pretrain_data(tmp_path):
    """A tiny random transformer and 32 two-word points, each labelled with one of 12 one-word labels."""
    path = write_tiny_encoder(tmp_path / "enc")
    tok = load_tokenizer(str(path))
    texts = [f"{WORDS[i % 12]} {WORDS[(3 * i + 1) % 12]}" for i in range(32)]

    def tokens(t):
        enc = tok(t, max_length=8, truncation=True, padding="max_length", return_tensors="np")
        return enc["input_ids"].astype(np.int32), enc["attention_mask"].sum(1).astype(np.int32)

    Y = sp.csr_matrix((np.ones(32, dtype=np.float32), (np.arange(32), np.arange(32) % 12)), shape=(32, 12))
    return path, tokens(texts), tokens(WORDS[:12]), Y


def test_seed_bank_clusters_the_starting_encoders_embeddings_from_epoch_0(monkeypatch, tmp_path):
    """pretrain.seed_bank: the first clustering (curriculum at epoch 0) is of the starting encoder's embeddings
    of the training points; without it a curriculum at epoch 0 is a config error (the bank is empty)."""
    torch.manual_seed(0)
    path, pt, lt, Y = _tiny_pretrain_data(tmp_path)
    rows = np.arange(2, 32)  # rows 0, 1 held out: their bank rows stay zero
    params = PretrainParams(sampler="ngame", curriculum=(0,), max_cluster_size=4, cluster_every=5, epochs=1,
                            batch_size=8, chunk_size=16, amp="off", warmup_steps=1)
    enc = load_encoder(str(path))
    with pytest.raises(XCConfigError, match="pretrain.curriculum.*seed_bank"):
        siamese.train_siamese(enc, pt, lt, Y, rows, params, torch.device("cpu"), None)
    start = encode_tokens(load_encoder(str(path)), pt[0][rows], pt[1][rows], torch.device("cpu"), None)
    seen = []
    real = batches.balanced_clusters
    monkeypatch.setattr(batches, "balanced_clusters", lambda X, *a, **k: (seen.append(np.array(X)), real(X, *a, **k))[1])
    monkeypatch.setattr(siamese, "ENCODE_ROWS", 7)  # the bank encoded in blocks of 7 rows: the same embeddings
    res = siamese.train_siamese(enc, pt, lt, Y, rows, dataclasses.replace(params, seed_bank=True),
                                torch.device("cpu"), None)
    assert res.reclusterings == 1 and res.steps >= 30 // 8
    assert len(seen) == 1 and np.allclose(seen[0], start, atol=1e-5)  # epoch 0's clusters: starting embeddings


def test_quick_curriculum_epoch_0_is_the_random_sampler_then_clusters_of_8(tmp_path, monkeypatch):
    """The quick preset's curriculum (1, 1, 1): the ngame sampler's first epoch is exactly the random sampler's
    (same batches, same weights), and from epoch 1 batches are unions of clusters of C = 8 from the memory bank;
    the paper preset keeps the paper's schedule. Both resolve the ngame strategy to the ngame sampler."""
    quick = DatasetSpec("X-Titles", "/x").config().pretrain
    paper = DatasetSpec("X-Titles", "/x", preset="paper").config().pretrain
    assert quick.sampler == paper.sampler == "ngame"
    assert quick.curriculum == (1, 1, 1) and paper.curriculum == (10, 20, 25, 50, 75, 100, 125, 150, 200)
    assert [batches.curriculum_cluster_size(e, quick.curriculum, quick.max_cluster_size) for e in (0, 1, 5)] == [1, 8, 8]

    path, pt, lt, Y = _tiny_pretrain_data(tmp_path)
    rows = np.arange(32)
    base = dataclasses.replace(quick, epochs=1, batch_size=8, chunk_size=16, amp="off", warmup_steps=1,
                               label_points=False, label_point_cooccurrence=0.0)  # the samplers alone

    banks = []  # the memory bank is allocated only when some epoch of the run clusters

    class Recording(batches.NGAMESampler):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            if self.bank is not None:
                banks.append(1)

    monkeypatch.setitem(batches.BATCH_SAMPLERS, "ngame", Recording)

    def train(**kw):
        torch.manual_seed(0)
        enc = load_encoder(str(path))
        res = siamese.train_siamese(enc, pt, lt, Y, rows, dataclasses.replace(base, **kw), torch.device("cpu"), None)
        return res, torch.cat([p.detach().flatten() for p in enc.parameters()])

    (r_ngame, w_ngame), (r_random, w_random) = train(), train(sampler="random")
    assert r_ngame.steps == r_random.steps == 4 and r_ngame.reclusterings == 0
    assert torch.equal(w_ngame, w_random) and not banks
    r2, w2 = train(epochs=2)
    _, w2_random = train(epochs=2, sampler="random")
    assert r2.reclusterings == 1 and r2.steps == 8 and banks == [1]  # epoch 1: 4 batches of one cluster of 8
    assert not torch.equal(w2, w2_random)


def test_point_batch_loss_symmetric_on_a_hand_case():
    """symmetric: the mean of the point-anchored loss and the label-anchored one on the transposed matrix."""
    sim = torch.tensor([[0.9, 0.7], [0.2, 0.5]])
    mask = torch.eye(2, dtype=torch.bool)
    p = PretrainParams(margin=0.3, num_negatives=1)
    loss = PAIR_LOSSES[p.loss].from_params(p)
    # points: row 0 [0.7 - 0.9 + 0.3]_+ = 0.1, row 1 [0.2 - 0.5 + 0.3]_+ = 0 -> 0.05
    assert float(point_batch_loss(sim, mask, loss, p.symmetric)) == pytest.approx(0.05, abs=1e-6)
    # labels (transposed): label 0 [0.2 - 0.9 + 0.3]_+ = 0, label 1 [0.7 - 0.5 + 0.3]_+ = 0.5 -> 0.25
    assert float(point_batch_loss(sim, mask, loss, symmetric=True)) == pytest.approx(0.15, abs=1e-6)
