"""A budgeted end-to-end classifier training (astra, mips) corrected as it trains (xc_dagster.training.replan), as
the pretraining is (tests/test_replan.py, also for the cosine schedule): the total steps follow the steps' seconds
as trained, the schedule decays to the new end without a jump, ASTRA's tables follow the new end, and a resumed run
keeps it."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import scipy.sparse as sp
import torch

from tests.test_pipeline import TINY, tiny_home  # noqa: F401  (fixture)
from tests.test_replan import ticking
from xc_dagster.artifacts import STAGE_ORDER
from xc_dagster.catalog import Catalog
from xc_dagster.config import ClassifierParams
from xc_dagster.pipeline import StageContext, run_all
from xc_dagster.pipeline import classifier as classifier_stage
from xc_dagster.storage import ArtifactStore
from xc_dagster.training.checkpoint import Checkpointer
from xc_dagster.training.end_to_end import train_end_to_end
from xc_dagster.training.replan import Replanner

CPU = torch.device("cpu")
# 120 points in batches of 16: 8 steps an epoch; ASTRA's first table at step 2, then one every 4 steps
P = ClassifierParams(negatives="astra", epochs=1.0, batch_size=16, num_hard=4, num_random=8, hard_start=0.25,
                     refresh_every=0.5, w_optimizer="sgd", lr=0.3, normalize=False, scale=1.0, label_points=False,
                     sampler_index="exact", refresh_async=False)


def _problem(n: int = 120, L: int = 40, d: int = 16, seed: int = 5):
    rng = np.random.default_rng(seed)
    rows = np.repeat(np.arange(n), 3)
    cols = np.concatenate([rng.choice(L, 3, replace=False) for _ in range(n)])
    Y = sp.csr_matrix((np.ones(len(rows), np.float32), (rows, cols)), shape=(n, L))
    X = rng.normal(size=(n, d)).astype(np.float32)
    X /= np.linalg.norm(X, axis=1, keepdims=True)
    return X, rng.normal(size=(L, d)).astype(np.float32), Y


def _train(params=P, replanner=None, checkpoint=None, factors=None, kill_at=None, follow=()):
    X, labels, Y = _problem()

    def log(step: int, m: dict) -> None:
        if factors is not None and "classifier_lr_factor" in m:
            factors.append(m["classifier_lr_factor"])
        if kill_at is not None and step >= kill_at:
            raise KeyboardInterrupt
    return train_end_to_end(X, labels, labels, Y, np.arange(120), params, CPU, checkpoint=checkpoint,
                            log_metrics=log, log_every=1, replanner=replanner, follow_intervals=follow)


def test_a_run_faster_than_planned_trains_on_with_more_refreshes_and_decays_to_its_new_end():
    planned = _train()
    assert planned.summary["steps"] == planned.summary["planned_steps"] == 8 and planned.summary["refreshes"] == 2
    assert "replanned_epochs" not in planned.summary
    factors = []
    # 1 s a step, training starting at 1 and the plan's seconds ending at 20: after the first window (2 steps,
    # ending at 3) 17 more steps fit
    replanner = Replanner(end=20.0, every=2.0, clock=ticking(1.0))
    res = _train(replanner=replanner, factors=factors)
    assert replanner.period == 4  # its rates span ASTRA's builds' interval (tests/test_replan.py: what that steadies)
    s = res.summary
    assert s["steps"] == 19 and s["planned_steps"] == 8 and s["replanned_epochs"] == pytest.approx(19 / 8)
    assert s["refreshes"] == 5  # ASTRA's tables at steps 2, 6, 10, 14, 18: the run's new end, not the plan's
    assert factors[-1] == pytest.approx(0.0) and np.all(np.diff(factors[1:]) <= 1e-9)
    # no jump at the re-plan (after step 2): the factor at step 2 is where the new decay starts
    assert factors[2] < factors[1] and factors[1] - factors[2] < 0.02


def test_intervals_the_plan_scaled_follow_the_re_planned_end():
    # as above, re-planned from 8 to 19 steps after step 2, before the first table (due at step 2) is built: with
    # hard_start and refresh_every following, 19 / 8 of the first plan's 2 and 4 steps, the first table at step 5
    # (round(4.75)) and then every 10 (round(9.5)): 5, 15 -- two tables over the run, as planned, not five
    replanner = Replanner(end=20.0, every=2.0, clock=ticking(1.0))
    res = _train(replanner=replanner, follow=("hard_start", "refresh_every"))
    assert res.summary["steps"] == 19 and res.summary["refreshes"] == 2 and replanner.period == 10
    # refresh_every alone: the first table at step 2 as planned, then every 10: 2, 12
    only = _train(replanner=Replanner(end=20.0, every=2.0, clock=ticking(1.0)), follow=("refresh_every",))
    assert only.summary["refreshes"] == 2
    # a re-plan later in the run re-anchors at the last table: 2 tables (2, 6) in the first 8 steps at 1 s a step
    # (the clock at 1 + steps), the end moved at step 8 to 8 + 31 = 39, then a table every round(4 x 39 / 8) = 20
    # after the one of step 6: at 26 (46 is past the end)
    late = _train(replanner=Replanner(end=40.0, every=8.0, clock=ticking(1.0)), follow=("refresh_every",))
    assert late.summary["steps"] == 39 and late.summary["refreshes"] == 3


def test_a_run_slower_than_planned_ends_its_schedule_before_the_deadline():
    factors = []
    # 24 steps planned; 1 s a step and the plan's seconds ending at 6: the first window ends at 3, so 2 + 3 steps
    res = _train(dataclasses.replace(P, epochs=3.0), Replanner(end=6.0, every=2.0, clock=ticking(1.0)),
                 factors=factors)
    assert res.summary["steps"] == 5 and not res.summary["stopped_at_deadline"]
    assert factors[-1] == pytest.approx(0.0)
    # a shorter run keeps the plan's intervals (tables at 2 of the 5 steps, as without following), not 24 / 5
    # times as many builds a step
    kept = _train(dataclasses.replace(P, epochs=3.0), Replanner(end=6.0, every=2.0, clock=ticking(1.0)),
                  follow=("hard_start", "refresh_every"))
    assert kept.summary["steps"] == 5 and kept.summary["refreshes"] == res.summary["refreshes"] == 1


@pytest.mark.parametrize("negatives", ["astra", "mips"])
def test_a_resumed_run_keeps_the_re_planned_end_and_weights(tmp_path, negatives):
    params = dataclasses.replace(P, negatives=negatives, sampler_index="exact" if negatives == "astra" else "ivf",
                                 mips_partitions=6, mips_probe=2)

    def replanner():
        return Replanner(end=20.0, every=2.0, clock=ticking(1.0))

    follow = ("hard_start", "refresh_every")
    whole = _train(params, replanner(), follow=follow)
    ckpt = Checkpointer(tmp_path / "ckpt", "key")
    with pytest.raises(KeyboardInterrupt):  # killed at step 12: the checkpoint after epoch 1 (step 8) was written
        _train(params, replanner(), checkpoint=ckpt, kill_at=12, follow=follow)
    # resumed without a re-planner: the checkpoint's total, schedule and the sampler's moved intervals carry it to
    # the same end, tables and weights
    again = _train(params, checkpoint=ckpt, follow=follow)
    assert again.summary["resumed_from_epoch"] == 1 and again.summary["steps"] == whole.summary["steps"] == 19
    assert again.summary["refreshes"] == whole.summary["refreshes"]
    assert np.array_equal(again.W, whole.W)


def test_the_classifier_stage_re_plans_an_end_to_end_run_under_a_budget(tiny_home, monkeypatch):  # noqa: F811
    spec = Catalog(tiny_home.catalog).get("TinyTitles")
    spec = dataclasses.replace(spec, strategy="astra",
                               overrides={k: v for k, v in spec.overrides.items() if k != "classifier.epochs"})
    over = {"classifier.batch_size": 16, "classifier.num_hard": 3, "classifier.num_random": 6,
            "classifier.sampler_hnsw_m": 8, "classifier.chunk_size": 8, "train.budget_minutes": 0.5,
            "train.max_epochs": 2}
    cfg = spec.config(over)
    assert "classifier.epochs" not in cfg.explicit and cfg.classifier.train_encoder
    ctx = StageContext(ArtifactStore(tiny_home.artifacts), spec, cfg, tiny_home.cache)
    run_all(ctx, STAGE_ORDER[:4])
    made = []

    def for_plan(plan, started, train, retime=None, clock=None):
        # the stage's plan re-planned on a clock of 10 s a step: after the first window (2 steps, 10 to 30 s) the
        # plan's seconds (to 50) hold 2 more
        r = Replanner(50.0, 20.0, clock=ticking(10.0))
        made.append((plan, retime, r))
        return r

    monkeypatch.setattr(classifier_stage.Replanner, "for_plan", staticmethod(for_plan))
    follows, train = [], classifier_stage.train_end_to_end

    def recorded(*a, **kw):
        follows.append(kw["follow_intervals"])
        return train(*a, **kw)
    monkeypatch.setattr(classifier_stage, "train_end_to_end", recorded)
    out = run_all(ctx, ("classifier",))["classifier"]
    assert follows == [("hard_start", "refresh_every")]  # the intervals the plan scaled move with its end
    (plan, retime, r), = made
    assert plan.field == "classifier.epochs" and not plan.explicit and plan.steps_per_epoch == out["steps_per_epoch"]
    assert out["planned_steps"] == math.ceil(plan.planned_epochs * plan.steps_per_epoch) > 4
    assert out["steps"] == 4 and out["replanned_epochs"] == pytest.approx(4 / out["steps_per_epoch"])
    assert out["replans"] == r.history == [{"step": 2, "seconds_per_step": 10.0, "total_steps": 4}]
    assert retime() > 0  # the encoding's sample timed again with the stage's encoder
