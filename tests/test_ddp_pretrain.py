"""Data-parallel Siamese pretraining (``train_siamese`` with a ``DistEnv``; xc_dagster/training/data_parallel.py)
with 2 real gloo ranks under ``torchrun`` on the CPU, one thread each, against one process with the same global
batches: the NGAME cluster sampler (seeded memory bank, in-batch negatives across the ranks, symmetric loss) with
the bag encoder, SiameseXML's label batches (anchors and centroid points) with a tiny random BERT, grad caching in
chunks of 3; a 2-rank checkpoint resumed by 1 process and a 1-process checkpoint by 2 ranks; a world of one
unchanged.

Dropout is 0 in these encoders: with dropout each rank draws its own masks for its rows, so a data-parallel run
equals one process in distribution only. This file, run by torchrun, is the worker; each rank saves what it
computed and the tests compare it with the single-process runs.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import scipy.sparse as sp
import torch
import torch.distributed as dist
from transformers import BertConfig, BertModel

from tests.torchrun import run_torchrun
from xc_dagster.artifacts import ENCODER, PARAMS, SUMMARY, TRAIN_EMB
from xc_dagster.catalog import Catalog
from xc_dagster.config import PretrainParams
from xc_dagster.encoders.bag import create_bag_encoder
from xc_dagster.encoders.transformer import SiameseEncoder
from xc_dagster.errors import XCConfigError, XCError
from xc_dagster.pipeline import StageContext, run_all
from xc_dagster.storage import ArtifactStore, stage_leftovers
from xc_dagster.training import launch
from xc_dagster.training.checkpoint import Checkpointer
from xc_dagster.training.data_parallel import average_gradients
from xc_dagster.training.distributed import DistEnv
from xc_dagster.training.siamese import SiameseTrainer, train_siamese

CPU = torch.device("cpu")
VOCAB, N, L, T = 300, 45, 12, 12
KEY = "ddp-pretrain-test"
WEIGHT_ATOL = 1e-5  # weights after 6-7 AdamW steps (lr 1e-3): only the gradients' summation order differs
LOSS_RTOL = 1e-5

SCENARIOS = {
    # 2 epochs of clustered batches (clusters of 3 of the seeded bank, then of the bank the training filled),
    # batches of 14-15 points: unequal parts on the two ranks
    "ngame": dict(sampler="ngame", curriculum=(0,), seed_bank=True, max_cluster_size=4, cluster_every=1,
                  symmetric=True, batch_size=14, grad_cache="off"),
    # 2 epochs x 2 batches of 7 labels (4 + 3 per rank), 2 centroid points each, grad-cached in chunks of 3
    "siamesexml": dict(sampler="siamesexml", loss="siamesexml", batch_size=7, centroid_points=2,
                       grad_cache="on", chunk_size=3),
}


def _data():
    """Token ids of N points and L labels (varying lengths) and a label matrix; every point has a label."""
    rng = np.random.default_rng(0)

    def tokens(n: int) -> tuple[np.ndarray, np.ndarray]:
        return rng.integers(5, VOCAB, (n, T)).astype(np.int32), rng.integers(3, T + 1, n).astype(np.int32)

    labels = [rng.choice(L, size=int(rng.integers(1, 4)), replace=False) for _ in range(N)]
    r = np.repeat(np.arange(N), [len(x) for x in labels])
    Y = sp.csr_matrix((np.ones(len(r), np.float32), (r, np.concatenate(labels))), shape=(N, L))
    return tokens(N), tokens(L), Y


def _encoder(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if name == "ngame":  # spectral norm on: its power-iteration buffers follow the forward passes
        return create_bag_encoder(VOCAB, 16, dropout=0.0, init="random", seed=0)
    cfg = BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=64, max_position_embeddings=64, hidden_dropout_prob=0.0,
                     attention_probs_dropout_prob=0.0)
    return SiameseEncoder(BertModel(cfg))


def _params(name: str) -> PretrainParams:
    return dataclasses.replace(PretrainParams(), **{"epochs": 2, "amp": "off", "warmup_steps": 2, "lr": 1e-3,
                                                    "num_negatives": 4, **SCENARIOS[name]})


def _train(name: str, env: DistEnv | None = None, ckpt: Path | None = None) -> dict[str, np.ndarray]:
    """A seeded run of scenario ``name``: the step losses (rank 0), the result's numbers and the encoder's state."""
    pt, lt, Y = _data()
    enc, losses = _encoder(name), []

    def log(step: int, values: dict[str, float]) -> None:
        if "pretrain_loss" in values:
            losses.append(values["pretrain_loss"])

    res = train_siamese(enc, pt, lt, Y, np.arange(N), _params(name), CPU, None, log_metrics=log, log_every=1,
                        checkpoint=Checkpointer(ckpt, KEY) if ckpt is not None else None, env=env)
    out = {"losses": np.array(losses), "final_loss": np.array(res.final_loss),
           "counts": np.array([res.steps, res.points, res.resumed_from_epoch, res.reclusterings])}
    return {**out, **{f"w:{k}": v.detach().numpy().copy() for k, v in enc.state_dict().items()}}


def _one_row_grads(env: DistEnv | None) -> np.ndarray:
    """The encoder's gradient of a loss on the embedding of a batch of ONE point (with 2 ranks rank 1 embeds
    nothing) after ``average_gradients``."""
    pt, lt, Y = _data()
    trainer = SiameseTrainer(_encoder("siamesexml"), pt, lt, Y, np.arange(N), _params("siamesexml"), CPU, None, env)
    trainer.start()
    p = trainer._embed_global(pt, np.array([5]))
    trainer.embedder.backward(p[:, :4].sum() + 0.5 * p[:, 4:9].sum())
    average_gradients(trainer.trainable, trainer.env)
    return torch.cat([q.grad.reshape(-1) for q in trainer.trainable if q.grad is not None]).numpy()


def _save(out: Path, name: str, res: dict[str, np.ndarray]) -> None:
    np.savez(out / f"{name}.npz", **res)


# ------------------------------------------------------------------------------------------------ the worker

def _worker(out: Path) -> None:
    torch.set_num_threads(1)
    env = DistEnv.from_env(device="cpu").init(timeout_s=60)
    r = env.rank
    try:
        _save(out, f"ngame_rank{r}", _train("ngame", env, out / "ckpt2"))
        _save(out, f"siamesexml_rank{r}", _train("siamesexml", env))
        _save(out, f"resumed_rank{r}", _train("ngame", env, out / "ckpt1"))  # written by one process
        np.save(out / f"one_row_rank{r}.npy", _one_row_grads(env))
        q = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2))
        q[0].grad = torch.tensor([2.0, 4.0, 6.0]) if r == 0 else None  # a gradient on rank 0 only, none anywhere
        average_gradients(list(q), env)
        np.save(out / f"averaged_rank{r}.npy", np.array([*q[0].grad.tolist(), q[1].grad is None]))
        try:  # rank 0 finds the checkpoint, rank 1 looks in an empty folder
            _train("ngame", env, out / ("ckpt1" if r == 0 else "empty"))
            message = "no error"
        except XCError as exc:
            message = str(exc)
        (out / f"disagree_rank{r}.txt").write_text(message)
        env.barrier()
    finally:
        env.close()


# ----------------------------------------------------------------------------------------------- the fixture

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _torchrun(args: list[str], env: dict[str, str]) -> str:
    return run_torchrun(args, env)


def _load(path: Path) -> dict[str, np.ndarray]:
    return dict(np.load(path))


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """One process's runs (the references; the ngame one leaves its epoch-1 checkpoint in ckpt1), then 2 ranks
    under torchrun, then one process resuming the 2 ranks' epoch-1 checkpoint."""
    out = tmp_path_factory.mktemp("ddp")
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        one = {"ngame": _train("ngame", None, out / "ckpt1"), "siamesexml": _train("siamesexml"),
               "one_row": _one_row_grads(None)}
    finally:
        torch.set_num_threads(n)
    (out / "empty").mkdir()
    env = dict(os.environ)
    _torchrun([str(Path(__file__).resolve()), str(out)], env)
    shutil.copytree(out / "ckpt2", out / "ckpt2_for_one")
    torch.set_num_threads(1)
    try:
        one["from_two"] = _train("ngame", None, out / "ckpt2_for_one")
    finally:
        torch.set_num_threads(n)
    two = {f"{k}{r}": _load(out / f"{k}_rank{r}.npz") for k in ("ngame", "siamesexml", "resumed") for r in (0, 1)}
    for r in (0, 1):
        two[f"one_row{r}"] = np.load(out / f"one_row_rank{r}.npy")
        two[f"averaged{r}"] = np.load(out / f"averaged_rank{r}.npy")
        two[f"disagree{r}"] = (out / f"disagree_rank{r}.txt").read_text()
    return {"one": one, "two": two, "out": out}


