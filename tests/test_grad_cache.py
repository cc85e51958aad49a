"""Gradient caching (xc_dagster.training.grad_cache) and the step memory plan (xc_dagster.training.memory):
a grad-cached step gives the encoder the plain backward's gradients (dropout on), for point batches, SiameseXML
label batches and the end-to-end loss; seeded runs end at the same weights; too little memory is a config error
that names the fields."""

from __future__ import annotations

import copy
import dataclasses

import numpy as np
import pytest
import scipy.sparse as sp
import torch
from transformers import BertConfig, BertModel

from xc_dagster.config import EndToEndTrainerParams, PretrainParams
from xc_dagster.encoders.bag import create_bag_encoder
from xc_dagster.encoders.transformer import SiameseEncoder
from xc_dagster.errors import XCConfigError
from xc_dagster.training import memory, siamese
from xc_dagster.training.end_to_end import EndToEndTrainer
from xc_dagster.training.grad_cache import StepEmbedder
from xc_dagster.training.memory import EncoderShape, plan_step_memory, predict_step_memory
from xc_dagster.training.siamese import SiameseTrainer, train_siamese

CPU = torch.device("cpu")
VOCAB, N, L, T = 300, 48, 12, 16
# fp32: the two backward passes differ only in the order the chunks' gradients are summed; absolute below 1,
# relative to the tensor's largest entry above (the token-type embedding's gradient sums every token: ~300)
GRAD_TOL = 1e-5
WEIGHT_ATOL = 1e-5  # after a seeded run of 12 AdamW steps


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def tiny_bert(seed: int = 0) -> SiameseEncoder:
    """A 2-layer, 32-wide random BERT with dropout on (0.1 on hidden states and attention probabilities)."""
    torch.manual_seed(seed)
    cfg = BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=64, max_position_embeddings=64, hidden_dropout_prob=0.1,
                     attention_probs_dropout_prob=0.1)
    return SiameseEncoder(BertModel(cfg))


@pytest.fixture(scope="module")
def data():
    """Token ids of N points and L labels (lengths vary, so chunks pad differently) and a label matrix."""
    rng = np.random.default_rng(0)

    def tokens(n: int) -> tuple[np.ndarray, np.ndarray]:
        return (rng.integers(5, VOCAB, (n, T)).astype(np.int32), rng.integers(3, T + 1, n).astype(np.int32))

    labels = [rng.choice(L, size=int(rng.integers(1, 4)), replace=False) for _ in range(N)]
    r = np.repeat(np.arange(N), [len(x) for x in labels])
    Y = sp.csr_matrix((np.ones(len(r), np.float32), (r, np.concatenate(labels))), shape=(N, L))
    return tokens(N), tokens(L), Y


def encoder_grads(encoder: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: p.grad.detach().clone() for k, p in encoder.named_parameters() if p.grad is not None}


