"""The dataset generator (xc_dagster.data.synthetic): LF files that ingest reads with the requested counts, the
same bytes for the same seed, power-law label frequencies, a planted signal that a text baseline finds and that
training points add to, and memory bounded by a block of points."""

from __future__ import annotations

import json
import tracemalloc

import numpy as np
import pytest
import scipy.sparse as sp
from sklearn.feature_extraction.text import TfidfVectorizer
from tinydata import label_prior_metrics

from xc_dagster.data import detect_layout, read_dataset
from xc_dagster.data import synthetic as syn
from xc_dagster.data.lf_raw import LF_FILES
from xc_dagster.errors import XCConfigError
from xc_dagster.evaluation.metrics import evaluate

FILES = (*LF_FILES, "filter_labels_train.txt", "filter_labels_test.txt", "synthetic.json")


@pytest.fixture(scope="module")
def law(tmp_path_factory):
    """20,000 labels at the 131k shape's ratios (45,000 training points, 2.29 labels per point), 3,000 test
    points: the dataset the frequency and signal tests read."""
    out = tmp_path_factory.mktemp("law") / "ds"
    stats = syn.generate(syn.shape_spec("45000,3000,20000,2.29"), out)
    return out, stats, read_dataset(out)


def test_files_read_back_with_the_requested_counts(tmp_path, monkeypatch):
    monkeypatch.setattr(syn, "BLOCK_POINTS", 700)  # several blocks per file
    spec = syn.shape_spec("3000,1000,2000,2.29")
    stats = syn.generate(spec, tmp_path / "ds")
    assert detect_layout(tmp_path / "ds") == "lf-raw"
    ds = read_dataset(tmp_path / "ds")
    assert (ds.num_train, ds.num_test, ds.num_labels) == (3000, 1000, 2000)
    freq = np.asarray(ds.Y_train.sum(0)).ravel()
    assert freq.min() >= 1  # every label has a training point (the cover points)
    assert ds.Y_train.nnz / 3000 == pytest.approx(2.29, rel=0.05)
    assert np.diff(ds.Y_train.indptr).min() >= 1 and np.diff(ds.Y_test.indptr).min() >= 1
    assert len(ds.filter_train) > 50 and len(ds.filter_test) > 10
    assert not ds.Y_test[ds.filter_test[:, 0], ds.filter_test[:, 1]].any()  # a filter label is never a target
    assert {len(t.split()) for t in ds.train_texts} <= set(range(5, 13))
    assert {len(t.split()) for t in ds.label_texts} <= {3, 4}
    assert (stats["train"]["max"], stats["train"]["median"]) == (freq.max(), np.median(freq))
    rec = json.loads((tmp_path / "ds" / "synthetic.json").read_text())
    assert rec["spec"]["n_labels"] == 2000 and rec["stats"]["test"]["points"] == 1000


def test_labels_of_a_cluster_share_their_first_word(tmp_path):
    syn.generate(syn.shape_spec("500,100,400,2"), tmp_path / "ds")
    model = syn.build_labels(syn.shape_spec("500,100,400,2"))
    first = np.array([t.split()[0] for t in read_dataset(tmp_path / "ds").label_texts])
    for c in range(len(model.start)):
        assert len(set(first[model.cluster_of == c])) == 1
    assert len(set(first)) == len(model.start)


def test_same_seed_same_bytes_and_another_seed_differs(tmp_path):
    for name, seed in (("a", 3), ("b", 3), ("c", 4)):
        syn.generate(syn.shape_spec("800,300,500,3", seed=seed), tmp_path / name)
    for f in FILES:
        assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes(), f
    assert (tmp_path / "a" / "trn.json.gz").read_bytes() != (tmp_path / "c" / "trn.json.gz").read_bytes()


def test_label_frequencies_follow_a_power_law(law):
    """About half the labels with at most 2 training points, the head with hundreds (max 604, median 3, 45.9%
    with at most 2)."""
    _, stats, ds = law
    freq = np.asarray(ds.Y_train.sum(0)).ravel()
    assert np.median(freq) <= 3
    assert freq.max() >= 50 * np.median(freq)
    assert (freq <= 2).mean() >= 0.4
    assert stats["train"]["labels_per_point"] == pytest.approx(2.29, rel=0.03)