def _assert_same_weights(a: dict[str, np.ndarray], b: dict[str, np.ndarray], atol: float = WEIGHT_ATOL) -> float:
    keys = sorted(k for k in a if k.startswith("w:"))
    assert keys and keys == sorted(k for k in b if k.startswith("w:"))
    worst = max(float(np.abs(a[k].astype(np.float64) - b[k]).max()) for k in keys)
    assert worst <= atol, worst
    return worst


def _moved(res: dict[str, np.ndarray], name: str) -> float:
    start = {f"w:{k}": v.numpy() for k, v in _encoder(name).state_dict().items()}
    return max(float(np.abs(res[k] - start[k]).max()) for k in start)


# ------------------------------------------------------------------------------------------- two real ranks

@pytest.mark.parametrize("name", ["ngame", "siamesexml"])
def test_two_ranks_train_the_one_process_encoder_of_the_global_batch(runs, name):
    """Same step losses, steps, points and weights as one process; both ranks hold the same encoder."""
    one, r0, r1 = runs["one"][name], runs["two"][f"{name}0"], runs["two"][f"{name}1"]
    assert len(one["losses"]) == one["counts"][0] >= 4 and _moved(one, name) > 100 * WEIGHT_ATOL
    np.testing.assert_allclose(r0["losses"], one["losses"], rtol=LOSS_RTOL)
    assert len(r1["losses"]) == 0  # rank 1 logs nothing
    assert float(r1["final_loss"]) == float(r0["final_loss"])
    for res in (r0, r1):
        assert res["counts"].tolist() == one["counts"].tolist()
        _assert_same_weights(one, res)
    for k in (k for k in r0 if k.startswith("w:")):
        np.testing.assert_array_equal(r0[k], r1[k])  # the ranks applied the same update, bit for bit