def grad_error(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The largest difference of two gradients, per tensor in units of max(1, its largest entry)."""
    assert a.keys() == b.keys() and len(a) > 3
    return max(float((a[k] - b[k]).abs().max()) / max(1.0, float(a[k].abs().max())) for k in a)


def assert_same_grads(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert grad_error(a, b) <= GRAD_TOL, grad_error(a, b)
    assert max(float(g.abs().max()) for g in a.values()) > 100 * GRAD_TOL  # the gradients are not all ~0


def pretrain_trainer(data, mode: str, **kw) -> SiameseTrainer:
    pt, lt, Y = data
    params = dataclasses.replace(PretrainParams(), **{"batch_size": 16, "chunk_size": 5, "amp": "off",
                                                      "num_negatives": 4, "grad_cache": mode, "warmup_steps": 2,
                                                      "lr": 1e-3, **kw})
    trainer = SiameseTrainer(tiny_bert(), pt, lt, Y, np.arange(N), params, CPU, None)
    trainer.start()
    return trainer


def one_backward(trainer, batch) -> tuple[float, dict[str, torch.Tensor], torch.Tensor]:
    """The step's loss and encoder gradients (no optimizer step), and the next draw of torch's generator."""
    torch.manual_seed(1)
    loss = trainer.batch_loss(batch)
    trainer.embedder.backward(loss)
    return float(loss.detach()), encoder_grads(trainer.encoder), torch.rand(3)


@pytest.mark.parametrize("sampler", ["random", "siamesexml"])
def test_grad_cached_pretraining_step_equals_the_plain_backward(data, sampler):
    """Point batches (random sampler, symmetric loss) and SiameseXML label batches (anchors + 2-point centroids,
    points drawn twice gathered): the same loss, encoder gradients to 1e-5, the RNG left where a plain step
    leaves it."""
    extra = {"symmetric": True} if sampler == "random" else {"loss": "siamesexml", "batch_size": 8}
    plain, cached = (pretrain_trainer(data, mode, sampler=sampler, **extra) for mode in ("off", "on"))
    assert not plain.memory.grad_cache and cached.memory.grad_cache
    batch = plain.epoch_batches(0)[0]
    assert repr(batch) == repr(cached.epoch_batches(0)[0])
    loss_a, grads_a, next_a = one_backward(plain, batch)
    loss_b, grads_b, next_b = one_backward(cached, batch)
    assert loss_b == pytest.approx(loss_a, abs=1e-6)
    assert_same_grads(grads_a, grads_b)
    assert torch.equal(next_a, next_b)


def test_the_ngame_memory_bank_records_the_same_embeddings(data):
    """What the sampler observes from the forward pass (NGAME's memory bank) is the same with grad caching."""
    plain, cached = (pretrain_trainer(data, mode, sampler="ngame", epochs=2) for mode in ("off", "on"))
    for trainer in (plain, cached):
        torch.manual_seed(1)
        for batch in trainer.epoch_batches(0)[:2]:
            trainer.step(batch)
    assert np.abs(plain.sampler.bank).sum() > 0
    np.testing.assert_allclose(plain.sampler.bank, cached.sampler.bank, atol=1e-5)


def test_a_seeded_pretraining_run_with_grad_caching_ends_at_the_same_weights(data):
    """4 epochs x 3 steps of AdamW with dropout: the weights agree to 1e-5 (rounding in the gradients' sums
    only), and so does the final loss."""
    pt, lt, Y = data
    out = {}
    for mode in ("off", "on"):
        torch.manual_seed(0)
        enc = tiny_bert()
        params = dataclasses.replace(PretrainParams(), batch_size=16, chunk_size=5, amp="off", epochs=4,
                                     warmup_steps=2, lr=1e-3, grad_cache=mode)
        res = train_siamese(enc, pt, lt, Y, np.arange(N), params, CPU, None)
        assert res.memory["grad_cache"] is (mode == "on")
        out[mode] = (res, enc.state_dict())
    (res_a, w_a), (res_b, w_b) = out["off"], out["on"]
    assert res_a.steps == res_b.steps == 12
    assert res_b.final_loss == pytest.approx(res_a.final_loss, abs=1e-5)
    assert max(float((w_a[k].float() - w_b[k].float()).abs().max()) for k in w_a) <= WEIGHT_ATOL


def e2e_trainer(data, mode: str) -> EndToEndTrainer:
    pt, lt, Y = data
    rng = np.random.default_rng(1)
    point_emb, label_emb = (rng.standard_normal((n, 32)).astype(np.float32) for n in (N, L))
    params = dataclasses.replace(EndToEndTrainerParams(), train_encoder=True, negatives="uniform", num_random=6,
                                 num_positives=2, label_points=True, batch_size=16, chunk_size=5, dropout=0.3,
                                 grad_cache=mode, normalize=False)
    return EndToEndTrainer(point_emb, label_emb, label_emb.copy(), Y, np.arange(N), params, CPU,
                           encoder=tiny_bert(), point_tokens=pt, label_tokens=lt, dtype=None)


def test_grad_cached_end_to_end_step_equals_the_plain_backward(data):
    """ASTRA / MIPS-s's stage: point and label texts in one batch, dropout on the query embedding in the loss
    (drawn between the forward and the re-forward): same loss, encoder and bias gradients to 1e-5."""
    plain, cached = e2e_trainer(data, "off"), e2e_trainer(data, "on")
    assert cached.memory.grad_cache and not plain.memory.grad_cache
    batch = plain.epoch_batches(0)[0]
    assert (batch == cached.epoch_batches(0)[0]).all() and (plain.src[batch] < 0).any()
    loss_a, grads_a, next_a = one_backward(plain, batch)
    loss_b, grads_b, next_b = one_backward(cached, batch)
    assert loss_b == pytest.approx(loss_a, abs=1e-6)
    assert_same_grads(grads_a, grads_b)
    assert float((plain.bias.grad - cached.bias.grad).abs()) <= GRAD_TOL
    assert torch.equal(next_a, next_b)
    assert float(plain.update(plain.batch_loss(batch))) > 0  # the full step runs (optimizers, sampler)
    cached.update(cached.batch_loss(batch))


def test_the_bag_encoder_re_forward_sees_the_same_dropout_and_spectral_norm_vectors():
    """The bag encoder's residual dropout (0.5) and spectral norm (a power iteration per training forward,
    buffers): gradients and the buffers after the step equal the plain step's."""
    rng = np.random.default_rng(0)
    ids, lens = rng.integers(5, 200, (40, T)).astype(np.int32), rng.integers(3, T + 1, 40).astype(np.int32)
    rows, out = rng.permutation(40)[:30], []
    for cached in (False, True):
        enc = create_bag_encoder(200, 16, init="random", seed=0)
        enc.train()
        torch.manual_seed(1)
        emb = StepEmbedder(enc, CPU, None, 7, cached)
        p, z = emb.embed(ids, lens, rows[:15]), emb.embed(ids, lens, rows[15:])
        emb.backward(torch.logsumexp(p @ z.T / 0.1, 1).mean())
        out.append((encoder_grads(enc), {k: b.clone() for k, b in enc.named_buffers()}))
    (g_a, b_a), (g_b, b_b) = out
    assert grad_error(g_a, g_b) <= GRAD_TOL
    assert all(torch.equal(b_a[k], b_b[k]) for k in b_a)


class AutocastProbe(torch.nn.Module):
    """An encoder that records the autocast state of every forward call."""

    def __init__(self, inner: torch.nn.Module):
        super().__init__()
        self.inner, self.seen = inner, []

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        self.seen.append((torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"), torch.is_grad_enabled()))
        return self.inner(ids, mask)


def test_the_re_forward_runs_under_the_steps_autocast(data):
    """bf16 autocast in the no-grad forward and in the re-forward with autograd alike."""
    pt, _, _ = data
    probe = AutocastProbe(tiny_bert())
    probe.train()
    emb = StepEmbedder(probe, CPU, torch.bfloat16, 5, cached=True)
    x = emb.embed(*pt, np.arange(12))
    emb.backward(x.float().pow(2).sum())
    assert len(probe.seen) == 2 * 3
    assert all(on and dt == torch.bfloat16 for on, dt, _ in probe.seen)
    assert [g for _, _, g in probe.seen] == [False] * 3 + [True] * 3
    assert probe.inner.transformer.embeddings.word_embeddings.weight.grad is not None


MINILM = EncoderShape(hidden=384, layers=6, heads=12, intermediate=1536, trainable=22_700_000)


def test_the_memory_plan_picks_grad_caching_and_the_largest_chunk_that_fits():
    groups = [(1600, 256, 256.0), (1600, 32, 20.0)]  # NGAME's paper batch: long points, short labels
    assert predict_step_memory(MINILM, groups, 64, None, True) < predict_step_memory(MINILM, groups, 128, None, True)
    plain = predict_step_memory(MINILM, groups, 128, None, False)
    assert plain > 10 * predict_step_memory(MINILM, groups, 128, None, True)
    roomy = plan_step_memory(MINILM, groups, None, "auto", 128, int(4 * plain), {})
    assert not roomy.grad_cache and roomy.chunk_size == 128
    gib = 2 ** 30
    tight = plan_step_memory(MINILM, groups, None, "auto", 128, 8 * gib, {})
    assert tight.grad_cache and 1 <= tight.chunk_size < 128
    budget = memory.STEP_MEMORY_SHARE * 8 * gib
    assert predict_step_memory(MINILM, groups, tight.chunk_size, None, True) <= budget
    assert predict_step_memory(MINILM, groups, tight.chunk_size + 1, None, True) > budget
    assert plan_step_memory(MINILM, groups, None, "on", 128, int(4 * plain), {}).grad_cache


def test_too_little_memory_is_a_config_error_naming_the_fields(data, monkeypatch):
    """Not even a one-text chunk fits: the trainer refuses at its start, naming chunk_size, batch_size, max_len
    and the predicted and available memory; with grad caching off the whole batch must fit."""
    monkeypatch.setattr(siamese, "available_memory", lambda device: 64 * 1024)
    with pytest.raises(XCConfigError) as err:
        pretrain_trainer(data, "auto")
    msg = str(err.value)
    for name in ("pretrain.chunk_size=5", "pretrain.batch_size=16", f"tokenize.max_len={T}", "GiB available",
                 "predicted to need"):
        assert name in msg, msg
    shape, groups = EncoderShape.of(tiny_bert()), [(16, T, T), (16, T, T)]
    one_text, plain = (predict_step_memory(shape, groups, 1, None, cached) for cached in (True, False))
    assert plain > one_text
    between = (one_text + plain) / 2 / memory.STEP_MEMORY_SHARE  # one-text chunks fit, the whole batch does not
    monkeypatch.setattr(siamese, "available_memory", lambda device: int(between))
    with pytest.raises(XCConfigError, match="grad caching off.*or set pretrain.grad_cache=auto"):
        pretrain_trainer(data, "off")
    assert pretrain_trainer(data, "auto").memory.grad_cache
    monkeypatch.setattr(memory, "available_memory", lambda device: 64 * 1024)
    with pytest.raises(XCConfigError, match="classifier.chunk_size=5, classifier.batch_size=16"):
        e2e_trainer(data, "on")


def test_grad_cache_must_be_a_known_mode(data):
    with pytest.raises(XCConfigError, match="pretrain.grad_cache"):
        pretrain_trainer(data, "sometimes")
    with pytest.raises(XCConfigError, match="classifier.grad_cache"):
        e2e_trainer(data, "yes")


def test_available_memory_takes_the_smaller_of_meminfo_and_the_cgroup_headroom(tmp_path, monkeypatch):
    (tmp_path / "memory.max").write_text("4294967296\n")
    (tmp_path / "memory.current").write_text(str(3 * 2 ** 30) + "\n")
    (tmp_path / "memory.stat").write_text(f"anon 1\ninactive_file {2 ** 30}\n")
    monkeypatch.setattr(memory, "CGROUP_V2", tmp_path)
    monkeypatch.setattr(memory, "CGROUP_V1", tmp_path / "absent")
    assert memory.cgroup_headroom() == 2 * 2 ** 30  # limit 4 GiB - working set (3 GiB used - 1 GiB cache)
    monkeypatch.setattr(memory, "mem_available", lambda: 5 * 2 ** 30)
    assert memory.available_memory(CPU) == 2 * 2 ** 30
    (tmp_path / "memory.max").write_text("max\n")
    assert memory.cgroup_headroom() is None and memory.available_memory(CPU) == 5 * 2 ** 30


def test_encoder_shape_of_a_transformer_and_of_the_bag_encoder():
    enc = tiny_bert()
    shape = EncoderShape.of(enc)
    assert (shape.hidden, shape.layers, shape.heads, shape.intermediate) == (32, 2, 2, 64)
    assert shape.trainable == sum(p.numel() for p in enc.parameters())
    bag = EncoderShape.of(create_bag_encoder(200, 16, init="random", seed=0))
    assert (bag.hidden, bag.layers) == (16, 0)
    frozen = copy.deepcopy(enc)
    frozen.freeze_bottom(1)
    assert EncoderShape.of(frozen).trainable < shape.trainable
