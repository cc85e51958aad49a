"""The pipeline's stages as plain functions: read upstream artifacts, compute, write this stage's artifacts.

Every Dagster asset in ``assets/`` is a thin call of one function here, so the whole pipeline also runs
from a script or notebook (``run_all``). Each stage writes atomically into
``<artifacts>/<dataset>/<stage>/`` and returns a summary of sizes, timings and key numbers.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from xc_dagster.artifacts import model_dir
from xc_dagster.catalog import BUILTIN_PREFIX, DatasetSpec, builtin_path
from xc_dagster.config import PipelineConfig
from xc_dagster.data import XCDataset, load_dataset, load_label_texts, read_dataset, resolve_source, save_dataset
from xc_dagster.data.checks import check_counts, compute_checks, label_frequencies, label_frequency_plot
from xc_dagster.data.registry import verify_counts
from xc_dagster.data.splits import validation_split, validation_targets
from xc_dagster.device import amp_dtype, resolve_device, seed_everything
from xc_dagster.encoders.bag import BagOfEmbeddingsEncoder, embed_from_intermediate
from xc_dagster.encoders.encode import encode_tokens
from xc_dagster.encoders.loading import load_encoder, save_encoder
from xc_dagster.encoders.names import parse_bag_name
from xc_dagster.encoders.tokenizer import load_tokenizer, load_tokens, save_pretokenized, tokenize_to_npy
from xc_dagster.errors import XCConfigError, XCError
from xc_dagster.evaluation.metrics import evaluate, inverse_propensity, recall_at, remove_filtered
from xc_dagster.evaluation.reports import decile_contributions, decile_plot, pk_plot, recall_by_frequency, recall_plot
from xc_dagster.pipeline.provenance import record_params, with_upstream_params
from xc_dagster.retrieval.ann import LabelIndex
from xc_dagster.retrieval.fusion import check_method, fit_fusion, load_fusion, missed_positive_features
from xc_dagster.retrieval.shortlist import (
    CENTROID_FILE,
    KNN_EXCLUDED_FILE,
    Shortlist,
    ShortlistSources,
    build_sources,
    check_label_repr,
    check_sources,
    label_centroids,
    label_representation,
    load_sources,
    retrieve,
    save_parts,
    save_sources,
    topk_from_scores,
)
from xc_dagster.sampling.negatives import SAMPLERS
from xc_dagster.serving.retraining import source_fingerprint
from xc_dagster.serving.warm_start import check_same_vocabulary, classifier_init, resolve_warm_start
from xc_dagster.storage import ArtifactStore, load_json, save_json
from xc_dagster.training.checkpoint import Checkpointer, fingerprint, fingerprint_files
from xc_dagster.training.classifier import propensity_label_weights, train_classifiers
from xc_dagster.training.end_to_end import train_end_to_end
from xc_dagster.training.siamese import train_siamese

log = logging.getLogger("xc_dagster")

STAGE_ORDER = ("ingest", "tokenize", "pretrain", "mining", "classifier", "index", "fusion", "evaluate")
TOKEN_SPLITS = ("train", "test", "label")


@dataclass
class StageContext:
    """What a stage needs: where artifacts live, which dataset, the effective config, logging hooks."""

    store: ArtifactStore
    spec: DatasetSpec
    cfg: PipelineConfig
    cache_dir: Path
    device: torch.device = field(default_factory=lambda: resolve_device("auto"))
    log_metrics: Callable[[int, dict[str, float]], None] | None = None
    info: Callable[[str], None] = log.info
    tracking_uri: str | None = None  # the MLflow store (pretrain.warm_start=champion finds the champion there)

    @property
    def name(self) -> str:
        return self.spec.name

    def dir(self, stage: str) -> Path:
        return self.store.require(self.name, stage)

    def checkpoint_dir(self, stage: str) -> Path:
        """Where ``stage`` keeps its per-epoch training checkpoint (removed once its artifacts are written)."""
        return self.store.root / self.name / "_checkpoints" / stage


def _fields(text: str) -> tuple[str, ...]:
    return ("title",) if text == "title" else ("title", "content")


def _filter_rows(pairs: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Filter pairs of ``rows`` (original row ids) re-indexed to positions within ``rows``."""
    pos = np.full(int(max(pairs[:, 0].max(initial=-1), rows.max(initial=-1))) + 1, -1, dtype=np.int64)
    pos[rows] = np.arange(len(rows))
    keep = pairs[:, 0] < len(pos)
    p = pairs[keep]
    new = pos[p[:, 0]]
    ok = new >= 0
    return np.stack([new[ok], p[ok, 1]], axis=1) if ok.any() else np.zeros((0, 2), dtype=np.int64)


