"""Reading and writing the shortlist sources (``xc_dagster.retrieval.shortlist``) in an index stage's folder:
faiss files, .npy, .npz and JSON, no pickle; a held-out copy of the parts built from training points beside them."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import scipy.sparse as sp

from xc_dagster.retrieval.ann import LabelIndex
from xc_dagster.retrieval.cooccurrence import LabelCooccurrence
from xc_dagster.retrieval.files import (
    CENTROID_FILE,
    COOCCURRENCE_FILE,
    INDEX_FILES,
    KNN_EXCLUDED_FILE,
    KNN_LABELS_FILE,
    LEXICAL_DIR,
)
from xc_dagster.retrieval.lexical import CONFIG_FILE, LexicalIndex, read_config
from xc_dagster.retrieval.lexical_classifier import BIAS_FILE, KEYS_FILE, WEIGHTS_FILE
from xc_dagster.retrieval.shortlist import (
    ANN_SOURCES,
    POINT_SOURCES,
    ShortlistSources,
    check_sources,
    label_representation,
)
from xc_dagster.storage import link, save_json


def save_sources(src: ShortlistSources, folder, centroids: np.ndarray | None) -> None:
    """Write every index as ``INDEX_FILES[name]``, the kNN label matrix and the centroids when used, the
    lexical index's folder ``LEXICAL_DIR`` and the co-occurrence source's file."""
    save_parts(folder, src.indexes, src.knn_labels, centroids, src.cooccurrence)
    if src.lexical is not None:
        src.lexical.save(Path(folder) / LEXICAL_DIR)


def save_parts(folder, indexes: dict[str, LabelIndex], knn_labels: sp.csr_matrix | None,
               centroids: np.ndarray | None, cooccurrence: LabelCooccurrence | None = None) -> None:
    """``save_sources`` for any subset of the parts, e.g. only those built from the training points."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for name, index in indexes.items():
        index.save(folder / INDEX_FILES[name])
    if knn_labels is not None:
        sp.save_npz(folder / KNN_LABELS_FILE, knn_labels.astype(np.float32))
    if centroids is not None:
        np.save(folder / CENTROID_FILE, centroids)
    if cooccurrence is not None:
        cooccurrence.save(folder)


def load_sources(folder, sources: tuple[str, ...], label_repr: str, kind: str, ef_search: int, W: np.ndarray,
                 label_emb: np.ndarray, knn_neighbours: int = 0, point_folder=None,
                 knn_power: float = 1.0, dense: bool = True) -> ShortlistSources:
    """The sources ``save_sources`` wrote into ``folder`` (faiss files, .npy, .npz, JSON; no pickle); with
    ``point_folder``, the parts built from training points (``POINT_SOURCES`` indexes, the kNN label matrix, the
    label centroids, the label co-occurrence) are read from there instead (what ``save_parts`` wrote, e.g. a
    held-out copy). A part the
    copy lacks is the deployed one; its ``KNN_EXCLUDED_FILE`` names the deployed kNN rows (and lexical points)
    it leaves out. ``dense``: the index summary's (False: the classifier and embedding scores are 0)."""
    folder = Path(folder)
    points = folder if point_folder is None else Path(point_folder)
    check_sources(tuple(sources), f"{folder}: sources")

    def where(file: str, from_points: bool = True) -> Path:
        return points / file if from_points and (points / file).exists() else folder / file

    indexes = {name: LabelIndex.load(where(INDEX_FILES[name], name in POINT_SOURCES), kind, ef_search)
               for name in sources if name in ANN_SOURCES}
    W, label_emb = _held_by(indexes.get("W"), W), _held_by(indexes.get("label"), label_emb)
    knn = excluded = None
    if "knn" in sources:
        knn = sp.load_npz(where(KNN_LABELS_FILE)).tocsr().astype(np.float64)  # as knn_label_scores sums
    if ("knn" in sources or "lexical" in sources) and (points / KNN_EXCLUDED_FILE).exists() \
            and not (points / INDEX_FILES["knn"]).exists():
        excluded = np.load(points / KNN_EXCLUDED_FILE, allow_pickle=False)
    lexical = LexicalIndex.load(folder / LEXICAL_DIR) if "lexical" in sources else None
    cooc = LabelCooccurrence.load(where(COOCCURRENCE_FILE).parent) if "cooccurrence" in sources else None
    path = points / CENTROID_FILE
    centroids = np.load(path, allow_pickle=False) if path.exists() else None
    return ShortlistSources(W, label_representation(label_emb, centroids, label_repr), indexes, knn, knn_neighbours,
                            knn_power, excluded, lexical, cooc, dense)


def _held_by(index: LabelIndex | None, vectors: np.ndarray) -> np.ndarray:
    """``vectors`` (e.g. a memmap of W) as the index over them stores them, so they are in memory once (at 1.3M
    labels W and the label embeddings are 2 GB each), else read into memory."""
    held = None if index is None else index.stored_vectors()
    if held is not None and held.shape == vectors.shape:
        return held
    if isinstance(vectors, np.memmap):
        return np.array(vectors, dtype=np.float32)  # into memory: a writable array, read once
    return np.asarray(vectors, dtype=np.float32)


CLASSIFIER_FILES = (KEYS_FILE, WEIGHTS_FILE, BIAS_FILE)  # what ``LexicalClassifier.save`` writes into the folder


def link_lexical(src: Path, dst: Path, classifiers: bool) -> None:
    """The lexical index's folder ``src`` as ``dst`` (hard links); without ``classifiers`` (a fusion fitted without
    them) their weights stay behind and ``dst``'s config no longer names them, so it loads as an index without."""
    config = read_config(src)
    if classifiers or not config.get("classifier"):
        link(src, dst)
        return
    dst.mkdir()
    for f in src.iterdir():
        if f.name not in CLASSIFIER_FILES + (CONFIG_FILE,):
            link(f, dst / f.name)
    save_json(dst / CONFIG_FILE, {k: v for k, v in config.items() if k != "classifier"})
