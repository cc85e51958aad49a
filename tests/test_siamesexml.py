"""SiameseXML Module I: label-batch sampler, probabilistic contrastive loss, train_siamese with label batches,
and the ``siamesexml`` strategy's config."""

from __future__ import annotations

import dataclasses
import itertools
import math

import numpy as np
import pytest
import scipy.sparse as sp
import torch
from scipy.stats import chisquare

from tests.tinydata import WORDS, write_tiny_encoder
from xc_dagster.catalog import DatasetSpec
from xc_dagster.config import PretrainParams, resolve_config
from xc_dagster.device import seed_everything
from xc_dagster.encoders.encode import encode_tokens
from xc_dagster.encoders.loading import load_encoder
from xc_dagster.encoders.tokenizer import load_tokenizer
from xc_dagster.errors import XCConfigError
from xc_dagster.sampling.batches import SiameseXMLSampler
from xc_dagster.sampling.labels import label_sampling_probs, sample_label_batch, sample_label_points
from xc_dagster.strategies import STRATEGIES
from xc_dagster.training.losses import siamesexml_loss
from xc_dagster.training.siamese import check_pretrain_params, train_siamese


def _freq_Y() -> tuple[sp.csr_matrix, np.ndarray, np.ndarray]:
    """40 rows x 6 labels; train rows 0..29, validation rows 30..39. Label j has freq[j] train positives,
    label 5 has positives only in validation rows (train freq 0: never sampled)."""
    freq = np.array([1, 2, 4, 8, 16, 0])
    rows, cols = [], []
    for j, f in enumerate(freq):
        rows += list(range(j, j + f))  # rows j..j+f-1 (all < 30)
        cols += [j] * f
    rows += [30, 31, 32, 33]  # validation rows: labels 5 and 0
    cols += [5, 5, 0, 4]
    Y = sp.csr_matrix((np.ones(len(rows), dtype=np.float32), (rows, cols)), shape=(40, 6))
    return Y, np.arange(30), freq


# ------------------------------------------------------------------------------------------ sampler

def test_label_probs_follow_freq_power_and_draws_match():
    Y, train, freq = _freq_Y()
    s = SiameseXMLSampler(Y.tocsr(), train, PretrainParams())
    assert s.freq.tolist() == freq.tolist() and s.n_labels == 5  # validation rows not counted
    expected = np.where(freq > 0, freq.astype(float) ** 0.45, 0.0)
    expected /= expected.sum()
    assert np.allclose(s.probs, expected)
    assert np.allclose(label_sampling_probs(freq, 0.0)[:5], 0.2)  # power 0: uniform over labels with a point
    # batches of one label: each draw is exactly ~ freq^0.45 (chi-square goodness of fit, seeded)
    rng = np.random.default_rng(0)
    n = 6000
    draws = np.concatenate([sample_label_batch(s.probs, 1, rng) for _ in range(n)])
    counts = np.bincount(draws, minlength=6)
    assert counts[5] == 0
    assert chisquare(counts[:5], n * expected[:5]).pvalue > 0.01
    assert np.all(np.abs(counts[:5] / n - expected[:5]) / expected[:5] < 0.1)


def test_label_batches_are_successive_draws_without_replacement():
    # 5 labels, batches of 3: exact inclusion probability of successive draws proportional to p over the
    # labels not yet drawn, enumerated over all ordered triples, against 8K sampled batches
    p = label_sampling_probs(np.array([1, 2, 4, 8, 16]), 0.45)
    incl = np.zeros(5)
    for a, b, c in itertools.permutations(range(5), 3):
        pr = p[a] * p[b] / (1 - p[a]) * p[c] / (1 - p[a] - p[b])
        incl[[a, b, c]] += pr
    rng = np.random.default_rng(1)
    batches = np.stack([sample_label_batch(p, 3, rng) for _ in range(8000)])
    assert all(len(set(b)) == 3 for b in batches)  # never a label twice in a batch
    got = np.bincount(batches.ravel(), minlength=5) / 8000
    assert np.allclose(got, incl, atol=0.02)  # standard error <= 0.0056
    # a batch as large as the labels with a point takes each of them once, never a freq-0 label
    q = label_sampling_probs(np.array([3, 0, 1, 5]), 0.45)
    assert sorted(sample_label_batch(q, 10, rng).tolist()) == [0, 2, 3]


