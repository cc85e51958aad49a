"""The training budget: the plan's arithmetic, who wins over it, the deadline guard, a resumed run's plan, and a
budgeted run end to end on tiny data."""

from __future__ import annotations

import math
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tests.test_pipeline import TINY, tiny_home  # noqa: F401  (fixture)
from tests.tinydata import write_tiny_encoder
from xc_dagster.catalog import Catalog, DatasetSpec
from xc_dagster.config import resolve_config
from xc_dagster.encoders.loading import load_encoder
from xc_dagster.errors import XCConfigError
from xc_dagster.pipeline import StageContext, run_all
from xc_dagster.pipeline import index as index_stage
from xc_dagster.retrieval.lexical_exact import SCALES, SCALES_EXTEND
from xc_dagster.storage import ArtifactStore
from xc_dagster.training import budget as budget_module
from xc_dagster.training import siamese
from xc_dagster.training.budget import BudgetPlan, check_train_params, plan_epochs, whole_steps


def test_plan_fills_what_is_left_of_the_budget():
    # 10 min = 600 s; reserve 0.15 -> 90 s; 30 s spent, 60 s of encoding: 420 s left at 2 s/step, 7 steps/epoch
    plan = plan_epochs("pretrain.epochs", 10, 1.0, False, 2.0, 256, 7, 60.0, 30.0, 0.15)
    assert plan.planned_epochs == 30.0 and plan.planned_train_seconds == pytest.approx(420.0)
    assert plan.points_per_second == pytest.approx(128.0) and not plan.capped
    # a machine twice as fast gets twice the epochs on the same data
    assert plan_epochs("pretrain.epochs", 10, 1.0, False, 1.0, 256, 7, 60.0, 30.0, 0.15).planned_epochs == 60.0
    # rounded down to whole steps: never more than what fits, none of it dropped (420 s at 2 s: 210 steps of 11)
    assert plan_epochs("pretrain.epochs", 10, 1.0, False, 3.0, 256, 7, 60.0, 30.0, 0.15).planned_epochs == 20.0
    odd = plan_epochs("pretrain.epochs", 10, 1.0, False, 2.0, 256, 11, 60.0, 30.0, 0.15)
    assert odd.planned_epochs == 19.090909 and math.ceil(odd.planned_epochs * 11) == 210
    assert odd.planned_train_seconds <= 420.0
    # an epoch far longer than the run: 0.0099 of an epoch of 8,768 steps is 86 steps (two decimals planned none)
    long_epoch = plan_epochs("pretrain.epochs", 10, 1.0, False, 1.0, 256, 8768, 60.0, 30.0, 0.15)
    assert math.ceil(long_epoch.planned_epochs * 8768) == 420  # 420 s at 1 s a step
    tiny = plan_epochs("pretrain.epochs", 10, 1.0, False, 420 / 86.5, 256, 8768, 60.0, 30.0, 0.15)
    assert tiny.planned_epochs == 0.009808 and math.ceil(tiny.planned_epochs * 8768) == 86
    capped = plan_epochs("pretrain.epochs", 10, 1.0, False, 2.0, 256, 7, 60.0, 30.0, 0.15, max_epochs=4)
    assert capped.planned_epochs == 4.0 and capped.capped
    # nothing left: no training rather than an overrun
    assert plan_epochs("pretrain.epochs", 1, 1.0, False, 2.0, 256, 7, 60.0, 30.0, 0.15).planned_epochs == 0.0
    # an encoding longer than the share: the later stages keep at least the encoding's seconds (they search every
    # point against every label, work that grows as the encoding does): 600 - 30 - 150 - 150 = 270 s at 14 s/epoch
    big = plan_epochs("pretrain.epochs", 10, 1.0, False, 2.0, 256, 7, 150.0, 30.0, 0.15)
    assert big.reserved_seconds == 150.0 and big.planned_epochs == 19.285714  # 135 steps of 7
    assert plan.reserved_seconds == 90.0  # the share where the encoding is shorter
    # the end-to-end classifier stage keeps a third of that for the index and fusion (as after ngame's classifiers
    # and in `xc-dagster plan`): max(90, 150) / 3 = 50 s, 600 - 30 - 150 - 50 = 370 s: 185 steps of 7
    e2e = plan_epochs("classifier.epochs", 10, 1.0, False, 2.0, 256, 7, 150.0, 30.0, 0.15, part=1 / 3)
    assert e2e.reserved_seconds == pytest.approx(50.0) and e2e.planned_epochs == 26.428571
    explicit = plan_epochs("pretrain.epochs", 10, 2.0, True, 2.0, 256, 7, 60.0, 30.0, 0.15)
    assert explicit.planned_epochs == 2.0 and explicit.deadline(0.0) is None
    assert plan.deadline(100.0) == pytest.approx(100.0 + 420.0 + 0.02 * 600)


