"""The serving bundle and its inference path: text in, top-k labels out.

A *bundle* is a folder that loads from plain files only (no pickle); the registered MLflow model
(``xc_dagster.serving.registry``) carries one as its artifact:

=====================  ==================================================================================
``encoder/``           the trained encoder and its tokenizer (safetensors + HF JSON files, or the bag encoder)
``W.npy``              classifier matrix (L, D)
``label_emb.npy``      label embeddings (L, D)
``*.index``            the ANNS indexes of the shortlist sources the model was evaluated with (faiss HNSW
                       files, or ``.npy`` vectors for ``exact``): ``W.index``, ``label_emb.index`` and, for
                       SiameseXML's Module II, ``centroid.index``, ``knn.index`` (+ ``knn_labels.npz``)
``label_centroid.npy`` label centroids, when the sources or the label representation use them
``lexical/``           the lexical source's TF-IDF index (vocabulary or feature words, idf, training-point and
                       label rows), when the sources have it: raw query text is vectorized with it
                       (``xc_dagster.retrieval.lexical``); one fitted on shipped BoW features serves only with the
                       dataset's feature words, mapping a text's words to their feature columns; the lexical
                       classifiers' weights only where the fusion scores them
``fusion.json``        the fitted fusion (alpha or tree), as the fusion stage wrote it
``inv_prop.npy``       inverse propensities of the labels (the tree fusion's third feature)
``labels.parquet``     label texts (column ``text``, row = label id)
``manifest.json``      every other file's size and SHA-256, checked at load (``xc_dagster.serving.bundle_files``)
``serving.json``       how to use them: max_len, pooling, index kind and efSearch, shortlist size, amp, k, and
                       ``input``: ``text``, or ``features`` for a model of feature rows without their words (its
                       points had no text): requests are then feature vectors (``predict_features``)
=====================  ==================================================================================

``predict_topk(texts, bundle, k)`` is the whole inference path (tokenize with the training max_len, encode,
and with the lexical source vectorize the texts; shortlist from the indexes, fuse, top-k): the pyfunc
:class:`XCModel` and ``bench/serving_bench.py`` both call it, and it gives the evaluation stage's predictions
for the same texts (same tokenizer, chunking and autocast). Its input is bounded (``xc_dagster.serving.limits``):
texts cut to ``max_len * 32`` characters before tokenizing, no labels for a text without a visible character,
k at most the shortlist's width; the pyfunc also caps a request's texts and characters.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import mlflow
import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import scipy.sparse as sp
import torch
from mlflow.protos.databricks_pb2 import INVALID_PARAMETER_VALUE

from xc_dagster.artifacts import ENCODER, FUSION, LABEL_EMB, W
from xc_dagster.data.canonical import LABEL_TEXTS_FILE
from xc_dagster.device import amp_dtype, resolve_device
from xc_dagster.durable import atomic_write, fsync_tree
from xc_dagster.encoders.encode import encode_tokens
from xc_dagster.encoders.loading import load_encoder
from xc_dagster.encoders.tokenizer import load_tokenizer, tokenize_texts
from xc_dagster.errors import XCConfigError, XCError
from xc_dagster.faiss_module import faiss
from xc_dagster.retrieval.files import CENTROID_FILE, COOCCURRENCE_FILE, INDEX_FILES, KNN_LABELS_FILE
from xc_dagster.retrieval.fitted_sources import as_fitted, fitted_choice
from xc_dagster.retrieval.fusion import load_fusion
from xc_dagster.retrieval.lexical import LEXICAL_DIR, read_config
from xc_dagster.retrieval.shortlist import ShortlistSources, retrieve, topk_from_scores
from xc_dagster.retrieval.source_files import link_lexical, load_sources
from xc_dagster.retrieval.votes import votes_record
from xc_dagster.serving.bundle_checks import check_parts, read_array, read_info, read_part
from xc_dagster.serving.bundle_files import MANIFEST_FILE, graph_copy, verify_bundle, write_manifest
from xc_dagster.serving.limits import RequestLimits, cut_texts, has_content
from xc_dagster.serving.requests import FEATURES_COLUMN, check_counts, input_features, input_texts, param_k
from xc_dagster.storage import link, load_json, save_json

if TYPE_CHECKING:  # pragma: no cover
    from xc_dagster.pipeline import StageContext

BUNDLE_FORMAT = 1
SERVING_FILE = "serving.json"
DEVICE_ENV = "XC_SERVING_DEVICE"  # device of a served model: auto (default) | cpu | cuda
THREADS_ENV = "XC_SERVING_THREADS"  # torch + faiss CPU threads of a served model (unset: their defaults)


# ------------------------------------------------------------------------------------------------ bundle

@dataclass
class ServingBundle:
    """Everything ``predict_topk`` needs, loaded from a bundle folder."""

    encoder: torch.nn.Module
    tokenizer: Any
    max_len: int
    sources: ShortlistSources  # W, label representation and the shortlist's indexes
    fusion: Any  # load_fusion(...): .score(shortlist, inv_prop)
    inv_prop: np.ndarray
    label_texts: np.ndarray  # object array, row = label id
    shortlist_size: int
    device: torch.device
    dtype: torch.dtype | None
    batch_size: int
    default_k: int
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def W(self) -> np.ndarray:
        return self.sources.W

    @property
    def num_labels(self) -> int:
        return int(len(self.W))

    @property
    def input(self) -> str:
        """What a request holds: ``text``, or ``features`` (a model of feature rows without their words)."""
        return str(self.info.get("input", "text"))

    @property
    def num_features(self) -> int:
        return int(self.info.get("num_features", 0))

    @property
    def counts(self) -> bool:
        """Whether its lexical TF-IDF was fitted on counts (sublinear tf): a feature row's values must be counts."""
        return bool(getattr(getattr(self.sources.lexical, "model", None), "sublinear_tf", False))

    @property
    def max_k(self) -> int:
        """The most labels a row can get: the shortlist's width (``shortlist_size`` per source), at most L."""
        return max(1, min(self.shortlist_size * len(self.sources.names), self.num_labels))