def _labels(ctx: StageContext) -> XCDataset:
    """The ingested label matrices and filter pairs, without texts or features (all most stages need)."""
    return load_dataset(ctx.dir("ingest") / "dataset", texts=False, features=False)


def _train_rows(ctx: StageContext, num_train: int) -> np.ndarray:
    """Training rows the models learn from: every training point but the held-out validation ones."""
    return np.setdiff1d(np.arange(num_train), np.load(ctx.dir("ingest") / "valid_rows.npy"))


CLASSIFIER_INIT = "classifier_init.npy"


def _inv_prop(ctx: StageContext, Y_train) -> np.ndarray:
    return inverse_propensity(Y_train, ctx.cfg.evaluate.propensity_a, ctx.cfg.evaluate.propensity_b)


# --------------------------------------------------------------------------------------------- stages

def ingest(ctx: StageContext) -> dict[str, Any]:
    """Fetch/resolve the source, parse its layout into canonical tables, carve the validation split.

    A known public dataset's counts must equal the published ones (``ingest.verify_counts``); the validation
    checks (``checks.json``) and the label-frequency plot (``label_freq.png``) are written with the tables.
    """
    p = ctx.cfg.ingest
    t0 = time.perf_counter()
    src = ctx.spec.source
    source_digest = _source_digest(src)  # before reading: a change made during ingest shows next time
    folder = (builtin_path(src[len(BUILTIN_PREFIX):]) if src.startswith(BUILTIN_PREFIX)
              else resolve_source(src, ctx.cache_dir / ctx.name, sha256=ctx.spec.sha256))
    text = p.text if p.text != "auto" else ctx.spec.text_fields
    label_fields = _fields(text) if p.label_text == "same" else _fields(p.label_text)
    ds = read_dataset(folder, layout=ctx.spec.layout, text_fields=_fields(text), label_text_fields=label_fields,
                      split=p.split)
    stats = dict(ds.stats())
    known = ctx.spec.known
    if p.verify_counts:  # before anything is written: a wrong download never becomes an ingested dataset
        verify_counts(ctx.name, stats, known, str(folder))
    freq = label_frequencies(ds.Y_train, ds.num_labels)
    checks = compute_checks(ds, known, freq)
    valid = validation_split(ds.num_train, p.valid_fraction, p.valid_max, p.seed)
    with ctx.store.writing(ctx.name, "ingest") as out:
        save_dataset(ds, out / "dataset")
        np.save(out / "valid_rows.npy", valid)
        save_json(out / "checks.json", checks)
        np.save(out / "label_freq.npy", freq)
        label_frequency_plot(freq, out / "label_freq.png", ctx.name)
        stats.update({"n_valid": int(len(valid)), "layout": ds.layout, "text": text, "source": str(folder),
                      "registry": known.name if known else None, "source_fingerprint": source_digest,
                      "counts_verified": bool(known is not None and p.verify_counts),
                      "checks_failed": checks["failed"], "check_counts": check_counts(checks),
                      "label_frequency": checks["label_frequency"],
                      "seconds": time.perf_counter() - t0})
        save_json(out / "summary.json", stats)
    ctx.info(f"ingest {ctx.name}: {stats['n_train']} train / {stats['n_test']} test / {stats['n_labels']} labels")
    return stats


def _source_digest(source: str) -> str | None:
    """The source's file fingerprint (names, sizes, modification stamps) that the retrain schedule compares."""
    try:
        fp = source_fingerprint(source)
    except XCError:
        return None
    return None if fp is None else fp.digest