def test_epochs_set_by_the_user_win_and_strategy_epochs_do_not():
    assert "pretrain.epochs" in resolve_config("quick", "ngame", ("catalog", {"pretrain.epochs": 2})).explicit
    siamese = DatasetSpec("X-Titles", "/x", strategy="siamesexml").config()
    assert siamese.pretrain.epochs == 3 and "pretrain.epochs" not in siamese.explicit  # the strategy's default
    assert siamese.train.budget_minutes == 30.0  # the quick preset's budget
    user = DatasetSpec("X-Titles", "/x", strategy="siamesexml", overrides={"pretrain.epochs": 1})
    assert "pretrain.epochs" in user.config().explicit
    assert "classifier.epochs" in DatasetSpec("X-Titles", "/x").config({"classifier.epochs": 2}).explicit


@pytest.mark.parametrize("field,value", [("budget_minutes", -1.0), ("budget_minutes", float("nan")),
                                         ("calibration_steps", 0), ("reserve", 1.0), ("max_epochs", -2.0)])
def test_bad_budget_settings_name_the_field(field, value):
    # nan fails where the override is coerced (no number field takes it), the others at the stage's check
    with pytest.raises(XCConfigError, match=f"train.{field}"):
        check_train_params(resolve_config("quick", "ngame", ("catalog", {f"train.{field}": value})).train)


def test_a_kept_plan_is_reused_only_for_the_same_configuration(tmp_path):
    plan = plan_epochs("pretrain.epochs", 10, 1.0, False, 2.0, 256, 7, 60.0, 30.0, 0.15)
    plan.save(tmp_path / "plan.json", "key-a")
    assert BudgetPlan.load(tmp_path / "plan.json", "key-a") == plan
    assert BudgetPlan.load(tmp_path / "plan.json", "key-b") is None
    (tmp_path / "bad.json").write_text("{not json")
    assert BudgetPlan.load(tmp_path / "bad.json", "key-a") is None


def test_deadline_stops_pretraining_between_steps(tiny_home, monkeypatch):  # noqa: F811
    real = siamese.SiameseTrainer.step

    def slow_step(self, batch):  # each step "takes" 0.2 s of the deadline
        time.sleep(0.2)
        return real(self, batch)

    spec = Catalog(tiny_home.catalog).get("TinyTitles")
    store = ArtifactStore(tiny_home.artifacts)
    run_all(StageContext(store, spec, spec.config(), tiny_home.cache), ("ingest", "tokenize"))
    ctx = StageContext(store, spec, spec.config(), tiny_home.cache)
    enc = load_encoder(spec.config().tokenize.encoder, "mean")
    ds = ctx.read.labels()
    rows = ctx.read.train_rows(ds.num_train)
    p = spec.config().pretrain
    monkeypatch.setattr(siamese.SiameseTrainer, "step", slow_step)
    res = siamese.train_siamese(enc, ctx.read.tokens("train"), ctx.read.tokens("label"), ds.Y_train, rows, p,
                                ctx.device, None, deadline=time.perf_counter() + 0.5)
    full = 2 * int(np.ceil(len(rows) / p.batch_size))  # TINY: 2 epochs
    assert res.stopped_at_deadline and 1 <= res.steps <= 4 < full