def _lexical_reads_features(ctx: "StageContext") -> dict[str, Any] | None:
    """The lexical source's ``lexical.json`` when it reads shipped BoW features without their words (so no raw
    text maps to its rows), else None."""
    if "lexical" not in ctx.read.summary("index").get("sources", []):
        return None
    lexical = read_config(ctx.read.dir("index") / LEXICAL_DIR)
    return None if lexical["input"] == "text" or lexical.get("feature_words") else lexical


def serving_input(ctx: "StageContext") -> str:
    """What a request to ``ctx``'s model holds: ``features`` when its lexical source reads feature rows without
    their words and its points had no text (the encoder read one empty text), else ``text``."""
    return "features" if _lexical_reads_features(ctx) is not None and not ctx.points_have_text() else "text"


def unservable(ctx: "StageContext") -> str:
    """Why ``ctx``'s model cannot be served ("" when it can): its lexical source reads the shipped BoW features
    without the dataset's feature words while its encoder reads the points' texts, so a request would need both."""
    if _lexical_reads_features(ctx) is None or not ctx.points_have_text():
        return ""
    return (f"index.sources: the lexical source of {ctx.name} was fitted on the shipped BoW features without the "
            "dataset's feature words (X_vocab.txt / vocab.txt), so raw query text cannot be mapped to them, while its "
            "encoder reads the points' texts; serve a model indexed without lexical")


