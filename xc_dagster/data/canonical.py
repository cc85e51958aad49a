"""The canonical in-memory dataset every layout is parsed into, and its pickle-free on-disk form.

On disk (one folder): ``{train,test,label}_texts.parquet`` (column ``text``), ``Y_train.npz``, ``Y_test.npz``
and, when present, ``X_train.npz``/``X_test.npz``/``X_label.npz`` (``scipy.sparse.save_npz``) with
``feature_words.parquet`` (column ``text``, one word per feature column: the BoW vocabulary),
``filter_{train,test}.npy``, for pre-tokenized datasets ``{train,test,label}_tokens_{input_ids,attention_mask}.npy``,
and ``meta.json`` (layout, stats, which matrices exist). ``meta.json`` is written
last and the whole folder is renamed into place, so a folder that exists is complete.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import scipy.sparse as sp

from xc_dagster.errors import XCDatasetNotFound, XCFormatError

FORMAT_VERSION = 1
_TEXTS = ("train_texts", "test_texts", "label_texts")
LABEL_TEXTS_FILE = "label_texts.parquet"  # the label texts, column ``text``, row = label id
FEATURE_WORDS_FILE = "feature_words.parquet"  # the feature vocabulary, column ``text``, row = feature column
_REQUIRED_MATRICES = ("Y_train", "Y_test")
_OPTIONAL_MATRICES = ("X_train", "X_test", "X_label")
_FILTERS = ("filter_train", "filter_test")
_TOKENS = ("train_tokens", "test_tokens", "label_tokens")
_TOKEN_KINDS = ("input_ids", "attention_mask")


def empty_pairs() -> np.ndarray:
    """An empty (0, 2) int64 array of (row, label) filter pairs."""
    return np.zeros((0, 2), dtype=np.int64)


@dataclass
class XCDataset:
    """One XC dataset in canonical form: texts, sparse label matrices, filter pairs, optional BoW features."""

    train_texts: list[str]
    test_texts: list[str]
    label_texts: list[str]
    Y_train: sp.csr_matrix
    Y_test: sp.csr_matrix
    filter_train: np.ndarray
    filter_test: np.ndarray
    X_train: sp.csr_matrix | None = None
    X_test: sp.csr_matrix | None = None
    X_label: sp.csr_matrix | None = None
    layout: str = ""
    train_tokens: tuple[np.ndarray, np.ndarray] | None = None  # (input_ids, attention_mask), pre-tokenized layout
    test_tokens: tuple[np.ndarray, np.ndarray] | None = None
    label_tokens: tuple[np.ndarray, np.ndarray] | None = None
    feature_words: list[str] | None = None  # one word per feature column (the BoW vocabulary), when shipped

    @property
    def num_labels(self) -> int:
        """Number of labels L (columns of Y)."""
        return int(self.Y_train.shape[1])

    @property
    def num_train(self) -> int:
        """Number of training points."""
        return int(self.Y_train.shape[0])

    @property
    def num_test(self) -> int:
        """Number of test points."""
        return int(self.Y_test.shape[0])

    def stats(self) -> dict[str, Any]:
        """Sizes and label-density numbers for summaries and sanity checks (plain JSON-able values)."""
        n_tr, n_te, L = self.num_train, self.num_test, self.num_labels
        nnz = int(self.Y_train.nnz)
        per_row_tr = np.diff(self.Y_train.indptr)
        per_row_te = np.diff(self.Y_test.indptr)
        return {
            "n_train": n_tr,
            "n_test": n_te,
            "n_labels": L,
            "avg_labels_per_point": float(nnz / n_tr) if n_tr else 0.0,
            "avg_points_per_label": float(nnz / L) if L else 0.0,
            "train_rows_without_labels": int((per_row_tr == 0).sum()),
            "test_rows_without_labels": int((per_row_te == 0).sum()),
            "n_filter_train": int(len(self.filter_train)),
            "n_filter_test": int(len(self.filter_test)),
            "n_features": int(self.X_train.shape[1]) if self.X_train is not None else None,
        }


# ------------------------------------------------------------------------------------------- saving

def _write_texts(path: Path, texts: list[str]) -> None:
    pq.write_table(pa.table({"text": pa.array(texts, type=pa.string())}), path)


def _write_contents(ds: XCDataset, tmp: Path) -> None:
    for name in _TEXTS:
        _write_texts(tmp / f"{name}.parquet", list(getattr(ds, name)))
    present = []
    for name in _REQUIRED_MATRICES + _OPTIONAL_MATRICES:
        m = getattr(ds, name)
        if m is None:
            continue
        # looked up at call time (not imported by name) so tests can make the writer fail
        sp.save_npz(tmp / f"{name}.npz", sp.csr_matrix(m, dtype=np.float32), compressed=True)
        present.append(name)
    for name in _FILTERS:
        np.save(tmp / f"{name}.npy", np.asarray(getattr(ds, name), dtype=np.int64).reshape(-1, 2),
                allow_pickle=False)
    if ds.feature_words is not None:
        _write_texts(tmp / FEATURE_WORDS_FILE, list(ds.feature_words))
    tokens = []
    for name in _TOKENS:
        pair = getattr(ds, name, None)
        if pair is None:
            continue
        for kind, arr in zip(_TOKEN_KINDS, pair):
            np.save(tmp / f"{name}_{kind}.npy", np.asarray(arr), allow_pickle=False)
        tokens.append(name)
    meta = {"format_version": FORMAT_VERSION, "layout": ds.layout, "matrices": present, "stats": ds.stats()}
    if tokens:
        meta["tokens"] = tokens
    if ds.feature_words is not None:
        meta["feature_words"] = True
    with open(tmp / "meta.json", "w", encoding="utf-8") as f:
        json.dump(meta, f, indent=2)
        f.flush()
        os.fsync(f.fileno())


def save_dataset(ds: XCDataset, out_dir: Path) -> None:
    """Write ``ds`` to ``out_dir`` atomically: build a temp sibling folder, then rename it into place.

    An existing ``out_dir`` is moved aside, replaced, then deleted; on any failure the temp folder is removed
    and the previous content (if any) is put back, so no half-written dataset is ever visible.
    """
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tag = uuid.uuid4().hex[:12]
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{tag}"
    old = out_dir.parent / f".{out_dir.name}.old-{tag}"
    tmp.mkdir()
    try:
        _write_contents(ds, tmp)
        moved_old = False
        if out_dir.exists():
            os.rename(out_dir, old)
            moved_old = True
        try:
            os.rename(tmp, out_dir)
        except BaseException:
            if moved_old:
                os.rename(old, out_dir)
            raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if old.exists():
        shutil.rmtree(old, ignore_errors=True)


# ------------------------------------------------------------------------------------------ loading

def _read_texts(path: Path) -> list[str]:
    col = pq.read_table(path, columns=["text"]).column("text").to_pylist()
    return ["" if t is None else t for t in col]


def _read_matrix(path: Path) -> sp.csr_matrix:
    # load_npz reads with allow_pickle=False
    return sp.csr_matrix(sp.load_npz(path), dtype=np.float32)


def load_label_texts(out_dir: Path) -> list[str]:
    """Only the label texts of a canonical dataset folder (row = label id)."""
    return _read_texts(Path(out_dir) / LABEL_TEXTS_FILE)


def load_texts(out_dir: Path, split: str) -> list[str]:
    """Only the texts of one split ("train", "test" points, or "label") of a canonical dataset folder."""
    if f"{split}_texts" not in _TEXTS:
        raise ValueError(f"split: expected train, test or label, got {split!r}")
    return _read_texts(Path(out_dir) / f"{split}_texts.parquet")


def load_features(out_dir: Path, split: str) -> sp.csr_matrix | None:
    """Only the BoW features ``X_<split>`` ("train", "test", "label") of a canonical dataset folder; None when
    the layout shipped none."""
    if f"X_{split}" not in _OPTIONAL_MATRICES:
        raise ValueError(f"split: expected train, test or label, got {split!r}")
    path = Path(out_dir) / f"X_{split}.npz"
    return _read_matrix(path) if path.is_file() else None


def load_feature_words(out_dir: Path) -> list[str] | None:
    """Only the feature vocabulary of a canonical dataset folder (row = feature column); None when the layout
    shipped none."""
    path = Path(out_dir) / FEATURE_WORDS_FILE
    return _read_texts(path) if path.is_file() else None


def load_dataset(out_dir: Path, *, texts: bool = True, features: bool = True) -> XCDataset:
    """Read a folder written by :func:`save_dataset` (no pickle anywhere).

    ``texts=False`` / ``features=False`` skip the texts and token arrays / the BoW matrices and feature words
    (left empty or None) for stages that need only the label matrices and filter pairs: at millions of points
    those are most of the bytes.
    """
    out_dir = Path(out_dir)
    meta_path = out_dir / "meta.json"
    if not out_dir.is_dir():
        raise XCDatasetNotFound(f"saved dataset folder {out_dir} does not exist")
    if not meta_path.is_file():
        raise XCFormatError(out_dir, None, "a saved dataset folder with meta.json", got=None)
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise XCFormatError(meta_path, None, "valid JSON", got=str(e)) from e
    if meta.get("format_version") != FORMAT_VERSION:
        raise XCFormatError(meta_path, None, f"format_version {FORMAT_VERSION}", got=str(meta.get("format_version")))
    present = set(meta.get("matrices", []))
    kw: dict[str, Any] = {name: _read_texts(out_dir / f"{name}.parquet") if texts else [] for name in _TEXTS}
    for name in _REQUIRED_MATRICES:
        kw[name] = _read_matrix(out_dir / f"{name}.npz")
    for name in _OPTIONAL_MATRICES:
        kw[name] = _read_matrix(out_dir / f"{name}.npz") if name in present and features else None
    for name in _FILTERS:
        kw[name] = np.load(out_dir / f"{name}.npy", allow_pickle=False).astype(np.int64).reshape(-1, 2)
    if features and meta.get("feature_words"):
        kw["feature_words"] = _read_texts(out_dir / FEATURE_WORDS_FILE)
    for name in _TOKENS:
        if texts and name in meta.get("tokens", []):
            kw[name] = tuple(np.load(out_dir / f"{name}_{kind}.npy", allow_pickle=False) for kind in _TOKEN_KINDS)
    return XCDataset(layout=str(meta.get("layout", "")), **kw)