def test_budgeted_run_plans_pretraining_and_records_the_plan(tiny_home, monkeypatch):  # noqa: F811
    over = {k: v for k, v in TINY.items() if k != "pretrain.epochs"}
    spec = DatasetSpec("BudgetTitles", Catalog(tiny_home.catalog).get("TinyTitles").source,
                       overrides={**over, "tokenize.encoder": Catalog(tiny_home.catalog).get("TinyTitles").overrides[
                           "tokenize.encoder"], "train.budget_minutes": 0.5, "train.max_epochs": 3})
    Catalog(tiny_home.catalog).add(spec)
    store = ArtifactStore(tiny_home.artifacts)
    out = run_all(StageContext(store, spec, spec.config(), tiny_home.cache))
    plan = out["pretrain"]["budget"]
    spe = 8  # (108 points + ngame's 20 label points) / batches of 16
    assert not plan["explicit"] and plan["seconds_per_step"] > 0 and plan["steps_per_epoch"] == spe
    left = plan["budget_seconds"] - plan["spent_seconds"] - plan["encode_seconds"] - plan["reserved_seconds"]
    # 30 s leave room for the 3 epochs even on a loaded machine; none left would plan 0 (max(0, left))
    expected = whole_steps(min(3.0, max(0.0, left) / (plan["seconds_per_step"] * spe)), spe)
    assert plan["planned_epochs"] == pytest.approx(expected)
    # the planned epochs were trained (ngame's cluster batches after the first epoch may number fewer than spe),
    # or the steps the run re-planned as it trained, never past train.max_epochs
    trained, replans = out["pretrain"]["steps"], out["pretrain"]["replans"]
    total = replans[-1]["total_steps"] if replans else int(np.ceil(plan["planned_epochs"] * spe))
    assert 0 < trained <= min(total, 3 * spe)
    assert trained >= min(spe, total) - 1 or out["pretrain"]["stopped_at_deadline"]
    assert out["classifier"]["budget"]["explicit"]  # TINY sets classifier.epochs
    # the index stage's lexical classifiers stop at the budget less the fusion's share, less what the stages before
    # took (their summaries' seconds)
    ctx = StageContext(store, spec, spec.config(), tiny_home.cache, stage="index")
    spent = sum(out[s]["seconds"] for s in ("pretrain", "mining", "classifier"))
    monkeypatch.setattr(index_stage, "time", SimpleNamespace(perf_counter=lambda: 100.0))
    assert plan["reserved_seconds"] == pytest.approx(max(30.0 * 0.15, plan["encode_seconds"]))
    keep = plan["reserved_seconds"] / 6
    assert index_stage.classifier_deadline(ctx) == pytest.approx(100.0 + max(0.0, 30.0 - keep - spent))
    mine = StageContext(store, spec, spec.config({"index.lexical_classifier_epochs": 2}), tiny_home.cache,
                        stage="index")
    assert index_stage.classifier_deadline(mine) is None  # epochs set explicitly win
    # the classifiers are left out where their hard negatives project past the deadline plus 5% of the budget
    captured = {}
    monkeypatch.setattr(index_stage, "LexicalIndex", SimpleNamespace(
        fit=lambda *a, **k: captured.update(k) or SimpleNamespace(classifier_skipped=False, classifier=None)))
    ds = ctx.read.labels()
    rows = ctx.read.train_rows(ds.num_train)
    index_stage.lexical_index(ctx, rows, ds, rows)
    assert captured["deadline"] == pytest.approx(100.0 + max(0.0, 30.0 - keep - spent))
    assert captured["skip_after"] == pytest.approx(captured["deadline"] + 0.05 * 30.0)
    index_stage.lexical_index(mine, rows, ds, rows)
    assert captured["deadline"] is None and captured["skip_after"] is None
    lexical = out["index"]["lexical"]
    # the tiny set's 30-odd fit points x labels are solved exactly: one solve, judged at each margin scale
    assert lexical["classifier_solver"] == "liblinear"
    assert len(SCALES) <= len(lexical["classifier_history"]) <= len(SCALES) + SCALES_EXTEND


def test_a_later_stage_stops_at_the_budget_less_what_it_keeps():
    """``stage_deadline``: the budget (seconds) less the share kept for later stages, less the earlier stages'
    seconds, counted from the stage's start; never before its start; no budget, no deadline."""
    train = SimpleNamespace(budget_minutes=30.0)
    assert budget_module.stage_deadline(train, 1000.0, 5.0, 90.0) == pytest.approx(5.0 + 1800 - 90 - 1000)
    assert budget_module.stage_deadline(train, 2000.0, 5.0, 90.0) == 5.0
    assert budget_module.stage_deadline(SimpleNamespace(budget_minutes=0.0), 10.0, 5.0, 90.0) is None


