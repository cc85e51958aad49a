"""Layout detection and the readers of the XC repository file layouts.

Five layouts (see ALGORITHMS.md, "XC repository file formats"):

- ``lf-raw``: ``trn.json.gz``, ``tst.json.gz``, ``lbl.json.gz`` gzipped JSON lines;
- ``bow``: legacy ``*train*.txt`` / ``*test*.txt`` with header ``N D L`` and rows ``l1,l2 f:v f:v``;
- ``bow-single``: the XC repository's single ``<Name>_data.txt`` (header ``N D L``, all points) with
  ``<name>_trSplit.txt`` / ``<name>_tstSplit.txt`` index tables (see :mod:`xc_dagster.data.bow_single`);
- ``split-sparse``: ``{trn,tst}_X_{Xf,Y}.txt`` (header ``rows cols``, rows of ``idx:val``), optional
  ``lbl_X_Xf.txt``/``Yf.txt`` and raw-text companions ``trn_X.txt``, ``tst_X.txt``, ``Y.txt``;
- ``tokenized``: ``{trn_doc,tst_doc,lbl}_{input_ids,attention_mask}.npy`` plus the split-sparse label files
  (see :mod:`xc_dagster.data.tokenized`).

Filter files ``filter_labels_{train,test}.txt`` are read for every layout when present.
Every problem in a file raises :class:`XCFormatError` naming the file, the 1-based line and what was expected.
The text sparse formats and LF JSON lines are parsed in bounded memory, chunk by chunk
(:mod:`xc_dagster.data.streaming`); :class:`SparseRows` remains as the small per-row accumulator.
"""

from __future__ import annotations

import gzip
import json
import math
from array import array
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Callable

import numpy as np
import scipy.sparse as sp

from xc_dagster.data import streaming
from xc_dagster.data.canonical import XCDataset, empty_pairs
from xc_dagster.data.streaming import DEFAULT_CHUNK_LINES
from xc_dagster.errors import XCConfigError, XCDatasetNotFound, XCFormatError

LAYOUTS = ("lf-raw", "bow", "bow-single", "split-sparse", "tokenized")
TEXT_FIELDS = ("title", "content")
_MAX_DIM = 2**40  # sanity bound on header sizes (guards against corrupted headers)

_LF_FILES = ("trn.json.gz", "tst.json.gz", "lbl.json.gz")
_SPLIT_REQUIRED = ("trn_X_Y.txt", "tst_X_Y.txt")


# ----------------------------------------------------------------------------------------- line input

def _iter_lines(path: Path, *, gz: bool = False) -> Iterator[tuple[int, str]]:
    """Yield ``(1-based line number, decoded line without terminator)``; bad UTF-8 / gzip -> XCFormatError."""
    opener: Callable[..., Any] = gzip.open if gz else open
    lineno = 0
    with streaming.gzip_errors(path, gz):
        with opener(path, "rb") as f:
            for raw in f:
                lineno += 1
                try:
                    s = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise XCFormatError(path, lineno, "UTF-8 text", got=f"undecodable bytes at column {e.start + 1}") from e
                if lineno == 1 and s.startswith("\ufeff"):
                    s = s[1:]
                yield lineno, s.rstrip("\r\n")


def _read_text_lines(path: Path, expected: int, what: str) -> list[str]:
    """All lines of a one-text-per-line file, which must hold exactly ``expected`` lines."""
    lines = [s for _, s in _iter_lines(path)]
    if len(lines) != expected:
        line = len(lines) + 1 if len(lines) < expected else expected + 1
        raise XCFormatError(path, line, f"{expected} lines (one {what} per line)", got=f"{len(lines)} lines")
    return lines


def _first_line(path: Path) -> str | None:
    """The first line of a file, or None when unreadable as UTF-8."""
    try:
        with open(path, "rb") as f:
            raw = f.readline(4096)
        if not raw:
            return None
        return raw.decode("utf-8").lstrip("\ufeff").rstrip("\r\n")
    except (OSError, UnicodeDecodeError):
        return None


