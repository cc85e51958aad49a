"""bench/frequency_baseline.py: the most frequent training labels for every test point, scored by hand."""

from __future__ import annotations

import json
import sys

import numpy as np
import scipy.sparse as sp

from bench import frequency_baseline as fb


def test_most_frequent_labels_scored_with_filters_out(tmp_path, monkeypatch):
    # training counts: label 2 x3, label 0 x2, label 1 x1, label 3 x0 -> ranking 2, 0, 1, 3
    Y_train = sp.csr_matrix(np.array([[1, 0, 1, 0], [1, 1, 1, 0], [0, 0, 1, 0]], dtype=np.float32))
    # test row 0 has label 2 (P@1 hit); row 1 has label 0 and its pair (1, 2) is filtered out, so its list is
    # 0, 1, 3: P@1 hit; row 2 has label 3 only: no hit in the top 1
    Y_test = sp.csr_matrix(np.array([[0, 0, 1, 0], [1, 0, 0, 0], [0, 0, 0, 1]], dtype=np.float32))
    sp.save_npz(tmp_path / "Y_train.npz", Y_train)
    sp.save_npz(tmp_path / "Y_test.npz", Y_test)
    np.save(tmp_path / "filter_test.npy", np.array([[1, 2]], dtype=np.int64))
    monkeypatch.setattr(sys, "argv", ["frequency_baseline.py", str(tmp_path), "--out", str(tmp_path / "b.json")])
    fb.main()
    out = json.loads((tmp_path / "b.json").read_text())
    assert out["top_label_points"] == 3 and out["labels"] == 4
    assert out["precision_at_1"] == round(100 * 2 / 3, 2)
    # P@3: row 0 list 2,0,1 -> 1 hit; row 1 list 0,1,3 -> 1; row 2 list 2,0,1 -> 0: 2 hits of 9
    assert out["precision_at_3"] == round(100 * 2 / 9, 2)