def tokenize(ctx: StageContext) -> dict[str, Any]:
    """Token-id arrays (memmap .npy) and lengths for train points, test points and labels.

    Splits that the dataset ships pre-tokenized (``tokenized`` layout) are used as given: their ids must come
    from the configured encoder's tokenizer.
    """
    p = ctx.cfg.tokenize
    t0 = time.perf_counter()
    ds = load_dataset(ctx.dir("ingest") / "dataset", features=False)
    tok = load_tokenizer(p.encoder)
    texts = {"train": ds.train_texts, "test": ds.test_texts, "label": ds.label_texts}
    summary: dict[str, Any] = {"encoder": p.encoder, "max_len": p.max_len}
    with ctx.store.writing(ctx.name, "tokenize") as out:
        for split in TOKEN_SPLITS:
            max_len = (p.label_max_len or p.max_len) if split == "label" else p.max_len
            given = getattr(ds, f"{split}_tokens")
            if given is not None:
                st = save_pretokenized(*given, max_len, out / f"{split}_ids.npy", out / f"{split}_len.npy")
            else:
                st = tokenize_to_npy(tok, texts[split], max_len, out / f"{split}_ids.npy",
                                     out / f"{split}_len.npy")
            summary.update({f"{split}_{k}": v for k, v in st.items()})
        summary["seconds"] = time.perf_counter() - t0
        save_json(out / "summary.json", summary)
    return summary


def _tokens(ctx: StageContext, split: str) -> tuple[np.ndarray, np.ndarray]:
    d = ctx.dir("tokenize")
    return load_tokens(d / f"{split}_ids.npy", d / f"{split}_len.npy")


def pretrain(ctx: StageContext) -> dict[str, Any]:
    """Siamese pretraining (M1); then embeddings of every training point and label with the trained encoder."""
    p = ctx.cfg.pretrain
    seed_everything(p.seed)
    ds = _labels(ctx)
    train_rows = _train_rows(ctx, ds.num_train)
    warm = resolve_warm_start(p.warm_start, ctx.name, ctx.tracking_uri, ctx.store.root / ctx.name / "_warm_start")
    tokenizer = load_tokenizer(ctx.cfg.tokenize.encoder)
    if warm is not None:
        check_same_vocabulary(warm, tokenizer)
        ctx.info(f"pretrain {ctx.name}: warm start from {warm}")
    encoder = load_encoder(str(warm / "encoder") if warm else ctx.cfg.tokenize.encoder, p.pooling).to(ctx.device)
    dtype = amp_dtype(ctx.device, p.amp)
    pt, lt = _tokens(ctx, "train"), _tokens(ctx, "label")
    if warm is None and parse_bag_name(ctx.cfg.tokenize.encoder) is not None:  # fresh bag: IDF of the texts
        encoder.fit_idf(pt, lt)
    key = fingerprint({**dataclasses.asdict(p), "encoder": ctx.cfg.tokenize.encoder,
                       "warm": fingerprint_files(warm / "encoder") if warm else ""}, pt[0], lt[0], train_rows,
                      ds.Y_train.indices)
    ckpt = Checkpointer(ctx.checkpoint_dir("pretrain"), key)
    res = train_siamese(encoder, pt, lt, ds.Y_train, train_rows, p, ctx.device, dtype, ctx.log_metrics,
                        checkpoint=ckpt)
    ctx.info(f"pretrain {ctx.name}: {res.steps} steps, {res.points} points in {res.seconds:.0f}s")
    t1 = time.perf_counter()
    point_emb = encode_tokens(encoder, *pt, ctx.device, dtype, p.encode_batch_size)
    label_emb = encode_tokens(encoder, *lt, ctx.device, dtype, p.encode_batch_size)
    encode_s = time.perf_counter() - t1
    W0, warm_labels = None, 0
    if warm is not None:
        W0, warm_labels = classifier_init(warm, load_label_texts(ctx.dir("ingest") / "dataset"), label_emb)
    summary = {"warm_start": str(warm) if warm else "", "warm_start_labels": warm_labels,"steps": res.steps, "points": res.points, "train_seconds": res.seconds,
               "reclusterings": res.reclusterings, "resumed_from_epoch": res.resumed_from_epoch,
               "points_per_s": res.points / max(res.seconds, 1e-9), "final_loss": res.final_loss,
               "encode_seconds": encode_s, "texts_per_s": (len(pt[1]) + len(lt[1])) / max(encode_s, 1e-9),
               "device": str(ctx.device), "amp": str(dtype), "dim": encoder.dim,
               "encoder_type": type(encoder).__name__,
               "seconds": res.seconds + encode_s}
    with ctx.store.writing(ctx.name, "pretrain") as out:
        save_encoder(encoder, tokenizer, out / "encoder")
        np.save(out / "train_emb.npy", point_emb)
        np.save(out / "label_emb.npy", label_emb)
        if W0 is not None:  # the classifier stage starts from it instead of the label embeddings
            np.save(out / CLASSIFIER_INIT, W0)
        save_json(out / "summary.json", {**summary, "pooling": p.pooling})
    ckpt.clear()
    return summary