def test_ngame_clusters_on_both_ranks_as_in_one_process(runs):
    one = runs["one"]["ngame"]
    assert one["counts"][3] == 2  # clustered at both epochs (seeded bank, then the bank the training filled)
    assert runs["two"]["ngame0"]["counts"][3] == 2


def test_a_two_rank_checkpoint_resumes_with_one_process_and_back(runs):
    """ckpt2 (epoch 1, written by rank 0 of 2) resumed by one process, ckpt1 (one process) resumed by 2 ranks:
    both end at the uninterrupted run's weights."""
    one, from_two = runs["one"]["ngame"], runs["one"]["from_two"]
    assert from_two["counts"][2] == 1 and from_two["counts"][0] == one["counts"][0]
    _assert_same_weights(one, from_two)
    np.testing.assert_allclose(from_two["losses"], one["losses"][-len(from_two["losses"]):], rtol=LOSS_RTOL)
    for r in (0, 1):
        resumed = runs["two"][f"resumed{r}"]
        assert resumed["counts"].tolist()[:3] == [one["counts"][0], one["counts"][1], 1]
        _assert_same_weights(one, resumed)
    assert (runs["out"] / "ckpt2" / "state.pt").is_file() and not list((runs["out"] / "empty").iterdir())


def test_a_rank_without_rows_still_joins_the_step(runs):
    """A global batch of one point: rank 1 embeds nothing, the encoder's gradient is still one process's."""
    np.testing.assert_allclose(runs["two"]["one_row0"], runs["one"]["one_row"], atol=1e-6)
    np.testing.assert_array_equal(runs["two"]["one_row0"], runs["two"]["one_row1"])


