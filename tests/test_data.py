"""Tests of dataset ingest: the three XC layouts, error messages, canonical save/load, source resolution."""

from __future__ import annotations

import functools
import gzip
import http.server
import io
import json
import tarfile
import tempfile
import threading
import zipfile
from pathlib import Path

import fsspec
import numpy as np
import pytest
import scipy.sparse as sp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from xc_dagster.data import XCDataset, detect_layout, load_dataset, read_dataset, resolve_source, save_dataset
from xc_dagster.errors import XCDatasetNotFound, XCError, XCFormatError

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
if not DATA.is_dir():
    DATA = Path("/work/shared/data")
WORDNET = DATA / "LF-WordNetNouns"
BIBTEX = DATA / "Bibtex" / "xc_format"
DELICIOUS = DATA / "Delicious" / "xc_format"
needs = {p: pytest.mark.skipif(not p.is_dir(), reason=f"{p} not available") for p in (WORDNET, BIBTEX, DELICIOUS)}


# ------------------------------------------------------------------------------------- small builders

def _gz(path: Path, lines: list[str] | bytes) -> None:
    raw = lines if isinstance(lines, bytes) else "".join(l + "\n" for l in lines).encode()
    path.write_bytes(gzip.compress(raw))


def _j(**kw) -> str:
    return json.dumps(kw)


LF_LBL = [_j(uid="l0", title="alpha", content="first letter"), _j(uid="l1", title="beta", content=""),
          _j(uid="l2", title="gamma", content="third")]
LF_TRN = [_j(uid="a", title="t0", content="c0 words", target_ind=[0, 2], target_rel=[1.0, 0.5]),
          _j(uid="b", title="t1", content="", target_ind=[1]),
          _j(uid="c", title="t2", target_ind=[], target_rel=[])]
LF_TST = [_j(uid="d", title="s0", content="x", target_ind=[2], target_rel=[1.0]),
          _j(uid="e", title="s1", content="y", target_ind=[0, 1], target_rel=[1.0, 1.0])]


def make_lf(folder: Path, trn: list[str] | bytes = LF_TRN, tst: list[str] | bytes = LF_TST,
            lbl: list[str] | bytes = LF_LBL, filt_test: str | None = "0 1\n1 2\n",
            filt_train: str | None = "2 0\n") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    _gz(folder / "trn.json.gz", trn)
    _gz(folder / "tst.json.gz", tst)
    _gz(folder / "lbl.json.gz", lbl)
    if filt_test is not None:
        (folder / "filter_labels_test.txt").write_text(filt_test)
    if filt_train is not None:
        (folder / "filter_labels_train.txt").write_text(filt_train)
    return folder


BOW_TRAIN = "3 4 3\n0,2 0:1 3:2\n 1:1\n1 2:1 0:1\n"
BOW_TEST = "2 4 3\n2 3:1\n0,1 1:0.5 2:1\n"


def make_bow(folder: Path, train: str | bytes = BOW_TRAIN, test: str | bytes = BOW_TEST,
             y: str | None = "a\nb\nc\n", vocab: str | None = "w0\nw1\nw2\nw3\n") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name, content in (("toy_train.txt", train), ("toy_test.txt", test), ("Y.txt", y), ("X_vocab.txt", vocab)):
        if content is not None:
            (folder / name).write_bytes(content if isinstance(content, bytes) else content.encode())
    return folder


SPLIT = {
    "trn_X_Y.txt": "3 3\n0:1 2:0.5\n1:1\n\n",
    "tst_X_Y.txt": "2 3\n2:1\n0:1 1:1\n",
    "trn_X_Xf.txt": "3 5\n0:1 4:0.5\n1:2\n3:1\n",
    "tst_X_Xf.txt": "2 5\n2:1\n0:1 1:1\n",
    "lbl_X_Xf.txt": "3 5\n0:1\n1:1\n4:1\n",
    "trn_X.txt": "doc zero\ndoc one\ndoc two\n",
    "tst_X.txt": "test zero\ntest one\n",
    "filter_labels_test.txt": "1 0\n",
}


