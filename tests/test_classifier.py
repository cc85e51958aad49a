"""Classifier training (NGAME M2 / SiameseXML Module IV): negative pools, cluster batches, learning."""

from __future__ import annotations

import re
import time

import numpy as np
import pytest
import scipy.sparse as sp
import torch
import torch.nn.functional as F

from xc_dagster.config import ClassifierParams
from xc_dagster.encoders.bag import create_bag_encoder, embed_from_intermediate
from xc_dagster.errors import XCConfigError
from xc_dagster.sampling.hard_negatives import hardest_negatives
from xc_dagster.training.checkpoint import Checkpointer, fingerprint
from xc_dagster.training.classifier import propensity_label_weights, train_classifiers


def csr(rows: list[list[int]], L: int) -> sp.csr_matrix:
    r = [i for i, ls in enumerate(rows) for _ in ls]
    c = [l for ls in rows for l in ls]
    return sp.csr_matrix((np.ones(len(c)), (r, c)), shape=(len(rows), L))


# 6 labels on a line: w_l . x = score_l for x = e1; scores [0.9, 0.8, 0.7, 0.6, 0.5, 0.4]
W6 = torch.tensor([[0.9, 0.0], [0.8, 0.0], [0.7, 0.0], [0.6, 0.0], [0.5, 0.0], [0.4, 0.0]])
X2 = torch.tensor([[1.0, 0.0], [1.0, 0.0]])
Y6 = csr([[0, 5], [3]], 6)  # point 0: positives {0, 5}; point 1: {3}
SL = np.array([[0, 4, 2, -1], [1, 3, 4, 5]])  # mined shortlists
POS = np.array([[0, 5], [3, -1]])  # sampled positives in the batch -> in-batch pool {0, 3, 5}


def test_hardest_negatives_from_each_pool_by_hand():
    b = np.array([0, 1])
    # shortlist: point 0 -> {4, 2} (0 is a positive) hardest first 2 (0.7), 4 (0.5); point 1 -> 1, 4, 5
    sl = hardest_negatives(X2, W6, b, POS, SL, Y6, "shortlist", 2)
    assert sl.tolist() == [[2, 4], [1, 4]]
    # in-batch pool {0, 3, 5}: point 0 -> only 3 (0 and 5 are its positives); point 1 -> 0 then 5
    ib = hardest_negatives(X2, W6, b, POS, SL, Y6, "in-batch", 2)
    assert ib.tolist() == [[3, -1], [0, 5]]
    # union: point 0 -> {4, 2} + {3}: 2 (0.7), 3 (0.6), 4; point 1 -> {1, 4, 5} + {0, 5}: 0, 1, 4 (5 once)
    both = hardest_negatives(X2, W6, b, POS, SL, Y6, "both", 3)
    assert both.tolist() == [[2, 3, 4], [0, 1, 4]]
    both5 = hardest_negatives(X2, W6, b, POS, SL, Y6, "both", 5)
    assert both5.tolist() == [[2, 3, 4, -1, -1], [0, 1, 4, 5, -1]]  # no label twice


def test_no_positive_is_ever_a_negative_random():
    rng = np.random.default_rng(0)
    n, L, D = 64, 40, 8
    Y = sp.random(n, L, density=0.1, random_state=2, format="csr")
    Y.data[:] = 1
    W = F.normalize(torch.randn(L, D), dim=-1)
    x = F.normalize(torch.randn(n, D), dim=-1)
    sl = np.stack([rng.permutation(L)[:10] for _ in range(n)])
    pos = np.where(Y.toarray().any(1, keepdims=True), np.array([Y[i].indices[:2].tolist() + [-1] * (2 - len(
        Y[i].indices[:2])) for i in range(n)]), -1)
    for mode in ("shortlist", "in-batch", "both"):
        neg = hardest_negatives(x, W, np.arange(n), pos, sl, Y, mode, 8).numpy()
        dense = Y.toarray()
        rows, cols = np.nonzero(neg >= 0)
        assert not dense[rows, neg[rows, cols]].any()
        for r in range(n):  # unique per row
            v = neg[r][neg[r] >= 0]
            assert len(v) == len(set(v.tolist()))


