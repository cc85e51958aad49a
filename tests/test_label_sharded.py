"""The classifiers with W's label ranges on 2 real gloo ranks under torchrun (xc_dagster/training/label_sharded.py)
against one process: the same W for every hardest-negative pool, both row optimizers and the sampled negatives
(uniform, ASTRA, MIPS-s), checkpoints that 1 process and 2 ranks resume from each other, and a label range that a
step does not touch still counting the step in SparseAdam.

This file, run by torchrun, is the worker; each rank trains the scenarios, rank 0 saves W, and the tests compare.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import scipy.sparse as sp
import torch
import torch.nn.functional as F

import xc_dagster.pipeline.classifier as classifier_stage
from tests.torchrun import run_torchrun
from xc_dagster.catalog import DatasetSpec
from xc_dagster.config import ClassifierParams
from xc_dagster.encoders.bag import create_bag_encoder
from xc_dagster.errors import XCConfigError
from xc_dagster.pipeline.context import StageContext
from xc_dagster.storage import ArtifactStore
from xc_dagster.training.checkpoint import Checkpointer
from xc_dagster.training.classifier import ClassifierTrainer, train_classifiers
from xc_dagster.training.distributed import DistEnv
from xc_dagster.training.end_to_end import EndToEndTrainer, train_end_to_end

CPU = torch.device("cpu")
N, L, D = 240, 37, 16  # 37 labels: ranges of 19 and 18
W_ATOL = 1e-5  # the ranks' score kernels differ from one process's in the last bits only
SCENARIOS = {  # name -> ClassifierParams fields
    "shortlist": dict(negatives="shortlist", w_optimizer="sparse-adam"),
    "both": dict(negatives="both", cluster_size=8, w_optimizer="sparse-adam", normalize=True),
    "in-batch-sgd": dict(negatives="in-batch", cluster_size=8, w_optimizer="sgd", lr=1.0),
    # 2 points a step with 2 positives and 1 negative each: many steps touch one rank's labels only
    "small-batches": dict(negatives="shortlist", w_optimizer="sparse-adam", batch_size=2, num_negatives=1),
}
KEY = "label-sharded-test"
# ASTRA (stale hard negatives from an exact index over W, refreshed every half epoch, no warm-up; dropout on the
# queries; built on the training thread, as several ranks do) and the uniform sampler, through the BCE trainer with a
# frozen encoder
SAMPLED = {
    "astra": dict(negatives="astra", num_hard=3, num_random=5, hard_start=0.0, refresh_every=0.5, refresh_async=False,
                  sampler_index="exact", dropout=0.2, w_optimizer="sgd", lr=0.5, weight_decay=1e-4),
    "uniform": dict(negatives="uniform", num_random=6, w_optimizer="sparse-adam", lr=0.02),
    # MIPS-s: each rank's stale index over its own rows, searched with the fresh query embeddings every step;
    # rebuilt every 6 of an epoch's 8 steps, so a run resumed at epoch 1 searches the checkpoint's indexes first
    "mips": dict(negatives="mips", num_hard=3, num_random=5, refresh_every=0.75, sampler_index="exact",
                 w_optimizer="sgd", lr=0.5),
}


def _data():
    """Points near 1-3 hidden label directions each, noisy label embeddings, each point's 10 nearest labels."""
    g = torch.Generator().manual_seed(0)
    mu = F.normalize(torch.randn(L, D, generator=g), dim=-1)
    rng = np.random.default_rng(0)
    labels = [rng.choice(L, size=int(rng.integers(1, 4)), replace=False) for _ in range(N)]
    X = F.normalize(torch.stack([mu[torch.as_tensor(ls)].sum(0) for ls in labels])
                    + 0.3 * torch.randn(N, D, generator=g), dim=-1).numpy()
    E = F.normalize(mu + 0.9 * torch.randn(L, D, generator=g), dim=-1).numpy()
    r = np.repeat(np.arange(N), [len(ls) for ls in labels])
    Y = sp.csr_matrix((np.ones(len(r), np.float32), (r, np.concatenate(labels))), shape=(N, L))
    return X, E, Y, np.argsort(-(X @ E.T), axis=1)[:, :10]