def _label_index(vectors: np.ndarray, kind: str, m: int, efc: int, efs: int) -> LabelIndex:
    return LabelIndex(kind, vectors, m=m, ef_construction=efc, ef_search=efs)


def mining(ctx: StageContext) -> dict[str, Any]:
    """Negative mining (SiameseXML Module II): a shortlist of candidate labels per training point.

    Candidates come from ``mining.sources`` (label text embeddings; label centroids; labels of the point's
    nearest other training points), ranked by (1 - g)(s_label + s_centroid) + g * s_knn with exact scores.
    The label centroids (of the non-validation training points) are written here for later stages.
    """
    p = ctx.cfg.mining
    check_sources(p.sources, "mining.sources")
    t0 = time.perf_counter()
    d = ctx.dir("pretrain")
    point_emb, label_emb = np.load(d / "train_emb.npy"), np.load(d / "label_emb.npy")
    ds = _labels(ctx)
    rows = _train_rows(ctx, ds.num_train)
    centroids = label_centroids(point_emb, ds.Y_train, rows)
    src = build_sources(p.sources, label_emb, label_emb, centroids, point_emb[rows], ds.Y_train[rows],
                        "text+centroid" if "centroid" in p.sources else "text", p.index, p.hnsw_m,
                        p.hnsw_ef_construction, p.hnsw_ef_search)
    k = min(p.shortlist_size, len(label_emb))
    own = np.full(ds.num_train, -1, dtype=np.int64)
    own[rows] = np.arange(len(rows))  # a training point is not its own neighbour
    sl = retrieve(point_emb, src, k, exclude_knn=own)
    merged = sl.emb if sl.knn is None else (1.0 - p.knn_weight) * sl.emb + p.knn_weight * sl.knn
    ids, scores = topk_from_scores(sl.ids, np.where(sl.ids < 0, -np.inf, merged).astype(np.float32), k)
    recall = recall_at(ids, ds.Y_train)
    summary = {"shortlist_size": k, "sources": list(p.sources), "train_recall": recall,
               "seconds": time.perf_counter() - t0}
    with ctx.store.writing(ctx.name, "mining") as out:
        np.save(out / "shortlist.npy", ids.astype(np.int32))
        np.save(out / "shortlist_scores.npy", scores)
        np.save(out / CENTROID_FILE, centroids)
        save_json(out / "summary.json", summary)
    ctx.info(f"mining {ctx.name}: shortlist of {k} from {'+'.join(p.sources)}, recall on train {recall:.3f}")
    return summary