def _planted(seed: int = 0, n: int = 400, L: int = 20, D: int = 16):
    """Points near hidden label directions; label embeddings are noisy versions of those directions."""
    g = torch.Generator().manual_seed(seed)
    mu = F.normalize(torch.randn(L, D, generator=g), dim=-1)
    y = torch.randint(0, L, (n,), generator=g)
    X = F.normalize(mu[y] + 0.3 * torch.randn(n, D, generator=g), dim=-1).numpy()
    E = F.normalize(mu + 0.9 * torch.randn(L, D, generator=g), dim=-1).numpy()
    Y = sp.csr_matrix((np.ones(n), (np.arange(n), y.numpy())), shape=(n, L))
    sl = np.argsort(-(X @ E.T), axis=1)[:, :8]
    return X, E, Y, sl


@pytest.mark.parametrize("negatives, cluster_size", [("shortlist", 0), ("in-batch", 8), ("both", 8)])
def test_training_improves_precision_for_every_pool(negatives, cluster_size):
    X, E, Y, sl = _planted()
    p1_before = float(((X @ E.T).argmax(1) == Y.indices).mean())
    params = ClassifierParams(epochs=15, batch_size=64, lr=0.02, num_negatives=5, negatives=negatives,
                              cluster_size=cluster_size, num_positives=1)
    W, summary = train_classifiers(X, E, Y, sl, np.arange(len(X)), params, torch.device("cpu"))
    p1_after = float(((X @ W.T).argmax(1) == Y.indices).mean())
    assert np.allclose(np.linalg.norm(W, axis=1), 1, atol=1e-5)
    assert p1_after > p1_before + 0.1, (p1_before, p1_after)
    assert summary["negatives"] == negatives
    assert summary["clusters"] == (0 if cluster_size <= 1 else 64)  # 400 points in clusters of <= 8
    # reproducible with the seed
    W2, _ = train_classifiers(X, E, Y, sl, np.arange(len(X)), params, torch.device("cpu"))
    assert np.array_equal(W, W2)


def test_bad_negatives_value_names_the_field():
    X, E, Y, sl = _planted(n=20)
    with pytest.raises(XCConfigError, match="classifier.negatives"):
        train_classifiers(X, E, Y, sl, np.arange(20), ClassifierParams(negatives="random"), torch.device("cpu"))


def test_sgd_step_by_hand_and_adam_differs():
    """classifier.w_optimizer=sgd: one step of the hinge [s_1 - s_0 + 0.2]_+ through the unit-norm w."""
    X = np.array([[1.0, 0.0]], dtype=np.float32)
    E = np.array([[0.6, 0.8], [1.0, 0.0], [0.0, 1.0]], dtype=np.float32)  # label 2 is never scored
    Y = csr([[0]], 3)
    sl = np.array([[0, 1]])
    params = ClassifierParams(epochs=1, batch_size=8, lr=0.5, num_positives=1, num_negatives=1,
                              w_optimizer="sgd")
    W, summary = train_classifiers(X, E, Y, sl, np.arange(1), params, torch.device("cpu"))
    assert summary["steps"] == 1
    # d loss / d w_0 = -(I - w_0 w_0^T) x = -[0.64, -0.48]; w_1 = x gets no gradient (x - (w_1.x) w_1 = 0)
    w0 = np.array([0.6 + 0.5 * 0.64, 0.8 - 0.5 * 0.48])
    assert np.allclose(W[0], w0 / np.linalg.norm(w0), atol=1e-6)
    assert np.array_equal(W[1], E[1]) and np.array_equal(W[2], E[2])
    Wa, _ = train_classifiers(X, E, Y, sl, np.arange(1), ClassifierParams(
        epochs=1, batch_size=8, lr=0.5, num_positives=1, num_negatives=1), torch.device("cpu"))
    assert not np.allclose(Wa[0], W[0], atol=1e-3)  # SparseAdam's first step is lr * sign(g) per coordinate
    with pytest.raises(XCConfigError, match="classifier.w_optimizer"):
        train_classifiers(X, E, Y, sl, np.arange(1), ClassifierParams(w_optimizer="adagrad"),
                          torch.device("cpu"))
    with pytest.raises(XCConfigError, match="classifier.weight_decay"):
        train_classifiers(X, E, Y, sl, np.arange(1), ClassifierParams(w_optimizer="sgd", weight_decay=1e-4),
                          torch.device("cpu"))


