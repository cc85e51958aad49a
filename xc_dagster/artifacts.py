"""The readers of the artifact contract (``xc_dagster.contract``: the files every stage writes and the upstream
stages it reads, whose names this module exports too).

:class:`ArtifactReader` is the only way a stage reads another stage's folder: it refuses a stage its consumer does not
declare and records what was opened. The deployed encoder and its embeddings are the classifier stage's when it
fine-tuned the encoder, else the pretrain stage's (:meth:`ArtifactReader.model_dir`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import scipy.sparse as sp

from xc_dagster.contract import (
    CHECKS,
    CLASSIFIER_INIT,
    CONTRACT,
    DATASET,
    ENCODER,
    FUSION,
    HELDOUT,
    LABEL_EMB,
    LABEL_FREQ,
    LABEL_FREQ_PLOT,
    METRICS,
    MINING_LABEL_INDEX,
    PARAMS,
    PLOTS,
    PREDICTIONS,
    REGISTERED_MODEL,
    REPORTS,
    SHORTLIST,
    SHORTLIST_SCORES,
    STAGE_ORDER,
    SUMMARY,
    TOKEN_SPLITS,
    TRAIN_EMB,
    TRAINING_STAGES,
    VALID_ROWS,
    StageArtifacts,
    UndeclaredRead,
    UndeclaredWrite,
    W,
    check_writes,
    token_files,
)
from xc_dagster.data import XCDataset, load_dataset, load_label_texts
from xc_dagster.data.canonical import load_feature_words, load_features, load_texts
from xc_dagster.encoders.tokenizer import load_tokens
from xc_dagster.errors import XCError
from xc_dagster.retrieval.files import CENTROID_FILE
from xc_dagster.retrieval.fitted_sources import as_fitted
from xc_dagster.retrieval.fusion import load_fusion
from xc_dagster.retrieval.shortlist import ShortlistSources
from xc_dagster.retrieval.source_files import load_sources
from xc_dagster.storage import VERSION, ArtifactStore, load_json

__all__ = ["CHECKS", "CLASSIFIER_INIT", "CONTRACT", "DATASET", "ENCODER", "FUSION", "HELDOUT", "LABEL_EMB",
           "LABEL_FREQ", "LABEL_FREQ_PLOT", "METRICS", "MINING_LABEL_INDEX", "PARAMS", "PLOTS", "PREDICTIONS",
           "REGISTERED_MODEL", "REPORTS", "SHORTLIST", "SHORTLIST_SCORES", "STAGE_ORDER", "SUMMARY", "TOKEN_SPLITS",
           "TRAIN_EMB", "TRAINING_STAGES", "VALID_ROWS", "W", "StageArtifacts", "UndeclaredRead", "UndeclaredWrite",
           "check_writes", "token_files", "ArtifactReader"]


def _version(stage_dir: Path) -> str:
    """The version folder a stage's link names; for a folder that is not one (written before versions, or linked
    by hand) its path and its summary's modification time and size, so that a rewrite changes it too."""
    target = stage_dir.resolve()
    if target.name.startswith(f".{stage_dir.name}.{VERSION}"):
        return target.name
    marker = target / SUMMARY if (target / SUMMARY).exists() else target
    st = marker.stat()
    return f"{target}:{st.st_mtime_ns}:{st.st_size}"