def make_split(folder: Path, **override: str | None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name, content in {**SPLIT, **override}.items():
        if content is not None:
            (folder / name).write_text(content)
    return folder


def assert_format_error(folder: Path, fname: str, line: int | None, *needles: str, **kw) -> XCFormatError:
    with pytest.raises(XCFormatError) as ei:
        read_dataset(folder, **kw)
    msg = str(ei.value)
    assert fname in msg, msg
    if line is not None:
        assert f"{fname}:{line}:" in msg, msg
    for n in needles:
        assert n in msg, msg
    return ei.value


# ------------------------------------------------------------------------------------------ real data

@needs[WORDNET]
def test_wordnet_real_counts_texts_and_labels():
    ds = read_dataset(WORDNET)
    assert ds.layout == "lf-raw"
    assert (ds.num_train, ds.num_test, ds.num_labels) == (57_480, 24_599, 21_523)
    assert len(ds.train_texts) == 57_480 and len(ds.label_texts) == 21_523
    assert ds.filter_test.shape == (6_358, 2) and ds.filter_train.shape == (15_164, 2)
    assert ds.filter_test.dtype == np.int64
    assert ds.train_texts[0] == "market, securities industry"
    assert ds.Y_train[0].indices.tolist() == [12240, 12241]
    assert ds.Y_train.dtype == np.float32 and isinstance(ds.Y_train, sp.csr_matrix)
    full = read_dataset(WORDNET, text_fields=("title", "content"), label_text_fields=("title",))
    assert full.train_texts[0].startswith("market, securities industry the securities markets")
    assert full.label_texts == ds.label_texts
    s = ds.stats()
    assert s["n_filter_test"] == 6_358 and s["n_features"] is None


@needs[BIBTEX]
def test_bibtex_real_bow():
    ds = read_dataset(BIBTEX)
    assert ds.layout == "bow" and detect_layout(BIBTEX) == "bow"
    assert (ds.num_train, ds.num_test, ds.num_labels) == (4_880, 2_515, 159)
    assert ds.X_train.shape == (4_880, 1_836) and ds.X_test.shape == (2_515, 1_836)
    assert ds.Y_train[0].indices.tolist() == [3, 23, 61, 63, 76]
    assert ds.label_texts[0] == "TAG_2005"
    vocab = (BIBTEX / "X_vocab.txt").read_text().splitlines()
    words = ds.train_texts[0].split(" ")
    assert len(words) == ds.X_train[0].nnz and set(words) <= set(vocab)
    assert sorted(words) == sorted(vocab[i] for i in ds.X_train[0].indices)
    assert ds.stats()["n_features"] == 1_836 and ds.filter_train.shape == (0, 2)


@needs[DELICIOUS]
def test_delicious_real_bow_rows_without_labels():
    ds = read_dataset(DELICIOUS)
    assert (ds.num_train, ds.num_test, ds.num_labels) == (12_920, 3_185, 983)
    s = ds.stats()
    assert s["train_rows_without_labels"] == 10 and s["test_rows_without_labels"] == 4


# --------------------------------------------------------------------------------------- small layouts

def test_small_lf(tmp_path):
    f = make_lf(tmp_path / "lf")
    assert detect_layout(f) == "lf-raw"
    ds = read_dataset(f)
    assert ds.train_texts == ["t0", "t1", "t2"] and ds.label_texts == ["alpha", "beta", "gamma"]
    assert ds.Y_train.toarray().tolist() == [[1.0, 0, 0.5], [0, 1.0, 0], [0, 0, 0]]
    assert ds.Y_test.shape == (2, 3)
    assert ds.filter_test.tolist() == [[0, 1], [1, 2]] and ds.filter_train.tolist() == [[2, 0]]
    full = read_dataset(f, text_fields=("title", "content"))
    assert full.train_texts == ["t0 c0 words", "t1", "t2"]
    assert full.label_texts == ["alpha first letter", "beta", "gamma third"]
    assert ds.stats()["train_rows_without_labels"] == 1
    with pytest.raises(XCError):
        read_dataset(f, text_fields=("body",))


def test_small_lf_without_filters(tmp_path):
    ds = read_dataset(make_lf(tmp_path / "lf", filt_test=None, filt_train=None))
    assert ds.filter_test.shape == (0, 2) and ds.filter_train.shape == (0, 2)


def test_small_bow(tmp_path):
    f = make_bow(tmp_path / "bow")
    ds = read_dataset(f)
    assert ds.layout == "bow"
    assert ds.Y_train.toarray().tolist() == [[1, 0, 1], [0, 0, 0], [0, 1, 0]]
    assert ds.X_train.toarray().tolist() == [[1, 0, 0, 2], [0, 1, 0, 0], [1, 0, 1, 0]]
    assert ds.train_texts == ["w3 w0", "w1", "w0 w2"]
    assert ds.test_texts == ["w3", "w2 w1"]
    assert ds.label_texts == ["a", "b", "c"]


def test_small_bow_without_names(tmp_path):
    ds = read_dataset(make_bow(tmp_path / "bow", y=None, vocab=None))
    assert ds.label_texts == ["label 0", "label 1", "label 2"] and ds.train_texts == ["", "", ""]


def test_small_split_sparse(tmp_path):
    f = make_split(tmp_path / "ss", **{"Y.txt": "L0\nL1\nL2\n"})
    assert detect_layout(f) == "split-sparse"
    ds = read_dataset(f)
    assert ds.Y_train.toarray().tolist() == [[1, 0, 0.5], [0, 1, 0], [0, 0, 0]]
    assert ds.X_train.shape == (3, 5) and ds.X_label.shape == (3, 5) and ds.X_test.nnz == 3
    assert ds.train_texts == ["doc zero", "doc one", "doc two"] and ds.label_texts == ["L0", "L1", "L2"]
    assert ds.filter_test.tolist() == [[1, 0]] and ds.filter_train.shape == (0, 2)
    bare = read_dataset(make_split(tmp_path / "bare", **{"trn_X.txt": None, "tst_X.txt": None,
                                                          "lbl_X_Xf.txt": None}))
    assert bare.label_texts == ["label 0", "label 1", "label 2"] and bare.train_texts == ["", "", ""]
    assert bare.X_label is None


def test_detect_layout_unknown_lists_files(tmp_path):
    (tmp_path / "notes.md").write_text("hi")
    with pytest.raises(XCFormatError) as ei:
        detect_layout(tmp_path)
    assert str(tmp_path) in str(ei.value) and "notes.md" in str(ei.value) and "trn.json.gz" in str(ei.value)
    with pytest.raises(XCDatasetNotFound):
        detect_layout(tmp_path / "missing")


def _assert_same(a: XCDataset, b: XCDataset) -> None:
    assert a.layout == b.layout
    for name in ("train_texts", "test_texts", "label_texts"):
        assert getattr(a, name) == getattr(b, name)
    for name in ("Y_train", "Y_test", "X_train", "X_test", "X_label"):
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None) == (y is None)
        if x is not None:
            assert isinstance(y, sp.csr_matrix) and y.dtype == np.float32 and x.shape == y.shape
            assert (x != y).nnz == 0
    for name in ("filter_train", "filter_test"):
        assert np.array_equal(getattr(a, name), getattr(b, name))
        assert getattr(b, name).shape[1] == 2


