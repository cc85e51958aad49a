"""Evaluation reports (decile contributions, recall by label frequency, plots) and model comparison."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp

from tests.tinydata import ready_home
from xc_dagster.cli import main as cli_main
from xc_dagster.evaluation.comparison import comparison_table, evaluation_runs, rank_runs, reference_rows
from xc_dagster.evaluation.metrics import evaluate
from xc_dagster.evaluation.reports import (
    decile_contributions,
    decile_plot,
    frequency_buckets,
    frequency_deciles,
    pk_plot,
    recall_by_frequency,
    recall_plot,
)
from xc_dagster.tracking import Tracker


def csr(rows: list[list[int]], L: int) -> sp.csr_matrix:
    r = [i for i, ls in enumerate(rows) for _ in ls]
    c = [l for ls in rows for l in ls]
    return sp.csr_matrix((np.ones(len(c)), (r, c)), shape=(len(rows), L))


FREQ = np.array([6, 3, 2, 1])  # training frequencies of 4 labels, 12 positives in all
Y = csr([[0, 1], [2], [3]], 4)
IDS = np.array([[0, 2], [2, 1], [0, -1]])  # top-2: row0 hits l0, row1 hits l2, row2 nothing
IP = np.array([1.0, 2.0, 3.0, 4.0])


def test_frequency_deciles_equal_training_positives_per_bin():
    # sorted desc l0(6) l1(3) l2(2) l3(1); positives before each: 0, 6, 9, 11 of 12
    # 2 bins: floor(2 * before / 12) = 0, 1, 1, 1
    assert frequency_deciles(FREQ, 2).tolist() == [0, 1, 1, 1]
    # 4 bins: floor(4 * before / 12) = 0, 2, 3, 3 (bin 1 is empty: the head label alone holds half)
    assert frequency_deciles(FREQ, 4).tolist() == [0, 2, 3, 3]
    # unseen labels go to the tail bin; ties keep label order
    assert frequency_deciles(np.array([0, 5, 5]), 2).tolist() == [1, 0, 1]


def test_decile_contributions_hand_example_sum_to_the_metrics():
    m = evaluate(IDS, Y, ks=(2,), inv_prop=IP)
    # P@2 = (1 + 1 + 0) / (3 rows * 2) = 1/3; PSP@2 numerator (1 + 3) / 6, ideal (2+1 + 3 + 4) / 6 -> 0.4
    assert m["precision_at_2"] == pytest.approx(1 / 3)
    assert m["psprecision_at_2"] == pytest.approx(0.4)
    dec = decile_contributions(IDS, Y, FREQ, IP, m, k=2, n_bins=2)
    # l0 is bin 0, l2 bin 1: each gives one hit of 6 slots; PSP weights 1 and 3 of 4 -> 0.1 / 0.3
    assert dec["precision"] == pytest.approx([1 / 6, 1 / 6])
    assert dec["psprecision"] == pytest.approx([0.1, 0.3])
    assert sum(dec["precision"]) == pytest.approx(m["precision_at_2"])
    assert sum(dec["psprecision"]) == pytest.approx(m["psprecision_at_2"])
    assert dec["n_labels"] == [1, 3] and dec["min_freq"] == [6, 1] and dec["max_freq"] == [6, 3]


def test_decile_contributions_match_evaluate_on_random_data():
    rng = np.random.default_rng(0)
    n, L, K = 300, 50, 10
    Yr = sp.random(n, L, density=0.08, random_state=1, format="csr")
    Yr.data[:] = 1
    ids = np.stack([rng.permutation(L)[:K] for _ in range(n)])
    freq = rng.integers(0, 40, L)
    ip = 1 + rng.random(L)
    m = evaluate(ids, Yr, ks=(5,), inv_prop=ip)
    dec = decile_contributions(ids, Yr, freq, ip, m, k=5)
    assert sum(dec["precision"]) == pytest.approx(m["precision_at_5"])
    assert sum(dec["psprecision"]) == pytest.approx(m["psprecision_at_5"])
    assert sum(dec["n_labels"]) == L


def test_recall_by_frequency_hand_example():
    b, names = frequency_buckets(FREQ)
    # 6 -> 4-7 (bucket 3), 3 and 2 -> 2-3 (bucket 2), 1 -> 1 (bucket 1)
    assert b.tolist() == [3, 2, 2, 1] and names == ["0", "1", "2-3", "4-7"]
    sl = np.array([[0, 1, 2], [3, 2, 1], [3, 0, 1]])
    rec = recall_by_frequency(IDS, Y, FREQ, k=2, shortlist=sl)
    # test positives: l3 (bucket 1): 1; l1, l2 (bucket 2): 2; l0 (bucket 3): 1
    assert rec["test_positives"] == [0, 1, 2, 1]
    # top-2 finds l0 and l2: bucket 1 0/1, bucket 2 1/2, bucket 3 1/1
    assert rec["recall"] == pytest.approx([0.0, 0.0, 0.5, 1.0])
    assert rec["shortlist_recall"] == pytest.approx([0.0, 1.0, 1.0, 1.0])
    assert rec["n_labels"] == [0, 1, 2, 1]


def test_plots_are_png(tmp_path):
    m = evaluate(IDS, Y, ks=tuple(range(1, 11)), inv_prop=IP)
    dec = decile_contributions(IDS, Y, FREQ, IP, m, k=2, n_bins=2)
    rec = recall_by_frequency(IDS, Y, FREQ, k=2)
    for path in (pk_plot(m, tmp_path / "a.png"), decile_plot(dec, tmp_path / "b.png"),
                 recall_plot(rec, tmp_path / "c.png")):
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _log_eval(tracker: Tracker, dataset: str, strategy: str, p1: float, psp1: float, train_s: float,
              fusion: str = "alpha") -> str:
    params = {"strategy": strategy, "preset": "quick", "tokenize.encoder": "/models/tiny-bert",
              "fusion.method": fusion, "pretrain.epochs": 1.0, "evaluate.top_k": 100}
    with tracker.run(dataset, "evaluate", params, {"strategy": strategy}) as run:
        run.log_final({"precision_at_1": p1, "psprecision_at_1": psp1, "precision_at_5": p1 / 2,
                       "stage_seconds.training_total": train_s})
        return run.run_id


def test_compare_ranks_runs_and_adds_reference_rows(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XC_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    home = ready_home(tmp_path / "home")
    tracker = Tracker(home.mlflow_uri, home.mlflow_artifacts)
    name = "LF-WordNetNounsTitles"
    a = _log_eval(tracker, name, "ngame", 0.34, 0.23, 600)
    b = _log_eval(tracker, name, "siamesexml", 0.36, 0.21, 540, fusion="tree")
    with pytest.raises(RuntimeError):  # a failed run is not compared
        with tracker.run(name, "evaluate", {"strategy": "broken"}, {}):
            raise RuntimeError("boom")
    runs = rank_runs(evaluation_runs(home.mlflow_uri, name))
    assert [r.label for r in runs] == [b[:8], a[:8]]  # best P@1 first
    assert runs[0].strategy == "siamesexml" and runs[0].encoder == "tiny-bert"
    assert runs[0].metrics["precision_at_1"] == pytest.approx(36.0) and runs[0].train_minutes == pytest.approx(9)
    assert [r.label for r in rank_runs(runs, "psprecision_at_1")] == [a[:8], b[:8]]
    refs = reference_rows(name)
    assert any(r.strategy.startswith("Omikuji") and r.metrics["precision_at_1"] == 27.6 for r in refs)

    assert cli_main(["compare", name]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    row_b = next(i for i, ln in enumerate(lines) if b[:8] in ln)
    row_a = next(i for i, ln in enumerate(lines) if a[:8] in ln)
    assert row_b < row_a and "36.00" in lines[row_b] and "siamesexml" in lines[row_b]
    # the hyperparameters that differ between the runs are named on each row (and only those)
    assert "fusion.method=tree" in lines[row_b] and "fusion.method=alpha" in lines[row_a]
    assert "pretrain.epochs" not in out
    assert "Omikuji" in out and "27.60" in out and "broken" not in out
    assert cli_main(["compare", name, "--sort", "nope"]) == 2
    assert "compare --sort 'nope'" in capsys.readouterr().err


def test_compare_without_runs_still_shows_references(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XC_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert cli_main(["compare", "LF-AmazonTitles-131K"]) == 0
    out = capsys.readouterr().out
    assert "no finished evaluation runs" in out and "46.01" in out and "NGAME" in out
    table = comparison_table([], [])
    assert table.splitlines()[0].startswith("#")