def classifier(ctx: StageContext) -> dict[str, Any]:
    """Train one-vs-all W from label embeddings (validation rows held out): on positives + the hardest mined
    negatives (NGAME, SiameseXML), or with BCE over sampled negatives (ASTRA, MIPS-s), optionally fine-tuning
    the encoder with them (end to end: ``classifier.train_encoder``; the bag encoder's residual block, SiameseXML
    Module IV: ``classifier.train_residual``); that encoder and its re-computed embeddings are written here and
    every later stage uses them (``model_dir``)."""
    p = ctx.cfg.classifier
    seed_everything(p.seed)
    d = ctx.dir("pretrain")
    point_emb = np.load(d / "train_emb.npy")
    init = d / CLASSIFIER_INIT  # a warm start's W, else W starts from the label embeddings
    label_emb = np.load(d / "label_emb.npy")
    check_label_repr(p.init, "classifier.init")
    if init.exists():
        W0 = np.load(init)
    elif p.init == "text":
        W0 = label_emb
    else:  # the embedding score's label representation, at unit norm
        W0 = label_representation(label_emb, np.load(ctx.dir("mining") / CENTROID_FILE), p.init)
        W0 /= np.maximum(np.linalg.norm(W0, axis=1, keepdims=True), 1e-12)
    sl = np.load(ctx.dir("mining") / "shortlist.npy")
    ds = _labels(ctx)
    rows = _train_rows(ctx, ds.num_train)
    sampled = p.negatives in SAMPLERS
    if p.train_encoder and not sampled:
        raise XCConfigError(f"classifier.train_encoder: end-to-end training needs sampled negatives "
                            f"(classifier.negatives = {' | '.join(SAMPLERS)}), got {p.negatives!r}")
    if p.train_residual and sampled:
        raise XCConfigError("classifier.train_residual: the residual block is fine-tuned by the hardest-negative "
                            "trainer (negatives = shortlist | in-batch | both); with sampled negatives use "
                            "classifier.train_encoder to fine-tune the whole encoder")
    encoder = tokenizer = None
    pooling = load_json(d / "summary.json")["pooling"] if (p.train_encoder or p.train_residual) else None
    residual_note = "off"
    if p.train_residual:
        encoder = load_encoder(str(d / "encoder"), pooling).to(ctx.device)
        if isinstance(encoder, BagOfEmbeddingsEncoder):
            tokenizer = load_tokenizer(str(d / "encoder"))
            residual_note = "trained"
        else:  # a transformer has no residual block: it stays frozen, as with train_residual off
            encoder, residual_note = None, "n/a: the encoder has no residual block"
            ctx.info("classifier.train_residual: the encoder has no residual block (tokenize.encoder=bag has "
                     "one); it stays frozen")
    inter = label_inter = None
    if isinstance(encoder, BagOfEmbeddingsEncoder):  # Module IV: train R on the frozen intermediate embeddings
        inter, label_inter = (encode_tokens(encoder, *_tokens(ctx, split), ctx.device, None,
                                            ctx.cfg.pretrain.encode_batch_size, forward=encoder.intermediate)
                              for split in ("train", "label"))
    warm = fingerprint_files(d / "encoder") if (p.train_encoder or encoder is not None) else ""
    lw = (propensity_label_weights(_inv_prop(ctx, ds.Y_train), ds.Y_train, rows, p.propensity_weight)
          if p.propensity_weight else None)
    # "w_state": the trainer's checkpoint layout (W and its optimizer as ShardedOptimizer state since the
    # hardest-negative trainer scores through ShardedClassifier): an older layout is never resumed from
    key = fingerprint({**dataclasses.asdict(p), "warm": warm, "w_state": "sharded"}, point_emb, W0, sl, rows,
                      *([] if lw is None else [lw]))
    ckpt = Checkpointer(ctx.checkpoint_dir("classifier"), key)
    res = None
    if sampled:
        kw: dict[str, Any] = {}
        if p.train_encoder:
            encoder = load_encoder(str(d / "encoder"), pooling).to(ctx.device)
            tokenizer = load_tokenizer(str(d / "encoder"))
            kw = {"encoder": encoder, "point_tokens": _tokens(ctx, "train"), "label_tokens": _tokens(ctx, "label"),
                  "dtype": amp_dtype(ctx.device, ctx.cfg.pretrain.amp)}
        res = train_end_to_end(point_emb, label_emb, W0, ds.Y_train, rows, p, ctx.device,
                               shortlist=sl, log_metrics=ctx.log_metrics, checkpoint=ckpt, label_weight=lw, **kw)
        W, summary = res.W, res.summary
    else:
        W, summary = train_classifiers(point_emb if inter is None else inter, W0, ds.Y_train, sl, rows, p,
                                       ctx.device, ctx.log_metrics, ckpt, encoder=encoder, label_weight=lw)
        summary["residual"] = residual_note
    with ctx.store.writing(ctx.name, "classifier") as out:
        np.save(out / "W.npy", W)
        if encoder is not None:  # the fine-tuned encoder replaces the pretrained one downstream
            save_encoder(encoder, tokenizer, out / "encoder")
            if res is not None:
                emb = res.point_emb, res.label_emb
            else:
                emb = tuple(embed_from_intermediate(encoder, h, ctx.device) for h in (inter, label_inter))
            np.save(out / "train_emb.npy", emb[0])
            np.save(out / "label_emb.npy", emb[1])
            summary.update({"pooling": pooling, "encoder_type": type(encoder).__name__})
        save_json(out / "summary.json", summary)
    ckpt.clear()
    ctx.info(f"classifier {ctx.name}: {summary['steps']} steps in {summary['seconds']:.0f}s")
    return summary