@pytest.mark.parametrize("maker", [make_lf, make_bow, make_split])
def test_save_load_round_trip(tmp_path, maker):
    ds = read_dataset(maker(tmp_path / "src"))
    out = tmp_path / "out" / "dataset"
    save_dataset(ds, out)
    back = load_dataset(out)
    _assert_same(ds, back)
    assert back.stats() == ds.stats()
    save_dataset(ds, out)  # replacing an existing folder
    _assert_same(ds, load_dataset(out))
    assert sorted(p.name for p in out.parent.iterdir()) == ["dataset"]


def test_load_missing_raises(tmp_path):
    with pytest.raises(XCDatasetNotFound):
        load_dataset(tmp_path / "nope")


def test_save_is_atomic(tmp_path, monkeypatch):
    ds = read_dataset(make_lf(tmp_path / "src"))
    out = tmp_path / "out" / "dataset"
    calls = {"n": 0}
    real = sp.save_npz

    def failing(*a, **kw):
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError("disk full")
        return real(*a, **kw)

    monkeypatch.setattr(sp, "save_npz", failing)
    with pytest.raises(OSError):
        save_dataset(ds, out)
    assert not out.exists() and list(out.parent.iterdir()) == []
    monkeypatch.setattr(sp, "save_npz", real)
    save_dataset(ds, out)  # previous content kept on a failed replace
    other = read_dataset(make_bow(tmp_path / "bow"))
    calls["n"] = 0
    monkeypatch.setattr(sp, "save_npz", failing)
    with pytest.raises(OSError):
        save_dataset(other, out)
    assert sorted(p.name for p in out.parent.iterdir()) == ["dataset"]
    _assert_same(ds, load_dataset(out))


# ----------------------------------------------------------------------------------------- bad files

