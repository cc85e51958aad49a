"""Tests of the bow-single and tokenized layouts, filter files everywhere, the streaming parsers and bad input."""

from __future__ import annotations

import functools
import gzip
import http.server
import json
import tarfile
import tempfile
import threading
import zipfile
from pathlib import Path

import numpy as np
import pytest
import scipy.sparse as sp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tests.test_data as td
from tests.test_data import DATA, _corrupt
from tests.test_data import assert_format_error as assert_error
from xc_dagster.data import detect_layout, load_dataset, read_dataset, resolve_source, save_dataset, streaming
from xc_dagster.data.lf_raw import read_lf_raw
from xc_dagster.errors import XCConfigError, XCFormatError

BIBTEX = DATA / "Bibtex" / "xc_format"
WORDNET = DATA / "LF-WordNetNouns"




def same(a: sp.csr_matrix, b: sp.csr_matrix) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and (a != b).nnz == 0


# --------------------------------------------------------------------------------- bow-single

DATA_TXT = "5 4 3\n0,2 0:1 3:2\n 1:1\n1 2:1 0:1\n2 3:1\n0,1 1:0.5 2:1\n"
TR_SPLIT = "1 2\n3 4\n5 1\n"  # 1-based, two splits (columns)
TS_SPLIT = "2 3\n4 5\n"


