"""The artifact contract: the files every stage writes and the upstream stages it reads.

Every stage writes one folder, ``<artifacts>/<dataset>/<stage>/``, atomically. ``CONTRACT`` declares, per stage,
its Dagster asset, the upstream stages whose files it reads and the names it writes; the Dagster assets take
their ``deps`` from the declared reads, so the asset graph is the data flow, and the readers of
``xc_dagster.artifacts`` (:class:`~xc_dagster.artifacts.ArtifactReader`) are the only way a stage reads another
stage's folder. The file names are the constants below (the shortlist sources' and the lexical source's folder
are ``xc_dagster.retrieval.files``). Names only: the CLI imports this module, not the readers' torch, transformers
and faiss (docs/decisions.md#add-imports); ``xc_dagster.artifacts`` exports every name here too.

====================  =================  ===================================================================
stage                 asset              reads
====================  =================  ===================================================================
ingest                dataset            (the source)
tokenize              tokens             ingest
pretrain              siamese_encoder    ingest, tokenize
mining                negative_shortlist ingest, pretrain
classifier            classifiers        ingest, tokenize, pretrain, mining
index                 ann_index          ingest, pretrain, classifier
fusion                fusion             ingest, pretrain, mining, classifier, index
evaluate              evaluation         every stage before it (the test predictions, and their run times)
(registered model)    registered_model   ingest, tokenize, pretrain, classifier, index, fusion, evaluate
====================  =================  ===================================================================

The deployed encoder and its embeddings are the classifier stage's when it fine-tuned the encoder (ASTRA and
MIPS-s end to end, SiameseXML Module IV's residual block), else the pretrain stage's
(:meth:`~xc_dagster.artifacts.ArtifactReader.model_dir`), so every stage that uses them reads both.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from xc_dagster.errors import XCError
from xc_dagster.retrieval.files import CENTROID_FILE, COOCCURRENCE_FILE, INDEX_FILES, KNN_LABELS_FILE, LEXICAL_DIR

# every stage
SUMMARY = "summary.json"  # sizes, timings and key numbers of the run that wrote the folder
PARAMS = "params.json"  # the effective config it ran with (xc_dagster.pipeline.provenance)
# ingest
DATASET = "dataset"  # canonical tables (xc_dagster.data.canonical)
VALID_ROWS = "valid_rows.npy"  # training rows held out for fitting the fusion
CHECKS = "checks.json"
LABEL_FREQ = "label_freq.npy"
LABEL_FREQ_PLOT = "label_freq.png"
# tokenize
TOKEN_SPLITS = ("train", "test", "label")
# pretrain, and classifier when it fine-tuned the encoder
ENCODER = "encoder"  # safetensors + tokenizer files, or the bag encoder's
TRAIN_EMB = "train_emb.npy"
LABEL_EMB = "label_emb.npy"
CLASSIFIER_INIT = "classifier_init.npy"  # a warm start's W (pretrain.warm_start)
# mining
SHORTLIST = "shortlist.npy"
MINING_LABEL_INDEX = "label_emb.index"  # mining's graph over the pretrained label embeddings, reused by the index stage
SHORTLIST_SCORES = "shortlist_scores.npy"
# classifier
W = "W.npy"
# index: the shortlist sources' files (the lexical source's in its folder LEXICAL_DIR), and a copy of the
# training-point parts without the validation points
HELDOUT = "heldout"
# fusion
FUSION = "fusion.json"
# evaluate
PREDICTIONS = "predictions.npz"
METRICS = "metrics.json"
REPORTS = "reports.json"
PLOTS = {"pk_plot": "pk_plot.png", "decile_plot": "decile_plot.png", "recall_plot": "recall_by_frequency.png"}


def token_files(split: str) -> tuple[str, str]:
    """The token ids (memmap .npy) and lengths of a tokenized split ("train", "test", "label")."""
    return f"{split}_ids.npy", f"{split}_len.npy"


@dataclass(frozen=True)
class StageArtifacts:
    """One stage's entry in the contract: its asset, the stages it reads, the names it writes."""

    stage: str
    asset: str
    reads: tuple[str, ...]
    writes: tuple[str, ...]


def _stage(stage: str, asset: str, reads: tuple[str, ...], *writes: str) -> StageArtifacts:
    return StageArtifacts(stage, asset, reads, (*writes, SUMMARY, PARAMS))


CONTRACT: dict[str, StageArtifacts] = {s.stage: s for s in (
    _stage("ingest", "dataset", (), DATASET, VALID_ROWS, CHECKS, LABEL_FREQ, LABEL_FREQ_PLOT),
    _stage("tokenize", "tokens", ("ingest",), *(f for s in TOKEN_SPLITS for f in token_files(s))),
    _stage("pretrain", "siamese_encoder", ("ingest", "tokenize"), ENCODER, TRAIN_EMB, LABEL_EMB, CLASSIFIER_INIT),
    _stage("mining", "negative_shortlist", ("ingest", "pretrain"), SHORTLIST, SHORTLIST_SCORES, CENTROID_FILE,
           MINING_LABEL_INDEX),
    _stage("classifier", "classifiers", ("ingest", "tokenize", "pretrain", "mining"), W, ENCODER, TRAIN_EMB,
           LABEL_EMB),
    _stage("index", "ann_index", ("ingest", "pretrain", "mining", "classifier"), *INDEX_FILES.values(), KNN_LABELS_FILE,
           CENTROID_FILE, LEXICAL_DIR, COOCCURRENCE_FILE, HELDOUT),
    _stage("fusion", "fusion", ("ingest", "pretrain", "mining", "classifier", "index"), FUSION),
    _stage("evaluate", "evaluation", ("ingest", "tokenize", "pretrain", "mining", "classifier", "index", "fusion"),
           PREDICTIONS, METRICS, REPORTS, *PLOTS.values()),
)}
STAGE_ORDER = tuple(CONTRACT)
# what train.budget_minutes counts, in order (the evaluation's stage_seconds.training_total)
TRAINING_STAGES = ("pretrain", "mining", "classifier", "index", "fusion")
# the registered MLflow model (asset registered_model) bundles the deployed model's files; it writes to MLflow
REGISTERED_MODEL = StageArtifacts("registered_model", "registered_model",
                                  ("ingest", "tokenize", "pretrain", "classifier", "index", "fusion", "evaluate"), ())


class UndeclaredRead(XCError):
    """Code read the artifacts of a stage its consumer does not declare in ``CONTRACT``."""


class UndeclaredWrite(XCError):
    """A stage wrote a file the artifact contract does not declare."""


def check_writes(entry: StageArtifacts, folder: Path) -> None:
    """Every top-level name in ``folder`` (a stage's output) is one ``entry`` declares, or raise."""
    extra = sorted(p.name for p in Path(folder).iterdir() if p.name not in entry.writes)
    if extra:
        raise UndeclaredWrite(f"stage {entry.stage!r} wrote {extra}, which the artifact contract "
                              f"(xc_dagster/contract.py) does not declare; it declares {list(entry.writes)}")