def test_gradients_are_averaged_and_missing_ones_stay_none(runs):
    for r in (0, 1):
        assert runs["two"][f"averaged{r}"].tolist() == [1.0, 2.0, 3.0, 1.0]


def test_ranks_that_found_different_checkpoints_stop_with_an_error(runs):
    for r in (0, 1):
        msg = runs["two"][f"disagree{r}"]
        assert "the checkpoint resumed from in" in msg and "differs between the ranks" in msg, msg
        assert "{0: 1, 1: -1}" in msg


# --------------------------------------------------------------------------- the launched pretrain stage

def _no_dropout_bert(folder: Path) -> Path:
    """The tiny random BERT of tests/tinydata.py with dropout 0 (with dropout, ranks draw their own masks)."""
    from transformers import AutoTokenizer  # noqa: PLC0415  (as tests/tinydata.py: loaded only here)

    from xc_dagster.encoders.names import resolve_encoder_path  # noqa: PLC0415

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(resolve_encoder_path("minilm"))
    cfg = BertConfig(vocab_size=tok.vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=64, max_position_embeddings=128, hidden_dropout_prob=0.0,
                     attention_probs_dropout_prob=0.0)
    BertModel(cfg).save_pretrained(folder, safe_serialization=True)
    tok.save_pretrained(folder)
    return folder


def test_the_launched_pretrain_stage_trains_with_two_ranks_and_rank_0_writes(tmp_path, monkeypatch):
    """``torchrun -m xc_dagster.training.launch`` with 2 ranks: the stage's artifacts equal one process's,
    written once (by rank 0), recorded, its checkpoint cleared; another stage is refused with WORLD_SIZE 2."""
    from tests.tinydata import tiny_lf_home  # noqa: PLC0415  (keeps dagster out of the torchrun ranks' imports)

    overrides = {"pretrain.epochs": 2, "pretrain.batch_size": 16, "pretrain.chunk_size": 8, "pretrain.lr": 1e-3,
                 "pretrain.warmup_steps": 2, "pretrain.amp": "off", "pretrain.grad_cache": "on"}
    home = tiny_lf_home(tmp_path, monkeypatch, overrides, encoder=_no_dropout_bert(tmp_path / "bert"))
    spec = Catalog(home.catalog).get("TinyTitles")
    store, cfg = ArtifactStore(home.artifacts), spec.config()
    ctx = StageContext(store, spec, cfg, home.cache, device=CPU)
    one = run_all(ctx, ("ingest", "tokenize", "pretrain"))["pretrain"]
    stage = store.stage_dir(spec.name, "pretrain")
    want, first = np.load(stage / TRAIN_EMB), os.readlink(stage)

    payload = launch.LaunchRequest("pretrain", spec, cfg, "cpu", 1).payload()
    log = _torchrun(["-m", launch.MODULE, "--payload", payload], {**os.environ, "XC_HOME": str(home.root)})
    assert "rank 1 of 2 launched" in log and "rank 0 of 2 launched" in log
    summary = json.loads((stage / SUMMARY).read_text())
    assert summary["world_size"] == 2 and summary["steps"] == one["steps"] and summary["points"] == one["points"]
    assert summary["final_loss"] == pytest.approx(one["final_loss"], rel=1e-5)
    assert os.readlink(stage) != first and (stage / PARAMS).is_file() and (stage / ENCODER).is_dir()
    np.testing.assert_allclose(np.load(stage / TRAIN_EMB), want, atol=1e-5)
    versions = [d.name for d in stage.parent.iterdir() if d.name.startswith("pretrain") and not d.is_symlink()]
    assert len(versions) <= 2, versions  # the in-process run's and rank 0's: rank 1 wrote none
    assert stage_leftovers(stage) == [] and not ctx.checkpoint_dir("pretrain").exists()

    other = json.dumps({"stage": "index"})  # refused before the payload is read further
    with pytest.raises(XCConfigError, match=r"WORLD_SIZE = 2: only the pretrain stage \(data parallel\) and the "
                                            r"classifier stage \(W's label ranges over the ranks\) train with "
                                            r"several processes; the others run in one; the payload's stage is "
                                            r"'index'"):
        launch.read_request(other, {"WORLD_SIZE": "2", "RANK": "1"})