def index(ctx: StageContext) -> dict[str, Any]:
    """The ANNS indexes of ``index.sources`` that inference shortlists from (NGAME dual MIPS: W and label
    embeddings; SiameseXML Module II: label embeddings, label centroids, training-point kNN)."""
    p = ctx.cfg.index
    check_sources(p.sources, "index.sources")
    check_label_repr(p.label_repr, "index.label_repr")
    if not (isinstance(p.knn_neighbours, int) and p.knn_neighbours >= 0):
        raise XCConfigError(f"index.knn_neighbours: expected an int >= 0, got {p.knn_neighbours!r}")
    if not isinstance(p.include_validation, bool):
        raise XCConfigError(f"index.include_validation: expected true or false, got {p.include_validation!r}")
    t0 = time.perf_counter()
    W = np.load(ctx.dir("classifier") / "W.npy")
    label_emb = np.load(model_dir(ctx) / "label_emb.npy")
    need_centroids = "centroid" in p.sources or p.label_repr == "text+centroid"
    centroids = point_emb = knn_labels = h_centroids = None
    heldout = False  # the fusion is fitted without the validation points (index/heldout/)
    if need_centroids or "knn" in p.sources:
        ds = _labels(ctx)
        rows = _train_rows(ctx, ds.num_train)
        # from the deployed encoder's embeddings: mining's centroids are stale once ASTRA/MIPS-s fine-tuned it
        train_emb = np.load(model_dir(ctx) / "train_emb.npy", mmap_mode="r")
        heldout = p.include_validation and len(rows) < ds.num_train
        deployed = np.arange(ds.num_train) if heldout else rows
        if need_centroids:
            centroids = label_centroids(train_emb, ds.Y_train, deployed)
            h_centroids = label_centroids(train_emb, ds.Y_train, rows) if heldout else None
        if "knn" in p.sources:
            point_emb, knn_labels = np.asarray(train_emb[deployed]), ds.Y_train[deployed]
    src = build_sources(p.sources, W, label_emb, centroids, point_emb, knn_labels, p.label_repr, p.kind,
                        p.hnsw_m, p.hnsw_ef_construction, p.hnsw_ef_search)
    with ctx.store.writing(ctx.name, "index") as out:
        save_sources(src, out, centroids)
        summary = {"kind": p.kind, "sources": list(p.sources), "label_repr": p.label_repr,
                   "labels": int(len(W)), "dim": int(W.shape[1]),
                   "knn_points": int(point_emb.shape[0]) if point_emb is not None else 0,
                   "knn_neighbours": int(p.knn_neighbours) if "knn" in p.sources else 0}
        if heldout:  # what the fusion is fitted with: the same parts without the validation points
            held = out / HELDOUT_DIR
            save_parts(held, {"centroid": _label_index(h_centroids, p.kind, p.hnsw_m, p.hnsw_ef_construction,
                                                       p.hnsw_ef_search)} if "centroid" in p.sources else {},
                       None, h_centroids)
            if "knn" in p.sources:  # the deployed kNN index searched without the validation points: no second build
                np.save(held / KNN_EXCLUDED_FILE, np.setdiff1d(np.arange(ds.num_train), rows))
            summary["heldout_knn_points"] = int(len(rows)) if "knn" in p.sources else 0
        summary["seconds"] = time.perf_counter() - t0
        save_json(out / "summary.json", summary)
    return summary


HELDOUT_DIR = "heldout"  # index/heldout/: the training-point parts without the validation points


def load_model(ctx: StageContext, heldout: bool = False) -> ShortlistSources:
    """W, the label representation and the indexes, as the index stage recorded them (kind, sources).

    ``heldout``: the training-point parts (kNN index, label centroids) without the validation points, for
    fitting on them; the deployed model when the index stage built none (validation included nowhere)."""
    d = ctx.dir("index")
    info = load_json(d / "summary.json")
    points = d / HELDOUT_DIR if heldout and (d / HELDOUT_DIR).is_dir() else None
    return load_sources(d, tuple(info.get("sources", ("W", "label"))), info.get("label_repr", "text"),
                        info["kind"], ctx.cfg.index.hnsw_ef_search, np.load(ctx.dir("classifier") / "W.npy"),
                        np.load(model_dir(ctx) / "label_emb.npy"), int(info.get("knn_neighbours", 0)), points)


@dataclass
class ValidationShortlists:
    """What the fusion is fitted on: the validation points' shortlists from the held-out model (their own
    points left out of the kNN index and centroids), their targets and filter pairs, the labels' propensities."""

    shortlist: Shortlist
    Y: Any  # csr (validation points x labels)
    filter_pairs: np.ndarray
    inv_prop: np.ndarray
    queries: np.ndarray
    model: ShortlistSources
    unseen_dropped: int


