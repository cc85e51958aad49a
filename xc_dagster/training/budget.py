"""Training within a time budget (``train.budget_minutes``): measure this machine's speed, then plan the epochs.

A fixed number of epochs means very different training on different data and machines: one epoch is 214 steps
on LF-WordNetNouns but 36 on a 9K-point dataset, and 7 minutes on an AMX Xeon but 29 on an AVX2 EPYC. With a
budget, the stage that trains the encoder (pretraining, or the end-to-end classifier stage) times a few steps
of its own trainer on the real batches (a throw-away copy of the encoder: the model is not changed), and
the encoding of a sample of texts, then plans its epochs so that the training stages together fill the budget:

    epochs = (budget - spent - encoding - reserve) / (seconds per step * steps per epoch)

``spent`` is what the earlier training stages took, ``encoding`` the estimated embedding of every point and
label after training, ``reserve`` what is kept for the stages after it (mining, classifiers, index, fusion): the
share ``train.reserve`` of the budget, and at least the encoding's seconds (``reserve_seconds``: the later
stages search every point against every label, work that grows with the data as the encoding does, where a
share of the budget does not). The LR schedules follow the planned length (they are built from it), and a
deadline at the planned end stops a run that goes slower than measured, so the budget is never overrun by more
than the steps in flight. Epochs set explicitly (catalog overrides, ``--set``, run config) win over the plan.
"""

from __future__ import annotations

import copy
import json
import math
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Callable

import numpy as np

from xc_dagster.encoders.encode import encode_tokens, encoded_as, padded_tokens
from xc_dagster.errors import XCConfigError

BUDGET_PLAN = "budget_plan.json"  # in a stage's checkpoint folder: the plan a resumed run keeps


def check_train_params(p: Any) -> None:
    """``train.*``: a budget >= 0 minutes, >= 1 calibration step, calibration seconds >= 0, a reserve in [0, 1),
    max_epochs >= 0, replan_every in [0, 1]."""
    if not (isinstance(p.budget_minutes, (int, float)) and math.isfinite(p.budget_minutes) and p.budget_minutes >= 0):
        raise XCConfigError(f"train.budget_minutes: expected minutes >= 0 (0 = no budget), got {p.budget_minutes!r}")
    if not (isinstance(p.calibration_steps, int) and p.calibration_steps >= 1):
        raise XCConfigError(f"train.calibration_steps: expected an int >= 1, got {p.calibration_steps!r}")
    if not (isinstance(p.calibration_seconds, (int, float)) and math.isfinite(p.calibration_seconds)
            and p.calibration_seconds >= 0):
        raise XCConfigError(f"train.calibration_seconds: expected seconds >= 0, got {p.calibration_seconds!r}")
    if not 0 <= p.reserve < 1:
        raise XCConfigError(f"train.reserve: expected a share of the budget in [0, 1), got {p.reserve!r}")
    if not p.max_epochs >= 0:
        raise XCConfigError(f"train.max_epochs: expected epochs >= 0 (0 = no cap), got {p.max_epochs!r}")
    if not 0 <= p.replan_every <= 1:
        raise XCConfigError(f"train.replan_every: expected a share of the planned training seconds in [0, 1] "
                            f"(0 = never), got {p.replan_every!r}")