def test_propensity_weights_by_hand_and_in_the_step():
    """classifier.propensity_weight: (1/p_l)^gamma at mean 1 over the training positives, scaling their terms."""
    inv = np.array([1.0, 2.0, 4.0])
    Y = csr([[0], [0, 1], [2], [1]], 3)  # rows 0-2 train: label counts 2, 1, 1
    rows = np.array([0, 1, 2])
    # gamma 1: [1, 2, 4] * 4 / (2*1 + 1*2 + 1*4) = [0.5, 1, 2]; gamma 0.5: [1, 1.414, 2] * 4 / 5.414
    assert np.allclose(propensity_label_weights(inv, Y, rows, 1.0), [0.5, 1.0, 2.0])
    assert np.allclose(propensity_label_weights(inv, Y, rows, 0.5), np.sqrt(inv) * 4 / (2 + np.sqrt(2) + 2))
    assert propensity_label_weights(inv, Y, rows, 0) is None
    with pytest.raises(XCConfigError, match="classifier.propensity_weight"):
        propensity_label_weights(inv, Y, rows, -1.0)
    # one SGD step through the hinge: label 0's weight 3 triples its gradient (the SGD test's setup)
    X = np.array([[1.0, 0.0]], dtype=np.float32)
    E = np.array([[0.6, 0.8], [1.0, 0.0], [0.0, 1.0]], dtype=np.float32)
    params = ClassifierParams(epochs=1, batch_size=8, lr=0.5, num_positives=1, num_negatives=1, w_optimizer="sgd")
    W, _ = train_classifiers(X, E, csr([[0]], 3), np.array([[0, 1]]), np.arange(1), params, torch.device("cpu"),
                             label_weight=np.array([3.0, 1.0, 1.0], dtype=np.float32))
    w0 = np.array([0.6 + 1.5 * 0.64, 0.8 - 1.5 * 0.48])
    assert np.allclose(W[0], w0 / np.linalg.norm(w0), atol=1e-6)


class Killed(Exception):
    pass


def test_killed_run_resumes_from_its_checkpoint_to_the_same_weights(tmp_path):
    X, E, Y, sl = _planted(n=200)
    params = ClassifierParams(epochs=5, batch_size=32, lr=0.02, num_negatives=4, negatives="both",
                              cluster_size=8, num_positives=2)
    rows = np.arange(len(X))
    W_full, s_full = train_classifiers(X, E, Y, sl, rows, params, torch.device("cpu"))

    key = fingerprint(params.__dict__, X, E, sl, rows)
    ckpt = Checkpointer(tmp_path / "ckpt", key)

    def kill_after_epoch_3(step: int, values: dict) -> None:
        if step == 3:
            raise Killed

    with pytest.raises(Killed):
        train_classifiers(X, E, Y, sl, rows, params, torch.device("cpu"), kill_after_epoch_3, ckpt)
    assert (tmp_path / "ckpt" / "state.pt").exists()
    # a checkpoint of other hyperparameters or inputs is never resumed from
    other = Checkpointer(tmp_path / "ckpt", fingerprint({**params.__dict__, "lr": 0.5}, X, E, sl, rows))
    assert other.load() is None
    W_res, s_res = train_classifiers(X, E, Y, sl, rows, params, torch.device("cpu"), None, ckpt)
    assert s_res["resumed_from_epoch"] == 3 and s_res["steps"] == s_full["steps"]
    assert np.array_equal(W_res, W_full)
    assert s_res["final_loss"] == s_full["final_loss"]


def _tiny_bag(D: int = 16, seed: int = 0):
    return create_bag_encoder(50, D, init="random", seed=seed)