def test_label_points_are_train_positives_distinct_and_uniform():
    Y, train, freq = _freq_Y()
    s = SiameseXMLSampler(Y.tocsr(), train, PretrainParams(centroid_points=2))
    rng = np.random.default_rng(2)
    Yd = Y.toarray()
    for _ in range(200):
        b = s.batch(4, rng)
        assert len(set(b.labels.tolist())) == 4 and 5 not in b.labels
        assert b.centroid.shape == (4, 2)
        assert np.all(Yd[b.anchors, b.labels] == 1) and np.all(b.anchors < 30)  # train rows only
        assert np.all(Yd[b.centroid, b.labels[:, None]] == 1) and np.all(b.centroid < 30)
        for lab, a, cen in zip(b.labels, b.anchors, b.centroid):
            if freq[lab] >= 3:  # enough positives: anchor and the two centroid points all distinct
                assert len({a, *cen}) == 3
            elif freq[lab] == 2:  # label 1 (rows 1 and 2): the other positive, twice
                assert list(cen) == [3 - a, 3 - a]
            else:  # a single positive: the centroid is the anchor itself
                assert list(cen) == [a, a]
    # the anchor is uniform over the label's positives (label 3: rows 3..10)
    Yc = Y.tocsr()[train].tocsc()
    anchors, _ = sample_label_points(Yc, np.full(8000, 3), 2, np.random.default_rng(3))
    counts = np.bincount(anchors, minlength=11)[3:11]
    assert chisquare(counts).pvalue > 0.01


# -------------------------------------------------------------------------------------------- loss

C, D = 0.9, 1.5
# positive term -ln p(+1, v) = -ln c + d (1 - v); -ln 0.9 = 0.105361
# negative term -ln(1 - c exp(d (v - 1)))


def test_siamesexml_loss_hand_computed_2x2():
    sim = torch.tensor([[0.8, 0.3], [0.5, 0.6]])
    mask = torch.eye(2, dtype=torch.bool)
    # row 0: pos 0.105361 + 1.5 * 0.2 = 0.405361; neg 0.3: p = 0.9 e^{-1.05} = 0.314944, -ln(0.685056) = 0.378255
    # row 1: pos 0.105361 + 1.5 * 0.4 = 0.705361; neg 0.5: p = 0.9 e^{-0.75} = 0.425130, -ln(0.574870) = 0.553611
    # per row / (kappa + 1) = / 2, mean over rows
    expected = ((0.405361 + 0.378255) / 2 + (0.705361 + 0.553611) / 2) / 2
    assert siamesexml_loss(sim, mask, C, D, 1).item() == pytest.approx(expected, abs=1e-5)
    assert expected == pytest.approx(0.510647, abs=1e-6)


def test_siamesexml_loss_hand_computed_3x3_with_masked_positive():
    sim = torch.tensor([[0.9, 0.7, 0.2], [0.4, 0.5, 0.6], [0.1, 0.8, 0.3]], requires_grad=True)
    mask = torch.eye(3, dtype=torch.bool)
    mask[0, 1] = True  # column 1 is also a true positive of row 0: its 0.7 is never a negative
    # kappa = 2:
    # row 0: pos 0.9 -> 0.255361; negatives {0.2} only (0.7 masked) -> 0.316184; second slot empty
    # row 1: pos 0.5 -> 0.855361; negatives 0.6 -> 0.681081, 0.4 -> 0.455569
    # row 2: pos 0.3 -> 1.155361; negatives 0.8 -> 1.098822, 0.1 -> 0.265681
    # each row / 3, mean over 3 rows: (0.571545 + 1.992011 + 2.519864) / 9 = 0.564824
    loss = siamesexml_loss(sim, mask, C, D, 2)
    assert loss.item() == pytest.approx(0.564824, abs=1e-5)
    loss.backward()
    g = sim.grad
    assert g[0, 1].item() == 0.0  # the masked true positive gets no negative gradient
    assert g[0, 0] < 0 and g[1, 1] < 0 and g[2, 2] < 0  # raising a positive's similarity lowers the loss
    assert g[0, 2] > 0 and g[1, 2] > 0 and g[2, 1] > 0  # raising a mined negative's similarity raises it
    assert g[0, 0].item() == pytest.approx(-D / 3 / 3)  # d(pos term)/dv = -d, / (kappa + 1), / rows
    # changing the masked entry does not change the loss at all
    sim2 = sim.detach().clone()
    sim2[0, 1] = 0.99
    assert siamesexml_loss(sim2, mask, C, D, 2).item() == pytest.approx(loss.item(), abs=1e-7)


