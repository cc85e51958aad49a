"""bench/pretrain_overhead.py's command line: a step count of 0 skips that part, a negative one or skipping
everything is an argparse error before any data is read (the runs themselves: its docstring's smoke command)."""

from __future__ import annotations

import argparse
import sys

import pytest

from bench import pretrain_overhead as po


def _args(**kw) -> argparse.Namespace:
    base = dict(encoders=["bag", "minilm"], samplers=["random", "ngame", "siamesexml"], steps=40, minilm_steps=6,
                classifier_modes=["shortlist", "in-batch", "both"], classifier_steps=20, crosscheck_steps=20)
    return argparse.Namespace(**{**base, **kw})


def test_zero_steps_skip_their_part():
    args = _args()
    assert po.plan_parts(args) == ([("bag", 40), ("minilm", 6)], ["random", "siamesexml"],
                                   ["shortlist", "in-batch", "both"])
    assert args.skipped == []
    args = _args(minilm_steps=0, classifier_steps=0)
    encoders, cross, modes = po.plan_parts(args)
    assert encoders == [("bag", 40)] and cross == ["random", "siamesexml"] and modes == []
    assert args.skipped == ["pretrain minilm: --minilm-steps 0", "classifier: --classifier-steps 0"]
    args = _args(steps=0, crosscheck_steps=0)
    encoders, cross, modes = po.plan_parts(args)
    assert encoders == [("minilm", 6)] and cross == [] and modes == ["shortlist", "in-batch", "both"]
    assert args.skipped == ["pretrain bag: --steps 0", "crosscheck: --crosscheck-steps 0"]


@pytest.mark.parametrize("argv, message", [
    (["--classifier-steps", "-1"], "argument --classifier-steps: expected a whole number >= 0"),
    (["--steps", "two"], "argument --steps: expected a whole number >= 0"),
    (["--steps", "0", "--minilm-steps", "0", "--classifier-steps", "0", "--crosscheck-steps", "0",
      "--clustering-sizes"], "nothing to measure: every part is skipped"),
])
def test_bad_or_empty_step_counts_are_argparse_errors(monkeypatch, capsys, argv, message):
    def no_data(*a, **kw):
        raise AssertionError("the data must not be read")

    monkeypatch.setattr(po, "load_data", no_data)
    monkeypatch.setattr(sys, "argv", ["pretrain_overhead.py", *argv])
    with pytest.raises(SystemExit) as exc:
        po.main()
    assert exc.value.code == 2 and message in capsys.readouterr().err
