"""Checks of a serving bundle at load (``xc_dagster.serving.bundle.load_bundle``): each file read names itself when it
fails, ``serving.json`` holds the keys the inference path reads, and the parts agree with each other (the labels'
count L and the encoder's width D), so a damaged bundle fails to load naming the file or field, instead of loading
and then failing every request with an error that names neither."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, TypeVar

import numpy as np

from xc_dagster.errors import XCError
from xc_dagster.retrieval.files import INDEX_FILES, KNN_LABELS_FILE, LEXICAL_DIR
from xc_dagster.storage import load_json

if TYPE_CHECKING:  # pragma: no cover
    from xc_dagster.serving.bundle import ServingBundle

T = TypeVar("T")
# serving.json keys the inference path reads without a default, and what each must be
REQUIRED: dict[str, tuple[type, int | None]] = {  # key -> (type, least value; None: any)
    "pooling": (str, None), "max_len": (int, 1), "index_kind": (str, None), "ef_search": (int, 1),
    "shortlist_size": (int, 1),
}


def read_part(path: Path, read: Callable[[Path], T]) -> T:
    """``read(path)``, a failure naming ``path`` (a missing, truncated or unreadable bundle file)."""
    if not path.exists():
        raise XCError(f"serving bundle file {path}: missing; write the bundle again (write_bundle)")
    try:
        return read(path)
    except Exception as e:  # numpy / pyarrow / faiss / safetensors each raise their own
        raise XCError(f"serving bundle file {path}: cannot be read ({type(e).__name__}: {e})") from e


def read_array(path: Path, mmap: bool = False) -> np.ndarray:
    """A bundle's ``.npy`` (no pickle), memory-mapped with ``mmap``."""
    return read_part(path, lambda p: np.load(p, allow_pickle=False, mmap_mode="r" if mmap else None))


def read_info(path: Path, bundle_format: int) -> dict[str, Any]:
    """``serving.json`` at ``path``, checked: its format and each key of ``REQUIRED``."""
    if not path.is_file():
        raise XCError(f"serving bundle {path.parent}: no {path.name}; not a bundle written by write_bundle")
    info = read_part(path, load_json)
    if not isinstance(info, dict) or info.get("format") != bundle_format:
        got = info.get("format") if isinstance(info, dict) else type(info).__name__
        raise XCError(f"serving bundle {path}: format {got!r}, this code reads {bundle_format}")
    for key, (kind, least) in REQUIRED.items():
        value = info.get(key)
        ok = isinstance(value, kind) and not isinstance(value, bool) and (least is None or value >= least)
        if not ok:
            want = kind.__name__ + ("" if least is None else f" >= {least}")
            raise XCError(f"serving bundle {path}: {key!r}: expected {want}, got {value!r}"
                          + (" (missing)" if key not in info else ""))
    return info


def _shape(folder: Path, name: str, got: tuple[int, ...], want: tuple[int, ...], why: str) -> None:
    if tuple(got) != tuple(want):
        raise XCError(f"serving bundle file {folder / name}: shape {tuple(got)}, expected {tuple(want)} ({why})")


def _index_dim(index: Any) -> int:
    """The width of the vectors an ANNS index holds (faiss's ``d``, or an exact index's array)."""
    vectors = index.stored_vectors()
    return int(vectors.shape[1]) if vectors is not None else int(index._index.d)


def check_parts(b: "ServingBundle", folder: Path, label_emb: np.ndarray, width: int) -> None:
    """Raise :class:`XCError` naming the file or field when ``b``'s parts disagree with its L labels
    (``labels.parquet``) or its encoder's width ``width`` (the queries the indexes are searched with)."""
    L, src = len(b.label_texts), b.sources
    if src.dense:  # not dense: W and the label vectors are never multiplied with a query
        _shape(folder, "W.npy", b.W.shape, (L, width), "labels x the encoder's width")
        _shape(folder, "label_emb.npy", label_emb.shape, (L, width), "labels x the encoder's width")
    else:
        _shape(folder, "W.npy", b.W.shape[:1], (L,), "one row per label")
    _shape(folder, "inv_prop.npy", b.inv_prop.shape, (L,), "one inverse propensity per label")
    for name, index in src.indexes.items():
        rows = L if name != "knn" else (0 if src.knn_labels is None else src.knn_labels.shape[0])
        _shape(folder, INDEX_FILES[name], (index.size, _index_dim(index)), (rows, width),
               "labels x the encoder's width" if name != "knn" else f"rows of {KNN_LABELS_FILE} x the encoder's width")
    if src.knn_labels is not None:
        _shape(folder, KNN_LABELS_FILE, src.knn_labels.shape[1:], (L,), "one column per label")
    if src.lexical is not None and src.lexical.num_labels != L:
        raise XCError(f"serving bundle {folder / LEXICAL_DIR}: the lexical index has {src.lexical.num_labels} "
                      f"labels, the bundle {L} (labels.parquet)")
    if b.input == "features":
        n = b.info.get("num_features")
        have = None if src.lexical is None else src.lexical.num_features
        if not isinstance(n, int) or isinstance(n, bool) or n != have:
            raise XCError(f"serving bundle {folder / 'serving.json'}: 'num_features' {n!r}: expected the lexical "
                          f"index's {have} (a model of feature rows reads them through its lexical source)")
