"""The file names the shortlist sources write in the index stage's folder (``source_files.save_sources``): a module of
names only, so the artifact contract (``xc_dagster.contract``) declares them without importing torch or faiss."""

from __future__ import annotations

INDEX_FILES = {"W": "W.index", "label": "label_emb.index", "centroid": "centroid.index", "knn": "knn.index"}
KNN_LABELS_FILE = "knn_labels.npz"
KNN_EXCLUDED_FILE = "knn_excluded.npy"  # a held-out copy's kNN: the deployed index without these rows
CENTROID_FILE = "label_centroid.npy"
COOCCURRENCE_FILE = "cooccurrence.npz"  # the label co-occurrence source (retrieval.cooccurrence)
LEXICAL_DIR = "lexical"  # the folder of a LexicalIndex among the index stage's files