def validation_shortlists(ctx: StageContext) -> ValidationShortlists:
    """Shortlist the validation points as the fusion stage fits on them (also for bench scripts)."""
    ds = _labels(ctx)
    valid = np.load(ctx.dir("ingest") / "valid_rows.npy")
    m = load_model(ctx, heldout=True)
    q = np.load(model_dir(ctx) / "train_emb.npy", mmap_mode="r")[valid]
    sl = retrieve(q, m, ctx.cfg.index.shortlist_size)
    # pairs of labels whose only training points are validation points are left out (unseen by the models)
    Yv, pairs, unseen = validation_targets(ds.Y_train, valid, _train_rows(ctx, ds.num_train),
                                           _filter_rows(ds.filter_train, valid))
    return ValidationShortlists(sl, Yv, pairs, _inv_prop(ctx, ds.Y_train), q, m, unseen)


def fusion(ctx: StageContext) -> dict[str, Any]:
    """Fit the score fusion ``fusion.method`` on the held-out validation points' shortlists (deployed indexes).

    The fitted fusion is plain JSON (a tree as arrays), loadable without executing code.
    """
    t0 = time.perf_counter()
    p = ctx.cfg.fusion
    check_method(p.method)  # a bad method fails before any work
    valid = np.load(ctx.dir("ingest") / "valid_rows.npy")
    if len(valid) == 0:  # alpha 0.5 ranks as the tree's T-free score emb + clf
        fit = {"method": "alpha", "alpha": 0.5, "grid": [], "note": "no validation rows; alpha defaulted"}
        fit_summary = {"method": "alpha", "alpha": 0.5, "note": fit["note"]}
    else:
        vs = validation_shortlists(ctx)
        extra = (missed_positive_features(vs.shortlist, vs.Y, vs.queries, vs.model.W, vs.model.label_repr,
                                          vs.inv_prop)
                 if p.method == "tree" and p.tree_add_positives else None)
        f = fit_fusion(vs.shortlist, vs.Y, p, vs.inv_prop, vs.filter_pairs, extra=extra)
        fit, fit_summary = f.to_dict(), f.summary()
        fit_summary["valid_pairs_unseen_dropped"] = vs.unseen_dropped
    summary = {**fit_summary, "objective": p.objective, "n_valid": int(len(valid)),
               "seconds": time.perf_counter() - t0}
    with ctx.store.writing(ctx.name, "fusion") as out:
        save_json(out / "fusion.json", fit)
        save_json(out / "summary.json", summary)
    ctx.info(f"fusion {ctx.name}: " + ", ".join(f"{k}={v}" for k, v in fit_summary.items()))
    return summary


def encode_split(ctx: StageContext, split: str) -> np.ndarray:
    """Embeddings of a tokenized split ("train", "test", "label") with the deployed encoder, as trained."""
    md = model_dir(ctx)
    pooling = load_json(md / "summary.json")["pooling"]  # as trained, whatever this run says
    encoder = load_encoder(str(md / "encoder"), pooling).to(ctx.device)
    dtype = amp_dtype(ctx.device, ctx.cfg.pretrain.amp)
    return encode_tokens(encoder, *_tokens(ctx, split), ctx.device, dtype, ctx.cfg.pretrain.encode_batch_size)


