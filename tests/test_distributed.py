"""torch.distributed building blocks (xc_dagster.training.distributed): two real ranks (torchrun, gloo on CPU)
give the same values and gradients as one process with the whole batch.

The two-rank checks share one torchrun launch (module fixture ``two_ranks``): this file, run as a script by
torchrun, is the worker; each rank saves what it computed and the tests compare it with single-process references.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.torchrun import run_torchrun
from xc_dagster.errors import XCConfigError
from xc_dagster.training.distributed import (
    DistEnv,
    RankShardedW,
    all_reduce_sum,
    gather_with_grad,
    label_range,
    rank_rows,
    rank_slice,
    sharded_bce_loss,
)
from xc_dagster.training.losses import masked_bce_loss
from xc_dagster.training.sharded import ShardedClassifier, ShardedOptimizer

LR, WD = 0.5, 0.1


@dataclass
class Problem:
    X: np.ndarray  # (6, 4) queries of the global batch
    W0: np.ndarray  # (11, 4) classifier rows
    pos: np.ndarray  # (6, 2) positive label ids, -1 = padding
    cand: np.ndarray  # (6, 4) candidate label ids (positives first), -1 = padding
    G: np.ndarray  # (5, 4) rows for the all-gather check (3 on rank 0, 2 on rank 1)


def _problem() -> Problem:
    rng = np.random.default_rng(7)
    L, D, N, K = 11, 4, 6, 4
    X = rng.normal(size=(N, D)).astype(np.float32)
    W0 = rng.normal(scale=0.5, size=(L, D)).astype(np.float32)
    pos = np.full((N, 2), -1, dtype=np.int64)
    cand = np.full((N, K), -1, dtype=np.int64)
    for i in range(N):
        labels = rng.permutation(L)
        n_pos = 1 + i % 2
        pos[i, :n_pos] = labels[:n_pos]
        n_cand = K - (i == 4)  # query 4 has a padded candidate slot
        cand[i, :n_cand] = labels[:n_cand]
    return Problem(X, W0, pos, cand, rng.normal(size=(5, D)).astype(np.float32))


def _is_pos(cand: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    return (cand.unsqueeze(-1) == pos.unsqueeze(-2)).any(-1) & (cand >= 0)


def _dense_bce_step(p: Problem) -> tuple[float, np.ndarray, np.ndarray]:
    """Plain torch on the full W: (loss, gradient w.r.t. every query, W after SGD with lazy weight decay)."""
    W = torch.tensor(p.W0, requires_grad=True)
    X = torch.tensor(p.X, requires_grad=True)
    cand, pos = torch.tensor(p.cand), torch.tensor(p.pos)
    valid = cand >= 0
    logits = (X.unsqueeze(1) * W[cand.clamp_min(0)]).sum(-1)
    loss = F.binary_cross_entropy_with_logits(logits, _is_pos(cand, pos).float(), reduction="none")[valid].sum()
    loss.backward()
    touched = cand[valid].unique()
    W_new = W.detach().clone()
    W_new[touched] -= LR * (W.grad[touched] + WD * W.detach()[touched])
    return loss.item(), X.grad.numpy(), W_new.numpy()


def _gather_loss(x: torch.Tensor, x_all: torch.Tensor, world: int) -> torch.Tensor:
    """A rank's part of an in-batch loss over the global batch (its rows against every row) plus a term every
    rank computes in full, divided by the world (the all-gather's backward sums the ranks' gradients)."""
    return torch.logsumexp(x @ x_all.T, 1).sum() + (x_all ** 3).sum() / world


def _one_rank_trained_w(p: Problem) -> np.ndarray:
    env = DistEnv()
    W = RankShardedW.from_full(p.W0, env)
    loss = sharded_bce_loss(W, torch.tensor(p.X), torch.tensor(p.pos), torch.tensor(p.cand), env)
    loss.local.backward()
    W.sgd_update(LR, WD)
    return W.consolidate()


# ------------------------------------------------------------------------------------------------ the worker

def _worker(out: Path) -> None:
    torch.manual_seed(0)
    p = _problem()
    env = DistEnv.from_env(device="cpu").init(timeout_s=60)
    r, world = env.rank, env.world_size
    res = {"env": np.array([r, world, env.local_rank, env.is_main, env.backend == "gloo"])}
    try:
        x = torch.tensor(p.G[rank_slice(len(p.G), r, world)], requires_grad=True)
        x_all = gather_with_grad(x)
        _gather_loss(x, x_all, world).backward()
        res.update(gather_values=x_all.detach().numpy(), gather_grad=x.grad.numpy())

        part = rank_slice(len(p.X), r, world)
        W = RankShardedW.from_full(p.W0, env)
        x = torch.tensor(p.X[part], requires_grad=True)
        loss = sharded_bce_loss(W, x, torch.tensor(p.pos[part]), torch.tensor(p.cand[part]), env)
        loss.local.backward()
        W.sgd_update(LR, WD)
        res.update(bce_total=loss.total.numpy(), bce_local=loss.local.detach().numpy(), bce_grad=x.grad.numpy(),
                   block=W.weight.numpy(), range=np.array([W.lo, W.hi]))
        full = W.consolidate()

        W1 = np.load(out / "w1.npy")
        lo, hi = label_range(len(W1), r, world)
        res.update(from_one_rank=RankShardedW.from_full(W1, env).weight.numpy(),
                   from_block=RankShardedW(W1[lo:hi], len(W1), env).weight.numpy())
        one_label = RankShardedW.from_full(np.arange(3, dtype=np.float32).reshape(1, 3), env)
        res["one_label_rows"] = np.array([one_label.lo, one_label.hi])
        one_full = one_label.consolidate()
        res["none_off_main"] = np.array([full is None, one_full is None])
        if full is not None:
            res.update(consolidated=full, one_label_full=one_full)
        env.barrier()
    finally:
        env.close()
    res["closed"] = np.array(not dist.is_initialized())
    np.savez(out / f"rank{r}.npz", **res)


# ----------------------------------------------------------------------------------------------- the fixture

@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("two_ranks")
    np.save(out / "w1.npy", _one_rank_trained_w(_problem()))
    run_torchrun([str(Path(__file__).resolve()), str(out)])
    return {"W1": np.load(out / "w1.npy"), **{r: dict(np.load(out / f"rank{r}.npz")) for r in (0, 1)}}


# ------------------------------------------------------------------------------------ checks without processes

@pytest.mark.parametrize("n", [0, 1, 7])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_rank_rows_split_the_batch_in_order_without_overlap(n, world):
    batch = np.arange(100, 100 + n)
    parts = [rank_rows(batch, r, world) for r in range(world)]
    assert np.array_equal(np.concatenate(parts), batch)
    assert [len(q) for q in parts] == [len(q) for q in np.array_split(batch, world)]
    assert max(map(len, parts)) - min(map(len, parts)) <= 1
    assert [rank_rows(list(batch), r, world) for r in range(world)] == [list(q) for q in parts]
    assert torch.equal(torch.cat([rank_rows(torch.tensor(batch), r, world) for r in range(world)]),
                       torch.tensor(batch))
    with pytest.raises(ValueError, match="rank 3 of world 3"):
        rank_rows(batch, 3, 3)


def test_label_range_is_the_split_of_the_sharded_classifier():
    W0 = np.zeros((11, 2), dtype=np.float32)
    for world in (1, 2, 3, 4):
        clf = ShardedClassifier(W0, [torch.device("cpu")] * world)
        assert [label_range(11, r, world) for r in range(world)] == list(zip(clf.offsets[:-1], clf.offsets[1:]))
    assert [label_range(11, r, 2) for r in range(2)] == [(0, 6), (6, 11)]
    assert [label_range(1, r, 2) for r in range(2)] == [(0, 0), (0, 1)]


def test_dist_env_reads_torchrun_variables():
    assert DistEnv.from_env({}, device="cpu") == DistEnv(0, 1, 0, "gloo", torch.device("cpu"))
    env = DistEnv.from_env({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1"}, device="cpu")
    assert (env.rank, env.world_size, env.local_rank, env.backend, env.is_main) == (3, 4, 1, "gloo", False)
    assert DistEnv.from_env({"RANK": " 1 ", "WORLD_SIZE": "2"}, device="cpu").local_rank == 1
    default = DistEnv.from_env({})
    assert default.device.type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert default.backend == ("nccl" if torch.cuda.is_available() else "gloo")


@pytest.mark.parametrize("environ, match", [
    ({"WORLD_SIZE": "two"}, r"WORLD_SIZE: expected an integer .*got 'two'"),
    ({"WORLD_SIZE": "0"}, r"WORLD_SIZE: expected an integer >= 1.*got 0"),
    ({"WORLD_SIZE": "2"}, r"RANK: expected an integer in \[0, 2\) .*not set"),
    ({"WORLD_SIZE": "2", "RANK": "2"}, r"RANK: expected an integer in \[0, 2\) for WORLD_SIZE=2, got 2"),
    ({"WORLD_SIZE": "2", "RANK": "-1"}, r"RANK: expected .*got -1"),
    ({"WORLD_SIZE": "2", "RANK": "1.0"}, r"RANK: expected an integer .*got '1.0'"),
    ({"RANK": "1"}, r"RANK: expected an integer in \[0, 1\) for WORLD_SIZE=1, got 1"),
    ({"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "x"}, r"LOCAL_RANK: expected an integer .*got 'x'"),
    ({"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "1"}, r"LOCAL_RANK: expected an integer in \[0, RANK=0\]"),
])
def test_dist_env_names_the_bad_variable(environ, match):
    with pytest.raises(XCConfigError, match=match):
        DistEnv.from_env(environ, device="cpu")


def test_dist_env_bad_device_and_missing_rendezvous(monkeypatch):
    with pytest.raises(XCConfigError, match="device: expected 'cpu', 'cuda' or 'cuda:<n>', got 'tpu9'"):
        DistEnv.from_env({}, device="tpu9")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    with pytest.raises(XCConfigError, match="MASTER_ADDR: expected rank 0's address"):
        DistEnv.from_env({"WORLD_SIZE": "2", "RANK": "0"}, device="cpu").init()
    assert not dist.is_initialized()


def test_a_world_of_one_is_a_no_op():
    p = _problem()
    env = DistEnv.from_env({}, device="cpu")
    with env:
        env.barrier()
        assert env.is_main and not env.active and not dist.is_initialized()
        x = torch.tensor(p.G)
        assert gather_with_grad(x) is x
        assert all_reduce_sum(torch.tensor(2.5)).item() == 2.5
    assert not dist.is_initialized()


def test_one_rank_sharded_bce_equals_the_dense_step_and_the_sharded_classifier():
    p = _problem()
    loss_ref, grad_ref, W_ref = _dense_bce_step(p)
    env = DistEnv()
    W = RankShardedW.from_full(p.W0, env)
    x = torch.tensor(p.X, requires_grad=True)
    loss = sharded_bce_loss(W, x, torch.tensor(p.pos), torch.tensor(p.cand), env)
    loss.local.backward()
    W.sgd_update(LR, WD)
    assert loss.total.item() == pytest.approx(loss_ref, rel=1e-6) and loss.local.item() == loss.total.item()
    np.testing.assert_allclose(x.grad.numpy(), grad_ref, atol=1e-6)
    np.testing.assert_allclose(W.consolidate(), W_ref, atol=1e-6)

    clf = ShardedClassifier(p.W0, [torch.device("cpu")])
    cand, pos = torch.tensor(p.cand), torch.tensor(p.pos)
    xs = torch.tensor(p.X, requires_grad=True)
    dense = masked_bce_loss(clf.scores(xs, cand), _is_pos(cand, pos), cand >= 0) * len(p.X)  # mean -> sum
    dense.backward()
    ShardedOptimizer(clf, "sgd", LR, WD).step()
    assert dense.item() == pytest.approx(loss_ref, rel=1e-6)
    np.testing.assert_allclose(clf.full(), W_ref, atol=1e-6)


def test_rank_sharded_w_rejects_a_block_of_the_wrong_rows():
    with pytest.raises(ValueError, match=r"expected a \(6, D\) block of labels \[0, 6\) of 11, got shape \(5, 4\)"):
        RankShardedW(np.zeros((5, 4), dtype=np.float32), 11, DistEnv(0, 2))


# ------------------------------------------------------------------------------------------- two real ranks

def test_two_ranks_come_from_torchrun(two_ranks):
    for r in (0, 1):
        assert two_ranks[r]["env"].tolist() == [r, 2, r, r == 0, True]
        assert bool(two_ranks[r]["closed"])


def test_gather_with_grad_of_unequal_parts_equals_one_process(two_ranks):
    p = _problem()
    X = torch.tensor(p.G, requires_grad=True)
    _gather_loss(X, X, 1).backward()
    for r, rows in ((0, slice(0, 3)), (1, slice(3, 5))):
        np.testing.assert_array_equal(two_ranks[r]["gather_values"], p.G)
        assert two_ranks[r]["gather_grad"].shape == (rows.stop - rows.start, 4)
        np.testing.assert_allclose(two_ranks[r]["gather_grad"], X.grad[rows].numpy(), atol=1e-5)


def test_label_sharded_bce_equals_the_dense_single_process_step(two_ranks):
    p = _problem()
    loss_ref, grad_ref, W_ref = _dense_bce_step(p)
    r0, r1 = two_ranks[0], two_ranks[1]
    assert r0["range"].tolist() == [0, 6] and r1["range"].tolist() == [6, 11]
    for res in (r0, r1):
        assert float(res["bce_total"]) == pytest.approx(loss_ref, rel=1e-6)
    assert float(r0["bce_local"]) + float(r1["bce_local"]) == pytest.approx(loss_ref, rel=1e-6)
    assert 0 < float(r0["bce_local"]) < loss_ref  # each rank scored a part of the pairs
    np.testing.assert_allclose(np.concatenate([r0["bce_grad"], r1["bce_grad"]]), grad_ref, atol=1e-6)
    np.testing.assert_allclose(np.concatenate([r0["block"], r1["block"]]), W_ref, atol=1e-6)


def test_consolidate_and_from_full_move_w_between_world_sizes(two_ranks):
    p = _problem()
    r0, r1 = two_ranks[0], two_ranks[1]
    assert r0["none_off_main"].tolist() == [False, False] and r1["none_off_main"].tolist() == [True, True]
    W2 = r0["consolidated"]
    assert W2.dtype == np.float32 and W2.shape == (11, 4)
    np.testing.assert_array_equal(W2, np.concatenate([r0["block"], r1["block"]]))
    np.testing.assert_allclose(W2, two_ranks["W1"], atol=1e-6)  # 2 ranks trained the same W as 1 rank
    assert not np.allclose(W2, p.W0)
    resumed = RankShardedW.from_full(W2, DistEnv())  # a 2-rank checkpoint resumed with 1 rank
    np.testing.assert_array_equal(resumed.weight.numpy(), W2)
    np.testing.assert_array_equal(resumed.consolidate(), W2)
    W1 = two_ranks["W1"]  # and a 1-rank W loaded by 2 ranks
    for r, (lo, hi) in ((0, (0, 6)), (1, (6, 11))):
        np.testing.assert_array_equal(two_ranks[r]["from_one_rank"], W1[lo:hi])
        np.testing.assert_array_equal(two_ranks[r]["from_block"], W1[lo:hi])
    assert r0["one_label_rows"].tolist() == [0, 0] and r1["one_label_rows"].tolist() == [0, 1]
    np.testing.assert_array_equal(r0["one_label_full"], [[0.0, 1.0, 2.0]])


if __name__ == "__main__":  # a torchrun rank (see ``two_ranks``)
    _worker(Path(sys.argv[1]))