def test_module_iv_trains_the_residual_with_w_on_frozen_intermediate_embeddings():
    """SiameseXML Module IV: the residual block R and W learn together on x = N(R(h)), h frozen; the token
    table is untouched; the encoder is updated in place and reproducible with the seed."""
    H, E, Y, sl = _planted(seed=1)  # H plays the intermediate embeddings f_E(x)
    enc = _tiny_bag()
    table = enc.embedding.weight.detach().clone()
    before = {k: v.clone() for k, v in enc.residual.state_dict().items()}
    X0 = embed_from_intermediate(enc, H, torch.device("cpu"))
    params = ClassifierParams(epochs=15, batch_size=64, lr=0.02, num_negatives=5, num_positives=1,
                              residual_lr=0.01)
    W, summary = train_classifiers(H, E, Y, sl, np.arange(len(H)), params, torch.device("cpu"), encoder=enc)
    assert not enc.training
    assert torch.equal(enc.embedding.weight, table)
    assert not torch.equal(enc.residual.state_dict()["linear.parametrizations.weight.original"],
                           before["linear.parametrizations.weight.original"])
    X1 = embed_from_intermediate(enc, H, torch.device("cpu"))
    assert np.allclose(np.linalg.norm(X1, axis=1), 1, atol=1e-5) and not np.allclose(X0, X1)
    p1_before = float(((X0 @ E.T).argmax(1) == Y.indices).mean())
    assert float(((X1 @ W.T).argmax(1) == Y.indices).mean()) > p1_before + 0.1
    enc2 = _tiny_bag()
    W2, _ = train_classifiers(H, E, Y, sl, np.arange(len(H)), params, torch.device("cpu"), encoder=enc2)
    assert np.array_equal(W, W2)
    assert all(torch.equal(a, b) for a, b in zip(enc.residual.state_dict().values(),
                                                 enc2.residual.state_dict().values()))


def test_module_iv_killed_run_resumes_residual_and_w_to_the_same_state(tmp_path):
    H, E, Y, sl = _planted(n=200, seed=2)
    params = ClassifierParams(epochs=4, batch_size=32, lr=0.02, num_negatives=4, num_positives=2, residual_lr=0.01)
    rows = np.arange(len(H))
    full_enc = _tiny_bag()
    W_full, _ = train_classifiers(H, E, Y, sl, rows, params, torch.device("cpu"), encoder=full_enc)
    ckpt = Checkpointer(tmp_path / "ckpt", fingerprint(params.__dict__, H, E, sl, rows))

    def kill_after_epoch_2(step: int, values: dict) -> None:
        if step == 2:
            raise Killed

    with pytest.raises(Killed):
        train_classifiers(H, E, Y, sl, rows, params, torch.device("cpu"), kill_after_epoch_2, ckpt,
                          encoder=_tiny_bag())
    enc = _tiny_bag()  # a fresh process: the residual comes back from the checkpoint
    W_res, s_res = train_classifiers(H, E, Y, sl, rows, params, torch.device("cpu"), None, ckpt, encoder=enc)
    assert s_res["resumed_from_epoch"] == 2
    assert np.array_equal(W_res, W_full)
    assert all(torch.equal(a, b) for a, b in zip(enc.residual.state_dict().values(),
                                                 full_enc.residual.state_dict().values()))


def test_progress_counts_steps_and_a_deadline_stops_inside_an_epoch(monkeypatch):
    """A one-epoch run of a large dataset reports its steps as they go (not one line at the epoch's end), and the
    budget's deadline stops it at a step, not at the end of the epoch it started."""
    monkeypatch.setenv("XC_PROGRESS_SECONDS", "1e-9")  # a line at every step
    X, E, Y, sl = _planted(n=400)
    params = ClassifierParams(epochs=2, batch_size=64, lr=0.02, num_negatives=5, num_positives=1)
    lines: list[str] = []
    _, summary = train_classifiers(X, E, Y, sl, np.arange(400), params, torch.device("cpu"), report=lines.append)
    assert summary["steps"] == 2 * 7 and summary["epochs_trained"] == 2  # 400 points in batches of 64: 7 a epoch
    done = [int(m[1]) for m in (re.match(r"classifier: (\d+)/14 steps", line) for line in lines) if m]
    assert done == list(range(1, 15)) + [14], lines

    clock = iter(range(1000))  # each look at the clock is one second later; the deadline passes at the 4th step
    monkeypatch.setattr(time, "perf_counter", lambda: float(next(clock)))
    _, cut = train_classifiers(X, E, Y, sl, np.arange(400), params, torch.device("cpu"), deadline=3.5)
    assert cut["stopped_at_deadline"] and cut["steps"] == 3 and cut["epochs_trained"] == round(3 / 7, 4)
