"""Training components as registries: the config checks accept exactly the registries' names, a new component is
one class and one registry line, and the trainers' steps by hand give the same weights as ``train_*``."""

from __future__ import annotations

import ast
import dataclasses
import re
from typing import Any, Callable

import numpy as np
import pytest
import scipy.sparse as sp
import torch

from tests.tinydata import label_word_texts
from xc_dagster.config import ClassifierParams, PretrainParams, resolve_config
from xc_dagster.device import seed_everything
from xc_dagster.encoders.loading import load_encoder
from xc_dagster.errors import XCConfigError
from xc_dagster.sampling import batches, hard_negatives
from xc_dagster.sampling.batches import BATCH_SAMPLERS
from xc_dagster.sampling.hard_negatives import HARD_NEGATIVE_POOLS
from xc_dagster.sampling.negatives import SAMPLED_NEGATIVES, SAMPLERS
from xc_dagster.strategies import STRATEGIES
from xc_dagster.training.classifier import ClassifierTrainer, check_hard_negative_params, train_classifiers
from xc_dagster.training.end_to_end import EndToEndTrainer, check_end_to_end_params, train_end_to_end
from xc_dagster.training.losses import CLASSIFIER_LOSSES, PAIR_LOSSES
from xc_dagster.training.sharded import ROW_OPTIMIZERS, check_optimizer
from xc_dagster.training.siamese import SiameseTrainer, check_pretrain_params, train_siamese

CPU = torch.device("cpu")

# (registry, config field, the check of that field on params with the field set)
CHECKS: list[tuple[dict, str, Callable[[Any], None]]] = [
    (BATCH_SAMPLERS, "pretrain.sampler", lambda v: check_pretrain_params(PretrainParams(sampler=v))),
    (PAIR_LOSSES, "pretrain.loss", lambda v: check_pretrain_params(PretrainParams(loss=v))),
    (CLASSIFIER_LOSSES, "classifier.loss", lambda v: check_hard_negative_params(ClassifierParams(loss=v))),
    (HARD_NEGATIVE_POOLS, "classifier.negatives",
     lambda v: check_hard_negative_params(ClassifierParams(negatives=v))),
    (SAMPLED_NEGATIVES, "classifier.negatives",
     lambda v: check_end_to_end_params(ClassifierParams(negatives=v), has_encoder=False)),
    (ROW_OPTIMIZERS, "classifier.w_optimizer", check_optimizer),
]


@pytest.mark.parametrize("registry, field, check", CHECKS, ids=[f"{f}-{i}" for i, (_, f, _) in enumerate(CHECKS)])
def test_the_checks_accept_exactly_the_registry_names(registry, field, check):
    for name in registry:
        check(name)  # every registered name passes
    with pytest.raises(XCConfigError) as err:
        check("no-such-component")
    message = str(err.value)
    assert message.startswith(field) and "no-such-component" in message
    listed = re.search(r"\[[^\]]*\]", message).group(0)  # the names the error lists: the registry's, all of them
    assert sorted(ast.literal_eval(listed)) == sorted(registry)


def test_strategies_pick_registered_components_and_samplers_are_the_registry():
    assert SAMPLERS == tuple(SAMPLED_NEGATIVES)
    assert not set(HARD_NEGATIVE_POOLS) & set(SAMPLED_NEGATIVES)  # classifier.negatives chooses the trainer
    for name in STRATEGIES:
        cfg = resolve_config("quick", name)
        assert cfg.pretrain.sampler in BATCH_SAMPLERS and cfg.pretrain.loss in PAIR_LOSSES, name
        assert cfg.classifier.loss in CLASSIFIER_LOSSES and cfg.classifier.w_optimizer in ROW_OPTIMIZERS, name
        assert cfg.classifier.negatives in {**HARD_NEGATIVE_POOLS, **SAMPLED_NEGATIVES}, name


# ----------------------------------------------------------------------------------------------- data

@pytest.fixture(scope="module")
def texts():
    """24 points naming one or two of 8 label words, tokenized with MiniLM's tokenizer (for the bag encoder)."""
    return label_word_texts()


def _pretrain_params(**kw) -> PretrainParams:
    return dataclasses.replace(PretrainParams(), **{"batch_size": 6, "chunk_size": 8, "warmup_steps": 1, "lr": 1e-2,
                                                   "amp": "off", "epochs": 2, "num_negatives": 3, **kw})


def _weights(module: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in module.state_dict().values()])


def _planted(n: int = 60, L: int = 10, D: int = 8, seed: int = 0):
    rng = np.random.default_rng(seed)
    mu = rng.normal(size=(L, D)).astype(np.float32)
    y = rng.integers(0, L, n)
    X = mu[y] + 0.3 * rng.normal(size=(n, D)).astype(np.float32)
    X /= np.linalg.norm(X, axis=1, keepdims=True)
    E = mu / np.linalg.norm(mu, axis=1, keepdims=True)
    Y = sp.csr_matrix((np.ones(n, np.float32), (np.arange(n), y)), shape=(n, L))
    return X, E, Y, np.argsort(-(X @ E.T), axis=1)[:, :5]


# ------------------------------------------------------------------------------------ a new component

class FixedBatches:
    """A toy batch sampler: the same two batches every epoch."""

    reclusterings = 0
    epochs_seen: list[int] = []

    def __init__(self, rows: np.ndarray):
        self.batches = [rows[:4], rows[4:8]]

    @classmethod
    def from_params(cls, Y, rows, params, dim) -> FixedBatches:
        return cls(rows)

    def steps_per_epoch(self) -> int:
        return 2

    def prepare(self, encode) -> dict[str, float]:
        return {}

    def epoch(self, epoch: int, rng: np.random.Generator) -> list[np.ndarray]:
        FixedBatches.epochs_seen.append(epoch)
        return list(self.batches)

    def observe(self, rows, emb) -> None:
        pass

    def state(self) -> dict[str, Any]:
        return {}

    def load_state(self, st: dict[str, Any]) -> None:
        pass