def write_bundle(ctx: "StageContext", out: Path, default_k: int = 10, shortlist_size: int = 0,
                 ef_search: int = 0, graph_above: int = 0) -> dict[str, Any]:
    """Assemble the serving bundle of ``ctx``'s dataset from the stages' artifacts into ``out``.

    Reads what the artifact contract declares for the registered model: the deployed encoder and its label
    embeddings (pretrain's, or classifier's when it fine-tuned the encoder), W, the index stage's files, the fitted
    fusion and the ingested label texts; computes the inverse propensities as evaluation does.
    ``shortlist_size`` / ``ef_search`` > 0 override the evaluated ``index.shortlist_size`` /
    ``index.hnsw_ef_search`` (a faster, slightly less exact serving setting); ``graph_above`` > 0 serves each exact
    index of more vectors from an HNSW graph built here (``bundle_files.graph_copy``). Returns ``serving.json``. The
    bundle is written whole or not at all (assembled beside ``out``, then renamed); ``out`` must be new or empty.
    """
    if default_k < 1:
        raise XCConfigError(f"serving default_k: expected >= 1, got {default_k}")
    if shortlist_size < 0 or ef_search < 0 or graph_above < 0:
        raise XCConfigError(f"serving shortlist_size / ef_search / graph_above: expected >= 0 (0 = as evaluated), "
                            f"got {shortlist_size} / {ef_search} / {graph_above}")
    why = unservable(ctx)  # before anything is written
    if why:
        raise XCConfigError(why)
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):  # never mixed with another bundle's files
        raise XCConfigError(f"serving bundle folder {out}: exists and is not empty; write the bundle to a new folder")
    out.parent.mkdir(parents=True, exist_ok=True)
    written: dict[str, Any] = {}
    atomic_write(out, lambda tmp: written.update(_assemble(ctx, tmp, default_k, shortlist_size, ef_search,
                                                           graph_above)), sync=fsync_tree)
    return written


def _assemble(ctx: "StageContext", out: Path, default_k: int, shortlist_size: int, ef_search: int,
              graph_above: int) -> dict[str, Any]:
    """``write_bundle``'s files, written into the new folder ``out``; returns ``serving.json``."""
    out.mkdir()
    read = ctx.read
    pre, idx = read.model_dir(), read.dir("index")  # the deployed encoder: pretrain's, or the end-to-end one
    link(pre / ENCODER, out / "encoder")
    link(pre / LABEL_EMB, out / "label_emb.npy")
    link(read.path("classifier", W), out / "W.npy")
    idx_summary = read.summary("index")
    sources = idx_summary.get("sources", ["W", "label"])
    graphs = [INDEX_FILES[n] for n in sources if n in INDEX_FILES and (idx / INDEX_FILES[n]).exists()
              and graph_copy(idx / INDEX_FILES[n], out / INDEX_FILES[n], graph_above, ctx)]
    parts = [KNN_LABELS_FILE, CENTROID_FILE, COOCCURRENCE_FILE]
    for name in [INDEX_FILES[n] for n in sources if n in INDEX_FILES] + parts:
        if (idx / name).exists() and name not in graphs:
            link(idx / name, out / name)
    link(read.path("fusion", FUSION), out / "fusion.json")
    fusion_file = load_json(out / "fusion.json")
    fusion_method, chosen = fusion_file.get("method"), fitted_choice(fusion_file)  # its (K, p), lexical classifiers
    if "lexical" in sources:  # the lexical classifiers' weights only where the fusion scores them
        link_lexical(idx / LEXICAL_DIR, out / LEXICAL_DIR, chosen.lexical_classifiers)
    link(read.dataset_dir() / LABEL_TEXTS_FILE, out / "labels.parquet")
    inv = ctx.inv_prop(read.labels().Y_train)
    np.save(out / "inv_prop.npy", np.asarray(inv, dtype=np.float64), allow_pickle=False)
    pre_summary = read.model_summary()
    tok_summary = read.summary("tokenize")
    votes = chosen.votes
    info = {
        "format": BUNDLE_FORMAT, "dataset": ctx.name, "strategy": ctx.cfg.strategy, "preset": ctx.cfg.preset,
        "encoder_source": ctx.cfg.tokenize.encoder, "encoder_type": pre_summary.get("encoder_type"),
        "pooling": pre_summary.get("pooling", ctx.cfg.pretrain.pooling),
        "max_len": int(tok_summary.get("max_len", ctx.cfg.tokenize.max_len)),
        "amp": ctx.cfg.pretrain.amp, "encode_batch_size": int(ctx.cfg.pretrain.encode_batch_size),
        "index_kind": "auto" if graphs else idx_summary["kind"], "graph_indexes": graphs, "sources": list(sources),
        "label_repr": idx_summary.get("label_repr", "text"), "dense": bool(idx_summary.get("dense", True)),
        "knn_neighbours": int(idx_summary.get("knn_neighbours", 0)) if votes is None or "knn" not in sources
        else votes[0],
        "knn_power": float(idx_summary.get("knn_power", 1.0)) if votes is None or "knn" not in sources else votes[1],
        "votes": None if votes is None else votes_record(votes),
        "lexical_classifiers": bool(idx_summary.get("lexical", {}).get("classifier_weights"))
                               and chosen.lexical_classifiers,
        "ef_search": int(ef_search or ctx.cfg.index.hnsw_ef_search),
        "shortlist_size": int(shortlist_size or ctx.cfg.index.shortlist_size), "fusion": fusion_method,
        "as_evaluated": (not shortlist_size or shortlist_size == ctx.cfg.index.shortlist_size)
                        and (not ef_search or ef_search == ctx.cfg.index.hnsw_ef_search) and not graphs,
        "num_labels": int(idx_summary["labels"]), "dim": int(idx_summary["dim"]), "default_k": int(default_k),
        **dict(zip(("propensity_a", "propensity_b"), ctx.propensity())),  # the A / B used (a 0 = by family)
        "input": serving_input(ctx), "manifest": MANIFEST_FILE,
    }
    if info["input"] == "features":  # requests: feature vectors of the dataset's columns (serving.requests)
        info["num_features"] = int(read_config(out / LEXICAL_DIR)["num_features"])
    save_json(out / SERVING_FILE, info)
    write_manifest(out)  # last: it lists every file above with its size and SHA-256
    return info