def test_siamesexml_loss_only_hardest_kappa_and_finite_above_one():
    sim = torch.tensor([[0.5, 0.9, 0.1]], requires_grad=True)
    mask = torch.tensor([[True, False, False]])
    siamesexml_loss(sim, mask, C, D, 1).backward()
    assert sim.grad[0, 1] > 0 and sim.grad[0, 2] == 0  # kappa = 1: only the hardest negative counts
    # low-precision rounding can push a cosine above 1; 1 - c exp(d (v - 1)) is clamped, the loss stays finite
    over = siamesexml_loss(torch.tensor([[1.0, 1.3]]), torch.tensor([[True, False]]), 0.9, 1.5, 1)
    assert torch.isfinite(over)
    with pytest.raises(ValueError):
        siamesexml_loss(sim, mask, 1.0, D, 1)


# ------------------------------------------------------------------------------- config, strategy

def test_siamesexml_strategy_resolves_the_sampler_and_loss():
    cfg = resolve_config("quick", "siamesexml")
    p = cfg.pretrain
    assert p.sampler == "siamesexml" and p.loss == "triplet" and p.num_negatives == 30 and p.epochs == 3
    assert (p.contrastive_c, p.contrastive_d, p.label_power) == (0.9, 1.5, 0.45)
    assert p.centroid_points == 2 and p.centroid_weight == pytest.approx(0.3)
    assert cfg.fusion.method == "alpha"
    assert cfg.flat()["pretrain.sampler"] == "siamesexml"
    spec = DatasetSpec("X-Titles", "/x", strategy="siamesexml").validate()
    assert spec.config({"pretrain.centroid_points": "0"}).pretrain.centroid_points == 0
    ngame_cfg = DatasetSpec("X-Titles", "/x").config()
    ngame = ngame_cfg.pretrain  # ngame: point batches
    assert ngame.sampler == "ngame" and ngame.loss == "triplet" and ngame.num_negatives == 30
    assert DatasetSpec("X-Titles", "/x", preset="paper").config().pretrain.num_negatives == 10  # NGAME code
    assert cfg.mining.sources == cfg.index.sources == ("label", "centroid", "knn")  # Module II
    assert cfg.index.label_repr == "text+centroid" and cfg.classifier.loss == "triplet"  # measured better
    assert cfg.classifier.init == "text+centroid" and ngame_cfg.classifier.init == "text"
    # propensity-scored positives for both hardest-negative strategies; the sampled-negative ones take none
    assert cfg.classifier.propensity_weight == ngame_cfg.classifier.propensity_weight == 1.0
    for name in ("astra", "mips"):
        assert DatasetSpec("X-Titles", "/x", strategy=name).config().classifier.propensity_weight == 0
    assert spec.config({"classifier.propensity_weight": 0}).classifier.propensity_weight == 0
    assert (cfg.classifier.contrastive_c, cfg.classifier.contrastive_d) == (0.75, 3.0)  # classifier.loss=siamesexml
    for name in ("Module I", "Module II", "Module III", "Module IV", "residual", "classifier.loss=siamesexml"):
        assert name.lower() in STRATEGIES["siamesexml"].description.lower()


@pytest.mark.parametrize("field, value", [
    ("sampler", "labels"), ("loss", "bce"), ("contrastive_c", 1.0), ("contrastive_d", 0.0),
    ("label_power", -0.5), ("centroid_points", -1), ("centroid_weight", 1.5), ("num_negatives", 0),
])
def test_bad_pretrain_values_name_the_field(field, value):
    with pytest.raises(XCConfigError, match=f"pretrain.{field}"):
        check_pretrain_params(dataclasses.replace(PretrainParams(), **{field: value}))