def _parse_header(path: Path, line: str | None, names: Sequence[str]) -> list[int]:
    """Parse a header of ``len(names)`` non-negative integers (line 1)."""
    expected = f"a header '{' '.join(names)}' of {len(names)} non-negative integers"
    parts = (line or "").split()
    if len(parts) != len(names):
        raise XCFormatError(path, 1, expected, got=line if line is not None else "an empty file")
    try:
        vals = [int(p) for p in parts]
    except ValueError:
        raise XCFormatError(path, 1, expected, got=line) from None
    if any(not 0 <= v < _MAX_DIM for v in vals):
        raise XCFormatError(path, 1, expected + " below 2**40", got=line)
    return vals


# ------------------------------------------------------------------------------------ sparse rows

class SparseRows:
    """Accumulates rows of (index, value) entries into flat arrays, then one vectorised CSR build.

    Used by the LF reader's line-by-line path: ``add_ids`` takes one row's parsed label ids (the streaming
    parsers in :mod:`xc_dagster.data.streaming` handle the ``idx:val`` text formats).
    """

    def __init__(self, path: Path, n_cols: int, what: str):
        self.path, self.n_cols, self.what = path, n_cols, what
        self.indptr = array("q", [0])
        self.indices = array("q")
        self.data = array("d")

    @property
    def n_rows(self) -> int:
        return len(self.indptr) - 1

    def _bad(self, lineno: int, got: str) -> XCFormatError:
        return XCFormatError(self.path, lineno,
                             f"{self.what} entries 'index:value' with an integer index in [0, {self.n_cols}) "
                             "and a finite number value", got=got)

    def add_ids(self, ids: Sequence[int], vals: Sequence[float] | None, lineno: int) -> None:
        """Append one row of already-parsed ids (values default to 1.0); checks the id range."""
        n = self.n_cols
        for i in ids:
            if not 0 <= i < n:
                raise XCFormatError(self.path, lineno, f"{self.what} ids in [0, {n})", got=str(i))
        self.indices.extend(ids)
        if vals is None:
            self.data.extend([1.0] * len(ids))
        else:
            self.data.extend(vals)
        self.indptr.append(len(self.indices))

    def to_csr(self) -> sp.csr_matrix:
        """The accumulated rows as a canonical (sorted, duplicates summed) float32 CSR matrix."""
        m = sp.csr_matrix(
            (np.frombuffer(self.data, dtype=np.float64).astype(np.float32),
             np.frombuffer(self.indices, dtype=np.int64),
             np.frombuffer(self.indptr, dtype=np.int64)),
            shape=(self.n_rows, self.n_cols))
        m.sum_duplicates()
        return m


def _read_sparse_file(path: Path, chunk_lines: int = DEFAULT_CHUNK_LINES) -> sp.csr_matrix:
    """A split-sparse file: header ``rows cols`` then exactly ``rows`` lines of ``idx:val`` pairs (streamed)."""
    return streaming.read_sparse_file(path, chunk_lines)


def read_filters(folder: Path, n_train: int, n_test: int, n_labels: int) -> tuple[np.ndarray, np.ndarray]:
    """``filter_labels_train.txt`` / ``filter_labels_test.txt`` of a folder (empty when absent)."""
    return (_read_filter(folder / "filter_labels_train.txt", n_train, n_labels),
            _read_filter(folder / "filter_labels_test.txt", n_test, n_labels))


def _read_filter(path: Path, n_rows: int, n_labels: int) -> np.ndarray:
    """``row label`` pairs (0-based) of a filter file; an absent file gives an empty (0, 2) array."""
    if not path.is_file():
        return empty_pairs()
    flat = array("q")
    for lineno, s in _iter_lines(path):
        parts = s.split()
        if not parts:
            continue
        try:
            if len(parts) != 2:
                raise ValueError
            r, c = int(parts[0]), int(parts[1])
        except ValueError:
            raise XCFormatError(path, lineno, "two integers 'row label' per line", got=s) from None
        if not 0 <= r < n_rows:
            raise XCFormatError(path, lineno, f"a row id in [0, {n_rows})", got=s)
        if not 0 <= c < n_labels:
            raise XCFormatError(path, lineno, f"a label id in [0, {n_labels})", got=s)
        flat.append(r)
        flat.append(c)
    return np.frombuffer(flat, dtype=np.int64).reshape(-1, 2).copy()