def load_bundle(folder: str | Path, device: str | torch.device | None = None) -> ServingBundle:
    """Load a bundle folder (no pickle: safetensors, .npy, faiss files, JSON, Parquet), checked (its files against
    ``manifest.json``, then ``xc_dagster.serving.bundle_checks``: a damaged or inconsistent bundle fails here, naming
    the file or field).

    ``device``: ``auto`` (CUDA when present), ``cpu`` or ``cuda``; default ``$XC_SERVING_DEVICE`` or auto.
    Autocast follows the ``pretrain.amp`` value the model was evaluated with, on this device.
    """
    folder = Path(folder)
    info = read_info(folder / SERVING_FILE, BUNDLE_FORMAT)
    verify_bundle(folder, required=bool(info.get("manifest")))  # before any other file is read
    dev = device if isinstance(device, torch.device) else resolve_device(device or os.environ.get(DEVICE_ENV)
                                                                          or "auto")
    encoder = read_part(folder / "encoder", lambda p: load_encoder(str(p), info["pooling"])).to(dev).eval()
    tokenizer = read_part(folder / "encoder", lambda p: load_tokenizer(str(p)))
    kind, efs = info["index_kind"], int(info["ef_search"])
    labels = read_part(folder / "labels.parquet", lambda p: pq.read_table(p, columns=["text"]).column("text"))
    label_texts = np.array(["" if t is None else t for t in labels.to_pylist()], dtype=object)
    W = read_array(folder / "W.npy", mmap=True)  # served from the W index's copy when it has one
    if W.ndim != 2 or len(label_texts) != len(W):
        raise XCError(f"serving bundle {folder}: {len(label_texts)} label texts for W.npy of shape {W.shape}")
    fusion_file, label_emb = read_part(folder / "fusion.json", load_json), read_array(folder / "label_emb.npy", True)
    sources = read_part(folder, lambda p: load_sources(
        p, tuple(info.get("sources", ("W", "label"))), info.get("label_repr", "text"), kind, efs, W, label_emb,
        int(info.get("knn_neighbours", 0)), knn_power=float(info.get("knn_power", 1.0)),
        dense=bool(info.get("dense", True))))
    bundle = ServingBundle(
        encoder=encoder, tokenizer=tokenizer, max_len=int(info["max_len"]),
        sources=as_fitted(sources, fusion_file),  # the kNN votes and lexical classifiers the fusion was fitted with
        fusion=read_part(folder / "fusion.json", lambda _: load_fusion(fusion_file)),
        inv_prop=read_array(folder / "inv_prop.npy"), label_texts=label_texts,
        shortlist_size=int(info["shortlist_size"]), device=dev, dtype=amp_dtype(dev, info.get("amp", "auto")),
        batch_size=int(info.get("encode_batch_size", 256)), default_k=int(info.get("default_k", 10)), info=info)
    check_parts(bundle, folder, label_emb, encoder.dim)  # the width of the queries the indexes are searched with
    return bundle


