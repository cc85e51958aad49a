"""Progress of long work: lines at a bounded rate with tqdm's rate and ETA formats, the final line, the rate
metric, the bar's switch, and a tiny pretraining reporting its steps of the planned total."""

from __future__ import annotations

import dataclasses
import math
import re

import numpy as np
import pytest
import torch

from tests.tinydata import label_word_texts
from xc_dagster import progress
from xc_dagster.config import PretrainParams
from xc_dagster.device import seed_everything
from xc_dagster.encoders.loading import load_encoder
from xc_dagster.errors import XCConfigError
from xc_dagster.progress import Progress, in_one_call
from xc_dagster.training.siamese import SiameseTrainer, train_siamese


class Clock:
    """A fake ``monotonic`` that moves only when the test says."""

    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def clock(monkeypatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(progress, "monotonic", c)
    return c


def test_lines_at_most_every_n_seconds_with_rate_eta_and_a_final_line(clock):
    lines, metrics = [], []
    with Progress("encode test", 1000, "texts", lines.append, lambda step, v: metrics.append((step, v)),
                  every=30, bar=False) as prog:
        for _ in range(100):  # 10 texts a second for 100 s
            clock.t += 1.0
            prog.update(10)
    assert lines == ["encode test: 300/1000 texts (30%), 10.0/s, ETA 01:10",
                     "encode test: 600/1000 texts (60%), 10.0/s, ETA 00:40",
                     "encode test: 900/1000 texts (90%), 10.0/s, ETA 00:10",
                     "encode test: 1000/1000 texts (100%), 10.0/s, ETA 00:00, elapsed 01:40"]
    assert metrics == [(300, {"encode_test_per_s": 10.0}), (600, {"encode_test_per_s": 10.0}),
                       (900, {"encode_test_per_s": 10.0}), (1000, {"encode_test_per_s": 10.0})]


def test_many_small_updates_still_give_one_line_per_interval(clock, monkeypatch):
    monkeypatch.setenv("XC_PROGRESS_SECONDS", "10")
    lines = []
    with Progress("pretrain", 5000, "steps", lines.append, bar=False) as prog:
        for i in range(4750):  # 95 s, a step every 20 ms
            clock.t = 1000.0 + (i + 1) / 50
            prog.update()
    assert len(lines) == 9 + 1  # at 10 s, 20 s, ... 90 s, and the final line
    assert lines[0] == "pretrain: 500/5000 steps (10%), 50.0/s, ETA 01:30"
    assert lines[-1] == "pretrain: 4750/5000 steps (95%), 50.0/s, ETA 00:05, elapsed 01:35"


def test_hours_slow_and_fast_rates_and_a_resumed_run(clock):
    slow = Progress("pretrain", 100_000, "steps", bar=False)
    clock.t += 30.0
    slow.done = 300
    assert slow.line(clock.t) == "pretrain: 300/100000 steps (0%), 10.0/s, ETA 2:46:10"  # 99700 / 10 s
    resumed = Progress("pretrain", 100, "steps", initial=40, bar=False)  # the rate counts this run's steps only
    clock.t += 40.0
    resumed.update(10)
    assert resumed.line(clock.t) == "pretrain: 50/100 steps (50%), 0.25/s, ETA 03:20"
    fast = Progress("retrieve test", 50_000, "queries", bar=False)
    clock.t += 8.0
    fast.update(9876)
    assert fast.line(clock.t) == "retrieve test: 9876/50000 queries (19%), 1.23k/s, ETA 00:32"
    assert Progress("x", 5, bar=False).line(clock.t) == "x: 0/5 it (0%), 0.00/s, ETA ?"  # no time passed yet
    empty = Progress("encode test", 0, "texts", bar=False)
    assert empty.line(clock.t, final=True) == "encode test: 0/0 texts (100%), 0.00/s, ETA 00:00, elapsed 00:00"


def test_a_failed_block_reports_no_final_line_and_one_call_work_reports_start_and_end(clock):
    lines = []
    with pytest.raises(RuntimeError), Progress("encode test", 10, "texts", lines.append, bar=False) as prog:
        prog.update(4)
        raise RuntimeError("boom")
    assert lines == []
    with in_one_call("index W", 20, "vectors", lines.append, "hnsw build"):
        clock.t += 5.0
    assert lines == ["index W: hnsw build started: 20 vectors",
                     "index W: 20/20 vectors (100%), 4.00/s, ETA 00:00, elapsed 00:05"]


def test_the_bar_goes_to_stderr_when_asked_and_bad_settings_name_the_variable(monkeypatch, capsys):
    with Progress("encode test", 3, "texts", bar=False) as prog:
        prog.update(3)
    assert capsys.readouterr().err == ""  # and pytest's stderr is no terminal: no bar by default either
    monkeypatch.setenv("XC_PROGRESS_BAR", "1")
    with Progress("encode test", 3, "texts") as prog:
        prog.update(3)
    assert "encode test: 100%" in capsys.readouterr().err
    monkeypatch.setenv("XC_PROGRESS_BAR", "maybe")
    with pytest.raises(XCConfigError, match="XC_PROGRESS_BAR"):
        Progress("x", 1)
    monkeypatch.setenv("XC_PROGRESS_BAR", "0")
    monkeypatch.setenv("XC_PROGRESS_SECONDS", "0")
    with pytest.raises(XCConfigError, match="XC_PROGRESS_SECONDS: expected a positive number"):
        Progress("x", 1)


def test_a_tiny_pretraining_reports_its_steps_of_the_planned_total(monkeypatch):
    monkeypatch.setenv("XC_PROGRESS_SECONDS", "1e-9")  # a line at every step
    pt, lt, Y = label_word_texts()
    params = dataclasses.replace(PretrainParams(), batch_size=6, chunk_size=8, warmup_steps=1, lr=1e-2, amp="off",
                                 epochs=1.5, num_negatives=3)
    planned = SiameseTrainer(load_encoder("bag:16"), pt, lt, Y, np.arange(24), params, torch.device("cpu"),
                             None).total_steps
    lines, metrics = [], []
    seed_everything(0)
    res = train_siamese(load_encoder("bag:16"), pt, lt, Y, np.arange(24), params, torch.device("cpu"), None,
                        lambda step, v: metrics.append((step, v)), report=lines.append)
    assert planned == math.ceil(1.5 * 4) == res.steps  # 24 points in batches of 6: 4 steps an epoch
    parsed = [re.match(r"pretrain: (\d+)/(\d+) steps \((\d+)%\), \S+/s, ETA \S+", line) for line in lines]
    assert all(parsed), lines
    assert [int(m[1]) for m in parsed] == list(range(1, planned + 1)) + [planned]  # every step, then the final
    assert {int(m[2]) for m in parsed} == {planned} and parsed[-1][3] == "100" and ", elapsed " in lines[-1]
    assert [step for step, v in metrics if "pretrain_per_s" in v] == list(range(1, planned + 1)) + [planned]