def test_bow_wrong_header(tmp_path):
    f = make_bow(tmp_path, train="3 4\n0 0:1\n")
    assert_format_error(f, "toy_train.txt", 1, "N D L")
    assert_format_error(f, "toy_train.txt", 1, "N D L", layout="bow")


def test_bow_header_not_utf8_is_named_not_taken_for_an_empty_file(tmp_path):
    f = make_bow(tmp_path / "u16", train="3 4 3\n0,2 0:1\n 1:1\n1 2:1\n".encode("utf-16"))
    assert_format_error(f, "toy_train.txt", 1, "UTF-8 text", "UTF-16 byte-order mark")
    f = make_bow(tmp_path / "latin", train=b"3 4 3\xa0\n0,2 0:1\n 1:1\n1 2:1\n")
    assert_format_error(f, "toy_train.txt", 1, "UTF-8 text", "column 6")


def test_bow_row_count_mismatch(tmp_path):
    f = make_bow(tmp_path, train="4 4 3\n0,2 0:1 3:2\n 1:1\n1 2:1 0:1\n")
    assert_format_error(f, "toy_train.txt", 1, "4 rows", "3 rows")
    f2 = make_bow(tmp_path / "more", train="2 4 3\n0,2 0:1 3:2\n 1:1\n1 2:1 0:1\n")
    assert_format_error(f2, "toy_train.txt", 4, "2 rows")


def test_bow_out_of_range_ids(tmp_path):
    assert_format_error(make_bow(tmp_path / "a", train="3 4 3\n0,2 0:1\n 1:1\n5 2:1\n"),
                        "toy_train.txt", 4, "[0, 3)", "label")
    assert_format_error(make_bow(tmp_path / "b", test="2 4 3\n2 3:1\n0 9:1\n"),
                        "toy_test.txt", 3, "[0, 4)", "feature")
    assert_format_error(make_bow(tmp_path / "c", train="3 4 3\n0,x 0:1\n 1:1\n1 2:1\n"),
                        "toy_train.txt", 2, "integer label ids")


def test_lf_out_of_range_label(tmp_path):
    trn = LF_TRN[:1] + [_j(title="t", target_ind=[7])] + LF_TRN[2:]
    assert_format_error(make_lf(tmp_path, trn=trn), "trn.json.gz", 2, "[0, 3)")


def test_split_sparse_out_of_range_label(tmp_path):
    f = make_split(tmp_path, **{"trn_X_Y.txt": "3 3\n0:1 5:1\n1:1\n\n"})
    assert_format_error(f, "trn_X_Y.txt", 2, "[0, 3)")
    g = make_split(tmp_path / "g", **{"tst_X_Xf.txt": "2 5\n2:1\n0:1 1\n"})
    assert_format_error(g, "tst_X_Xf.txt", 3, "index:value")
    h = make_split(tmp_path / "h", **{"trn_X.txt": "one\ntwo\n"})
    assert_format_error(h, "trn_X.txt", 3, "3 lines")


@pytest.mark.parametrize("bad_line, needle", [
    ('{"title": "t", "target_ind": [1]', "valid JSON"),
    ('{"content": "c", "target_ind": [1]}', "'title'"),
    ('{"title": "t", "target_ind": [1.5]}', "list of integers"),
    ('{"title": "t", "target_ind": "1"}', "list of integers"),
    ('{"title": "t", "target_ind": [0, 1], "target_rel": [1.0]}', "same length"),
    ('[1, 2]', "JSON object"),
])
def test_lf_bad_lines(tmp_path, bad_line, needle):
    trn = LF_TRN[:2] + [bad_line]
    assert_format_error(make_lf(tmp_path, trn=trn), "trn.json.gz", 3, needle)