def test_the_later_stages_keep_what_the_pretrainings_plan_reserved():
    """``reserved_after_pretraining``: the seconds the pretraining's plan kept (its share or its encoding), else
    the share of the budget (no plan: explicit epochs, another budget, no pretraining summary)."""
    train = SimpleNamespace(budget_minutes=30.0, reserve=0.15)
    plan = plan_epochs("pretrain.epochs", 30, 1.0, False, 2.0, 256, 7, 400.0, 30.0, 0.15).summary()
    assert budget_module.reserved_after_pretraining({"budget": plan}, train) == 400.0
    assert budget_module.reserved_after_pretraining(None, train) == pytest.approx(270.0)
    explicit = plan_epochs("pretrain.epochs", 30, 1.0, True, 2.0, 256, 7, 400.0, 30.0, 0.15).summary()
    assert budget_module.reserved_after_pretraining({"budget": explicit}, train) == pytest.approx(270.0)
    other = SimpleNamespace(budget_minutes=60.0, reserve=0.15)  # a later stage re-run under another budget
    assert budget_module.reserved_after_pretraining({"budget": plan}, other) == pytest.approx(540.0)


def test_calibration_times_the_trainer_in_train_mode(tmp_path, monkeypatch):
    """A loaded transformer is in eval mode; the steps a calibration times run in train mode (dropout on), as the
    run trains, on a copy: the encoder it was given stays as it was."""
    encoder = load_encoder(str(write_tiny_encoder(tmp_path / "tiny-bert")), "mean")
    assert not any(m.training for m in encoder.transformer.modules())
    seen = {}

    def time_steps(trainer, n, min_seconds=0.0, max_seconds=float("inf")):
        if trainer.encoder is not None:  # the classifier trainers' calibration: no encoder
            seen["modes"] = [m.training for m in trainer.encoder.transformer.modules()]
        return 2.0, 16.0

    monkeypatch.setattr(budget_module, "time_steps", time_steps)
    got = budget_module.calibrate(lambda enc: SimpleNamespace(encoder=enc, steps_per_epoch=7), encoder, 3)
    assert got == (2.0, 16.0, 7) and seen["modes"] and all(seen["modes"])
    assert not any(m.training for m in encoder.transformer.modules())
    assert budget_module.calibrate(lambda enc: SimpleNamespace(encoder=enc, steps_per_epoch=1), None, 3)[2] == 1


class _WarmingTrainer:
    """Steps of 1.0 s (on a fake clock) for its first ``slow`` steps, then 0.1 s: a GPU meeting new batch shapes."""

    def __init__(self, clock: list[float], slow: int) -> None:
        self.clock, self.slow, self.done = clock, slow, 0

    def epoch_batches(self, epoch: int) -> list[list[int]]:
        return [[0] * 8 for _ in range(50)]

    def step(self, batch: list[int]) -> float:
        self.clock[0] += 1.0 if self.done < self.slow else 0.1
        self.done += 1
        return 0.0


def test_calibration_times_past_the_warm_up(monkeypatch):
    """Steps are timed for min_seconds: the second half's median is the run's 0.1 s, where the first three steps
    alone read 1.0 (as an H200 did); without min_seconds, the three steps' mean as before; at most
    CALIBRATION_MAX_STEPS; the least seconds are train.calibration_seconds, at most 2% of the budget."""
    clock = [0.0]
    monkeypatch.setattr(budget_module.time, "perf_counter", lambda: clock[0])
    assert budget_module.time_steps(_WarmingTrainer(clock, 6), 3) == (1.0, 8.0)
    assert budget_module.time_steps(_WarmingTrainer(clock, 6), 3, min_seconds=10.0) == (pytest.approx(0.1), 8.0)
    trainer = _WarmingTrainer(clock, 0)
    budget_module.time_steps(trainer, 3, min_seconds=1e9)
    assert trainer.done == 1 + budget_module.CALIBRATION_MAX_STEPS
    assert budget_module.calibration_seconds(SimpleNamespace(calibration_seconds=10.0, budget_minutes=30)) == 10.0
    assert budget_module.calibration_seconds(SimpleNamespace(calibration_seconds=10.0, budget_minutes=5)) == 6.0
    with pytest.raises(XCConfigError, match="train.calibration_seconds"):
        check_train_params(SimpleNamespace(budget_minutes=5, calibration_steps=3, calibration_seconds=-1.0,
                                           reserve=0.1, max_epochs=0))


