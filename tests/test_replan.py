"""A budgeted pretraining corrected as it trains (xc_dagster.training.replan): the total steps follow the steps'
seconds as trained, the schedule decays to the new end without a jump, and a resumed run keeps the re-planned end."""

from __future__ import annotations

import dataclasses
import math
import time

import numpy as np
import pytest
import torch

from tests.test_clustering import _tiny_pretrain_data
from xc_dagster.config import PretrainParams, TrainParams
from xc_dagster.encoders.loading import load_encoder
from xc_dagster.training import siamese
from xc_dagster.training.budget import BudgetPlan
from xc_dagster.training.checkpoint import Checkpointer
from xc_dagster.training.replan import Replanner
from xc_dagster.training.schedules import CosineWithWarmup, LinearWithWarmup

CPU = torch.device("cpu")


def ticking(seconds_per_call: float):
    """A clock that moves ``seconds_per_call`` at each reading: the re-planner reads it once per step."""
    now = [0.0]

    def clock() -> float:
        now[0] += seconds_per_call
        return now[0]
    return clock


# the schedule's factors at steps 0, 1, 2, 6, 10 of a 2-step warm-up and 10 steps; after retotal(6, 16), at 6, 11,
# 16, 20 and 7: linear from 0.5 down to 0 at 16, cosine along a half cosine from 0.5 down to 0 at 16
SCHEDULES = [(LinearWithWarmup, [0.5, 1.0, 1.0, 0.5, 0.0], [0.5, 0.25, 0.0, 0.0], 0.45),
             (CosineWithWarmup, [0.5, 1.0, 1.0, 0.5, 0.0], [0.5, 0.25, 0.0, 0.0], 0.25 * (1 + math.cos(math.pi / 10)))]


@pytest.mark.parametrize("schedule, planned, moved, at_7", SCHEDULES)
def test_the_schedule_decays_to_a_moved_end_from_where_it_is(schedule, planned, moved, at_7):
    f = schedule(2, 10)
    assert [f(s) for s in (0, 1, 2, 6, 10)] == pytest.approx(planned)
    f.retotal(6, 16)
    assert [f(s) for s in (6, 11, 16, 20)] == pytest.approx(moved)
    w = schedule(4, 10)
    w.retotal(1, 22)  # during the warm-up only the end moves
    assert [w(s) for s in (1, 3, 4, 13, 22)] == pytest.approx([0.5, 1.0, 1.0, 0.5, 0.0])
    # kept by LambdaLR's state: a scheduler loaded from it goes on to the moved end
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule(2, 10))
    for _ in range(6):
        opt.step()
        sched.step()
    sched.lr_lambdas[0].retotal(6, 16)
    state = sched.state_dict()
    opt2 = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched2 = torch.optim.lr_scheduler.LambdaLR(opt2, schedule(2, 10))
    sched2.load_state_dict(state)
    opt2.step()
    sched2.step()
    assert sched2.get_last_lr()[0] == pytest.approx(at_7)  # step 7 of the moved decay


def test_the_replanner_fits_the_steps_left_at_the_last_windows_rate():
    now = [0.0]
    r = Replanner(end=100.0, every=10.0, clock=lambda: now[0])
    r.start(0)
    now[0] = 5.0
    assert r.check(3, 50) is None  # the window is not over
    now[0] = 10.0
    assert r.check(5, 50) is None  # 2 s a step: 5 + 90 / 2 = 50 steps, the plan's
    now[0] = 20.0
    assert r.check(15, 50) == 95  # 1 s a step over the last window: 15 + 80
    assert r.history == [{"step": 15, "seconds_per_step": 1.0, "total_steps": 95}]
    now[0] = 30.0
    assert r.check(20, 95) == 55  # 2 s a step again: 20 + 70 / 2
    now[0] = 40.0
    assert r.check(25, 55) is None  # 25 + 60 / 2 = 55
    now[0] = 50.0
    assert r.check(30, 55) is None  # 30 + 50 / 2 = 55
    now[0] = 60.0
    assert r.check(35, 55) is None  # 35 + 40 / 2
    now[0] = 70.0
    assert r.check(40, 55) is None  # 40 + 30 / 2
    now[0] = 80.0
    assert r.check(50, 55) == 70  # 1 s a step: 50 + 20
    capped = Replanner(end=100.0, every=10.0, max_steps=60, clock=lambda: now[0])
    now[0] = 0.0
    capped.start(0)
    now[0] = 10.0
    assert capped.check(20, 30) == 60  # 20 + 180 steps fit; train.max_epochs' cap holds it at 60
    # a plan of explicit epochs (or no budget) is never re-planned; a planned one every REPLAN_EVERY of its seconds
    explicit = BudgetPlan("pretrain.epochs", 600.0, 2.0, 2.0, True, 1.0, 10.0, 100)
    train = TrainParams(max_epochs=2.5)
    assert Replanner.for_plan(explicit, 0.0, train) is None
    planned = BudgetPlan("pretrain.epochs", 600.0, 1.0, 3.0, False, 1.0, 10.0, 100, planned_train_seconds=300.0)
    r = Replanner.for_plan(planned, 7.0, train)
    assert (r.end, r.every, r.max_steps) == (307.0, 0.1 * 300.0, 250)  # the default: every 10%
    assert Replanner.for_plan(planned, 7.0, TrainParams(replan_every=0.0)) is None  # off