@dataclass
class BudgetPlan:
    """How a stage's epochs were planned, logged with the stage (MLflow, Dagster metadata)."""

    field: str  # the planned setting, e.g. "pretrain.epochs"
    budget_seconds: float
    configured_epochs: float
    planned_epochs: float
    explicit: bool  # epochs were set explicitly: the configured value is kept
    seconds_per_step: float = 0.0
    points_per_second: float = 0.0
    steps_per_epoch: int = 0
    encode_seconds: float = 0.0  # estimated embedding of every point and label after training
    reserved_seconds: float = 0.0  # kept for the later stages
    spent_seconds: float = 0.0  # used by earlier training stages and by the calibration
    planned_train_seconds: float = 0.0
    capped: bool = False  # the plan hit train.max_epochs

    def summary(self) -> dict[str, Any]:
        return asdict(self)

    def save(self, path: Path, key: str) -> None:
        """Keep the plan next to the stage's checkpoint, so a resumed run trains the same plan (a new
        calibration would differ a little, and so would the checkpoint's fingerprint)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps({"key": key, "plan": self.summary()}))
        tmp.replace(path)

    @classmethod
    def load(cls, path: Path, key: str) -> BudgetPlan | None:
        """The plan ``save`` kept for the same configuration (``key``), else None."""
        try:
            d = json.loads(path.read_text())
            names = {f.name for f in fields(cls)}
            return cls(**{k: v for k, v in d["plan"].items() if k in names}) if d.get("key") == key else None
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def deadline(self, started: float, slack: float = 0.02) -> float | None:
        """``time.perf_counter()`` value after which training stops (None: no budget or explicit epochs)."""
        if self.explicit or self.budget_seconds <= 0:
            return None
        return started + self.planned_train_seconds + slack * self.budget_seconds


# of the budget: how far past their deadline the lexical classifiers' hard negatives may project before the
# classifiers are left out, and where their first pass stops (the budget's tolerance is 10%;
# docs/decisions.md#lexical-classifiers-left-out)
SKIP_SLACK = 0.05
CALIBRATION_MAX_STEPS = 200  # timed steps at most, however short each is


def time_steps(trainer: Any, steps: int, min_seconds: float = 0.0,
               max_seconds: float = math.inf) -> tuple[float, float]:
    """(seconds per step, points per step) of ``trainer`` on the first batches of its epoch 0, after one
    untimed warm-up step (allocation, first-call kernels). ``trainer`` has ``epoch_batches`` and ``step`` (which
    returns the loss value, so a GPU's queued work is done when it returns).

    Steps are timed until ``steps`` of them ran and they took ``min_seconds``: on a GPU the first steps of each
    new batch shape cost ~10x a step of the run (an H200 timed 0.99 s/step over 3 steps where the run took 0.11:
    docs/decisions.md#calibration-warm-up). When more than twice ``steps`` ran, the first half is warm-up and the
    rate is the second half's median step; a CPU's few long steps are all timed, as before. Past ``max_seconds``
    from the warm-up step's start no further step is timed, one at least (a step of half a minute on long texts
    and 2 cores took 4 steps, half of a 5-minute budget: docs/decisions.md#calibration-within-the-budget)."""
    batches = trainer.epoch_batches(0)
    if not batches:
        return 0.0, 0.0
    begun = time.perf_counter()
    trainer.step(batches[0])
    seconds: list[float] = []
    points: list[int] = []
    started = time.perf_counter()
    while (len(seconds) < steps or (time.perf_counter() - started < min_seconds
                                    and len(seconds) < CALIBRATION_MAX_STEPS)) \
            and (not seconds or time.perf_counter() - begun < max_seconds):
        b = batches[(len(seconds) + 1) % len(batches)]
        t0 = time.perf_counter()
        trainer.step(b)
        seconds.append(time.perf_counter() - t0)
        points.append(len(getattr(b, "labels", b)))
    if len(seconds) > 2 * steps:  # the second half's median: past the warm-up, robust to a slow step
        return float(np.median(seconds[len(seconds) // 2:])), float(np.mean(points[len(points) // 2:]))
    return float(np.mean(seconds)), float(np.mean(points))


CALIBRATION_SHARE = 0.02  # of the budget at most, timing the steps
CALIBRATION_CAP = 0.05  # of the budget: no further step is timed past it (one timed step at least)


def calibration_seconds(p: Any) -> float:
    """The least seconds the calibration times steps for (``time_steps``): ``train.calibration_seconds``, at most
    2% of the budget (a half-minute budget on a test's tiny data times its steps for 0.6 s)."""
    return min(float(p.calibration_seconds), CALIBRATION_SHARE * 60.0 * float(p.budget_minutes))


def calibrate(make_trainer: Callable[[Any], Any], encoder: Any, steps: int,
              min_seconds: float = 0.0, max_seconds: float = math.inf) -> tuple[float, float, int]:
    """Time ``steps`` steps, and ``min_seconds`` at least, of ``make_trainer(copy of encoder)`` (the real encoder
    is not touched; :func:`time_steps`).

    Returns (seconds per step, points per step, steps per epoch)."""
    enc = copy.deepcopy(encoder)
    if enc is not None:
        # in train mode, as the run trains: a transformer loads in eval mode, and its dropout is part of every real
        # step (MiniLM on this CPU: steps 1.09-1.47x slower with it, docs/decisions.md#calibration-as-trained)
        enc.train()
    trainer = make_trainer(enc)
    try:
        spe = int(getattr(trainer, "steps_per_epoch", 0) or len(trainer.epoch_batches(0)))
        sec, pts = time_steps(trainer, steps, min_seconds, max_seconds)
    finally:
        close = getattr(trainer, "close", None)
        if close is not None:
            close()
    return sec, pts, spe


def calibrate_stage(make_trainer: Callable[[Any], Any], encoder: Any, train: Any, tokens: tuple[Any, Any],
                    label_tokens: tuple[Any, Any], device: Any, dtype: Any, batch_size: int,
                    seed: int, spent: float = 0.0, reserve: float | None = None,
                    part: float = 1.0) -> tuple[float, float, int, float]:
    """What a stage training the encoder plans its epochs from, under ``train`` (``train.*``): :func:`calibrate`'s
    (seconds per step, points per step, steps per epoch) and the seconds to encode every point (``tokens``) and
    label (``label_tokens``) after training, from :func:`encode_rate` on a sample of the points. The encoding is
    estimated first: where it and the stages after it (``reserve``, default ``train.reserve``) leave no room in the
    budget past the ``spent`` seconds, no step is timed (0, 0, 0: :func:`plan_epochs` plans no epoch); ``part``:
    :func:`reserve_seconds`'."""
    started = time.perf_counter()
    encode_s = encoding_seconds(encoder, tokens, label_tokens, device, dtype, batch_size, seed)
    budget = 60.0 * train.budget_minutes
    share = train.reserve if reserve is None else reserve
    if training_room(budget, spent + time.perf_counter() - started, encode_s, share, part) <= 0:
        return 0.0, 0.0, 0, encode_s
    sec, pts, spe = calibrate(make_trainer, encoder, train.calibration_steps, calibration_seconds(train),
                              CALIBRATION_CAP * budget)
    return sec, pts, spe, encode_s


def encoding_seconds(encoder: Any, tokens: tuple[Any, Any], label_tokens: tuple[Any, Any], device: Any, dtype: Any,
                     batch_size: int, seed: int) -> float:
    """The estimated seconds to encode every point (``tokens``) and label (``label_tokens``): the seconds per
    padded token of :func:`encode_rate`'s timed sample of the points, times the padded tokens of both
    (:func:`padded_tokens`); ``encoder`` is left in eval mode. Label names are a few tokens where full-text points
    fill up to 128 (counted as points, they were 27% of full text's estimate where they take 11% of its encoding),
    and a sample of long-tailed lengths pads more than the whole set does (Delicious: 29.8 s estimated from its
    rate, 24.0 s run): docs/decisions.md#encode-labels-by-tokens."""
    timed: list[np.ndarray] = []

    def encode(rows: np.ndarray) -> Any:
        timed.append(rows)
        return encode_tokens(encoder, tokens[0][rows], tokens[1][rows], device, dtype, batch_size)

    rate = encode_rate(encode, len(tokens[1]), seed=seed,
                       runs_as_whole=encoded_as(encoder, tokens[1], device, batch_size))
    sample = timed[-1] if timed else np.arange(len(tokens[1]))
    return padded_seconds(encoder, tokens[1][sample], len(sample) / rate,
                          padded_tokens(encoder, tokens[1], device, batch_size)
                          + padded_tokens(encoder, label_tokens[1], device, batch_size), device, batch_size)


def padded_seconds(encoder: Any, sample_lengths: np.ndarray, sample_seconds: float, padded: int, device: Any,
                   batch_size: int) -> float:
    """Seconds to encode ``padded`` padded tokens at the rate of a sample of rows of ``sample_lengths`` encoded in
    ``sample_seconds`` (its seconds per padded token: :func:`padded_tokens`)."""
    return sample_seconds / max(padded_tokens(encoder, sample_lengths, device, batch_size), 1) * padded


def reserve_seconds(share: float, budget_seconds: float, encode_seconds: float, part: float = 1.0) -> float:
    """What the stages after the encoder's training keep of the budget: its ``share``, and at least the
    encoding's seconds. On the 131K shape (MiniLM, 2-core CPU without AMX) the later stages took 0.8x the
    encoding of every point and label, full text 1.35x (AMD EPYC), Titles 1.9x, where a 15% share of 30 minutes
    covers them (docs/decisions.md#reserve-at-least-the-encoding). ``part``: the share of that which the stages
    after a later one keep (the end-to-end classifier stage's: the index and fusion keep a third, as after
    ``ngame``'s classifiers)."""
    return part * max(share * budget_seconds, encode_seconds)


def training_room(budget_seconds: float, spent_seconds: float, encode_seconds: float, reserve: float,
                  part: float = 1.0) -> float:
    """The seconds of the budget left to train the encoder in (negative: none): less what is spent, the encoding
    after training and what the later stages keep (:func:`reserve_seconds`)."""
    return budget_seconds - spent_seconds - encode_seconds - reserve_seconds(reserve, budget_seconds, encode_seconds,
                                                                             part)


def reserved_after_pretraining(pretrain_summary: dict[str, Any] | None, train: Any) -> float:
    """The seconds the pretraining's plan kept for the stages after it (its summary's ``budget``), or the share
    ``train.reserve`` of the budget where it planned none (epochs set explicitly, no pretraining)."""
    plan = (pretrain_summary or {}).get("budget") or {}
    share = train.reserve * 60.0 * train.budget_minutes
    if plan.get("explicit", True) or float(plan.get("budget_seconds", 0.0)) != 60.0 * train.budget_minutes:
        return share
    return max(share, float(plan.get("reserved_seconds", 0.0)))


def stage_deadline(train: Any, spent_seconds: float, started: float, keep_seconds: float) -> float | None:
    """The ``time.perf_counter()`` value at which a stage after the encoder's training stops its own iterations
    (the classifiers' epochs, the lexical classifiers' passes): the budget less the ``keep_seconds`` that the
    stages after this one keep, less ``spent_seconds`` the earlier stages took; None without a budget."""
    if train.budget_minutes <= 0:
        return None
    return started + max(0.0, 60.0 * train.budget_minutes - keep_seconds - spent_seconds)


ENCODE_SAMPLE_SECONDS = 2.0  # the encoding's timed pass lasts this long at least (or holds every row)


def encode_rate(encode: Callable[[np.ndarray], Any], n_rows: int, sample: int = 512, seed: int = 0,
                min_seconds: float = ENCODE_SAMPLE_SECONDS,
                runs_as_whole: Callable[[np.ndarray], bool] | None = None) -> float:
    """Texts per second of ``encode(rows)`` on seeded random samples of ``n_rows`` rows: an untimed warm-up pass
    over ``sample`` rows, then timed passes over samples doubling from ``sample`` rows until one lasts
    ``min_seconds`` and ``runs_as_whole(rows)`` (the sample is encoded the way the whole set will be), or holds
    every row; the last pass's rate.

    A sample of a few hundred short texts runs unlike the whole set: on a CPU fewer than ``CHUNKS_PER_THREAD``
    chunks per thread run on one thread (intra-op) instead of one torch thread each, and per-chunk costs weigh
    more (MiniLM on Titles, EPYC: 512 points read 602 texts/s, 2,048 717, 8,192 863; the pipeline's 512-point
    estimates were 1.2-2.3x the runs' encoding seconds, docs/decisions.md#encode-rate-sample). Long-tailed lengths
    pack a sample's many short texts into few full chunks, whose pass can last ``min_seconds`` on the one thread:
    hence ``runs_as_whole``."""
    order = np.random.default_rng(seed).permutation(n_rows)
    size = min(sample, n_rows)
    encode(np.sort(order[:size]))  # warm-up: the batch shapes (a GPU's first call of each costs ~25x its run's rate)
    while True:
        rows = np.sort(order[:size])
        t0 = time.perf_counter()
        encode(rows)
        seconds = max(time.perf_counter() - t0, 1e-9)
        if size >= n_rows or (seconds >= min_seconds and (runs_as_whole is None or runs_as_whole(rows))):
            return size / seconds
        size = min(2 * size, n_rows)


def whole_steps(epochs: float, steps_per_epoch: int) -> float:
    """``epochs`` rounded down to whole steps, never above what fits: the trainers run ceil(epochs x steps per
    epoch) steps, exactly the whole steps that fit: steps / steps per epoch rounded down to 6 decimals, 10^-6 less
    where float rounding puts the product past the whole step (exact up to 10^6 steps an epoch). Two decimals of an
    epoch, as before, dropped up to 1% of an epoch: 87 steps of a 1.3M-point epoch of 8,768, which a short CPU
    budget's whole run can be."""
    steps = math.floor(epochs * steps_per_epoch)
    whole = math.floor(steps / steps_per_epoch * 1e6) / 1e6
    return whole - 1e-6 if math.ceil(whole * steps_per_epoch) > steps else whole


def plan_epochs(field: str, budget_minutes: float, configured: float, explicit: bool, seconds_per_step: float,
                points_per_step: float, steps_per_epoch: int, encode_seconds: float, spent_seconds: float,
                reserve: float, max_epochs: float = 0.0, part: float = 1.0) -> BudgetPlan:
    """The epochs that fill what is left of the budget (at least 0; at most ``max_epochs`` when > 0), less the
    share ``reserve`` of it or the encoding's seconds, whichever is more, times ``part`` (``reserve_seconds``)."""
    budget = 60.0 * budget_minutes
    reserved = reserve_seconds(reserve, budget, encode_seconds, part)
    plan = BudgetPlan(field, budget, float(configured), float(configured), explicit, seconds_per_step,
                      points_per_step / max(seconds_per_step, 1e-9), steps_per_epoch, encode_seconds, reserved,
                      spent_seconds)
    available = max(0.0, training_room(budget, spent_seconds, encode_seconds, reserve, part))
    if not explicit and budget > 0 and available <= 0:  # nothing left: no training rather than an overrun
        plan.planned_epochs = 0.0
        return plan
    if explicit or budget <= 0 or seconds_per_step <= 0 or steps_per_epoch <= 0:
        plan.planned_train_seconds = configured * steps_per_epoch * seconds_per_step
        return plan
    epochs = available / (seconds_per_step * steps_per_epoch)
    if max_epochs > 0 and epochs > max_epochs:
        epochs, plan.capped = float(max_epochs), True
    epochs = whole_steps(epochs, steps_per_epoch)
    plan.planned_epochs = epochs
    plan.planned_train_seconds = epochs * steps_per_epoch * seconds_per_step
    return plan