# ---------------------------------------------------------------------------------- end to end

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny random BERT and a learnable toy problem: 12 labels (words), 60 points naming their labels."""
    path = write_tiny_encoder(tmp_path_factory.mktemp("enc") / "tiny-bert")
    tok = load_tokenizer(str(path))
    rng = np.random.default_rng(0)
    n, L = 60, 12
    labels = [rng.choice(L, size=int(rng.integers(1, 3)), replace=False) for _ in range(n)]
    texts = [" ".join(WORDS[j] for j in lab) + f" item {i}" for i, lab in enumerate(labels)]
    r = np.repeat(np.arange(n), [len(lab) for lab in labels])
    Y = sp.csr_matrix((np.ones(len(r), dtype=np.float32), (r, np.concatenate(labels))), shape=(n, L))

    def tokens(t: list[str]) -> tuple[np.ndarray, np.ndarray]:
        enc = tok(t, padding="max_length", truncation=True, max_length=12, return_tensors="np")
        return enc["input_ids"].astype(np.int32), enc["attention_mask"].sum(1).astype(np.int32)

    return path, tokens(texts), tokens(WORDS[:L]), Y


def _margin(encoder, pt, lt, Y) -> float:
    """Mean over labels of (mean sim to its points - mean sim to other points)."""
    P = encode_tokens(encoder, *pt, torch.device("cpu"), None, 64)
    Z = encode_tokens(encoder, *lt, torch.device("cpu"), None, 64)
    S, M = Z @ P.T, Y.T.toarray() > 0
    return float(np.mean([S[j, M[j]].mean() - S[j, ~M[j]].mean() for j in range(len(Z))]))


def _run(tiny, **kw):
    path, pt, lt, Y = tiny
    seed_everything(0)
    enc = load_encoder(str(path))
    params = dataclasses.replace(PretrainParams(), **{
        "sampler": "siamesexml", "loss": "siamesexml", "num_negatives": 2, "batch_size": 8, "chunk_size": 16,
        "warmup_steps": 2, "lr": 2e-3, "amp": "off", **kw})
    before = _margin(enc, pt, lt, Y)
    res = train_siamese(enc, pt, lt, Y, np.arange(54), params, torch.device("cpu"), None)
    return res, before, _margin(enc, pt, lt, Y)


def test_train_siamese_with_label_batches_learns_and_is_deterministic(tiny, one_torch_thread):
    res, before, after = _run(tiny, epochs=10)
    assert res.steps == 10 * math.ceil(12 / 8)  # an epoch = ceil(labels with a train point / batch_size)
    assert res.points > 0 and math.isfinite(res.final_loss)
    assert after > before + 0.05  # labels moved towards their points, away from the others
    again, _, after2 = _run(tiny, epochs=10)
    assert again.final_loss == pytest.approx(res.final_loss, abs=1e-6) and after2 == pytest.approx(after, abs=1e-6)


def test_train_siamese_label_batches_without_centroid_and_with_triplet(tiny, one_torch_thread):
    res, _, _ = _run(tiny, epochs=1, centroid_points=0)
    assert res.steps == 2 and res.points <= 2 * 8  # anchors only (8 per batch), each encoded once
    res, _, _ = _run(tiny, epochs=0.5, loss="triplet")
    assert res.steps == 1 and math.isfinite(res.final_loss)
    # point batches (random sampler) with either loss still run through the same loop
    res, _, _ = _run(tiny, epochs=1, sampler="random", loss="triplet")
    assert res.steps == math.ceil(54 / 8) and res.points == 54
    res, _, _ = _run(tiny, epochs=1, sampler="random")
    assert res.steps == 7 and math.isfinite(res.final_loss)


def test_freeze_layers_trains_only_the_layers_above(tiny, one_torch_thread):
    """pretrain.freeze_layers = 1 on the 2-layer BERT: embeddings and layer 0 end bit-identical, layer 1 moves,
    and the encoder still learns; more layers than the model has, or a bag encoder, is a config error."""
    path, pt, lt, Y = tiny
    start = {k: v.clone() for k, v in load_encoder(str(path)).state_dict().items()}
    seed_everything(0)
    enc = load_encoder(str(path))
    params = dataclasses.replace(PretrainParams(), sampler="random", batch_size=8, chunk_size=16, warmup_steps=2,
                                 lr=2e-3, amp="off", epochs=5, freeze_layers=1)
    before = _margin(enc, pt, lt, Y)
    train_siamese(enc, pt, lt, Y, np.arange(54), params, torch.device("cpu"), None)
    after = enc.state_dict()
    frozen = [k for k in after if ".embeddings." in k or ".layer.0." in k]
    trained = [k for k in after if ".layer.1." in k]
    assert frozen and trained
    assert all(torch.equal(after[k], start[k]) for k in frozen)
    assert sum(not torch.equal(after[k], start[k]) for k in trained) == len(trained)
    assert _margin(enc, pt, lt, Y) > before + 0.02
    with pytest.raises(XCConfigError, match="pretrain.freeze_layers: expected at most the encoder's 2 layers"):
        train_siamese(load_encoder(str(path)), pt, lt, Y, np.arange(54),
                      dataclasses.replace(params, freeze_layers=3), torch.device("cpu"), None)
    with pytest.raises(XCConfigError, match="pretrain.freeze_layers: expected an int >= 0"):
        check_pretrain_params(dataclasses.replace(params, freeze_layers=-1))
    with pytest.raises(XCConfigError, match="pretrain.freeze_layers: BagOfEmbeddingsEncoder"):
        train_siamese(load_encoder("bag:16"), pt, lt, Y, np.arange(54), params, torch.device("cpu"), None)
