"""bench/make_subset.py: a cut of an LF raw-text dataset keeps contiguous label ids, points with labels and
correctly remapped filter pairs, and reads back with ``read_dataset``."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest

from bench import make_subset as ms
from xc_dagster.catalog import builtin_path
from xc_dagster.data import read_dataset
from xc_dagster.data.companions import read_filters


def _records(path: Path) -> list[dict]:
    with gzip.open(path, "rt") as f:
        return [json.loads(s) for s in f]


def _write(folder: Path, name: str, records: list[dict]) -> None:
    with gzip.open(folder / name, "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)


def test_hand_made_cut(tmp_path):
    """All 3 train points sampled: label 1 (test only) goes, test point 0 (only label 1) goes, ids shift."""
    src = tmp_path / "src"
    src.mkdir()
    lab = [{"uid": f"L{j}", "title": f"label {j}", "content": ""} for j in range(4)]
    trn = [{"uid": "a", "title": "a", "content": "", "target_ind": [3], "target_rel": [1.0]},
           {"uid": "b", "title": "b", "content": "", "target_ind": [0, 2], "target_rel": [0.5, 1.0]},
           {"uid": "c", "title": "c", "content": "", "target_ind": [2], "target_rel": [1.0]}]
    tst = [{"uid": "x", "title": "x", "content": "", "target_ind": [1], "target_rel": [1.0]},
           {"uid": "y", "title": "y", "content": "", "target_ind": [1, 3], "target_rel": [1.0, 2.0]}]
    _write(src, "trn.json.gz", trn)
    _write(src, "tst.json.gz", tst)
    _write(src, "lbl.json.gz", lab)
    (src / "filter_labels_train.txt").write_text("2 3\n0 1\n")
    (src / "filter_labels_test.txt").write_text("0 3\n1 2\n1 1\n")
    ms.write_subset(src, tmp_path / "out", n_train=3, seed=0)
    out = tmp_path / "out"
    assert [r["uid"] for r in _records(out / "lbl.json.gz")] == ["L0", "L2", "L3"]  # 0->0, 2->1, 3->2
    assert [(r["uid"], r["target_ind"], r["target_rel"]) for r in _records(out / "trn.json.gz")] == [
        ("a", [2], [1.0]), ("b", [0, 1], [0.5, 1.0]), ("c", [1], [1.0])]
    assert [(r["uid"], r["target_ind"], r["target_rel"]) for r in _records(out / "tst.json.gz")] == [
        ("y", [2], [2.0])]
    # train (2, 3) -> (2, 2); (0, 1) loses its label. Test row 0 is gone; test row 1 -> 0: (1, 2) -> (0, 1)
    assert (out / "filter_labels_train.txt").read_text() == "2 2\n"
    assert (out / "filter_labels_test.txt").read_text() == "0 1\n"
    prov = json.loads((out / "subset.json").read_text())
    assert prov["counts"]["test"]["dropped_without_labels"] == 1 and prov["counts"]["labels"]["kept"] == 3
    with pytest.raises(FileExistsError):
        ms.write_subset(src, out, n_train=3, seed=0)


def test_cut_of_the_embedded_dataset(tmp_path):
    src = builtin_path("LF-WordNetNouns")
    out = tmp_path / "cut"
    prov = ms.write_subset(src, out, n_train=300, seed=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cut"]  # no temporary folder left behind
    ds = read_dataset(out, text_fields=("title",), label_text_fields=("title",))
    c = prov["counts"]
    assert (ds.num_train, ds.num_test, ds.num_labels) == (300, c["test"]["kept"], c["labels"]["kept"])
    assert c["test"]["sampled"] == round(300 / 57480 * 24599)
    # label ids contiguous: every one of 0..L'-1 is some training point's label; every point has labels
    assert np.array_equal(np.unique(ds.Y_train.indices), np.arange(ds.num_labels))
    assert (np.diff(ds.Y_train.indptr) > 0).all() and (np.diff(ds.Y_test.indptr) > 0).all()
    # filter pairs, by uid: each output pair is a source pair, and each source pair that survives is there
    s_trn, s_tst, s_lbl = (_records(src / n) for n in ("trn.json.gz", "tst.json.gz", "lbl.json.gz"))
    o_trn, o_tst, o_lbl = (_records(out / n) for n in ("trn.json.gz", "tst.json.gz", "lbl.json.gz"))
    s_filters = read_filters(src, len(s_trn), len(s_tst), len(s_lbl))
    lbl_uid = {r["uid"]: i for i, r in enumerate(s_lbl)}
    for s_rows, o_rows, s_pairs, o_pairs in zip((s_trn, s_tst), (o_trn, o_tst), s_filters,
                                                (ds.filter_train, ds.filter_test)):
        row_uid = {r["uid"]: i for i, r in enumerate(s_rows)}
        back = {(row_uid[o_rows[r]["uid"]], lbl_uid[o_lbl[c]["uid"]]) for r, c in o_pairs.tolist()}
        kept_rows = {row_uid[r["uid"]] for r in o_rows}
        kept_labels = {lbl_uid[x["uid"]] for x in o_lbl}
        expected = {(r, c) for r, c in s_pairs.tolist() if r in kept_rows and c in kept_labels}
        assert back == expected
    assert len(ds.filter_train) > 0
    # one pair by hand: the first train filter pair names the same point and label as in the source
    r, c = ds.filter_train[0].tolist()
    sr, sc = next(i for i, x in enumerate(s_trn) if x["uid"] == o_trn[r]["uid"]), lbl_uid[o_lbl[c]["uid"]]
    assert [sr, sc] in s_filters[0].tolist()
    assert (o_trn[r]["title"], o_lbl[c]["title"]) == (s_trn[sr]["title"], s_lbl[sc]["title"])
    assert ds.train_texts[r] == s_trn[sr]["title"] and ds.label_texts[c] == s_lbl[sc]["title"]


def test_label_sample_follows_the_training_frequencies():
    """Labels are drawn in proportion to their training points: over seeded draws of one label, label 0 (6 of 9
    positives) comes about twice as often as label 1 (3 of 9); label 2 (no training point) never."""
    train = [{"target_ind": [0]}] * 6 + [{"target_ind": [1]}] * 3
    draws = np.array([ms.label_sample(np.random.default_rng(s), train, 3, 1) for s in range(3000)])
    assert draws.sum(1).tolist() == [1] * 3000 and not draws[:, 2].any()
    assert abs(draws[:, 0].mean() - 2 / 3) < 0.03
    assert ms.label_sample(np.random.default_rng(0), train, 3, 5).tolist() == [True, True, False]  # at most 2


def test_cut_with_a_label_sample(tmp_path):
    """``n_labels``: every kept label was sampled, every point sampled carries one, and the cut keeps only those."""
    src = builtin_path("LF-WordNetNouns")
    prov = ms.write_subset(src, tmp_path / "cut", n_train=400, seed=3, n_labels=300)
    s_trn, s_lbl = _records(src / "trn.json.gz"), _records(src / "lbl.json.gz")
    keep = ms.label_sample(np.random.default_rng(3), s_trn, len(s_lbl), 300)
    uid_label = {r["uid"]: i for i, r in enumerate(s_lbl)}
    o_lbl = [uid_label[r["uid"]] for r in _records(tmp_path / "cut" / "lbl.json.gz")]
    assert 0 < len(o_lbl) <= 300 and keep[o_lbl].all() and o_lbl == sorted(o_lbl)
    by_uid = {r["uid"]: r["target_ind"] for r in s_trn}
    o_trn = _records(tmp_path / "cut" / "trn.json.gz")
    assert len(o_trn) == 400 and prov["n_labels_requested"] == 300
    for r in o_trn:  # a point keeps exactly its source labels that were sampled, renumbered
        assert [o_lbl[j] for j in r["target_ind"]] == [lab for lab in by_uid[r["uid"]] if keep[lab]]