def make_single(folder: Path, data: str | bytes = DATA_TXT, tr: str | bytes = TR_SPLIT, ts: str | bytes = TS_SPLIT,
                y: str | None = "a\nb\nc\n", vocab: str | None = "w0\nw1\nw2\nw3\n",
                vocab_name: str = "X_vocab.txt", **extra: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    files = {"Toy_data.txt": data, "toy_trSplit.txt": tr, "toy_tstSplit.txt": ts, "Y.txt": y, vocab_name: vocab,
             **extra}
    for name, content in files.items():
        if content is not None:
            (folder / name).write_bytes(content if isinstance(content, bytes) else content.encode())
    return folder


def test_bow_single_splits(tmp_path):
    f = make_single(tmp_path / "s", **{"filter_labels_test.txt": "1 0\n"})
    assert detect_layout(f) == "bow-single"
    ds = read_dataset(f)
    assert ds.layout == "bow-single" and (ds.num_train, ds.num_test, ds.num_labels) == (3, 2, 3)
    assert ds.Y_train.toarray().tolist() == [[1, 0, 1], [0, 1, 0], [1, 1, 0]]  # rows 1, 3, 5
    assert ds.Y_test.toarray().tolist() == [[0, 0, 0], [0, 0, 1]]  # rows 2, 4
    assert ds.X_train.shape == (3, 4) and ds.train_texts == ["w3 w0", "w0 w2", "w2 w1"]
    assert ds.label_texts == ["a", "b", "c"] and ds.filter_test.tolist() == [[1, 0]]
    ds1 = read_dataset(f, split=1)
    assert ds1.Y_train.toarray().tolist() == [[0, 0, 0], [0, 0, 1], [1, 0, 1]]  # rows 2, 4, 1
    assert ds1.Y_test.toarray().tolist() == [[0, 1, 0], [1, 1, 0]]  # rows 3, 5


def test_bow_single_zero_based_and_vocab_txt(tmp_path):
    f = make_single(tmp_path / "z", tr="0\n2\n4\n", ts="1\n3\n", vocab_name="vocab.txt", y=None)
    ds = read_dataset(f)
    assert ds.Y_train.toarray().tolist() == [[1, 0, 1], [0, 1, 0], [1, 1, 0]]
    assert ds.train_texts[0] == "w3 w0" and ds.label_texts == ["label 0", "label 1", "label 2"]


@pytest.mark.skipif(not BIBTEX.is_dir(), reason="Bibtex not available")
def test_bibtex_as_single_file(tmp_path):
    """The real Bibtex rows joined into one data file with 1-based split tables read back like the bow layout."""
    trn = (BIBTEX / "bibtex_train.txt").read_text().splitlines()
    tst = (BIBTEX / "bibtex_test.txt").read_text().splitlines()
    n_tr, n_te = len(trn) - 1, len(tst) - 1
    _, D, L = trn[0].split()
    rng = np.random.default_rng(0)
    order = rng.permutation(n_tr + n_te)  # data file row k holds original point order[k]
    rows = trn[1:] + tst[1:]
    f = tmp_path / "Bibtex"
    f.mkdir()
    (f / "Bibtex_data.txt").write_text(f"{n_tr + n_te} {D} {L}\n" + "\n".join(rows[i] for i in order) + "\n")
    pos = np.argsort(order) + 1  # 1-based row of each original point
    (f / "bibtex_trSplit.txt").write_text("\n".join(f"{p} {p}" for p in pos[:n_tr]) + "\n")
    (f / "bibtex_tstSplit.txt").write_text("\n".join(f"{p} {p}" for p in pos[n_tr:]) + "\n")
    for name in ("Y.txt", "X_vocab.txt"):
        (f / name).write_bytes((BIBTEX / name).read_bytes())
    ds, ref = read_dataset(f, split=1), read_dataset(BIBTEX)
    assert (ds.num_train, ds.num_test, ds.num_labels) == (4_880, 2_515, 159)
    for name in ("X_train", "X_test", "Y_train", "Y_test"):
        assert same(getattr(ds, name), getattr(ref, name)), name
    assert ds.train_texts == ref.train_texts and ds.label_texts == ref.label_texts


@pytest.mark.parametrize("kw, fname, line, needles", [
    ({"data": "5 4\n0 0:1\n"}, "Toy_data.txt", 1, ("N D L",)),
    ({"data": ""}, "Toy_data.txt", 1, ("N D L", "empty file")),
    ({"data": "5 4 3\n0 0:1\n"}, "Toy_data.txt", 1, ("5 rows", "1 rows")),
    ({"data": DATA_TXT.replace("2 3:1", "7 3:1")}, "Toy_data.txt", 5, ("[0, 3)", "label")),
    ({"data": DATA_TXT.replace("1 2:1 0:1", "1 2:1 9:1")}, "Toy_data.txt", 4, ("[0, 4)", "feature")),
    ({"tr": "1 2\n3 4\n6 1\n"}, "toy_trSplit.txt", 3, ("1-based", "[1, 6)")),
    ({"ts": "2 3\n4 x\n"}, "toy_tstSplit.txt", 2, ("integer indices",)),
    ({"ts": "2 3\n4\n"}, "toy_tstSplit.txt", 2, ("2 columns",)),
    ({"ts": ""}, "toy_tstSplit.txt", 1, ("empty file",)),
    ({"tr": b"1 2\n3 \xff4\n5 1\n"}, "toy_trSplit.txt", 2, ("UTF-8",)),
    ({"data": DATA_TXT.encode().replace(b" 1:1", b" 1:\xfe1")}, "Toy_data.txt", 3, ("UTF-8",)),
    ({"vocab": "w0\n"}, "X_vocab.txt", 2, ("4 lines",)),
    ({"tr": "1 2\n3 4\n3 1\n"}, "toy_trSplit.txt", 3, ("each row index once", "3 again")),  # a point twice
    ({"ts": "2 3\n1 5\n"}, "toy_tstSplit.txt", 2, ("not training rows", "1, also")),  # test rows it trained on
    ({"tr": "1 2\n\n\n3 4\n9 1\n"}, "toy_trSplit.txt", 5, ("[1, 6)", "'9'")),  # the file's line, past blanks
    ({"tr": "1 2\n3 99999999999999999999999\n5 1\n"}, "toy_trSplit.txt", 2, ("[0, 2147483647]",)),
])
def test_bow_single_bad_input(tmp_path, kw, fname, line, needles):
    assert_error(make_single(tmp_path / "b", **kw), fname, line, *needles)


def test_bow_single_split_tables_may_start_with_a_bom(tmp_path):
    plain = read_dataset(make_single(tmp_path / "a"))
    bom = read_dataset(make_single(tmp_path / "b", tr="\ufeff" + TR_SPLIT, ts="\ufeff" + TS_SPLIT))
    assert same(bom.Y_train, plain.Y_train) and same(bom.X_test, plain.X_test)


def test_bow_single_split_out_of_range(tmp_path):
    f = make_single(tmp_path / "s")
    assert_error(f, "toy_trSplit.txt", 1, "split 2", "2 columns", split=2)
    with pytest.raises(XCConfigError):
        read_dataset(f, split=-1)
    assert_error(make_single(tmp_path / "t", ts="2\n4\n"), "toy_tstSplit.txt", 1, "split 1", split=1)


# ---------------------------------------------------------------------------------- tokenized

SPLIT_Y = {"trn_X_Y.txt": "3 3\n0:1 2:0.5\n1:1\n\n", "tst_X_Y.txt": "2 3\n2:1\n0:1 1:1\n"}


def make_tok(folder: Path, rows: tuple[int, int, int] = (3, 2, 3), max_len: int = 4, lbl: bool = True,
             **override: str | None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(1)
    for prefix, n in zip(("trn_doc", "tst_doc", "lbl"), rows):
        if prefix == "lbl" and not lbl:
            continue
        np.save(folder / f"{prefix}_input_ids.npy", rng.integers(0, 30_000, (n, max_len)).astype(np.int64))
        np.save(folder / f"{prefix}_attention_mask.npy", np.ones((n, max_len), dtype=np.int64))
    for name, content in {**SPLIT_Y, "tst_X.txt": "q0\nq1\n", **override}.items():
        if content is not None:
            (folder / name).write_text(content)
    return folder


def test_tokenized_layout_and_round_trip(tmp_path):
    f = make_tok(tmp_path / "t", **{"filter_labels_train.txt": "2 1\n"})
    assert detect_layout(f) == "tokenized"
    ds = read_dataset(f)
    assert ds.layout == "tokenized" and (ds.num_train, ds.num_test, ds.num_labels) == (3, 2, 3)
    assert ds.train_tokens[0].shape == (3, 4) and ds.label_tokens[1].shape == (3, 4)
    assert ds.train_texts == ["", "", ""] and ds.test_texts == ["q0", "q1"]
    assert ds.filter_train.tolist() == [[2, 1]]
    out = tmp_path / "saved"
    save_dataset(ds, out)
    back = load_dataset(out)
    for name in ("train_tokens", "test_tokens", "label_tokens"):
        for a, b in zip(getattr(ds, name), getattr(back, name)):
            assert np.array_equal(a, b) and a.dtype == b.dtype
    assert same(back.Y_train, ds.Y_train) and back.layout == "tokenized"
    nolbl = read_dataset(make_tok(tmp_path / "n", lbl=False))
    assert nolbl.label_tokens is None
    save_dataset(nolbl, tmp_path / "saved2")
    assert load_dataset(tmp_path / "saved2").label_tokens is None


def test_tokenized_bad_input(tmp_path):
    assert_error(make_tok(tmp_path / "a", **{"tst_X_Y.txt": None}), "tst_X_Y.txt", None, "label files")
    f = make_tok(tmp_path / "b")
    np.save(f / "trn_doc_attention_mask.npy", np.ones((3, 5), dtype=np.int64))
    assert_error(f, "trn_doc_attention_mask.npy", None, "shape", "(3, 4)")
    assert_error(make_tok(tmp_path / "c", rows=(3, 4, 3)), "tst_doc_input_ids.npy", None, "2 rows", "4 rows")
    assert_error(make_tok(tmp_path / "d", rows=(3, 2, 5)), "lbl_input_ids.npy", None, "3 rows")
    g = make_tok(tmp_path / "e")
    raw = (g / "trn_doc_input_ids.npy").read_bytes()
    (g / "trn_doc_input_ids.npy").write_bytes(raw[: len(raw) - 20])
    assert_error(g, "trn_doc_input_ids.npy", None, ".npy")
    h = make_tok(tmp_path / "f")
    (h / "lbl_attention_mask.npy").unlink()
    assert_error(h, "lbl_attention_mask.npy", None, "together")
    k = make_tok(tmp_path / "g")
    np.save(k / "tst_doc_input_ids.npy", np.ones(2))
    assert_error(k, "tst_doc_input_ids.npy", None, "2-D integer")
    (k / "tst_doc_input_ids.npy").write_bytes(b"")
    assert_error(k, "tst_doc_input_ids.npy", None, ".npy")
    assert_error(make_tok(tmp_path / "h", **{"trn_X_Y.txt": "3 3\n0:1\n7:1\n\n"}), "trn_X_Y.txt", 3, "[0, 3)")
    assert_error(make_tok(tmp_path / "i", **{"trn_X_Y.txt": "3\n0:1\n1:1\n\n"}), "trn_X_Y.txt", 1, "rows cols")
    assert_error(make_tok(tmp_path / "j", **{"trn_X_Y.txt": ""}), "trn_X_Y.txt", 1, "empty file")
    assert_error(make_tok(tmp_path / "k", **{"Y.txt": "a\n"}), "Y.txt", 2, "3 lines")


# ------------------------------------------------------------------------------ filters, all layouts

def test_filters_in_bow_layout(tmp_path):
    f = tmp_path / "bow"
    f.mkdir()
    (f / "toy_train.txt").write_text("3 4 3\n0,2 0:1 3:2\n 1:1\n1 2:1 0:1\n")
    (f / "toy_test.txt").write_text("2 4 3\n2 3:1\n0,1 1:0.5 2:1\n")
    (f / "filter_labels_test.txt").write_text("1 2\n")
    (f / "filter_labels_train.txt").write_text("0 0\n2 1\n")
    ds = read_dataset(f)
    assert ds.filter_test.tolist() == [[1, 2]] and ds.filter_train.tolist() == [[0, 0], [2, 1]]
    (f / "filter_labels_test.txt").write_text("2 0\n")
    assert_error(f, "filter_labels_test.txt", 1, "row id in [0, 2)")


# ------------------------------------------------------------------------------ streaming parsers

def _random_rows(rng: np.random.Generator, n: int, d: int, odd: bool) -> list[str]:
    """Rows of idx:val tokens; ``odd`` adds spellings only the line-by-line rules take (tabs, 1_0, CRLF)."""
    out = []
    for r in range(n):
        k = int(rng.integers(0, 6))
        toks = [f"{int(i)}:{float(v):.4g}" for i, v in zip(rng.integers(0, d, k), rng.random(k) * 3)]
        line = " ".join(toks)
        if odd and r % 5 == 3:
            line = "\t".join(toks) + ("  1_0:2" if d > 10 else "")
        out.append(line)
    return out


@pytest.mark.parametrize("odd", [False, True])
def test_streaming_chunk_sizes_agree(tmp_path, odd):
    rng = np.random.default_rng(7)
    rows = _random_rows(rng, 60, 20, odd)
    p = tmp_path / "trn_X_Xf.txt"
    p.write_text("60 20\n" + "\n".join(rows) + ("\r\n" if odd else "\n"))
    ref = streaming.read_sparse_file(p)
    for c in (1, 7):
        assert same(streaming.read_sparse_file(p, chunk_lines=c), ref)
    # the reference rules, line by line
    acc = streaming.Growing(p, 20, "feature")
    for j, r in enumerate(rows):
        idx: list[int] = []
        val: list[float] = []
        k = streaming._slow_pairs_line(acc, r, j + 2, idx, val)
        acc.append(np.array([k]), np.array(idx, np.int64), np.array(val))
    assert same(acc.to_csr(), ref)
    # BoW rows: labels in front (some rows without labels start with a space)
    labs = [",".join(str(int(x)) for x in rng.integers(0, 9, int(rng.integers(0, 4)))) for _ in rows]
    b = tmp_path / "x_train.txt"
    b.write_text("60 20 9\n" + "\n".join(f"{l} {r}" if l else f" {r}" for l, r in zip(labs, rows)) + "\n")
    X, Y = streaming.read_bow_file(b)
    for c in (1, 7):
        X2, Y2 = streaming.read_bow_file(b, chunk_lines=c)
        assert same(X, X2) and same(Y, Y2)
    assert same(X, ref)
    assert [sorted(set(Y[i].indices.tolist())) for i in range(60)] == \
        [sorted({int(t) for t in l.split(",")}) if l else [] for l in labs]


@pytest.mark.parametrize("chunk_lines", [1, 1000])
def test_values_past_float32_are_refused_naming_the_line(tmp_path, chunk_lines):
    """Values are kept as float32: 1e39 would become inf (and then NaN in any normalisation), so the reader refuses
    it naming the file and line, on the chunked fast path and line by line; two entries of one column that sum past
    the range are refused naming the line and data row."""
    p = tmp_path / "x_train.txt"
    p.write_text("3 4 2\n0 0:1 1:0.5\n1 2:-1e39 3:1\n0 0:3.4e38\n")
    with pytest.raises(XCFormatError, match=r"x_train.txt:3: .*float32's range.*got '2:-1e39'"):
        streaming.read_bow_file(p, chunk_lines=chunk_lines)
    p.write_text("2 4 2\n0 0:1\n1 3:3e38 3:3e38\n")
    with pytest.raises(XCFormatError, match=r"x_train.txt:3: .*sum per \(row, column\) fits float32.*data row 2"):
        streaming.read_bow_file(p, chunk_lines=chunk_lines)
    p.write_text("2 4 2\n0 0:1\n1 3:3.4e38\n")  # within the range: read as it is
    X, _ = streaming.read_bow_file(p, chunk_lines=chunk_lines)
    assert np.isfinite(X.data).all() and X[1, 3] == np.float32(3.4e38)


def test_read_dataset_chunk_lines(tmp_path):
    f = make_single(tmp_path / "s")
    a, b = read_dataset(f), read_dataset(f, chunk_lines=1)
    assert same(a.X_train, b.X_train) and same(a.Y_test, b.Y_test)
    with pytest.raises(XCConfigError):
        read_dataset(f, chunk_lines=0)


def _lf(folder: Path, trn: list[str], n_labels: int = 4) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    lbl = [json.dumps({"uid": i, "title": f"L{i}", "content": "c"}) for i in range(n_labels)]
    tst = [json.dumps({"title": "q", "target_ind": [0]})]
    for name, lines in (("trn.json.gz", trn), ("tst.json.gz", tst), ("lbl.json.gz", lbl)):
        (folder / name).write_bytes(gzip.compress(("\n".join(lines) + "\n").encode()))
    return folder


def test_lf_fast_and_line_readers_agree(tmp_path):
    trn = [json.dumps({"uid": "a", "title": " t0 ", "content": "c0", "target_ind": [0, 3], "target_rel": [1, 0.5]}),
           json.dumps({"uid": 2, "title": "t1", "target_ind": [1]}),
           json.dumps({"title": "t2", "content": None, "target_ind": [], "target_rel": None}),
           "",
           json.dumps({"title": "t3", "content": "x", "target_ind": [2, 2], "extra": {"k": [1]}})]
    f = _lf(tmp_path / "lf", trn)
    for fields in (("title",), ("title", "content")):
        a, b = read_lf_raw(f, fields, fields), read_lf_raw(f, fields, fields, fast=False)
        assert a.train_texts == b.train_texts and a.label_texts == b.label_texts
        assert same(a.Y_train, b.Y_train) and same(a.Y_test, b.Y_test)
    assert a.train_texts == ["t0 c0", "t1", "t2", "t3 x"] and a.Y_train[3].toarray().tolist() == [[0, 0, 2, 0]]
    small = read_lf_raw(f, ("title",), ("title",))
    assert small.Y_train.shape == (4, 4)


@pytest.mark.parametrize("bad, line, needle", [
    ('{"title": 5, "target_ind": [1]}', 3, "'title' to be a string"),
    ('{"title": "t", "target_ind": [true]}', 3, "list of integers"),
    ('{"title": "t", "target_ind": [1.0]}', 3, "list of integers"),
    ('{"title": "t", "target_ind": [9]}', 3, "[0, 4)"),
    ('{"title": "t", "target_ind": [1], "target_rel": [NaN]}', 3, "finite numbers"),
    ('{"title": "t", "target_ind": [1], "target_rel": [-1]}', 3, "relevances: finite numbers >= 0"),
    ('{"title": "t", "target_ind": [1], "target_rel": [1e39]}', 3, "within float32's range"),
    # two objects on a line, or one over two lines: Arrow's parser takes either, the layout is one per line
    ('{"title": "t", "target_ind": [1]} {"title": "u", "target_ind": [0]}', 3, "a valid JSON object per line"),
    ('{"title": "t",\n"target_ind": [1]}', 3, "a valid JSON object per line"),
    ('{"title": "a\\ud800b", "target_ind": [1]}', 3, "UTF-8 encodable"),  # a lone surrogate: no text
    ('{"title": null, "target_ind": [1]}', None, None),  # null title: accepted (empty text)
])
def test_lf_fast_path_errors_name_the_line(tmp_path, bad, line, needle):
    trn = [json.dumps({"title": f"t{i}", "target_ind": [i]}) for i in range(2)] + [bad]
    f = _lf(tmp_path / "lf", trn)
    if line is None:
        assert read_dataset(f).train_texts[2] == ""
        return
    assert_error(f, "trn.json.gz", line, needle)


def test_lf_sums_past_float32_name_the_line_on_both_readers(tmp_path):
    """A label id repeated with relevances that sum past float32 is refused once the rows are summed: the error names
    the file line of the record on the Arrow path as line by line, blank lines counted."""
    trn = [json.dumps({"title": "t0", "target_ind": [0]}), "", "",
           json.dumps({"title": "t1", "target_ind": [1, 1], "target_rel": [3e38, 3e38]})]
    f = _lf(tmp_path / "lf", trn)
    for fast in (True, False):
        with pytest.raises(XCFormatError, match=r"trn.json.gz:4: expected label values whose sum per \(row, column\) "
                                                r"fits float32.*an overflow in data row 2"):
            read_lf_raw(f, ("title",), ("title",), fast=fast)


def test_lf_relevance_zero_is_no_label_on_both_readers(tmp_path):
    """A target_rel of 0 (a judged non-relevant label) is dropped, never stored as a 0 that a trainer reading the
    stored entries would take for a positive; both readers agree."""
    trn = [json.dumps({"title": "t0", "target_ind": [0, 3], "target_rel": [1, 0]}),
           json.dumps({"title": "t1", "target_ind": [1, 2], "target_rel": [0, 0.0]})]
    f = _lf(tmp_path / "lf", trn)
    for fast in (True, False):
        Y = read_lf_raw(f, ("title",), ("title",), fast=fast).Y_train
        assert Y.nnz == 1 and Y.toarray().tolist() == [[1, 0, 0, 0], [0, 0, 0, 0]]


def test_lf_truncated_gzip_large(tmp_path):
    trn = [json.dumps({"title": f"title {i}", "target_ind": [i % 4, (i + 1) % 4]}) for i in range(20_000)]
    f = _lf(tmp_path / "lf", trn)
    assert read_dataset(f).num_train == 20_000
    raw = (f / "trn.json.gz").read_bytes()
    (f / "trn.json.gz").write_bytes(raw[: len(raw) * 2 // 3])
    assert_error(f, "trn.json.gz", None, "gzip")


@pytest.mark.skipif(not WORDNET.is_dir(), reason="WordNet not available")
def test_wordnet_fast_equals_line_by_line():
    a = read_lf_raw(WORDNET, ("title",), ("title",))
    b = read_lf_raw(WORDNET, ("title",), ("title",), fast=False)
    assert a.train_texts == b.train_texts and same(a.Y_train, b.Y_train) and same(a.Y_test, b.Y_test)


# ------------------------------------------------------------------------------------- fuzzing



_edits = st.lists(st.tuples(st.integers(0, 10_000), st.binary(max_size=3)
                            | st.sampled_from([b":", b",", b" ", b"\t", b"\r", b"-", b"e", b"9", b"_", b"\n"])),
                  max_size=4)
_lines = st.lists(st.tuples(st.integers(0, 100), st.binary(max_size=20)
                            | st.text(alphabet="0123456789,: .-e\t", max_size=20).map(str.encode)), max_size=3)
_fuzz = settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _parses_or_format_error(folder: Path, **kw) -> None:
    for chunk in (1, streaming.DEFAULT_CHUNK_LINES):
        try:
            ds = read_dataset(folder, chunk_lines=chunk, **kw)
        except XCFormatError:
            continue
        assert ds.Y_train.shape[1] == len(ds.label_texts) and ds.X_train.shape[0] == ds.num_train


@_fuzz
@given(which=st.sampled_from(["Toy_data.txt", "toy_trSplit.txt", "toy_tstSplit.txt", "Y.txt", "X_vocab.txt"]),
       edits=_edits, lines=_lines, split=st.integers(0, 2))
def test_fuzz_bow_single(which, edits, lines, split):
    with tempfile.TemporaryDirectory() as d:
        f = make_single(Path(d))
        (f / which).write_bytes(_corrupt((f / which).read_bytes(), edits, lines))
        try:
            _parses_or_format_error(f, split=split)
        except XCConfigError:
            pytest.fail("a file corruption must not surface as a configuration error")


_SPLIT = {"trn_X_Y.txt": "3 3\n0:1 2:0.5\n1:1\n\n", "tst_X_Y.txt": "2 3\n2:1\n0:1 1:1\n",
          "trn_X_Xf.txt": "3 5\n0:1 4:0.5\n1:2\n3:1\n", "tst_X_Xf.txt": "2 5\n2:1\n0:1 1:1\n",
          "Yf.txt": "3 5\n0:1\n1:1\n4:1\n", "trn_X.txt": "a\nb\nc\n", "filter_labels_test.txt": "1 0\n"}


@_fuzz
@given(which=st.sampled_from(sorted(_SPLIT)), edits=_edits, lines=_lines)
def test_fuzz_split_sparse(which, edits, lines):
    with tempfile.TemporaryDirectory() as d:
        f = Path(d)
        for name, content in _SPLIT.items():
            (f / name).write_text(content)
        (f / which).write_bytes(_corrupt((f / which).read_bytes(), edits, lines))
        _parses_or_format_error(f)


# ------------------------------------------------------------------------- every layout over http

@pytest.mark.parametrize("layout, make, archive", [
    ("lf-raw", "make_lf", "zip"), ("bow", "make_bow", "tar.gz"), ("bow-single", "make_single", "zip"),
    ("split-sparse", "make_split", "tar.gz"), ("tokenized", "make_tok", "zip"),
])
def test_every_layout_from_a_local_http_server(tmp_path, layout, make, archive):
    """Each layout, packed as an archive and served by http.server on 127.0.0.1, ingests like the folder."""
    maker = {"make_single": make_single, "make_tok": make_tok}.get(make) or getattr(td, make)
    src = maker(tmp_path / "src" / f"DS-{layout}")
    served = tmp_path / "served"
    served.mkdir()
    name = f"ds.{archive}"
    if archive == "zip":
        with zipfile.ZipFile(served / name, "w") as zf:
            for p in src.iterdir():
                zf.write(p, f"{src.name}/{p.name}")
    else:
        with tarfile.open(served / name, "w:gz") as tf:
            tf.add(src, arcname=src.name)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0),
                                             functools.partial(td._QuietHandler, directory=str(served)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        got = resolve_source(f"http://127.0.0.1:{server.server_address[1]}/{name}", tmp_path / "cache")
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)
    assert detect_layout(got) == layout
    a, b = read_dataset(got), read_dataset(src)
    assert a.layout == layout and same(a.Y_train, b.Y_train) and same(a.Y_test, b.Y_test)
    assert a.train_texts == b.train_texts and a.label_texts == b.label_texts


def test_load_dataset_labels_only(tmp_path):
    """Stages that need only the label matrices skip texts, tokens and features."""
    ds = read_dataset(td.make_bow(tmp_path / "bow"))
    save_dataset(ds, tmp_path / "saved")
    slim = load_dataset(tmp_path / "saved", texts=False, features=False)
    assert slim.train_texts == [] and slim.X_train is None
    assert same(slim.Y_train, ds.Y_train) and same(slim.Y_test, ds.Y_test)
    assert np.array_equal(slim.filter_test, ds.filter_test) and slim.num_train == ds.num_train


@pytest.mark.parametrize("name", ["filter_labels_test.txt", "Y.txt", "X_vocab.txt"])
def test_an_optional_file_that_is_a_folder_is_named_not_read_as_absent(tmp_path, name):
    """A folder by an optional file's name read as "no such file": a filter folder left evaluation unfiltered (every
    metric changed, no word), a Y.txt folder gave generic label names."""
    from tests.tinydata import write_lf_dataset

    lf = write_lf_dataset(tmp_path / "lf") if name.startswith("filter") else None
    if lf is None:  # the bow layout's optional companions: Bibtex's files with the folder beside them
        lf = tmp_path / "bow"
        lf.mkdir()
        for f in ("bibtex_train.txt", "bibtex_test.txt", "X_vocab.txt", "Y.txt"):
            if f != name:
                (lf / f).write_bytes((BIBTEX / f).read_bytes())
    if (Path(lf) / name).exists():
        (Path(lf) / name).unlink()
    (Path(lf) / name).mkdir()
    assert_error(Path(lf), name, None, "expected a file, or nothing by that name", "got 'a folder'")