def _periodic_run(period: int) -> tuple[int, float, list[int]]:
    """A run of 1 s steps with a 9 s overhead at every 10th step (1.9 s a step on average), re-planned every 7 s
    towards an end at 400 s from a plan of 100 steps: (steps run, seconds, the totals it was re-planned to)."""
    now = [0.0]
    r = Replanner(end=400.0, every=7.0, clock=lambda: now[0])
    r.start(0, period)
    steps, total, totals = 0, 100, []
    while steps < total:
        steps += 1
        now[0] += 1.0 + (9.0 if steps % 10 == 0 else 0.0)
        new = r.check(steps, total)
        if new is not None:
            total = new
            totals.append(new)
    return steps, now[0], totals


def test_a_rate_spanning_the_trainers_overhead_period_steadies_the_end():
    # with the period: the first window (7 steps at 1 s, no overhead seen yet) reads 400 steps, every later rate
    # spans 10 steps or more from the start or a window's end: 1.9 s a step, 400 / 1.9 -> 210 steps, kept
    steps, seconds, totals = _periodic_run(period=10)
    assert totals == [400, 210] and steps == 210 and seconds == 399.0
    # without it each window has one overhead or none, and the end swings between ~105 and ~400 steps each time
    steps, seconds, totals = _periodic_run(period=0)
    assert len(totals) == 40 and totals[:4] == [400, 105, 391, 110]
    assert (steps, seconds) == (205, 385.0)  # the last swing ends it short of the plan's seconds

def _train(path, pt, lt, Y, params, replanner=None, checkpoint=None, lrs=None):
    torch.manual_seed(0)
    enc = load_encoder(str(path))
    log = (lambda step, m: "pretrain_lr" in m and lrs.append((step, m["pretrain_lr"]))) if lrs is not None else None
    res = siamese.train_siamese(enc, pt, lt, Y, np.arange(32), params, CPU, None, log_metrics=log, log_every=1,
                                checkpoint=checkpoint, replanner=replanner)
    return res, torch.cat([p.detach().flatten() for p in enc.parameters()])


QUICK = PretrainParams(sampler="ngame", curriculum=(1, 1, 1), max_cluster_size=8, epochs=0.5, batch_size=8,
                       chunk_size=16, amp="off", warmup_steps=1)  # 32 points: 4 steps an epoch


def test_a_run_faster_than_planned_trains_on_into_a_clustering_epoch(tmp_path):
    path, pt, lt, Y = _tiny_pretrain_data(tmp_path)
    planned, _ = _train(path, pt, lt, Y, QUICK)
    assert planned.steps == 2 and planned.reclusterings == 0  # half an epoch: no epoch clusters, no bank
    lrs = []
    # each step "takes" 1 s and the plan's seconds end at 12: after the first step, 1 + 10 steps fit
    res, _ = _train(path, pt, lt, Y, QUICK, Replanner(end=12.0, every=1.0, clock=ticking(1.0)), lrs=lrs)
    assert res.steps == 11  # epoch 0's 4, epoch 1's 4 cluster batches, 3 of epoch 2's 4
    assert res.reclusterings >= 1  # epoch 1 clusters the bank filled by the encoder as it was then
    factors = [lr / QUICK.lr for _, lr in lrs]
    assert factors[-1] == pytest.approx(0.0)  # the schedule ended with the re-planned run
    # from the first step's factor (the warm-up's end) down to 0 in equal steps: no jump at the re-plan
    assert np.allclose(np.diff(factors), -factors[0] / 10, atol=1e-6)


def test_a_run_slower_than_planned_ends_its_schedule_before_the_deadline(tmp_path):
    path, pt, lt, Y = _tiny_pretrain_data(tmp_path)
    params = dataclasses.replace(QUICK, epochs=3.0, curriculum=(9,))  # 12 steps planned, random batches
    lrs = []
    # 1 s a step, the clock at 1 when training starts and the plan's seconds ending at 6: the first window (2
    # steps) ends at 3, which leaves 3 s, so 2 + 3 steps in all
    res, _ = _train(path, pt, lt, Y, params, Replanner(end=6.0, every=2.0, clock=ticking(1.0)), lrs=lrs)
    assert res.steps == 5 and not res.stopped_at_deadline
    assert lrs[-1][1] == pytest.approx(0.0)


