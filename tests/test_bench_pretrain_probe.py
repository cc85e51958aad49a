"""bench/pretrain_probe.py: the embedding-ranking metrics by hand, and one probe end to end on generated data."""

from __future__ import annotations

import json
import sys

import numpy as np
import scipy.sparse as sp

from bench import pretrain_probe as pp
from tests.tinydata import write_lf_dataset, write_tiny_encoder


def test_ranking_metrics_by_hand_filter_pairs_removed_before_the_top_1():
    q = np.array([[1.0, 0.0], [0.0, 1.0]], dtype=np.float32)
    reprs = np.array([[1.0, 0.0], [0.6, 0.8], [0.0, 1.0]], dtype=np.float32)
    # q0 ranks 0 (1.0), 1 (0.6), 2 (0.0); q1 ranks 2 (1.0), 1 (0.8), 0 (0.0); both are relevant to label 1 only
    Y = sp.csr_matrix((np.ones(2), ([0, 1], [1, 1])), shape=(2, 3))
    inv = np.array([1.0, 2.0, 4.0])
    m = pp.ranking_metrics(q, reprs, Y, np.array([[0, 0]]), inv)
    # (0, 0) filtered: q0's top 1 is label 1 (right), q1's is label 2 (wrong); PSP@1 = 2 / (2 + 2)
    assert m == {"precision_at_1": 50.0, "psprecision_at_1": 50.0, "precision_at_5": 20.0,
                 "psprecision_at_5": 100.0}
    unfiltered = pp.ranking_metrics(q, reprs, Y, np.zeros((0, 2), dtype=np.int64), inv)
    assert unfiltered["precision_at_1"] == 0.0 and unfiltered["precision_at_5"] == 20.0


def test_one_probe_end_to_end_appends_a_record(tmp_path, monkeypatch, capsys):
    data = write_lf_dataset(tmp_path / "data", n_train=120, n_test=40, n_labels=20)
    enc = write_tiny_encoder(tmp_path / "tiny-bert")
    out = tmp_path / "probes.jsonl"
    argv = ["pretrain_probe.py", "--name", "Tiny", "--source", str(data), "--work", str(tmp_path / "work"),
            "--set", f"tokenize.encoder={enc}", "--set", "pretrain.batch_size=16", "--set", "pretrain.epochs=2",
            "--set", "pretrain.lr=0.001", "--set", "tokenize.max_len=16", "--set", "ingest.valid_fraction=0.1",
            "--set", "pretrain.sampler=random",
            "--label", "tiny", "--out", str(out)]
    for _ in range(2):  # the second run reuses the ingested and tokenized data
        monkeypatch.setattr(sys, "argv", argv)
        pp.main()
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == 2
    r = records[0]
    assert r["label"] == "tiny" and r["pretrain"]["batch_size"] == 16 and r["pretrain"]["epochs"] == 2.0
    assert r["pretrain"]["sampler"] == "random" and r["pretrain"]["num_negatives"] == 30  # override, default
    # 120 - 12 validation points and ngame's 20 label points, batches of 16
    assert r["points"] == 2 * (108 + 20) and r["steps"] == 2 * 8
    assert set(r["metrics"]) == {"valid", "test"}
    for split in ("valid", "test"):
        for repr_name in ("text", "text+centroid"):
            m = r["metrics"][split][repr_name]
            assert set(m) == set(pp.REPORTED) and all(0.0 <= v <= 100.0 for v in m.values())
    assert records[1]["metrics"] == r["metrics"]  # seeded: the same probe gives the same numbers
    assert "valid text+centroid" in capsys.readouterr().out