def _train(name: str, epochs: int, env: DistEnv | None = None, ckpt: Path | None = None):
    X, E, Y, sl = _data()
    params = dataclasses.replace(ClassifierParams(epochs=epochs, batch_size=32, lr=0.02, num_negatives=4,
                                                  num_positives=2), **SCENARIOS[name])
    return train_classifiers(X, E, Y, sl, np.arange(N), params, CPU, env=env,
                             checkpoint=Checkpointer(ckpt, KEY) if ckpt is not None else None)


def _sampled(name: str, env: DistEnv | None = None) -> tuple[np.ndarray | None, np.ndarray | None]:
    """Two epochs of the BCE trainer with sampler ``name``: W (rank 0) and ASTRA's last hard-negative table."""
    X, E, Y, sl = _data()
    params = dataclasses.replace(ClassifierParams(epochs=2, batch_size=32, num_positives=2), **SAMPLED[name])
    trainer = EndToEndTrainer(X, E, E, Y, np.arange(N), params, CPU, shortlist=sl, env=env)
    try:
        for epoch in range(trainer.n_epochs):
            for batch in trainer.epoch_batches(epoch):
                trainer.step(batch)
        return trainer.clf.full(), getattr(trainer.sampler, "table", None)
    finally:
        trainer.close()


VOCAB, T = 300, 12  # the bag encoder trained end to end: its vocabulary and the texts' token width