def test_calibration_stays_within_a_share_of_the_budget_and_skips_what_cannot_fit(monkeypatch):
    """Long texts on 2 cores: steps of 33 s. Past max_seconds (5% of the budget) from the warm-up step no further
    step is timed, one at least. The encoding is estimated first: where it and the reserve leave no room in the
    budget, no step is timed at all and the plan is no epoch -- a 5-minute budget whose encoding alone took 256 s
    had spent 152 s timing four steps, then trained none and ran 42% over."""
    clock = [0.0]
    monkeypatch.setattr(budget_module.time, "perf_counter", lambda: clock[0])
    trainer = _WarmingTrainer(clock, 10**6)  # every step 1.0 s
    assert budget_module.time_steps(trainer, 3, max_seconds=1.5) == (1.0, 8.0) and trainer.done == 2
    trainer = _WarmingTrainer(clock, 10**6)
    assert budget_module.time_steps(trainer, 3, max_seconds=0.0) == (1.0, 8.0) and trainer.done == 2  # one timed
    assert budget_module.time_steps(_WarmingTrainer(clock, 6), 3, min_seconds=10.0, max_seconds=1e9) == (
        pytest.approx(0.1), 8.0)  # a cap far off changes nothing

    made, rate = [], [4.0]
    monkeypatch.setattr(budget_module, "encode_rate", lambda *a, **k: rate[0])
    monkeypatch.setattr(budget_module, "encoded_as", lambda *a, **k: None)

    def calibrate(make, encoder, steps, min_seconds=0.0, max_seconds=float("inf")):
        made.append(max_seconds)
        return 33.0, 256.0, 79

    monkeypatch.setattr(budget_module, "calibrate", calibrate)
    train = SimpleNamespace(budget_minutes=5, reserve=0.15, calibration_steps=3, calibration_seconds=10.0)
    tokens, labels = (np.zeros((1000, 4)), np.full(1000, 4)), (np.zeros((200, 4)), np.full(200, 4))
    cpu = torch.device("cpu")  # texts of one length: the padded tokens count as the texts
    got = budget_module.calibrate_stage(None, None, train, tokens, labels, cpu, None, 256, 0)
    assert got == (0.0, 0.0, 0, 300.0) and made == []  # 1,200 texts at 4/s: the whole budget
    plan = plan_epochs("pretrain.epochs", 5, 1.0, False, *got[:3], got[3], 0.0, 0.15)
    assert plan.planned_epochs == 0.0 and plan.planned_train_seconds == 0.0  # not the configured epoch
    rate[0] = 100.0  # 12 s of encoding: room for steps, timed for 15 s at most
    assert budget_module.calibrate_stage(None, None, train, tokens, labels, cpu, None, 256, 0) == (
        33.0, 256.0, 79, 12.0) and made == [15.0]
    assert budget_module.calibrate_stage(None, None, train, tokens, labels, cpu, None, 256, 0, spent=280.0,
                                         reserve=0.0)[2] == 0  # earlier stages spent what the encoding would leave
    assert made == [15.0]


def test_encoding_rate_is_timed_on_a_sample_that_lasts(monkeypatch):
    """The timed sample doubles from 512 rows until a pass lasts 2 s: with a fixed 0.05 s per call and 1 ms per
    row, 512 rows read 911 texts/s where the whole set runs at ~1,000; the rate is the 2,048-row pass's
    2048 / 2.098. A set smaller than the sample is timed whole; the samples are nested, sorted and distinct."""
    clock, calls = [0.0], []
    monkeypatch.setattr(budget_module.time, "perf_counter", lambda: clock[0])

    def encode(rows):
        calls.append(rows)
        clock[0] += 0.05 + 0.001 * len(rows)

    assert budget_module.encode_rate(encode, 100_000) == pytest.approx(2048 / 2.098)
    assert [len(r) for r in calls] == [512, 512, 1024, 2048]
    assert all(np.array_equal(r, np.unique(r)) and r.max() < 100_000 for r in calls)
    assert set(calls[2]) <= set(calls[3]) and np.array_equal(calls[0], calls[1])
    calls.clear()
    assert budget_module.encode_rate(encode, 300) == pytest.approx(300 / 0.35)
    assert [len(r) for r in calls] == [300, 300]