def _generic_labels(n: int) -> list[str]:
    return [f"label {i}" for i in range(n)]


# ------------------------------------------------------------------------------------------ LF raw

def _compose(rec: dict[str, Any], fields: Sequence[str], path: Path, lineno: int) -> str:
    """Point text = the non-empty requested fields joined by a space."""
    parts = []
    for f in fields:
        v = rec.get(f)
        if v is None:
            continue
        if not isinstance(v, str):
            raise XCFormatError(path, lineno, f"'{f}' to be a string", got=type(v).__name__)
        v = v.strip()
        if v:
            parts.append(v)
    return " ".join(parts)


def _read_jsonl(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """Records of a gzipped JSON-lines file; each must be an object with a string ``title``."""
    for lineno, s in _iter_lines(path, gz=True):
        if not s.strip():
            continue  # blank lines are skipped (as Arrow's reader does)
        try:
            rec = json.loads(s)
        except (ValueError, RecursionError) as e:
            raise XCFormatError(path, lineno, "a valid JSON object per line", got=s) from e
        if not isinstance(rec, dict):
            raise XCFormatError(path, lineno, "a JSON object per line", got=s)
        if "title" not in rec:
            raise XCFormatError(path, lineno, "a 'title' field", got=s)
        yield lineno, rec


def _read_lf_points(path: Path, n_labels: int, fields: Sequence[str],
                    fast: bool = True) -> tuple[list[str], sp.csr_matrix]:
    """Texts and label rows of ``trn``/``tst.json.gz``: the vectorised reader, else line by line."""
    if fast:
        try:
            texts, acc = streaming.read_jsonl_fast(path, fields, n_labels)
        except streaming.FastPathFailed:
            pass
        else:
            if not texts:
                raise XCFormatError(path, 1, "at least one JSON line", got="an empty file")
            assert acc is not None
            return texts, acc.to_csr()
    texts: list[str] = []
    acc = SparseRows(path, n_labels, "label")
    for lineno, rec in _read_jsonl(path):
        texts.append(_compose(rec, fields, path, lineno))
        ind = rec.get("target_ind")
        if not isinstance(ind, list) or any(type(i) is not int for i in ind):
            raise XCFormatError(path, lineno, "'target_ind' to be a list of integers", got=json.dumps(ind)[:200])
        rel = rec.get("target_rel")
        if rel is not None:
            try:
                if not isinstance(rel, list) or any(type(r) not in (int, float) for r in rel):
                    raise ValueError
                rel = [float(r) for r in rel]
                if not all(math.isfinite(r) for r in rel):
                    raise ValueError
            except (ValueError, OverflowError):
                raise XCFormatError(path, lineno, "'target_rel' to be a list of finite numbers",
                                    got=json.dumps(rel)[:200]) from None
            if len(rel) != len(ind):
                raise XCFormatError(path, lineno, f"'target_rel' of the same length as 'target_ind' ({len(ind)})",
                                    got=f"length {len(rel)}")
        acc.add_ids(ind, rel, lineno)
    if not texts:
        raise XCFormatError(path, 1, "at least one JSON line", got="an empty file")
    return texts, acc.to_csr()


def _require(folder: Path, names: Sequence[str], layout: str) -> None:
    missing = [n for n in names if not (folder / n).is_file()]
    if missing:
        raise XCFormatError(folder, None, f"the {layout} files {', '.join(names)}",
                            got="missing " + ", ".join(missing))


def _read_lf_labels(path: Path, fields: Sequence[str], fast: bool = True) -> list[str]:
    if fast:
        try:
            return streaming.read_jsonl_fast(path, fields, None)[0]
        except streaming.FastPathFailed:
            pass
    return [_compose(rec, fields, path, n) for n, rec in _read_jsonl(path)]


def read_lf_raw(folder: Path, text_fields: Sequence[str], label_text_fields: Sequence[str],
                fast: bool = True) -> XCDataset:
    """LF raw-text layout: L = number of lines of ``lbl.json.gz``; ``fast=False`` forces the line-by-line reader."""
    _require(folder, _LF_FILES, "lf-raw")
    lbl_path = folder / "lbl.json.gz"
    label_texts = _read_lf_labels(lbl_path, label_text_fields, fast)
    L = len(label_texts)
    if L == 0:
        raise XCFormatError(lbl_path, 1, "at least one label line", got="an empty file")
    train_texts, Y_train = _read_lf_points(folder / "trn.json.gz", L, text_fields, fast)
    test_texts, Y_test = _read_lf_points(folder / "tst.json.gz", L, text_fields, fast)
    f_train, f_test = read_filters(folder, len(train_texts), len(test_texts), L)
    return XCDataset(
        train_texts=train_texts, test_texts=test_texts, label_texts=label_texts,
        Y_train=Y_train, Y_test=Y_test, filter_train=f_train, filter_test=f_test, layout="lf-raw")


# --------------------------------------------------------------------------------------------- BoW

def _bow_files(folder: Path) -> tuple[Path, Path] | None:
    """The (train, test) pair of a BoW folder, or None; a lone pair with a bad header raises."""
    txt = sorted(p for p in folder.iterdir() if p.is_file() and p.name.lower().endswith(".txt")
                 and not p.name.lower().startswith("filter_labels"))
    train = [p for p in txt if "train" in p.name.lower()]
    test = [p for p in txt if "test" in p.name.lower()]
    if len(train) != 1 or len(test) != 1 or train[0] == test[0]:
        return None
    _parse_header(train[0], _first_line(train[0]), ("N", "D", "L"))
    return train[0], test[0]


def _read_bow_file(path: Path, chunk_lines: int = DEFAULT_CHUNK_LINES) -> tuple[sp.csr_matrix, sp.csr_matrix]:
    """One BoW file -> (X, Y): header ``N D L``, then N rows ``l1,l2,... f:v f:v ...`` (streamed)."""
    return streaming.read_bow_file(path, chunk_lines)


def _texts_from_vocab(X: sp.csr_matrix, vocab: np.ndarray) -> list[str]:
    """Each row's feature words, by descending feature value (ties by feature id), joined by spaces."""
    rows = np.repeat(np.arange(X.shape[0]), np.diff(X.indptr))
    order = np.lexsort((X.indices, -X.data, rows))
    words = vocab[X.indices[order]]
    bounds = X.indptr
    return [" ".join(words[bounds[r]:bounds[r + 1]]) for r in range(X.shape[0])]


def read_bow(folder: Path, chunk_lines: int = DEFAULT_CHUNK_LINES) -> XCDataset:
    """Legacy BoW layout; texts are rebuilt from ``X_vocab.txt`` when present, labels named by ``Y.txt``."""
    pair = _bow_files(folder)
    if pair is None:
        raise XCFormatError(folder, None, "exactly one *train*.txt and one *test*.txt file (BoW layout)",
                            got=", ".join(sorted(p.name for p in folder.iterdir()))[:200])
    trn, tst = pair
    X_train, Y_train = _read_bow_file(trn, chunk_lines)
    X_test, Y_test = _read_bow_file(tst, chunk_lines)
    D, L = X_train.shape[1], Y_train.shape[1]
    if (X_test.shape[1], Y_test.shape[1]) != (D, L):
        raise XCFormatError(tst, 1, f"the same D and L as {trn.name} ({D} {L})",
                            got=f"{X_test.shape[1]} {Y_test.shape[1]}")
    label_texts, (train_texts, test_texts) = bow_texts(folder, X_train, X_test, L)
    f_train, f_test = read_filters(folder, X_train.shape[0], X_test.shape[0], L)
    return XCDataset(
        train_texts=train_texts, test_texts=test_texts, label_texts=label_texts,
        Y_train=Y_train, Y_test=Y_test, filter_train=f_train, filter_test=f_test,
        X_train=X_train, X_test=X_test, layout="bow")


def bow_texts(folder: Path, X_train: sp.csr_matrix, X_test: sp.csr_matrix,
              L: int, vocab_names: Sequence[str] = ("X_vocab.txt",)) -> tuple[list[str], tuple[list[str], list[str]]]:
    """Label names from ``Y.txt`` (else generic) and point texts rebuilt from the first vocabulary file found."""
    y_txt = folder / "Y.txt"
    label_texts = _read_text_lines(y_txt, L, "label name") if y_txt.is_file() else _generic_labels(L)
    D = X_train.shape[1]
    for name in vocab_names:
        vocab_path = folder / name
        if vocab_path.is_file():
            vocab = np.array(_read_text_lines(vocab_path, D, "feature word"), dtype=object)
            return label_texts, (_texts_from_vocab(X_train, vocab), _texts_from_vocab(X_test, vocab))
    return label_texts, ([""] * X_train.shape[0], [""] * X_test.shape[0])


# ------------------------------------------------------------------------------------ split sparse

def _check_rows(path: Path, m: sp.csr_matrix, n: int, what: str) -> None:
    if m.shape[0] != n:
        raise XCFormatError(path, 1, f"{n} rows ({what})", got=f"{m.shape[0]} rows")


def read_split_sparse(folder: Path, chunk_lines: int = DEFAULT_CHUNK_LINES,
                      layout: str = "split-sparse") -> XCDataset:
    """Split sparse layout: ``{trn,tst}_X_Y.txt`` required, features and raw-text companions optional."""
    _require(folder, _SPLIT_REQUIRED, layout)
    Y_train = _read_sparse_file(folder / "trn_X_Y.txt", chunk_lines)
    tst_y = folder / "tst_X_Y.txt"
    Y_test = _read_sparse_file(tst_y, chunk_lines)
    n_tr, n_te, L = Y_train.shape[0], Y_test.shape[0], Y_train.shape[1]
    if Y_test.shape[1] != L:
        raise XCFormatError(tst_y, 1, f"{L} label columns, as in trn_X_Y.txt", got=str(Y_test.shape[1]))

    def opt_matrix(name: str, n: int, what: str) -> sp.csr_matrix | None:
        p = folder / name
        if not p.is_file():
            return None
        m = _read_sparse_file(p, chunk_lines)
        _check_rows(p, m, n, what)
        return m

    X_train = opt_matrix("trn_X_Xf.txt", n_tr, "one per training point")
    X_test = opt_matrix("tst_X_Xf.txt", n_te, "one per test point")
    lbl_name = "lbl_X_Xf.txt" if (folder / "lbl_X_Xf.txt").is_file() else "Yf.txt"
    X_label = opt_matrix(lbl_name, L, "one per label")
    dims = {name: m.shape[1] for name, m in
            (("trn_X_Xf.txt", X_train), ("tst_X_Xf.txt", X_test), (lbl_name, X_label)) if m is not None}
    if len(set(dims.values())) > 1:
        first = next(iter(dims))
        for name, d in dims.items():
            if d != dims[first]:
                raise XCFormatError(folder / name, 1, f"{dims[first]} feature columns, as in {first}", got=str(d))

    def texts(name: str, n: int, what: str, default: list[str]) -> list[str]:
        p = folder / name
        return _read_text_lines(p, n, what) if p.is_file() else default

    f_train, f_test = read_filters(folder, n_tr, n_te, L)
    return XCDataset(
        train_texts=texts("trn_X.txt", n_tr, "training text", [""] * n_tr),
        test_texts=texts("tst_X.txt", n_te, "test text", [""] * n_te),
        label_texts=texts("Y.txt", L, "label text", _generic_labels(L)),
        Y_train=Y_train, Y_test=Y_test, filter_train=f_train, filter_test=f_test,
        X_train=X_train, X_test=X_test, X_label=X_label, layout=layout)


# ----------------------------------------------------------------------------------- entry points

def _check_folder(folder: Path) -> Path:
    folder = Path(folder)
    if not folder.is_dir():
        raise XCDatasetNotFound(f"dataset folder {folder} does not exist or is not a folder")
    return folder


def detect_layout(folder: Path) -> str:
    """Which layout a folder holds: ``lf-raw``, ``tokenized``, ``split-sparse``, ``bow-single`` or ``bow``
    (checked in that order)."""
    from xc_dagster.data import bow_single, tokenized

    folder = _check_folder(folder)
    names = sorted(p.name for p in folder.iterdir())
    if all(n in names for n in _LF_FILES):
        return "lf-raw"
    if tokenized.is_tokenized(folder):
        return "tokenized"
    if all(n in names for n in _SPLIT_REQUIRED):
        return "split-sparse"
    if bow_single.find_files(folder) is not None:
        return "bow-single"
    if _bow_files(folder) is not None:
        return "bow"
    listing = ", ".join(names[:30]) + (f", ... ({len(names)} in all)" if len(names) > 30 else "")
    raise XCFormatError(
        folder, None,
        "a known dataset layout: lf-raw (trn.json.gz, tst.json.gz, lbl.json.gz), tokenized "
        "(trn_doc_input_ids.npy, ... with trn_X_Y.txt, tst_X_Y.txt), split-sparse (trn_X_Y.txt, tst_X_Y.txt), "
        "bow-single (<Name>_data.txt with <name>_trSplit.txt, <name>_tstSplit.txt) or bow (one *train*.txt "
        "and one *test*.txt starting with 'N D L'); "
        f"files found: {listing or 'none'}")


def _check_fields(fields: Sequence[str], what: str) -> tuple[str, ...]:
    if isinstance(fields, str):
        fields = (fields,)
    out = tuple(fields)
    if not out or any(f not in TEXT_FIELDS for f in out):
        raise XCConfigError(f"{what} must be a non-empty subset of {TEXT_FIELDS}, got {out!r}")
    return out


def read_dataset(folder: Path, *, layout: str = "auto", text_fields: Sequence[str] = ("title",),
                 label_text_fields: Sequence[str] | None = None, split: int = 0,
                 chunk_lines: int = DEFAULT_CHUNK_LINES) -> XCDataset:
    """Parse a dataset folder into an :class:`XCDataset` (``layout="auto"`` detects it).

    ``text_fields``/``label_text_fields`` (subsets of ``title``, ``content``) compose point and label texts
    of the ``lf-raw`` layout; other layouts carry a single text per point. ``split`` picks the column of the
    ``bow-single`` split tables (0-based); ``chunk_lines`` is the streaming parsers' chunk size in lines.
    """
    from xc_dagster.data import bow_single, tokenized

    if chunk_lines < 1:
        raise XCConfigError(f"chunk_lines must be >= 1, got {chunk_lines!r}")
    folder = _check_folder(folder)
    fields = _check_fields(text_fields, "text_fields")
    lfields = fields if label_text_fields is None else _check_fields(label_text_fields, "label_text_fields")
    if layout == "auto":
        layout = detect_layout(folder)
    if layout == "lf-raw":
        return read_lf_raw(folder, fields, lfields)
    if layout == "bow":
        return read_bow(folder, chunk_lines)
    if layout == "bow-single":
        return bow_single.read_bow_single(folder, split=split, chunk_lines=chunk_lines)
    if layout == "split-sparse":
        return read_split_sparse(folder, chunk_lines)
    if layout == "tokenized":
        return tokenized.read_tokenized(folder, chunk_lines=chunk_lines)
    raise XCConfigError(f"layout must be 'auto' or one of {LAYOUTS}, got {layout!r}")