def _tokens(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.integers(5, VOCAB, (n, T)).astype(np.int32), rng.integers(3, T + 1, n).astype(np.int32)


def _end_to_end_args(env: DistEnv | None) -> tuple[tuple, dict]:
    """ASTRA with the bag encoder trained end to end (no dropout, so that one process and 2 ranks draw nothing
    differently): the trainer's arguments."""
    X, E, Y, sl = _data()
    torch.manual_seed(0)
    encoder = create_bag_encoder(VOCAB, D, dropout=0.0, init="random", seed=0)
    params = dataclasses.replace(ClassifierParams(epochs=2, batch_size=32, num_positives=2), **{
        **SAMPLED["astra"], "dropout": 0.0, "train_encoder": True, "encoder_lr": 1e-2})
    return (X, E, E, Y, np.arange(N), params, CPU), dict(encoder=encoder, point_tokens=_tokens(N, 1),
                                                        label_tokens=_tokens(L, 2), shortlist=sl, env=env)


def _astra_end_to_end(env: DistEnv | None = None) -> tuple[np.ndarray | None, dict[str, np.ndarray]]:
    """2 epochs of ``_end_to_end_args``: W (rank 0) and the encoder's weights."""
    args, kw = _end_to_end_args(env)
    res = train_end_to_end(*args, **kw)
    return res.W, {k: v.detach().numpy().copy() for k, v in kw["encoder"].state_dict().items()}


def _first_step_encoder_gradient(env: DistEnv | None = None) -> np.ndarray:
    """The encoder's gradient of the first step of ``_end_to_end_args`` as it reaches clipping and AdamW (the
    ranks' gradients combined)."""
    args, kw = _end_to_end_args(env)
    trainer, seen = EndToEndTrainer(*args, **kw), []
    clip = torch.nn.utils.clip_grad_norm_

    def record(params, *a, **k):
        params = list(params)
        seen.append(torch.cat([p.grad.reshape(-1) for p in params if p.grad is not None]).numpy().copy())
        return clip(params, *a, **k)

    try:
        trainer.start()
        with mock.patch.object(torch.nn.utils, "clip_grad_norm_", record):
            trainer.step(trainer.epoch_batches(0)[0])
    finally:
        trainer.close()
    return seen[0]


def _residual_args() -> tuple[tuple, torch.nn.Module]:
    """SiameseXML Module IV: W and the bag encoder's residual block (dropout 0.5, the default) trained together by
    the hardest-negative trainer: its arguments and the encoder."""
    X, E, Y, sl = _data()
    torch.manual_seed(0)
    encoder = create_bag_encoder(100, D, init="random", seed=0)
    params = dataclasses.replace(ClassifierParams(epochs=2, batch_size=32, lr=0.02, num_negatives=4,
                                                  num_positives=2), **SCENARIOS["shortlist"], residual_lr=1e-2)
    return (X, E, Y, sl, np.arange(N), params, CPU), encoder


def _residual(env: DistEnv | None = None) -> tuple[np.ndarray | None, dict[str, np.ndarray]]:
    """2 epochs of ``_residual_args``: W (rank 0) and the residual block's weights, with the first step's gradient
    of the block as it reaches Adam (Adam hides a gradient's scale) under ``grad``."""
    args, encoder = _residual_args()
    trainer = ClassifierTrainer(*args, encoder, env=env)
    trainer.start()
    adam, seen = trainer.residual_opt.step, []
    trainer.residual_opt.step = lambda: seen.append(np.concatenate(
        [p.grad.reshape(-1).numpy().copy() for p in encoder.residual.parameters()])) or adam()
    trainer.step(trainer.epoch_batches(0)[0])
    args, encoder = _residual_args()
    W, _ = train_classifiers(*args, encoder=encoder, env=env)
    return W, {"grad": seen[0], **{k: v.detach().numpy().copy() for k, v in encoder.residual.state_dict().items()}}


def _sampled_run(name: str, env: DistEnv | None, ckpt: Path) -> tuple[np.ndarray | None, int]:
    """``train_end_to_end`` with sampler ``name`` for 2 epochs, its epoch-1 checkpoint left in ``ckpt`` (or resumed
    from it)."""
    X, E, Y, sl = _data()
    params = dataclasses.replace(ClassifierParams(epochs=2, batch_size=32, num_positives=2), **SAMPLED[name])
    res = train_end_to_end(X, E, E, Y, np.arange(N), params, CPU, shortlist=sl, env=env,
                           checkpoint=Checkpointer(ckpt, KEY))
    return res.W, res.summary["resumed_from_epoch"]


def _worker(out: Path) -> None:
    torch.set_num_threads(1)
    env = DistEnv.from_env(device="cpu").init(timeout_s=60)
    try:
        for name in SCENARIOS:
            W, summary = _train(name, 2, env)
            assert (W is None) == (env.rank != 0)
            if env.is_main:
                np.save(out / f"{name}.npy", W)
        for name in SAMPLED:
            W, table = _sampled(name, env)
            if env.is_main:
                np.save(out / f"{name}.npy", W)
            if table is not None:
                np.save(out / f"{name}_table_rank{env.rank}.npy", table)
        W, weights = _residual(env)
        if env.is_main:
            np.savez(out / "residual.npz", W=W, **weights)
        W, weights = _astra_end_to_end(env)
        grad = _first_step_encoder_gradient(env)
        if env.is_main:
            np.savez(out / "astra_end_to_end.npz", W=W, **weights)
            np.save(out / "end_to_end_gradient.npy", grad)
        for name in ("astra", "mips"):
            _sampled_run(name, env, out / f"{name}_from_two")  # rank 0 writes the epoch-1 checkpoint
        W, at = _sampled_run("mips", env, out / "mips_from_one")  # resumes the 1 process's epoch-1 checkpoint
        if env.is_main:
            np.save(out / "mips_resumed_by_two.npy", W)
            assert at == 1
        _train("shortlist", 1, env, out / "from_two")  # rank 0 writes the epoch-1 checkpoint
        W, _ = _train("shortlist", 2, env, out / "from_one")  # resumes the 1 process's epoch-1 checkpoint
        if env.is_main:
            np.save(out / "resumed_by_two.npy", W)
        env.barrier()
    finally:
        env.close()


# ----------------------------------------------------------------------------------------------- the fixture

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """One process's W per scenario (and its epoch-1 checkpoint in from_one), then 2 ranks, then one process
    resuming the 2 ranks' epoch-1 checkpoint."""
    out = tmp_path_factory.mktemp("label_sharded")
    one = {name: _train(name, 2)[0] for name in SCENARIOS}
    sampled = {name: _sampled(name) for name in SAMPLED}
    one.update({name: W for name, (W, _) in sampled.items()})
    _train("shortlist", 1, None, out / "from_one")
    _sampled_run("mips", None, out / "mips_from_one")  # leaves its epoch-1 checkpoint
    res_W, res_weights = _residual()
    e2e_W, e2e_weights = _astra_end_to_end()
    e2e_grad = _first_step_encoder_gradient()
    run_torchrun([str(Path(__file__).resolve()), str(out)])
    two = {name: np.load(out / f"{name}.npy") for name in (*SCENARIOS, *SAMPLED)}
    resumed_by_one, _ = _train("shortlist", 2, None, out / "from_two")
    resumed = {name: _sampled_run(name, None, out / f"{name}_from_two") for name in ("astra", "mips")}
    whole = {name: _sampled_run(name, None, out / f"{name}_whole") for name in ("astra", "mips")}  # uninterrupted
    tables = {"one": sampled["astra"][1], **{r: np.load(out / f"astra_table_rank{r}.npy") for r in (0, 1)}}
    return {"one": one, "two": two, "tables": tables, "resumed_by_one": resumed_by_one,
            "sampled_resumed_by_one": resumed, "sampled_whole": whole,
            "mips_resumed_by_two": np.load(out / "mips_resumed_by_two.npy"),
            "resumed_by_two": np.load(out / "resumed_by_two.npy"),
            "end_to_end": {"one": {"W": e2e_W, **e2e_weights}, "two": dict(np.load(out / "astra_end_to_end.npz"))},
            "end_to_end_gradient": (e2e_grad, np.load(out / "end_to_end_gradient.npy")),
            "residual": {"one": {"W": res_W, **res_weights}, "two": dict(np.load(out / "residual.npz"))}}


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_two_label_ranges_train_the_one_process_w(runs, name):
    one, two = runs["one"][name], runs["two"][name]
    X, E, _, _ = _data()
    assert np.abs(one - E).max() > 0.05  # training moved W: the comparison is not of the starting point
    np.testing.assert_allclose(two, one, atol=W_ATOL)


@pytest.mark.parametrize("name", list(SAMPLED))
def test_two_label_ranges_train_the_one_process_w_with_sampled_negatives(runs, name):
    _, E, _, _ = _data()
    assert np.abs(runs["one"][name] - E).max() > 0.05
    np.testing.assert_allclose(runs["two"][name], runs["one"][name], atol=W_ATOL)


def test_two_ranks_train_the_encoder_end_to_end_as_one_process(runs):
    """ASTRA with the encoder trained: each rank embeds its share of the batch, the shares are all-gathered with
    autograd, every rank scores its label range, and the encoder's gradients are summed over the ranks."""
    one, two = runs["end_to_end"]["one"], runs["end_to_end"]["two"]
    assert set(one) == set(two) and len(one) > 1
    torch.manual_seed(0)
    start = create_bag_encoder(VOCAB, D, dropout=0.0, init="random", seed=0).state_dict()
    moved = [k for k, v in start.items() if v.dtype.is_floating_point and np.abs(one[k] - v.numpy()).max() > 1e-3]
    assert moved  # the encoder was trained: the comparison is not of its starting point
    for k in one:
        np.testing.assert_allclose(two[k], one[k], atol=W_ATOL, err_msg=k)
    # AdamW hides a gradient's scale: the first step's gradient itself is one process's (summed, not averaged)
    g_one, g_two = runs["end_to_end_gradient"]
    assert np.abs(g_one).max() > 1e-4
    np.testing.assert_allclose(g_two, g_one, rtol=1e-4, atol=1e-7)


def test_two_ranks_train_the_residual_block_as_one_process(runs):
    """Module IV: every rank runs the block on the whole batch (the same dropout masks: the same seeded draws),
    scores its label range, and the block's gradients are summed over the ranks."""
    one, two = runs["residual"]["one"], runs["residual"]["two"]
    torch.manual_seed(0)
    start = create_bag_encoder(100, D, init="random", seed=0).residual.state_dict()
    assert any(np.abs(one[k] - v.numpy()).max() > 1e-3 for k, v in start.items() if v.dtype.is_floating_point)
    assert set(one) == set(two) and np.abs(one["grad"]).max() > 1e-4
    np.testing.assert_allclose(two["grad"], one["grad"], rtol=1e-4, atol=1e-7)  # summed, not averaged
    for k in one:
        np.testing.assert_allclose(two[k], one[k], atol=W_ATOL, err_msg=k)


def test_the_rank_sharded_astra_table_is_the_one_process_table_without_positives(runs):
    """Each rank searched an index over its own rows; merged by score over the ranks, the hard negatives are the
    ones an index over all of W gives (exact search), the same on both ranks, and never a positive."""
    t = runs["tables"]
    assert t["one"] is not None and (t["one"] >= 0).mean() > 0.9
    np.testing.assert_array_equal(t[0], t["one"])
    np.testing.assert_array_equal(t[1], t["one"])
    _, _, Y, _ = _data()
    rows, cols = np.nonzero(t[0] >= 0)
    assert not np.asarray(Y[rows, t[0][rows, cols]]).any()
    assert (t[0] >= 0).sum() and {int(x) for x in t[0][t[0] >= 0]} & set(range(19, L))  # rank 1's labels too


def test_checkpoints_resume_across_world_sizes(runs):
    for name in ("astra", "mips"):  # 2 ranks' epoch 1, then 1 process
        (resumed, at), (whole, fresh) = runs["sampled_resumed_by_one"][name], runs["sampled_whole"][name]
        assert (at, fresh) == (1, 0)
        np.testing.assert_allclose(resumed, whole, atol=W_ATOL)
    # MIPS-s: 1 process's epoch 1 (one index over all of W), then 2 ranks, each searching it for its own labels
    np.testing.assert_allclose(runs["mips_resumed_by_two"], runs["sampled_whole"]["mips"][0], atol=W_ATOL)
    np.testing.assert_allclose(runs["resumed_by_one"], runs["one"]["shortlist"], atol=W_ATOL)
    np.testing.assert_allclose(runs["resumed_by_two"], runs["one"]["shortlist"], atol=W_ATOL)


if __name__ == "__main__":  # a torchrun rank (see ``runs``)
    _worker(Path(sys.argv[1]))


def test_a_budget_planned_end_to_end_run_is_refused_with_several_ranks(tmp_path):
    """Each rank would time its own steps and plan its own epochs (then wait for the others at a collective)."""
    spec = DatasetSpec("D", str(tmp_path), strategy="astra", overrides={"train.budget_minutes": 30})
    ctx = StageContext(ArtifactStore(tmp_path / "artifacts", remote=None), spec, spec.config(), tmp_path / "cache",
                       device=CPU, stage="classifier")
    with pytest.raises(XCConfigError, match=r"train.budget_minutes: expected 0, or classifier.epochs set explicitly, "
                                            r"with WORLD_SIZE=2 \(the budget's epochs are planned from one process"):
        classifier_stage.run(ctx, env=DistEnv(0, 2, 0, "gloo", CPU))  # refused before any artifact is read