def _topk(S: np.ndarray, k: int = 5) -> np.ndarray:
    top = np.argpartition(-S, k, 1)[:, :k]
    return np.take_along_axis(top, np.argsort(-np.take_along_axis(S, top, 1), 1, kind="stable"), 1)


def test_the_planted_signal_is_found_and_training_points_add_to_it(law):
    """TF-IDF over label titles (zero-shot) 45.4 P@1 against the label prior's 1.7; TF-IDF kNN over the
    training points (10 neighbours, which learns the labels' hidden words) 63.0."""
    _, _, ds = law
    vec = TfidfVectorizer(sublinear_tf=True, dtype=np.float32).fit(ds.label_texts + ds.train_texts)
    Q = vec.transform(ds.test_texts)
    A, X = vec.transform(ds.label_texts).T.tocsr(), vec.transform(ds.train_texts).T.tocsr()
    zero_shot, knn = [], []
    for a in range(0, Q.shape[0], 1000):
        q = Q[a:a + 1000]
        zero_shot.append(_topk((q @ A).toarray()))
        sim = (q @ X).toarray()
        nn = np.argpartition(-sim, 10, 1)[:, :10]
        rows = np.repeat(np.arange(len(nn)), 10)
        W = sp.csr_matrix((sim[rows, nn.ravel()], (rows, nn.ravel())), shape=sim.shape)
        knn.append(_topk((W @ ds.Y_train).toarray()))
    p1 = {name: evaluate(np.vstack(t), ds.Y_test, ks=(1,), filter_pairs=ds.filter_test)["precision_at_1"]
          for name, t in (("zero_shot", zero_shot), ("knn", knn))}
    prior = label_prior_metrics(ds.Y_train, ds.Y_test, ds.filter_test, ks=(1,))["precision_at_1"]
    assert prior < 0.03
    assert p1["zero_shot"] > 0.38 and p1["zero_shot"] > 10 * prior
    assert p1["knn"] > p1["zero_shot"] + 0.08


def test_memory_is_bounded_by_a_block_and_lines_do_not_depend_on_n(tmp_path, monkeypatch):
    """Four times the points (same labels) peak at about the same traced memory (2.71 and 2.75 MB); the test
    file of 2 blocks is the first 2 blocks of the one of 3."""
    monkeypatch.setattr(syn, "BLOCK_POINTS", 1024)
    peaks = []
    for name, shape in (("small", "2048,2048,3000,4"), ("big", "8192,3072,3000,4")):
        tracemalloc.start()
        syn.generate(syn.shape_spec(shape), tmp_path / name)
        peaks.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()
    assert peaks[1] < 1.25 * peaks[0], peaks
    small = read_dataset(tmp_path / "small")
    big = read_dataset(tmp_path / "big")
    assert big.test_texts[:small.num_test] == small.test_texts
    assert (big.Y_test[:small.num_test] != small.Y_test).nnz == 0


def test_shapes_by_name_scale_and_custom():
    s = syn.shape_spec("131k", 0.25)
    assert (s.n_train, s.n_test, s.n_labels, s.labels_per_point) == (73701, 33709, 32768, 2.29)
    s = syn.shape_spec("1.3M")
    assert (s.n_train, s.n_test, s.n_labels, s.labels_per_point) == (2248619, 970237, 1305265, 22.2)
    assert syn.shape_spec("10,5,4,2.5", seed=7).seed == 7
    for bad in ("13k", "1,2,3", "10,5,4,9"):
        with pytest.raises(XCConfigError):
            syn.shape_spec(bad)


def test_cli_writes_the_folder_and_refuses_to_overwrite(tmp_path, capsys):
    out = tmp_path / "cli"
    args = ["--shape", "300,100,200,2", "--out", str(out), "--seed", "1", "--content-words", "40"]
    assert syn.main(args) == 0
    assert json.loads(capsys.readouterr().out)["stats"]["train"]["points"] == 300
    ds = read_dataset(out, text_fields=("title", "content"))
    assert min(len(t.split()) for t in ds.train_texts + ds.label_texts) >= 40
    assert syn.main(args) == 2 and "not empty" in capsys.readouterr().err
    assert syn.main([*args, "--force"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cli"]  # no partial folder left behind