def test_a_registered_batch_sampler_is_the_one_the_trainer_uses(monkeypatch, texts):
    pt, lt, Y = texts
    monkeypatch.setitem(BATCH_SAMPLERS, "fixed", FixedBatches)
    FixedBatches.epochs_seen = []
    seed_everything(0)
    res = train_siamese(load_encoder("bag:16"), pt, lt, Y, np.arange(24), _pretrain_params(sampler="fixed", epochs=3),
                        CPU, None)
    assert FixedBatches.epochs_seen == [0, 1, 2] and res.steps == 6 and res.points == 3 * 8
    with pytest.raises(XCConfigError, match=r"pretrain.sampler: expected one of \[.*'fixed'"):  # listed with the rest
        check_pretrain_params(_pretrain_params(sampler="fixes"))


class FirstLabelPool:
    """A toy negative pool: label 0 for every point (unless it is a positive)."""

    def __init__(self, Y: sp.csr_matrix, shortlist: np.ndarray):
        self.Y = Y

    def candidates(self, x, W, batch, pos):
        ids = np.zeros((len(batch), 1), dtype=np.int64)
        ids = torch.from_numpy(np.where(self.Y[batch][:, 0].toarray() > 0, -1, ids))
        return [(ids, (x @ W[:1].T).masked_fill(ids < 0, float("-inf")))]


def test_a_registered_negative_pool_is_the_one_the_classifier_trainer_uses(monkeypatch):
    X, E, Y, sl = _planted()
    monkeypatch.setitem(HARD_NEGATIVE_POOLS, "first-label", FirstLabelPool)
    trainer = ClassifierTrainer(X, E, Y, sl, np.arange(60), ClassifierParams(negatives="first-label", epochs=1,
                                                                             batch_size=16, num_negatives=3), CPU)
    c = trainer.candidates(trainer.epoch_batches(0)[0])
    negatives = c.ids[:, trainer.params.num_positives:].numpy()
    assert negatives.shape[1] == 1 and set(np.unique(negatives)) <= {-1, 0}
    assert hard_negatives.HARD_NEGATIVE_POOLS is HARD_NEGATIVE_POOLS and batches.BATCH_SAMPLERS is BATCH_SAMPLERS


# ----------------------------------------------------------------------------- trainer steps by hand

@pytest.mark.parametrize("sampler, loss", [("random", "triplet"), ("siamesexml", "siamesexml"),
                                           ("ngame", "infonce")])
def test_siamese_steps_by_hand_equal_train_siamese(texts, sampler, loss):
    pt, lt, Y = texts
    params = _pretrain_params(sampler=sampler, loss=loss, curriculum=(1,), max_cluster_size=4, symmetric=True)
    seed_everything(0)
    enc = load_encoder("bag:16")
    res = train_siamese(enc, pt, lt, Y, np.arange(24), params, CPU, None)
    seed_everything(0)
    by_hand = load_encoder("bag:16")
    trainer = SiameseTrainer(by_hand, pt, lt, Y, np.arange(24), params, CPU, None)
    assert trainer.start() == 0
    losses = []
    for epoch in range(trainer.n_epochs):
        for batch in trainer.epoch_batches(epoch):
            losses.append(trainer.update(trainer.batch_loss(batch)))  # the step's two parts, as a bench times them
    assert trainer.steps == res.steps >= 4 and losses[-1] == res.final_loss
    assert torch.equal(_weights(by_hand), _weights(enc))


@pytest.mark.parametrize("negatives, loss", [("shortlist", "triplet"), ("both", "bce"), ("in-batch", "siamesexml")])
def test_classifier_steps_by_hand_equal_train_classifiers(negatives, loss):
    X, E, Y, sl = _planted()
    params = ClassifierParams(epochs=3, batch_size=16, lr=0.02, num_negatives=3, num_positives=1, loss=loss,
                              negatives=negatives, cluster_size=0 if negatives == "shortlist" else 4)
    W, summary = train_classifiers(X, E, Y, sl, np.arange(60), params, CPU)
    trainer = ClassifierTrainer(X, E, Y, sl, np.arange(60), params, CPU)
    for epoch in range(trainer.epochs):
        for batch in trainer.epoch_batches(epoch):
            trainer.step(batch)
    assert trainer.steps == summary["steps"] == 3 * 4
    assert np.array_equal(trainer.weights(), W)


@pytest.mark.parametrize("negatives", list(SAMPLED_NEGATIVES))
def test_end_to_end_steps_by_hand_equal_train_end_to_end(negatives):
    X, E, Y, sl = _planted()
    params = ClassifierParams(negatives=negatives, epochs=2, batch_size=16, num_hard=2, num_random=4,
                              hard_start=0.5, refresh_every=0.5, sampler_index="exact", w_optimizer="sgd", lr=0.3)
    full = train_end_to_end(X, E, E, Y, np.arange(60), params, CPU, shortlist=sl)
    trainer = EndToEndTrainer(X, E, E, Y, np.arange(60), params, CPU, shortlist=sl)
    try:
        for epoch in range(trainer.n_epochs):
            for batch in trainer.epoch_batches(epoch):
                trainer.step(batch)
    finally:
        trainer.close()
    by_hand = trainer.result(0.0, 0, reencode=False)
    assert trainer.steps == full.summary["steps"] == 8
    assert np.array_equal(by_hand.W, full.W)
    assert by_hand.summary["refreshes"] == full.summary["refreshes"]
