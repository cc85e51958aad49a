"""The planner's pretraining calibration runs the steps the stage runs: texts whose token lengths follow the
dataset's (the tokenize stage's lengths), a trainer whose encoder is in train mode (dropout on)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from xc_dagster.config import resolve_config
from xc_dagster.planning import calibration, dataset_shape
from xc_dagster.planning.model import Costs, Shape
from xc_dagster.training import budget

# 95 texts of 10 tokens, 5 cut at max_len 128: a bag-of-words dataset's long tail (Delicious: 3.7% at 128)
TAIL = np.array([10] * 95 + [128] * 5, dtype=np.int32)


def _cfg(**overrides):
    return resolve_config("quick", "ngame", ("test", {"tokenize.max_len": 128, **overrides}))


def test_length_percentiles_of_a_long_tail():
    """np.percentile's linear interpolation on the sorted lengths: rank q * 99 of 100."""
    p = calibration.length_percentiles(TAIL, 128)
    assert len(p) == calibration.LENGTH_PERCENTILES == 101
    assert p[:95] == (10,) * 95  # rank q * 0.99 <= 94 for q <= 94; q = 95: rank 94.05 -> 10 + 0.05 * 118 = 15.9
    assert p[95] == 16 and p[96:] == (128,) * 5  # q = 96: rank 95.04, already between two 128s
    assert calibration.length_percentiles(TAIL, 64)[96:] == (64,) * 5  # cut at a smaller max_len
    assert calibration.length_percentiles(np.array([], dtype=np.int32), 128) == ()


def test_synthetic_lengths_follow_the_percentiles():
    """Drawn through the percentiles above: u <= 0.95 gives 10, u >= 0.96 gives 128 (rounded from >= 127.5 a
    little below), so ~95% of the rows have 10 tokens and ~4% have 128; the normal around the same mean (15.9)
    never reaches 128: no batch pads its longest chunk to max_len, which made real steps ~1.3x slower."""
    rng = np.random.default_rng(0)
    p = calibration.length_percentiles(TAIL, 128)
    ids, lens = calibration.synthetic_tokens(rng, 20_000, float(TAIL.mean()), 128, 30_000, p)
    assert ids.shape == (20_000, 128) and lens.min() >= 1 and lens.max() == 128
    assert np.mean(lens == 10) == pytest.approx(0.95, abs=0.01)
    assert np.mean(lens == 128) == pytest.approx(0.04, abs=0.005)
    assert (ids[np.arange(128)[None, :] >= lens[:, None]] == 0).all() and (ids[:, 0] >= 1000).all()
    _, normal = calibration.synthetic_tokens(rng, 20_000, float(TAIL.mean()), 128, 30_000)
    assert normal.max() < 64 and normal.mean() == pytest.approx(TAIL.mean(), abs=0.5)


def _summaries(root, lens: np.ndarray, label_lens: np.ndarray) -> None:
    for stage, summary in {"ingest": {"n_train": 100, "n_test": 20, "n_labels": 30, "avg_labels_per_point": 2.0,
                                      "n_valid": 0},
                           "tokenize": {"train_mean_len": float(lens.mean()),
                                        "label_mean_len": float(label_lens.mean())}}.items():
        (root / "D" / stage).mkdir(parents=True)
        (root / "D" / stage / "summary.json").write_text(json.dumps(summary))
    np.save(root / "D" / "tokenize" / "train_len.npy", lens)
    np.save(root / "D" / "tokenize" / "label_len.npy", label_lens)


def test_shape_carries_the_tokenize_stage_lengths(tmp_path):
    _summaries(tmp_path, TAIL, np.full(30, 5, dtype=np.int32))
    cfg = _cfg()
    shape, source = dataset_shape(tmp_path, "D", cfg, {})
    assert shape.tokens == pytest.approx(15.9) and shape.token_percentiles == calibration.length_percentiles(TAIL, 128)
    assert shape.label_token_percentiles == (5,) * 101 and "token lengths" in source
    # --tokens describes other texts than the tokenized ones: no percentiles, the normal around the mean
    other, _ = dataset_shape(tmp_path, "D", cfg, {"tokens": 40.0})
    assert other.tokens == 40.0 and other.token_percentiles == other.label_token_percentiles == ()


class RecordingUnits:
    """Records the settings a unit is keyed by and measures it."""

    def __init__(self):
        self.device, self.keys = torch.device("cpu"), []

    def get(self, name, settings, measure):
        self.keys.append((name, settings))
        return measure()


def test_encoder_calibration_trains_in_train_mode_on_the_real_lengths(monkeypatch):
    """The trainer it times gets an encoder in train mode (dropout on, as ``train_siamese``'s start sets it;
    a loaded encoder is in eval mode) and texts drawn through the shape's percentiles; the cache key holds them."""
    seen = {}

    def time_steps(trainer, n, min_seconds=0.0, max_seconds=float("inf")):  # what budget.calibrate times
        seen["training"] = [m.training for m in trainer.encoder.modules()]
        seen["lens"] = trainer.point_tokens[1]
        return 1.0, 256.0

    monkeypatch.setattr(budget, "time_steps", time_steps)
    monkeypatch.setattr(calibration, "ENCODE_TEXTS", 16)
    cfg = _cfg(**{"tokenize.encoder": "bag:16", "pretrain.batch_size": 256})
    p = calibration.length_percentiles(TAIL, 128)
    shape = Shape(1000, 100, 50, 2.0, float(TAIL.mean()), 5.0, 0, p, (5,) * 101)
    units = RecordingUnits()
    costs = Costs(units, cfg, shape)
    assert costs.encoder["pretrain_step_s"] == 1.0
    assert seen["training"] and all(seen["training"])
    lens = np.asarray(seen["lens"])  # ngame trains on the label points too: 1,024 points, then their labels' texts
    assert len(lens) == 2048 and np.mean(lens[:1024] == 128) == pytest.approx(0.04, abs=0.02)
    assert set(lens[1024:]) == {5}
    assert units.keys[0][1]["lengths"] == [list(p), [5] * 101]