def test_lf_truncated_gzip(tmp_path):
    f = make_lf(tmp_path)
    data = (f / "tst.json.gz").read_bytes()
    (f / "tst.json.gz").write_bytes(data[: len(data) // 2])
    assert_format_error(f, "tst.json.gz", None, "gzip")
    (f / "tst.json.gz").write_bytes(b"not gzip at all")
    assert_format_error(f, "tst.json.gz", None, "gzip")


def test_bad_utf8(tmp_path):
    raw = ("\n".join(LF_TRN[:1]) + "\n").encode() + b'{"title": "caf\xff", "target_ind": []}\n'
    assert_format_error(make_lf(tmp_path / "lf", trn=raw), "trn.json.gz", 2, "UTF-8")
    assert_format_error(make_bow(tmp_path / "bow", y=b"a\nb\xfe\nc\n"), "Y.txt", 2, "UTF-8")


def test_empty_files(tmp_path):
    assert_format_error(make_bow(tmp_path / "bow", train=""), "toy_train.txt", 1, "N D L", "empty file")
    assert_format_error(make_lf(tmp_path / "lf", lbl=b""), "lbl.json.gz", 1, "at least one")
    assert_format_error(make_lf(tmp_path / "lf2", trn=b""), "trn.json.gz", 1, "at least one")
    assert_format_error(make_split(tmp_path / "ss", **{"tst_X_Y.txt": ""}), "tst_X_Y.txt", 1, "rows cols")


def test_y_txt_line_count_mismatch(tmp_path):
    assert_format_error(make_bow(tmp_path / "a", y="a\nb\n"), "Y.txt", 3, "3 lines", "2 lines")
    assert_format_error(make_bow(tmp_path / "b", y="a\nb\nc\nd\n"), "Y.txt", 4, "3 lines")
    assert_format_error(make_bow(tmp_path / "c", vocab="w0\n"), "X_vocab.txt", 2, "4 lines")
    assert_format_error(make_split(tmp_path / "d", **{"Y.txt": "x\n"}), "Y.txt", 2, "3 lines")


@pytest.mark.parametrize("content, line, needle", [
    ("0 1\n1 2 3\n", 2, "two integers"),
    ("0 1\nx 2\n", 2, "two integers"),
    ("0 1\n\n5 0\n", 3, "row id in [0, 2)"),
    ("1 3\n", 1, "label id in [0, 3)"),
])
def test_bad_filter_lines(tmp_path, content, line, needle):
    assert_format_error(make_lf(tmp_path, filt_test=content), "filter_labels_test.txt", line, needle)


# -------------------------------------------------------------------------------- fuzz: never crash

def _corrupt(data: bytes, edits: list[tuple[int, bytes]], lines: list[tuple[int, bytes]]) -> bytes:
    b = bytearray(data)
    for pos, rep in edits:
        p = pos % (len(b) + 1)
        b[p:p + 1] = rep
    out = bytes(b).split(b"\n")
    for pos, garbage in lines:
        out.insert(pos % (len(out) + 1), garbage)
    return b"\n".join(out)


_edits = st.lists(st.tuples(st.integers(0, 10_000), st.binary(max_size=3)), max_size=4)
_lines = st.lists(st.tuples(st.integers(0, 100), st.binary(max_size=20)
                            | st.text(alphabet="0123456789,: {}[]\"-.ex", max_size=20).map(str.encode)),
                  max_size=3)
_fuzz = settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _parses_or_format_error(folder: Path) -> None:
    try:
        ds = read_dataset(folder, text_fields=("title", "content"))
    except XCFormatError:
        return
    assert ds.Y_train.shape[1] == len(ds.label_texts)


@_fuzz
@given(which=st.sampled_from(["toy_train.txt", "toy_test.txt", "Y.txt", "X_vocab.txt"]),
       edits=_edits, lines=_lines)
def test_fuzz_bow(which, edits, lines):
    with tempfile.TemporaryDirectory() as d:
        f = make_bow(Path(d))
        (f / which).write_bytes(_corrupt((f / which).read_bytes(), edits, lines))
        _parses_or_format_error(f)


@_fuzz
@given(which=st.sampled_from(["trn.json.gz", "tst.json.gz", "lbl.json.gz", "filter_labels_test.txt"]),
       compressed=st.booleans(), edits=_edits, lines=_lines)
def test_fuzz_lf(which, compressed, edits, lines):
    with tempfile.TemporaryDirectory() as d:
        f = make_lf(Path(d))
        p = f / which
        if compressed or not which.endswith(".gz"):
            p.write_bytes(_corrupt(p.read_bytes(), edits, lines))
        else:
            p.write_bytes(gzip.compress(_corrupt(gzip.decompress(p.read_bytes()), edits, lines)))
        _parses_or_format_error(f)


# ------------------------------------------------------------------------------------------- sources

def test_resolve_local_and_file_uri(tmp_path):
    f = make_lf(tmp_path / "lf")
    cache = tmp_path / "cache"
    assert resolve_source(str(f), cache) == f
    assert resolve_source(f.as_uri(), cache) == f
    assert resolve_source((f / "trn.json.gz").as_uri(), cache) == f
    assert resolve_source(str(f / "trn.json.gz"), cache) == f
    with pytest.raises(XCDatasetNotFound) as ei:
        resolve_source(str(tmp_path / "missing"), cache)
    assert "missing" in str(ei.value)


def test_resolve_memory_fsspec(tmp_path):
    src = make_split(tmp_path / "ss")
    fs = fsspec.filesystem("memory")
    root = f"/xc-test-{tmp_path.name}/ds"
    try:
        for p in src.iterdir():
            fs.pipe(f"{root}/{p.name}", p.read_bytes())
        got = resolve_source(f"memory://{root}", tmp_path / "cache")
        assert got.parent == tmp_path / "cache"
        assert sorted(p.name for p in got.iterdir()) == sorted(p.name for p in src.iterdir())
        assert read_dataset(got).num_train == 3
        assert resolve_source(f"memory://{root}", tmp_path / "cache") == got  # cached
        with pytest.raises(XCDatasetNotFound):
            resolve_source(f"memory://{root}-absent", tmp_path / "cache")
    finally:
        fs.rm(f"/xc-test-{tmp_path.name}", recursive=True)


def _tar_gz(path: Path, folder: Path, arcroot: str) -> Path:
    with tarfile.open(path, "w:gz") as tf:
        tf.add(folder, arcname=arcroot)
    return path


def test_resolve_tar_gz_local(tmp_path):
    src = make_bow(tmp_path / "bow")
    arc = _tar_gz(tmp_path / "ds.tar.gz", src, "Toy")
    got = resolve_source(str(arc), tmp_path / "cache")
    assert got.name == "Toy" and read_dataset(got).num_train == 3
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [got.parent.name]  # no temp leftovers


def _tar_with(path: Path, member: tarfile.TarInfo, data: bytes = b"x") -> Path:
    with tarfile.open(path, "w:gz") as tf:
        if member.isfile():
            member.size = len(data)
            tf.addfile(member, io.BytesIO(data))
        else:
            tf.addfile(member)
    return path


def test_resolve_rejects_malicious_archives(tmp_path):
    cache = tmp_path / "cache"
    bad = _tar_with(tmp_path / "bad.tar.gz", tarfile.TarInfo("../evil"))
    with pytest.raises(XCError) as ei:
        resolve_source(str(bad), cache)
    assert "../evil" in str(ei.value)
    link = tarfile.TarInfo("ds/link")
    link.type, link.linkname = tarfile.SYMTYPE, "../../etc/passwd"
    with pytest.raises(XCError) as ei:
        resolve_source(str(_tar_with(tmp_path / "link.tgz", link)), cache)
    assert "ds/link" in str(ei.value)
    absolute = _tar_with(tmp_path / "abs.tar.gz", tarfile.TarInfo("/tmp/evil"))
    with pytest.raises(XCError):
        resolve_source(str(absolute), cache)
    zbad = tmp_path / "bad.zip"
    with zipfile.ZipFile(zbad, "w") as zf:
        zf.writestr("../evil.txt", "x")
    with pytest.raises(XCError) as ei:
        resolve_source(str(zbad), cache)
    assert "../evil.txt" in str(ei.value)
    assert not (tmp_path / "evil").exists() and not (tmp_path / "evil.txt").exists()
    assert not cache.exists() or list(cache.iterdir()) == []


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:  # keep test output clean
        pass


def test_resolve_http_zip(tmp_path):
    src = make_lf(tmp_path / "lf")
    served = tmp_path / "served"
    served.mkdir()
    with zipfile.ZipFile(served / "ds.zip", "w") as zf:
        for p in src.iterdir():
            zf.write(p, f"LF-Toy/{p.name}")
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0),
                                             functools.partial(_QuietHandler, directory=str(served)))
    port = server.server_address[1]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        got = resolve_source(f"http://127.0.0.1:{port}/ds.zip", tmp_path / "cache")
        assert got.name == "LF-Toy"
        assert read_dataset(got).train_texts == ["t0", "t1", "t2"]
        with pytest.raises(XCDatasetNotFound):
            resolve_source(f"http://127.0.0.1:{port}/absent.zip", tmp_path / "cache")
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)
    assert resolve_source(f"http://127.0.0.1:{port}/ds.zip", tmp_path / "cache") == got  # served from cache