def evaluation(ctx: StageContext) -> dict[str, Any]:
    """Encode the test texts with the trained encoder, predict top-k, compute the XC metrics."""
    p = ctx.cfg.evaluate
    t0 = time.perf_counter()
    ds = _labels(ctx)
    q = encode_split(ctx, "test")
    t_enc = time.perf_counter() - t0
    m = load_model(ctx)
    fz = load_fusion(load_json(ctx.dir("fusion") / "fusion.json"))
    t1 = time.perf_counter()
    sl = retrieve(q, m, ctx.cfg.index.shortlist_size)
    inv = _inv_prop(ctx, ds.Y_train)
    ids, scores = topk_from_scores(sl.ids, fz.score(sl, inv), p.top_k)
    ids, scores = remove_filtered(ids, scores, ds.filter_test)  # reciprocal/self pairs never predicted
    t_pred = time.perf_counter() - t1
    ks = tuple(sorted(set(p.ks) | set(range(1, 11))))  # k = 1..10 for the P@k / PSP@k curves
    metrics = evaluate(ids, ds.Y_test, ks=ks, inv_prop=inv, filter_pairs=ds.filter_test)
    metrics["shortlist_recall"] = recall_at(sl.ids, ds.Y_test)
    # each ranking on its own, for the ablation the papers report (encoder only / classifier only)
    for name, s in (("classifier_only", sl.clf), ("embedding_only", sl.emb)):
        i2, _ = topk_from_scores(sl.ids, s, max(ks) + 20)
        for k, v in evaluate(i2, ds.Y_test, ks=(1, 5), inv_prop=inv, filter_pairs=ds.filter_test).items():
            if k in ("precision_at_1", "precision_at_5", "psprecision_at_1", "psprecision_at_5"):
                metrics[f"{name}_{k}"] = v
    freq = np.load(ctx.dir("ingest") / "label_freq.npy")
    deciles = decile_contributions(ids, ds.Y_test, freq, inv, metrics, k=5)
    by_freq = recall_by_frequency(ids, ds.Y_test, freq, k=5, shortlist=sl.ids)
    summary = {"metrics": metrics, "fusion": fz.summary(), "n_test": int(len(q)), "encode_seconds": t_enc,
               "predict_seconds": t_pred, "ms_per_query_index_fusion": 1000 * t_pred / max(len(q), 1),
               "stage_seconds": upstream_seconds(ctx), "seconds": time.perf_counter() - t0}
    summary["stage_seconds"]["training_total"] = sum(summary["stage_seconds"].get(s, 0.0) for s in TRAINING_STAGES)
    title = f"{ctx.name} ({ctx.cfg.strategy}, {ctx.cfg.preset})"
    with ctx.store.writing(ctx.name, "evaluate") as out:
        np.savez(out / "predictions.npz", ids=ids.astype(np.int32), scores=scores)
        save_json(out / "metrics.json", metrics)
        save_json(out / "reports.json", {"deciles": deciles, "recall_by_frequency": by_freq})
        pk_plot(metrics, out / REPORT_FILES["pk_plot"], title)
        decile_plot(deciles, out / REPORT_FILES["decile_plot"], title)
        recall_plot(by_freq, out / REPORT_FILES["recall_plot"], title)
        save_json(out / "summary.json", summary)
    return summary


TRAINING_STAGES = ("pretrain", "mining", "classifier", "index", "fusion")
REPORT_FILES = {"pk_plot": "pk_plot.png", "decile_plot": "decile_plot.png", "recall_plot": "recall_by_frequency.png"}


def upstream_seconds(ctx: StageContext) -> dict[str, float]:
    """Wall seconds of every stage before evaluation, from the summaries they recorded (model comparison)."""
    out: dict[str, float] = {}
    for stage in STAGE_ORDER[:-1]:
        path = ctx.store.stage_dir(ctx.name, stage) / "summary.json"
        if path.exists():
            s = load_json(path)
            out[stage] = float(s.get("seconds", s.get("train_seconds", 0.0) + s.get("encode_seconds", 0.0)))
    return out


STAGES: dict[str, Callable[[StageContext], dict[str, Any]]] = {
    "ingest": ingest, "tokenize": tokenize, "pretrain": pretrain, "mining": mining,
    "classifier": classifier, "index": index, "fusion": fusion, "evaluate": evaluation,
}


def run_all(ctx: StageContext, stages: tuple[str, ...] = STAGE_ORDER) -> dict[str, dict[str, Any]]:
    """Run the stages in order without Dagster (scripts, notebooks, the GPU box); returns every summary.

    As the Dagster assets do (``xc_dagster.pipeline.provenance``): the sections of the stages before the first one run
    come from their artifacts' records, and each stage run records the config it ran with."""
    unknown = [s for s in stages if s not in STAGES]
    if unknown:
        raise XCConfigError(f"run_all: unknown stage(s) {unknown}; stages are {list(STAGE_ORDER)}")
    first = min((STAGE_ORDER.index(s) for s in stages), default=0)
    ctx = dataclasses.replace(ctx, cfg=with_upstream_params(ctx.cfg, ctx.store, ctx.name, STAGE_ORDER[:first]).cfg)
    out = {}
    for s in stages:
        t0 = time.perf_counter()
        out[s] = STAGES[s](ctx)
        record_params(ctx.store, ctx.name, s, ctx.cfg)
        out[s]["wall_seconds"] = time.perf_counter() - t0
        ctx.info(f"stage {s} done in {out[s]['wall_seconds']:.1f}s")
    return out