class ArtifactReader:
    """The upstream artifacts of one dataset, as read on behalf of ``consumer``.

    ``consumer``: a ``CONTRACT`` entry (or ``REGISTERED_MODEL``) whose declared reads bound what may be opened,
    or None for a script that reads everything (benches, notebooks). ``opened`` records the stages read.
    """

    def __init__(self, store: ArtifactStore, dataset: str, consumer: StageArtifacts | None = None):
        self.store, self.dataset_name, self.consumer = store, dataset, consumer
        self.opened: set[str] = set()

    def dir(self, stage: str) -> Path:
        """The folder of ``stage``'s artifacts (it must be materialized and declared by the consumer)."""
        if stage not in CONTRACT:
            raise XCError(f"unknown stage {stage!r}; stages are {', '.join(STAGE_ORDER)}")
        if self.consumer is not None and stage not in self.consumer.reads:
            raise UndeclaredRead(f"{self.consumer.stage!r} reads the artifacts of {stage!r}, which it does not "
                                 f"declare (xc_dagster/contract.py: reads {list(self.consumer.reads)})")
        self.opened.add(stage)
        return self.store.require(self.dataset_name, stage)

    def path(self, stage: str, name: str) -> Path:
        """One file or folder of ``stage``'s artifacts."""
        return self.dir(stage) / name

    def versions(self) -> dict[str, str]:
        """The version folder (``xc_dagster.storage``: a new one at every write) of each stage the consumer reads:
        what a resumable stage keys its kept work on, so that work over older inputs is never resumed."""
        if self.consumer is None:
            raise XCError("versions: a reader without a consumer declares no reads")
        folders = {stage: self.store.stage_dir(self.dataset_name, stage) for stage in self.consumer.reads}
        # the local folders only: not a read (``opened`` stays as it is), nothing fetched from a remote root
        return {stage: _version(d) for stage, d in folders.items() if d.is_dir()}

    def summary(self, stage: str, missing_ok: bool = False) -> dict[str, Any] | None:
        """The summary ``stage`` recorded; with ``missing_ok``, None when the stage is not materialized."""
        if missing_ok and not self.store.sync(self.dataset_name, stage):  # local, or fetched from a remote root
            return None
        return load_json(self.path(stage, SUMMARY))

    def stage_seconds(self, stage: str) -> float | None:
        """The wall seconds ``stage`` recorded in its summary (a summary written before stages recorded them: its
        training and encoding seconds); None when the stage is not materialized."""
        s = self.summary(stage, missing_ok=True)
        if s is None:
            return None
        return float(s.get("seconds", s.get("train_seconds", 0.0) + s.get("encode_seconds", 0.0)))

    def spent_seconds(self, *stages: str) -> float:
        """The wall seconds ``stages`` recorded (0 for one not materialized): what a training budget counts as
        spent before the stage reading it."""
        return sum(self.stage_seconds(s) or 0.0 for s in stages)

    def spent_before(self, stage: str) -> float:
        """:meth:`spent_seconds` of the budgeted stages (``TRAINING_STAGES``) before ``stage``, one of them."""
        return self.spent_seconds(*TRAINING_STAGES[:TRAINING_STAGES.index(stage)])

    # ---- ingest
    def dataset_dir(self) -> Path:
        return self.path("ingest", DATASET)

    def dataset(self, texts: bool = True, features: bool = True) -> XCDataset:
        return load_dataset(self.dataset_dir(), texts=texts, features=features)

    def labels(self) -> XCDataset:
        """The label matrices and filter pairs, without texts or features (what most stages need)."""
        return self.dataset(texts=False, features=False)

    def label_texts(self) -> list[str]:
        return load_label_texts(self.dataset_dir())

    def texts(self, split: str) -> list[str]:
        """The texts of one split alone: "train" / "test" points, or "label"."""
        return load_texts(self.dataset_dir(), split)

    def features(self, split: str) -> sp.csr_matrix | None:
        """The shipped BoW features of one split ("train", "test", "label"); None when ingest stored none."""
        return load_features(self.dataset_dir(), split)

    def feature_words(self) -> list[str] | None:
        """One word per feature column (the BoW vocabulary the layout shipped); None when ingest stored none."""
        return load_feature_words(self.dataset_dir())

    def valid_rows(self) -> np.ndarray:
        return np.load(self.path("ingest", VALID_ROWS))

    def train_rows(self, num_train: int) -> np.ndarray:
        """The rows the models learn from: every training point but the held-out validation ones."""
        return np.setdiff1d(np.arange(num_train), self.valid_rows())

    def label_freq(self) -> np.ndarray:
        return np.load(self.path("ingest", LABEL_FREQ))

    # ---- tokenize
    def tokens(self, split: str) -> tuple[np.ndarray, np.ndarray]:
        """Token ids (memory-mapped) and lengths of ``split``."""
        ids, lens = token_files(split)
        return load_tokens(self.path("tokenize", ids), self.path("tokenize", lens))

    # ---- the deployed encoder and embeddings
    def model_dir(self) -> Path:
        """Where the deployed encoder and its embeddings live: the classifier stage's folder when it wrote an
        encoder (it fine-tuned one), else the pretrain stage's."""
        c = self.dir("classifier")
        return c if (c / ENCODER).is_dir() else self.dir("pretrain")

    def model_summary(self) -> dict[str, Any]:
        """The summary of the stage that wrote the deployed encoder (its pooling and type, as trained)."""
        return load_json(self.model_dir() / SUMMARY)

    def embeddings(self, which: str, mmap: bool = False) -> np.ndarray:
        """The deployed model's ``"train"`` point or ``"label"`` embeddings."""
        name = {"train": TRAIN_EMB, "label": LABEL_EMB}[which]
        return np.load(self.model_dir() / name, mmap_mode="r" if mmap else None)

    def pretrained(self, name: str, mmap: bool = False) -> np.ndarray:
        """An array the pretrain stage wrote (``TRAIN_EMB``, ``LABEL_EMB``, ``CLASSIFIER_INIT``)."""
        return np.load(self.path("pretrain", name), mmap_mode="r" if mmap else None)

    # ---- mining, classifier, index, fusion
    def shortlist(self) -> np.ndarray:
        return np.load(self.path("mining", SHORTLIST))

    def mining_centroids(self) -> np.ndarray:
        return np.load(self.path("mining", CENTROID_FILE))

    def W(self, mmap: bool = False) -> np.ndarray:
        return np.load(self.path("classifier", W), mmap_mode="r" if mmap else None)

    def shortlist_sources(self, ef_search: int, heldout: bool = False) -> ShortlistSources:
        """W, the label representation and the indexes, as the index stage recorded them (kind, sources).

        ``heldout``: the training-point parts (kNN index, label centroids) without the validation points, for
        fitting on them; the deployed ones when the index stage built none (validation included nowhere)."""
        d = self.dir("index")
        info = self.summary("index")
        points = d / HELDOUT if heldout and (d / HELDOUT).is_dir() else None
        return load_sources(d, tuple(info.get("sources", ("W", "label"))), info.get("label_repr", "text"),
                            info["kind"], ef_search, self.W(mmap=True), self.embeddings("label", mmap=True),
                            int(info.get("knn_neighbours", 0)), points, float(info.get("knn_power", 1.0)),
                            bool(info.get("dense", True)))

    def lexical_queries(self, sources: ShortlistSources, split: str,
                        rows: np.ndarray | None = None) -> sp.csr_matrix | None:
        """The TF-IDF rows of ``split``'s points (only ``rows`` of them, when given) for the lexical source of
        ``sources``, from their BoW features or texts as it was fitted; None when ``sources`` have no lexical."""
        lex = sources.lexical
        if lex is None:
            return None
        if lex.input == "features":
            X = self.features(split)
            if X is None:
                raise XCError(f"{self.dataset_dir()}: the lexical index was fitted on BoW features, but the "
                              f"{split} points have none")
            return lex.transform(X if rows is None else X[rows])
        texts = self.texts(split)
        return lex.transform(texts if rows is None else [texts[i] for i in rows])

    def fusion_file(self) -> dict[str, Any]:
        """The fusion stage's ``fusion.json``: the fitted fusion and the kNN votes it chose, if any."""
        return load_json(self.path("fusion", FUSION))

    def fusion(self) -> Any:
        """The fitted fusion (``xc_dagster.retrieval.fusion``)."""
        return load_fusion(self.fusion_file())

    def deployed_sources(self, ef_search: int) -> ShortlistSources:
        """:meth:`shortlist_sources` scoring as the fusion was fitted (its kNN votes, its lexical classifiers or
        none), as evaluation and the serving bundle predict (``xc_dagster.retrieval.fitted_sources``)."""
        return as_fitted(self.shortlist_sources(ef_search), self.fusion_file())

    # ---- evaluate
    def metrics(self) -> dict[str, float]:
        return load_json(self.path("evaluate", METRICS))

