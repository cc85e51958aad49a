"""DEXML's decoupled softmax (``pretrain.loss=dexml``): by hand, against infonce, and through the trainer."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from tests.tinydata import label_word_texts
from xc_dagster.config import PretrainParams
from xc_dagster.device import seed_everything
from xc_dagster.encoders.loading import load_encoder
from xc_dagster.training.losses import PAIR_LOSSES, DEXMLPairLoss, dexml_loss, infonce_loss
from xc_dagster.training.siamese import check_pretrain_params, train_siamese


def _nll(s: float, negatives: list[float], t: float) -> float:
    """-log(e^{s/t} / (e^{s/t} + sum_n e^{n/t})), in numpy."""
    return float(-s / t + np.log(np.exp(s / t) + np.exp(np.array(negatives) / t).sum()))


def test_dexml_hand_computed_with_two_positives_in_a_row():
    # row 0: its sampled label (col 0) and col 1 are positives, col 2 its only negative; rows 1, 2: one positive
    sim = torch.tensor([[0.5, 0.6, 0.1], [0.2, 0.9, 0.4], [0.3, 0.0, 0.7]], requires_grad=True)
    mask = torch.tensor([[True, True, False], [False, True, False], [False, False, True]])
    t = 0.5
    row0 = (_nll(0.5, [0.1], t) + _nll(0.6, [0.1], t)) / 2  # each positive against the negatives only
    row1 = _nll(0.9, [0.2, 0.4], t)
    row2 = _nll(0.7, [0.3, 0.0], t)
    loss = dexml_loss(sim, mask, temperature=t)
    assert loss.item() == pytest.approx((row0 + row1 + row2) / 3, rel=1e-6)
    loss.backward()
    # the second positive is trained (infonce gives it no gradient), and only through its own term
    p01 = np.exp(0.6 / t) / (np.exp(0.6 / t) + np.exp(0.1 / t))
    assert sim.grad[0, 1].item() == pytest.approx(-(1 - p01) / (t * 2 * 3), rel=1e-5)
    p00 = np.exp(0.5 / t) / (np.exp(0.5 / t) + np.exp(0.1 / t))
    assert sim.grad[0, 0].item() == pytest.approx(-(1 - p00) / (t * 2 * 3), rel=1e-5)
    sim_i = sim.detach().clone().requires_grad_(True)
    infonce_loss(sim_i, mask, temperature=t).backward()
    assert sim_i.grad[0, 1].item() == 0.0
    # the two losses differ exactly by row 0: infonce keeps only its sampled positive's term
    assert infonce_loss(sim.detach(), mask, t).item() == pytest.approx((_nll(0.5, [0.1], t) + row1 + row2) / 3,
                                                                       rel=1e-6)


@pytest.mark.parametrize("shape", [(6, 6), (5, 9)])
def test_dexml_equals_infonce_without_extra_positives(shape):
    g = torch.Generator().manual_seed(0)
    sim = torch.rand(shape, generator=g) * 2 - 1
    mask = torch.zeros(shape, dtype=torch.bool)
    n = min(shape)
    mask[torch.arange(n), torch.arange(n)] = True
    a, b = sim.clone().requires_grad_(True), sim.clone().requires_grad_(True)
    la, lb = dexml_loss(a, mask, 0.1), infonce_loss(b, mask, 0.1)
    assert la.item() == pytest.approx(lb.item(), rel=1e-6)
    la.backward()
    lb.backward()
    assert torch.allclose(a.grad, b.grad, atol=1e-6)
    # an unmasked diagonal is still the sampled positive (as in infonce)
    assert dexml_loss(sim, torch.zeros(shape, dtype=torch.bool), 0.1).item() == pytest.approx(lb.item(), rel=1e-6)


def test_dexml_row_without_negatives_is_zero_with_finite_gradients():
    sim = torch.tensor([[0.3, 0.8], [0.1, 0.4]], requires_grad=True)
    mask = torch.tensor([[True, True], [False, True]])  # row 0: both columns positive, no negative
    loss = dexml_loss(sim, mask, 0.05)
    assert loss.item() == pytest.approx(_nll(0.4, [0.1], 0.05) / 2, abs=1e-7)
    loss.backward()
    assert torch.isfinite(sim.grad).all() and sim.grad[0].abs().sum().item() == 0.0


def test_dexml_is_registered_with_the_infonce_temperature():
    params = dataclasses.replace(PretrainParams(), loss="dexml", infonce_temperature=0.2)
    check_pretrain_params(params)
    loss = PAIR_LOSSES["dexml"].from_params(params)
    assert isinstance(loss, DEXMLPairLoss) and loss.temperature == 0.2


def test_train_siamese_with_dexml_runs_and_is_deterministic():
    pt, lt, Y = label_word_texts()
    params = dataclasses.replace(PretrainParams(), loss="dexml", batch_size=6, chunk_size=8, warmup_steps=1,
                                 lr=1e-2, amp="off", epochs=2)
    out = []
    for _ in range(2):
        seed_everything(0)
        enc = load_encoder("bag:16")
        res = train_siamese(enc, pt, lt, Y, np.arange(24), params, torch.device("cpu"), None)
        out.append((res, torch.cat([p.detach().flatten() for p in enc.state_dict().values()])))
    assert out[0][0].steps == 8 and np.isfinite(out[0][0].final_loss)
    assert out[0][0].final_loss == out[1][0].final_loss and torch.equal(out[0][1], out[1][1])