def test_the_encoding_estimate_counts_padded_tokens_at_the_samples_seconds_per_token(monkeypatch):
    """The estimate is the timed sample's seconds per padded token times the padded tokens of every point and label.
    64 points of 128 tokens fill 4 chunks of 16 rows (8,192 tokens) under a 2,048-token budget; 512 labels of 8
    tokens and one of 20 fill 102 x 20 + 256 x 8 + 155 x 8 = 5,328. A sample of 16 points timed at 100 points/s
    (0.16 s for 2,048 tokens) gives 0.16 x (8,192 + 5,328) / 2,048 s, not the 577 texts at the points' rate (5.77
    s): full text's labels, 27% of its texts, took 11% of its encoding on the 2-core Xeon. With long-tailed
    lengths the sample's rate does not stand for the set's: 16 long points and 48 of 8 tokens pad to 2,048 + 384
    tokens, 0.19 s at the long sample's seconds per token, where 64 points at its rate read 0.64 s."""
    from xc_dagster.encoders import encode as encode_module

    cpu, enc = torch.device("cpu"), SimpleNamespace(cpu_batch_tokens=2048)
    points, labels = np.full(64, 128), np.r_[np.full(512, 8), 20]
    assert encode_module.padded_tokens(enc, points, cpu, 256) == 8192
    assert encode_module.padded_tokens(enc, labels, cpu, 256) == 5328
    assert encode_module.padded_tokens(SimpleNamespace(), labels, cpu, 256) == 256 * 20 + 257 * 8  # rows only
    assert encode_module.padded_tokens(enc, np.zeros(3, dtype=np.int64), cpu, 256) == 3  # a token a row at least
    sampled = []

    def rate(encode, n_rows, **kw):  # times the first 16 rows at 100 rows/s
        sampled.append(n_rows)
        encode(np.arange(16))
        return 100.0

    monkeypatch.setattr(budget_module, "encode_rate", rate)
    monkeypatch.setattr(budget_module, "encode_tokens", lambda *a, **k: None)
    ids = np.zeros((64, 1), dtype=np.int64)  # token ids: not read by the stand-in encoder
    seconds = budget_module.encoding_seconds(enc, (ids, points), (ids, labels), cpu, None, 256, 0)
    assert seconds == pytest.approx(0.16 * (8192 + 5328) / 2048) and sampled == [64]
    assert budget_module.encoding_seconds(enc, (ids, points), (ids, points[:32]), cpu, None, 256, 0) == \
        pytest.approx(0.96)  # labels as long as the points: at their rate
    tail = np.r_[np.full(16, 128), np.full(48, 8)]
    assert encode_module.padded_tokens(enc, tail, cpu, 256) == 2048 + 384
    assert budget_module.encoding_seconds(enc, (ids, tail), (ids, tail[:0]), cpu, None, 256, 0) == \
        pytest.approx(0.16 * 2432 / 2048)


def test_encoding_rate_waits_for_a_sample_encoded_as_the_whole_set(monkeypatch):
    """Long-tailed lengths: 512 rows of mostly short texts fill two 256-row chunks, too few for one torch thread
    each, so their pass runs on one thread however long it lasts; the sample doubles until it is split over the
    threads as the whole set is (here 2,048 rows: 8 chunks for 2 threads), and that pass's rate counts."""
    from xc_dagster.encoders import encode as encode_module

    monkeypatch.setattr(encode_module.torch, "get_num_threads", lambda: 2)
    cpu, enc = torch.device("cpu"), SimpleNamespace(cpu_batch_tokens=8192)
    lengths = np.full(100_000, 8)
    lengths[::1000] = 128  # one long text in a thousand: a chunk of at most 64 of them
    assert encode_module.encode_plan(enc, lengths[:512], cpu, 256)[1] == 1  # 2 chunks (+1 of the long one)
    assert encode_module.encode_plan(enc, lengths, cpu, 256)[1] == 2
    assert encode_module.encode_plan(SimpleNamespace(), lengths, cpu, 256)[1] == 1  # no token budget: intra-op
    clock, calls = [0.0], []
    monkeypatch.setattr(budget_module.time, "perf_counter", lambda: clock[0])

    def encode(rows):
        calls.append(rows)
        clock[0] += 0.005 * len(rows)  # every pass lasts 2 s or more

    whole = encode_module.encoded_as(enc, lengths, cpu, 256)  # as the budget's calibration asks
    assert budget_module.encode_rate(encode, 100_000, runs_as_whole=whole) == pytest.approx(200.0)
    assert [len(r) for r in calls] == [512, 512, 1024, 2048]
    calls.clear()
    assert budget_module.encode_rate(encode, 100_000) == pytest.approx(200.0)
    assert [len(r) for r in calls] == [512, 512]  # without the condition the first pass would count