# --------------------------------------------------------------------------------------------- inference

def encode_texts(texts: Sequence[str], bundle: ServingBundle) -> np.ndarray:
    """Unit embeddings (n, D) float32 of ``texts`` (each cut to ``max_len * 32`` characters first) with the bundled
    tokenizer and encoder."""
    ids, lens = tokenize_texts(bundle.tokenizer, cut_texts(texts, bundle.max_len), bundle.max_len)
    if len(lens) == 0:
        return np.zeros((0, bundle.W.shape[1]), dtype=np.float32)
    return encode_tokens(bundle.encoder, ids, lens, bundle.device, bundle.dtype, bundle.batch_size)


def lexical_rows(texts: Sequence[str], bundle: ServingBundle) -> Any:
    """The texts' TF-IDF rows (of the texts cut as for the encoder) for the bundle's lexical source (its saved
    vectorizer, or its feature words and idf); None when it has none."""
    lexical = bundle.sources.lexical
    return None if lexical is None else lexical.transform(cut_texts(texts, bundle.max_len))


def rank(queries: np.ndarray, bundle: ServingBundle, k: int,
         lexical_queries: Any = None) -> tuple[np.ndarray, np.ndarray]:
    """The index + fusion part: shortlist from the indexes, fused scores, top-k (ids -1 padded) of width
    ``min(k, bundle.max_k)``: a larger k gets no more labels, only padding, so it is clamped.
    ``lexical_queries``: the queries' TF-IDF rows (:func:`lexical_rows`), needed with the lexical source."""
    if k < 1:
        raise XCConfigError(f"k: expected >= 1, got {k}")
    k = min(int(k), bundle.max_k)
    if len(queries) == 0:
        return np.zeros((0, k), dtype=np.int64), np.zeros((0, k), dtype=np.float32)
    sl = retrieve(queries, bundle.sources, bundle.shortlist_size, lexical_queries=lexical_queries)
    return topk_from_scores(sl.ids, bundle.fusion.score(sl, bundle.inv_prop), k)