def test_a_resumed_run_keeps_the_re_planned_end(tmp_path, monkeypatch):
    path, pt, lt, Y = _tiny_pretrain_data(tmp_path)

    def replanner():
        return Replanner(end=12.0, every=1.0, clock=ticking(1.0))

    whole, w_whole = _train(path, pt, lt, Y, QUICK, replanner())
    ckpt = Checkpointer(tmp_path / "ckpt", "key")
    real = siamese.SiameseTrainer.step

    def crash_at_7(self, batch):
        if self.steps == 6:
            raise KeyboardInterrupt
        return real(self, batch)

    monkeypatch.setattr(siamese.SiameseTrainer, "step", crash_at_7)
    with pytest.raises(KeyboardInterrupt):
        _train(path, pt, lt, Y, QUICK, replanner(), checkpoint=ckpt)
    monkeypatch.setattr(siamese.SiameseTrainer, "step", real)
    # resumed after epoch 1 (the checkpoint of step 8 was never written) without re-planning: the checkpoint's
    # total and schedule carry the run to the same end and the same weights
    resumed, w_resumed = _train(path, pt, lt, Y, QUICK, checkpoint=ckpt)
    assert resumed.resumed_from_epoch == 1 and whole.steps == resumed.steps == 11
    assert torch.allclose(w_whole, w_resumed, atol=1e-6)


def test_a_window_far_from_the_calibration_times_the_encoding_again_and_moves_the_end():
    now = [0.0]
    timed = []

    def retime(seconds):
        def f():
            timed.append(now[0])
            now[0] += 5.0  # the re-timing takes 5 s of the run
            return seconds
        return f

    # calibrated 2 s a step under load, the encoding estimated at 50 s; the run's steps take 1 s, the encoding now
    # times at 10 s: the end moves 40 s on (the later stages' reserve is left as planned)
    r = Replanner(end=100.0, every=10.0, clock=lambda: now[0], calibrated=2.0, encode_seconds=50.0,
                  retime=retime(10.0), share=0.1)
    r.start(0)
    now[0] = 10.0
    assert r.check(10, 50) == 10 + 125  # after the re-timing (now 15 s): 140 - 15 s left at 1 s a step
    assert (r.end, r.shift, timed) == (140.0, 40.0, [10.0])
    assert r.every == 14.0  # windows of a tenth of the longer run
    assert r.history[-1] == {"step": 10, "seconds_per_step": 1.0, "total_steps": 135, "encode_seconds": 10.0,
                             "shift": 40.0}
    assert r.moved(170.0) == 210.0 and r.moved(None) is None
    now[0] = 29.0  # the next window starts after the re-timing: 14 steps in 14 s, the plan holds
    assert r.check(24, 135) is None and timed == [10.0]  # the encoding is timed once
    # slower than calibrated: the encoding grows, so the end comes earlier
    now[0] = 0.0
    slow = Replanner(end=100.0, every=10.0, clock=lambda: now[0], calibrated=1.0, encode_seconds=20.0,
                     retime=retime(40.0))
    slow.start(0)
    now[0] = 10.0
    assert slow.check(5, 100) == 5 + 32  # 2 s a step; end 100 + 20 - 40 = 80, now 15: 65 s / 2
    assert slow.shift == -20.0
    # within RETIME_FACTOR of the calibration nothing is timed again
    near = Replanner(end=100.0, every=10.0, clock=lambda: now[0], calibrated=1.1, encode_seconds=20.0,
                     retime=retime(1.0))
    now[0] = 0.0
    near.start(0)
    now[0], timed[:] = 10.0, []
    assert near.check(10, 100) is None and timed == [] and near.shift == 0.0


def test_a_moved_end_moves_the_deadline_with_it(tmp_path):
    path, pt, lt, Y = _tiny_pretrain_data(tmp_path)
    params = dataclasses.replace(QUICK, epochs=1.0)
    gone = time.perf_counter() - 1.0  # a deadline already past: no step
    res = siamese.train_siamese(load_encoder(str(path)), pt, lt, Y, np.arange(32), params, CPU, None, deadline=gone)
    assert res.steps == 0 and res.stopped_at_deadline
    r = Replanner(end=1e9, every=1e9, shift=3600.0)  # its end (and the deadline) moved an hour on
    res = siamese.train_siamese(load_encoder(str(path)), pt, lt, Y, np.arange(32), params, CPU, None, deadline=gone,
                                replanner=r)
    assert res.steps == 4 and not res.stopped_at_deadline
