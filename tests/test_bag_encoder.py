"""The bag-of-embeddings encoder: IDF, TF-IDF pooling, the residual block at init, save/load, training."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from xc_dagster.encoders.bag import (
    BAG_CONFIG_FILE,
    BAG_WEIGHTS_FILE,
    BagOfEmbeddingsEncoder,
    create_bag_encoder,
    fit_idf,
    minilm_word_embeddings,
)
from xc_dagster.encoders.encode import encode_tokens
from xc_dagster.encoders.loading import load_encoder, save_encoder
from xc_dagster.encoders.names import parse_bag_name
from xc_dagster.encoders.tokenizer import load_tokenizer
from xc_dagster.encoders.transformer import SiameseEncoder
from xc_dagster.errors import XCConfigError

V, D = 40, 16


def small(dropout: float = 0.0, seed: int = 0, **kw) -> BagOfEmbeddingsEncoder:
    return create_bag_encoder(V, D, dropout=dropout, special_ids=(0, 1), init="random", seed=seed, **kw)


def batch(rows: list[list[int]], width: int | None = None, pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    width = width or max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = torch.tensor(r)
        mask[i, :len(r)] = 1
    return ids, mask


# ---------------------------------------------------------------------------------------------- idf

def test_fit_idf_hand_computed_three_documents():
    # doc0 = {5, 6, 6}, doc1 = {6, 7} (the 9 after its length is padding), doc2 = {5, 6, 8, 9}
    ids = np.array([[5, 6, 6, 0], [6, 7, 9, 9], [5, 6, 8, 9]])
    lengths = np.array([3, 2, 4])
    idf = fit_idf(ids, lengths, 10, ignore=(0,))
    df = {5: 2, 6: 3, 7: 1, 8: 1, 9: 1, 1: 0}
    for tok, d in df.items():  # ln((1 + N) / (1 + df)) + 1 with N = 3
        assert idf[tok] == pytest.approx(math.log(4 / (1 + d)) + 1, rel=1e-6)
    assert idf[6] == pytest.approx(1.0) and idf[0] == 0.0 and idf.dtype == np.float32
    # two corpora (e.g. points and labels) count like their concatenation
    enc = create_bag_encoder(10, 4, special_ids=(0,), init="random")
    got = enc.fit_idf((ids[:1], lengths[:1]), (ids[1:, :3], lengths[1:].clip(max=3)))
    np.testing.assert_allclose(got, fit_idf(np.array([[5, 6, 6], [6, 7, 9], [5, 6, 8]]), np.array([3, 2, 3]), 10,
                                            ignore=(0,)))
    np.testing.assert_allclose(enc.idf.numpy(), got)


def test_fit_idf_rejects_ids_outside_the_vocabulary():
    with pytest.raises(XCConfigError, match="token ids must lie in"):
        fit_idf(np.array([[1, 12]]), np.array([2]), 10)


def test_tfidf_weights_are_the_l2_normalised_tfidf_vector():
    enc = small()
    enc.idf.copy_(torch.linspace(0.5, 2.0, V))
    enc.idf[0] = enc.idf[1] = 0.0
    ids, mask = batch([[1, 5, 7, 5, 0], [1, 9, 0]])  # 1 = special ([CLS]-like), 0 = [SEP]-like
    w = enc.tfidf_weights(ids, mask)
    i5, i7 = float(enc.idf[5]), float(enc.idf[7])
    norm = math.hypot(2 * i5, i7)  # tf(5) = 2
    torch.testing.assert_close(w[0], torch.tensor([0, i5 / norm, i7 / norm, i5 / norm, 0]))
    torch.testing.assert_close(w[1], torch.tensor([0.0, 1.0, 0.0, 0.0, 0.0]))
    # the pooled vector is E^T x for the normalised tf-idf x
    x = torch.zeros(V)
    x[5], x[7] = 2 * i5 / norm, i7 / norm
    pooled = enc.embedding(ids, per_sample_weights=w)
    torch.testing.assert_close(pooled[0], x @ enc.embedding.weight, atol=1e-6, rtol=1e-5)
    # a text of special tokens only falls back to the mean of its tokens (never a zero vector)
    w_empty = enc.tfidf_weights(*batch([[1, 0]]))
    torch.testing.assert_close(w_empty, torch.tensor([[0.5, 0.5]]))


# ------------------------------------------------------------------------------------------ forward

def test_forward_unit_norm_shape_and_dtype():
    enc = small().eval()
    ids, mask = batch([[1, 3, 4, 0], [1, 5, 0], [1, 0], [1, 7, 7, 7, 8, 0]])
    out = enc(ids, mask)
    assert out.shape == (4, D) and out.dtype == torch.float32 and enc.dim == D
    torch.testing.assert_close(out.norm(dim=1), torch.ones(4))


def test_padding_does_not_change_the_output():
    enc = small().eval()
    rows = [[1, 3, 4, 0], [1, 5, 6, 6, 9, 0]]
    ids, mask = batch(rows)
    wide, wide_mask = batch(rows, width=12)
    wide[:, 6:] = torch.randint(2, V, (2, 6))  # garbage in the padded slots: masked out
    torch.testing.assert_close(enc(ids, mask), enc(wide, wide_mask))
    torch.testing.assert_close(enc(ids[:1, :4], mask[:1, :4]), enc(ids, mask)[:1])  # batch-independent


def test_residual_block_at_init_is_x_plus_relu_x():
    """SiameseXML's block x + Dropout(ReLU(r (SN(W) x + b))) with W = I, b = 0, r = 1 is x + ReLU(x): the
    identity (after normalisation) only for non-negative x. GELU outputs dip below 0, so not in general."""
    enc = small(dropout=0.3)
    block = enc.residual
    h = torch.randn(8, D)
    torch.testing.assert_close(block.linear.weight, torch.eye(D))  # SN(I) = I / sigma(I) = I
    block.eval()
    torch.testing.assert_close(block(h), h + F.relu(h))
    pos = h.abs()
    torch.testing.assert_close(F.normalize(block(pos), dim=-1), F.normalize(pos, dim=-1))
    assert not torch.allclose(F.normalize(block(h), dim=-1), F.normalize(h, dim=-1))
    # train mode: the power iteration keeps sigma(I) = 1; dropout only acts on the ReLU branch
    enc0 = small(dropout=0.0).train()
    torch.testing.assert_close(enc0.residual(h), h + F.relu(h))
    block.train()
    torch.manual_seed(0)
    out = block(h)
    branch = out - h
    kept = branch != 0
    torch.testing.assert_close(branch[kept], (F.relu(h) / 0.7)[kept])
    # end to end: the final embedding is N(x + ReLU(x)) of the paper's intermediate N(GELU(E^T x))
    enc.eval()
    ids, mask = batch([[1, 3, 4, 0]])
    mid = enc.intermediate(ids, mask)
    torch.testing.assert_close(enc(ids, mask), F.normalize(mid + F.relu(mid), dim=-1))


# ---------------------------------------------------------------------------------------- save/load

def test_save_load_round_trip_same_outputs(tmp_path):
    tok = load_tokenizer("bag")
    enc = create_bag_encoder(len(tok), 24, dropout=0.2, special_ids=tok.all_special_ids, init="random", seed=1)
    ids = np.array([[101, 2000, 2001, 2000, 102, 0], [101, 3000, 102, 0, 0, 0]])
    lens = np.array([5, 3])
    enc.fit_idf((ids, lens))
    opt = torch.optim.Adam(enc.parameters(), lr=0.05)  # move every parameter (and the power-iteration u, v)
    t_ids, t_mask = torch.from_numpy(ids), torch.from_numpy((np.arange(6) < lens[:, None]).astype(np.int64))
    for _ in range(3):
        opt.zero_grad()
        (-enc(t_ids, t_mask)[0] @ enc(t_ids, t_mask)[1]).backward()
        opt.step()
    enc.eval()
    save_encoder(enc, tok, tmp_path / "encoder")
    folder = tmp_path / "encoder"
    cfg = json.loads((folder / BAG_CONFIG_FILE).read_text())
    assert cfg["type"] == "bag-of-embeddings" and cfg["vocab_size"] == len(tok) and cfg["dim"] == 24
    assert cfg["dropout"] == 0.2 and (folder / BAG_WEIGHTS_FILE).exists()
    assert not list(folder.glob("*.bin")) + list(folder.glob("*.pt")) + list(folder.glob("*.pkl"))
    back = load_encoder(str(folder), "mean")
    assert isinstance(back, BagOfEmbeddingsEncoder) and not back.training
    torch.testing.assert_close(back(t_ids, t_mask), enc(t_ids, t_mask), rtol=0, atol=0)
    torch.testing.assert_close(back.idf, enc.idf)
    assert load_tokenizer(str(folder))("apple river")["input_ids"] == tok("apple river")["input_ids"]


def test_bad_bag_folder_config_is_a_config_error(tmp_path):
    (tmp_path / BAG_CONFIG_FILE).write_text(json.dumps({"type": "something-else"}))
    with pytest.raises(XCConfigError, match="expected type 'bag-of-embeddings'"):
        load_encoder(str(tmp_path))


def test_names_resolve_and_hf_folders_still_load(tmp_path):
    from tests.tinydata import write_tiny_encoder

    assert parse_bag_name("bag") == 384 and parse_bag_name("bag-of-embeddings:300") == 300
    assert parse_bag_name("minilm") is None and parse_bag_name("/some/bag") is None
    with pytest.raises(XCConfigError, match="bag:<positive int dim>"):
        parse_bag_name("bag:wide")
    with pytest.raises(XCConfigError, match="init: expected"):
        create_bag_encoder(10, 4, init="glove")
    assert load_tokenizer("bag").vocab_size == load_tokenizer("minilm").vocab_size
    enc = load_encoder("bag")  # D = 384: the table starts from MiniLM's input word embeddings
    torch.testing.assert_close(enc.embedding.weight.detach(), minilm_word_embeddings())
    assert enc.dim == 384 and float(enc.idf[101]) == 0.0 and float(enc.idf[2000]) == 1.0
    assert load_encoder("bag:32").dim == 32
    hf = load_encoder(str(write_tiny_encoder(tmp_path / "tiny")), "mean")
    assert isinstance(hf, SiameseEncoder) and hf.dim == 32


def test_encode_tokens_with_the_bag_encoder_and_bf16_autocast():
    enc = small()
    ids = np.array([[1, 3, 4, 0, 0], [1, 5, 6, 7, 0], [1, 8, 0, 0, 0]], dtype=np.int32)
    lens = np.array([4, 5, 3])
    ref = encode_tokens(enc, ids, lens, torch.device("cpu"), None, batch_size=2)
    assert ref.shape == (3, D) and ref.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(ref, axis=1), 1.0, rtol=1e-5)
    t_ids, t_mask = batch([[1, 3, 4, 0], [1, 5, 6, 7, 0], [1, 8, 0]])
    np.testing.assert_allclose(ref, enc(t_ids, t_mask).detach().numpy(), rtol=1e-5, atol=1e-6)
    low = encode_tokens(enc, ids, lens, torch.device("cpu"), torch.bfloat16, batch_size=2)
    np.testing.assert_allclose(low, ref, atol=2e-2)


# ----------------------------------------------------------------------------------------- training

def test_gradients_reach_the_table_and_the_residual():
    enc = small(dropout=0.1).train()
    ids, mask = batch([[1, 3, 4, 0], [1, 5, 0]])
    (enc(ids, mask) * torch.randn(2, D)).sum().backward()
    g = enc.embedding.weight.grad
    used = torch.zeros(V, dtype=torch.bool)
    used[[3, 4, 5]] = True
    assert g[used].abs().sum(1).gt(0).all() and g[~used].abs().sum() == 0  # specials weigh 0
    assert enc.residual.linear.parametrizations.weight.original.grad.abs().sum() > 0
    assert enc.residual.radius.grad is not None and enc.idf.grad is None
    sparse = small(sparse=True).train()
    sparse(ids, mask).sum().backward()
    assert sparse.embedding.weight.grad.is_sparse


def test_contrastive_steps_raise_positive_similarity():
    torch.manual_seed(0)
    enc = small(dropout=0.0, seed=3)
    # point i = tokens {2+i, 12+i}; its label = tokens {22+i, 32+i} (disjoint vocabularies: no overlap at start)
    n = 8
    x_ids, x_mask = batch([[1, 2 + i, 12 + i, 0] for i in range(n)])
    z_ids, z_mask = batch([[1, 22 + i, 32 + i, 0] for i in range(n)])
    opt = torch.optim.Adam(enc.parameters(), lr=0.05)

    def pos_sim() -> float:
        with torch.no_grad():
            return float((enc(x_ids, x_mask) * enc(z_ids, z_mask)).sum(1).mean())

    before = pos_sim()
    enc.train()
    for _ in range(30):
        sim = enc(x_ids, x_mask) @ enc(z_ids, z_mask).T
        loss = F.cross_entropy(sim / 0.1, torch.arange(n))
        opt.zero_grad()
        loss.backward()
        opt.step()
    enc.eval()
    after = pos_sim()
    assert after > before + 0.3 and after > 0.8