def predict_topk(texts: Sequence[str], bundle: ServingBundle, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Top-k (label ids int64, scores float32) per text, ids -1 (score -inf) past the shortlist's end; width
    ``min(k, bundle.max_k)``. Texts are cut to ``max_len * 32`` characters; a text without a visible character
    (empty, whitespace) gets no labels (a row of -1), and is not encoded."""
    if bundle.input == "features":
        raise XCError(f"this model reads feature vectors (column {FEATURES_COLUMN!r}, {bundle.num_features} "
                      "features: serving.requests), not text: its points had no text")
    texts = cut_texts(texts, bundle.max_len)
    keep = np.flatnonzero([has_content(t) for t in texts])
    if len(keep) == len(texts):
        return rank(encode_texts(texts, bundle), bundle, k, lexical_rows(texts, bundle))
    kept = [texts[i] for i in keep]
    ids, scores = rank(encode_texts(kept, bundle), bundle, k, lexical_rows(kept, bundle))
    out_ids = np.full((len(texts), ids.shape[1]), -1, dtype=np.int64)
    out_scores = np.full((len(texts), ids.shape[1]), -np.inf, dtype=np.float32)
    out_ids[keep], out_scores[keep] = ids, scores
    return out_ids, out_scores


def predict_features(X: Any, bundle: ServingBundle, k: int) -> tuple[np.ndarray, np.ndarray]:
    """:func:`predict_topk` of a model of feature rows (``bundle.input`` ``features``): the encoder reads the empty
    text its training points had, the lexical source each row (n, ``num_features``); a row without a nonzero value
    gets no labels (a row of -1)."""
    if bundle.input != "features":
        raise XCError("this model reads text (column 'text'), not feature vectors")
    X = sp.csr_matrix(X, dtype=np.float32)
    X.eliminate_zeros()
    check_counts(X, bundle.counts)
    keep = np.flatnonzero(np.diff(X.indptr))
    width = min(max(int(k), 1), bundle.max_k)
    ids = np.full((X.shape[0], width), -1, dtype=np.int64)
    scores = np.full((X.shape[0], width), -np.inf, dtype=np.float32)
    if len(keep):
        empty = np.repeat(encode_texts([""], bundle), len(keep), axis=0)
        ids[keep], scores[keep] = rank(empty, bundle, k, bundle.sources.lexical.transform(X[keep]))
    return ids, scores


def predictions_frame(ids: np.ndarray, scores: np.ndarray, bundle: ServingBundle) -> pd.DataFrame:
    """One row per input: ``label_ids`` (list[int]), ``labels`` (list[str]), ``scores`` (list[float])."""
    out_ids, out_labels, out_scores = [], [], []
    for row_ids, row_s in zip(ids, scores):
        keep = row_ids >= 0
        r = row_ids[keep]
        out_ids.append([int(i) for i in r])
        out_labels.append([str(t) for t in bundle.label_texts[r]])
        out_scores.append([float(s) for s in row_s[keep]])
    return pd.DataFrame({"label_ids": out_ids, "labels": out_labels, "scores": out_scores})


class XCModel(mlflow.pyfunc.PythonModel):
    """MLflow pyfunc: ``predict(DataFrame({"text": [...]}), params={"k": 10})`` -> per row the top-k
    ``label_ids``, ``labels`` (texts) and ``scores``; fewer than k when the shortlist is shorter, none for a text
    without a visible character. A request over its limits (``RequestLimits``: ``$XC_SERVING_MAX_TEXTS``,
    ``$XC_SERVING_MAX_REQUEST_CHARS``), a bad k or a value that is not text is refused with an
    ``MlflowException`` INVALID_PARAMETER_VALUE: HTTP 400 from ``mlflow models serve``."""

    def __init__(self) -> None:
        self.bundle: ServingBundle | None = None
        self.limits = RequestLimits()

    def load_context(self, context) -> None:
        threads = os.environ.get(THREADS_ENV)
        if threads:  # e.g. 1 per worker: single queries are too small to split across cores
            torch.set_num_threads(int(threads))
            faiss.omp_set_num_threads(int(threads))
        self.limits = RequestLimits.from_env()
        self.bundle = load_bundle(context.artifacts["bundle"])

    def predict(self, context, model_input: pd.DataFrame, params: dict[str, Any] | None = None) -> pd.DataFrame:
        if self.bundle is None:  # pragma: no cover - MLflow always calls load_context first
            self.load_context(context)
        try:  # the caller's mistakes: a client error (HTTP 400), with our message, not a server error
            k = param_k(params, self.bundle.default_k)
            if self.bundle.input == "features":
                X = input_features(model_input, self.bundle.num_features, self.limits, self.bundle.counts)
                ids, scores = predict_features(X, self.bundle, k)
            else:
                ids, scores = predict_topk(input_texts(model_input, self.limits), self.bundle, k)
        except XCError as e:
            raise mlflow.exceptions.MlflowException(str(e), error_code=INVALID_PARAMETER_VALUE) from e
        return predictions_frame(ids, scores, self.bundle)