def test_the_launched_astra_classifier_stage_trains_the_encoder_with_two_ranks(tmp_path, monkeypatch):
    """``torchrun -m xc_dagster.training.launch`` with 2 ranks for the ``astra`` strategy's classifier stage (W's
    label ranges over the ranks, the encoder trained end to end, data parallel): its W and re-encoded embeddings
    equal one process's (no dropout, no AMP, the hard-negative table built at its own step in both)."""
    from tests.tinydata import tiny_lf_home  # noqa: PLC0415  (keeps dagster out of the torchrun ranks' imports)

    overrides = {"classifier.epochs": 1, "classifier.batch_size": 16, "classifier.num_hard": 3,
                 "classifier.num_random": 5, "classifier.sampler_index": "exact", "classifier.hard_start": 0.0,
                 "classifier.refresh_every": 0.5, "classifier.refresh_async": False, "pretrain.amp": "off",
                 "train.budget_minutes": 0, "mining.shortlist_size": 8, "index.shortlist_size": 8}
    home = tiny_lf_home(tmp_path, monkeypatch, overrides, encoder=_no_dropout_bert(tmp_path / "bert"))
    spec = dataclasses.replace(Catalog(home.catalog).get("TinyTitles"), strategy="astra")
    store, cfg = ArtifactStore(home.artifacts), spec.config()
    assert cfg.classifier.train_encoder and cfg.classifier.negatives == "astra"
    one = run_all(StageContext(store, spec, cfg, home.cache, device=CPU),
                  ("ingest", "tokenize", "pretrain", "mining", "classifier"))["classifier"]
    stage = store.stage_dir(spec.name, "classifier")
    want = {f: np.load(stage / f) for f in ("W.npy", TRAIN_EMB)}
    moved = np.abs(want[TRAIN_EMB] - np.load(store.stage_dir(spec.name, "pretrain") / TRAIN_EMB)).max()

    payload = launch.LaunchRequest("classifier", spec, cfg, "cpu", 1).payload()
    _torchrun(["-m", launch.MODULE, "--payload", payload], {**os.environ, "XC_HOME": str(home.root)})
    summary = json.loads((stage / SUMMARY).read_text())
    assert summary["world_size"] == 2 and summary["steps"] == one["steps"] and summary["train_encoder"]
    assert moved > 1e-3  # the encoder was trained: its embeddings are not the pretrained ones
    # measured: 9e-8 (embeddings, which moved 1e-2) and 8e-7 (W); the tolerances leave room for other CPUs' kernels
    np.testing.assert_allclose(np.load(stage / TRAIN_EMB), want[TRAIN_EMB], atol=1e-5)
    np.testing.assert_allclose(np.load(stage / "W.npy"), want["W.npy"], atol=1e-5)


# ------------------------------------------------------------------------------------ without processes

def test_a_world_of_one_is_the_single_process_run_bit_for_bit():
    a, b = _train("siamesexml"), _train("siamesexml", DistEnv())
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])


def test_several_ranks_without_a_process_group_are_refused():
    pt, lt, Y = _data()
    with pytest.raises(XCError, match=r"rank 1 of 2: the torch.distributed process group is not up"):
        SiameseTrainer(_encoder("ngame"), pt, lt, Y, np.arange(N), _params("ngame"), CPU, None, DistEnv(1, 2))
    assert not dist.is_initialized()


if __name__ == "__main__":  # a torchrun rank (see ``runs``)
    _worker(Path(sys.argv[1]))
