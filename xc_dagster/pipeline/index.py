"""Stage ``index``: the ANNS indexes of ``index.sources`` that inference shortlists from (NGAME dual MIPS: W and
label embeddings; SiameseXML Module II: label embeddings, label centroids, training-point kNN), and the lexical
source's TF-IDF index (``xc_dagster.retrieval.lexical``) when the sources name it."""

from __future__ import annotations

import dataclasses
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import scipy.sparse as sp

from xc_dagster.artifacts import HELDOUT, MINING_LABEL_INDEX, SUMMARY
from xc_dagster.data.canonical import XCDataset
from xc_dagster.data.splits import filter_rows, validation_targets
from xc_dagster.errors import XCConfigError
from xc_dagster.pipeline.context import StageContext
from xc_dagster.pipeline.cross_fit import fit_on
from xc_dagster.pipeline.kept import KeptWork
from xc_dagster.progress import in_one_call
from xc_dagster.retrieval.ann import LabelIndex
from xc_dagster.retrieval.cooccurrence import CooccurrenceSettings, LabelCooccurrence
from xc_dagster.retrieval.exact_settings import resolve_kind
from xc_dagster.retrieval.fusion.objective import validation_objective
from xc_dagster.retrieval.lexical import LEXICAL_DIR, LexicalIndex
from xc_dagster.retrieval.lexical_classifier import ClassifierSettings
from xc_dagster.retrieval.lexical_weight import best_weight, check_weights, sample_points, weight_grid
from xc_dagster.retrieval.shortlist import (
    CENTROID_FILE,
    INDEX_FILES,
    KNN_EXCLUDED_FILE,
    KNN_LABELS_FILE,
    check_label_repr,
    check_sources,
    label_centroids,
    label_index_settings,
)
from xc_dagster.retrieval.sparse_rows import check_power, sparse_topk
from xc_dagster.retrieval.tfidf import check_char_weight
from xc_dagster.storage import link, load_json, save_json
from xc_dagster.training.budget import SKIP_SLACK, reserved_after_pretraining, stage_deadline


def _check(p: Any) -> None:
    check_sources(p.sources, "index.sources")
    check_label_repr(p.label_repr, "index.label_repr")
    if not (isinstance(p.knn_neighbours, int) and p.knn_neighbours >= 0):
        raise XCConfigError(f"index.knn_neighbours: expected an int >= 0, got {p.knn_neighbours!r}")
    check_power(p.knn_power, "index.knn_power")
    check_power(p.lexical_power, "index.lexical_power")
    check_char_weight(p.lexical_char_weight)
    if not isinstance(p.lexical_classifier, bool):
        raise XCConfigError(f"index.lexical_classifier: expected true or false, got {p.lexical_classifier!r}")
    classifier_settings(p, 0)
    check_weights(p.lexical_classifier_weights)
    cooccurrence_settings(p)
    if "cooccurrence" in p.sources and "label" not in p.sources:
        raise XCConfigError(f"index.sources: cooccurrence votes through the label source's neighbours; add label "
                            f"(got {list(p.sources)})")
    if not isinstance(p.include_validation, bool):
        raise XCConfigError(f"index.include_validation: expected true or false, got {p.include_validation!r}")
    for name, least in (("lexical_neighbours", 1), ("lexical_min_df", 1), ("lexical_max_postings", 0),
                        ("lexical_exact_points", 0)):
        value = getattr(p, name)
        if not (isinstance(value, int) and not isinstance(value, bool) and value >= least):
            raise XCConfigError(f"index.{name}: expected an int >= {least}, got {value!r}")


def classifier_settings(p: Any, seed: int) -> ClassifierSettings:
    """``index.lexical_classifier_*`` as the lexical classifiers' settings, checked."""
    return ClassifierSettings(epochs=p.lexical_classifier_epochs, hard_negatives=p.lexical_classifier_hard_negatives,
                              random_negatives=p.lexical_classifier_random_negatives,
                              max_terms=p.lexical_classifier_max_terms, max_pairs=p.lexical_classifier_max_pairs,
                              candidates=p.lexical_classifier_candidates, solver=p.lexical_classifier_solver,
                              c=p.lexical_classifier_c, seed=seed).check()


def cooccurrence_settings(p: Any) -> CooccurrenceSettings:
    """``index.cooccurrence_*`` as the co-occurrence source's settings, checked."""
    return CooccurrenceSettings(p.cooccurrence_neighbours, p.cooccurrence_power, p.cooccurrence_max_entries).check()


def cross_fitted(ctx: StageContext, fit_rows: np.ndarray, num_train: int) -> bool:
    """Whether the fusion will be cross-fitted on the training points (``fusion.fit_on``, resolved as the fusion
    stage resolves it): parts learned from every training point's labels would then score their own labels."""
    return fit_on(ctx, num_train - len(fit_rows)) == "cross_fit"


LEXICAL_KEPT = "lexical-fit"  # the kept lexical source: its folder and its summary (_kept_lexical)
LEXICAL_ONLY_NEIGHBOURS = 25  # the lexical kNN's votes where that source is the whole model (lexical_neighbours)
FUSION_RESERVE = 1 / 6  # of the pretraining's reserve: kept after the lexical classifiers (the fusion's fit)


def classifier_deadline(ctx: StageContext) -> float | None:
    """When the lexical classifiers stop training under ``train.budget_minutes``: the budget less what the
    encoder's and classifiers' stages took, less the fusion's share (``stage_deadline``); None when their epochs
    were set explicitly (they win over the budget, as every stage's)."""
    b = ctx.cfg.train
    if "index.lexical_classifier_epochs" in ctx.cfg.explicit:
        return None
    spent = ctx.read.spent_before("index")
    keep = FUSION_RESERVE * reserved_after_pretraining(ctx.read.summary("pretrain", missing_ok=True), b)
    return stage_deadline(b, spent, time.perf_counter(), keep)


def lexical_neighbours(ctx: StageContext) -> int:
    """``index.lexical_neighbours``, or ``LEXICAL_ONLY_NEIGHBOURS`` where the lexical source is the whole model
    (``StageContext.lexical_only``) and the user set none: its kNN is then the one part that proposes labels by the
    query's content, where with text the dense kNN and the W and label searches propose too
    (docs/decisions.md#lexical-only-without-text)."""
    if ctx.lexical_only() and "index.lexical_neighbours" not in ctx.cfg.explicit:
        return LEXICAL_ONLY_NEIGHBOURS
    return ctx.cfg.index.lexical_neighbours


def lexical_index(ctx: StageContext, rows: np.ndarray, ds: XCDataset, fit_rows: np.ndarray) -> LexicalIndex:
    """The lexical source over the training points ``rows`` (the kNN index's rows), its TF-IDF fitted on the
    points ``fit_rows`` (the models' training rows) and the labels: of their shipped BoW features when ingest
    stored them (and of the labels' features, when shipped; else no label-text part), read as word sets with the
    dataset's feature words when it has them (so that it serves raw text), else of their texts and the label
    texts; ``ds`` the dataset's labels and filter pairs (``ctx.read.labels()``)."""
    p, Y_train = ctx.cfg.index, ds.Y_train
    X = ctx.read.features("train")
    words = None
    if X is not None:
        points, labels, words = X[rows], ctx.read.features("label"), ctx.read.feature_words()
    else:
        texts = ctx.read.texts("train")
        points, labels = [texts[i] for i in rows], ctx.read.texts("label")
    fit_on = np.flatnonzero(np.isin(rows, fit_rows))
    cross_fit = cross_fitted(ctx, fit_rows, Y_train.shape[0])
    settings = classifier_settings(p, ctx.cfg.classifier.seed) if p.lexical_classifier and not cross_fit else None
    valid = None  # validation points not indexed (index.include_validation false) still pick the classifiers' pass
    held = np.setdiff1d(np.arange(Y_train.shape[0]), rows)
    if settings is not None and len(held) and len(rows) == len(fit_rows):
        valid = (X[held] if X is not None else [texts[i] for i in held], Y_train[held])
    deadline = classifier_deadline(ctx)
    try:
        index = LexicalIndex.fit(points, labels, Y_train[rows], lexical_neighbours(ctx), p.lexical_min_df, fit_on,
                                 max_postings=p.lexical_max_postings if len(rows) > p.lexical_exact_points else 0,
                                 feature_words=words, power=p.lexical_power, classifier=settings, valid=valid,
                                 deadline=deadline, skip_after=None if deadline is None
                                 else deadline + SKIP_SLACK * 60.0 * ctx.cfg.train.budget_minutes,
                                 char_weight=p.lexical_char_weight)
    except XCConfigError as e:
        raise XCConfigError(f"{ctx.name}: {e}") from None
    if index.classifier is not None:
        choose_classifier_weight(ctx, index, rows, fit_rows, ds, X if X is not None else texts)
    if index.classifier_skipped:
        ctx.info(f"index {ctx.name}: the lexical classifiers left out: their hard negatives alone would end more "
                 f"than {SKIP_SLACK:.0%} of train.budget_minutes={ctx.cfg.train.budget_minutes:g} past their deadline")
    return index


WEIGHT_SHORTLIST = 100  # the lexical ranking's top labels the classifiers' weight is judged on (a source's shortlist)


def choose_classifier_weight(ctx: StageContext, index: LexicalIndex, rows: np.ndarray, fit_rows: np.ndarray,
                             ds: XCDataset, inputs: Any) -> None:
    """Set g, the weight of the lexical classifiers' scores in the lexical score, to the one of
    ``index.lexical_classifier_weights`` whose lexical ranking of the validation points (``inputs``: every training
    point's feature rows or texts; at most ``lexical_weight.MAX_POINTS`` of them, seeded) scores the best
    ``fusion.objective``, their own rows excluded from the kNN as in the fusion's fit (``xc_dagster.retrieval.
    lexical_weight``); the first of the weights without validation points."""
    weights, Y_train = check_weights(ctx.cfg.index.lexical_classifier_weights), ds.Y_train
    valid = np.setdiff1d(np.arange(Y_train.shape[0]), fit_rows)
    grid: list[tuple[float, float]] = []
    if len(weights) > 1 and len(valid):
        scored = sample_points(valid, ctx.cfg.classifier.seed)
        Yv, pairs, _ = validation_targets(Y_train, scored, fit_rows, filter_rows(ds.filter_train, scored))
        inv_prop = ctx.inv_prop(Y_train)

        def value(S: sp.csr_matrix) -> float:
            ids, vals = sparse_topk(S, WEIGHT_SHORTLIST)
            return validation_objective(ids, np.where(ids < 0, -np.inf, vals).astype(np.float32), Yv,
                                        ctx.cfg.fusion.objective, inv_prop, pairs, 10)

        Q = index.transform(inputs[scored] if sp.issparse(inputs) else [inputs[i] for i in scored])
        grid = weight_grid(index, Q, np.flatnonzero(np.isin(rows, valid)), weights, value)
    index.classifier.settings = dataclasses.replace(index.classifier.settings,
                                                    weight=best_weight(grid) if grid else weights[0])
    index.weight_grid = grid
    if grid:
        ctx.info(f"index {ctx.name}: lexical classifiers' weight {index.classifier.settings.weight:g} of "
                 + ", ".join(f"{g:g}: {v:.4f}" for g, v in grid) + f" ({ctx.cfg.fusion.objective} on validation)")


def _lexical_or_note(ctx: StageContext, rows: np.ndarray, ds: XCDataset,
                     fit_rows: np.ndarray) -> tuple[LexicalIndex | None, str]:
    """``lexical_index``, or (None, why) when the data has no text or features for it and the lexical source
    came with the strategy (``index.sources`` set by the user: the error stands)."""
    try:
        return lexical_index(ctx, rows, ds, fit_rows), ""
    except XCConfigError as e:
        if "index.sources" in ctx.cfg.explicit:
            raise
        ctx.info(f"index {ctx.name}: the strategy's lexical source is left out: {e}")
        return None, str(e)


def _kept_lexical(ctx: StageContext, kept: KeptWork, deployed: np.ndarray, ds: XCDataset, rows: np.ndarray,
                  out: Path) -> tuple[dict[str, Any] | None, str]:
    """The lexical source over the ``deployed`` points written to ``out``; (its summary, why it was left out). Kept
    whole once fitted (its TF-IDF and classifiers: 5.5 minutes at the 1.3M shape), so a run after a killed one of
    this stage reads it back instead of fitting it again."""
    done = kept.path(LEXICAL_KEPT)
    if done is None:
        lexical, note = (lexical_index(ctx, deployed, ds, rows), "") if ctx.lexical_only() \
            else _lexical_or_note(ctx, deployed, ds, rows)  # lexical only: its error stands
        if lexical is None:
            return None, note
        summary = _lexical_summary(lexical)

        def write(path: Path) -> None:
            lexical.save(path / LEXICAL_DIR)
            save_json(path / SUMMARY, summary)

        if (done := kept.keep(LEXICAL_KEPT, write)) is None:  # nothing is kept (no checkpoint folder)
            lexical.save(out / LEXICAL_DIR)
            return summary, ""
    else:
        ctx.info(f"index {ctx.name}: the lexical source a killed run of this stage fitted, kept")
    link(done / LEXICAL_DIR, out / LEXICAL_DIR)
    return load_json(done / SUMMARY), ""


def _cooccurrence(ctx: StageContext, Y_train: Any, deployed: np.ndarray, rows: np.ndarray, out: Path,
                  held: Path | None) -> dict[str, Any]:
    """Write into ``out`` the co-occurrence source of the ``deployed`` points' labels, and into ``held`` that of
    the fit points ``rows`` (what the fusion is fitted with); its summary, or {"left_out": why}."""
    if cross_fitted(ctx, rows, Y_train.shape[0]):
        why = "the cooccurrence source is left out: the fusion is cross-fitted on the points it counts"
        if "index.sources" in ctx.cfg.explicit:
            raise XCConfigError(f"index.sources: {why} (fusion.fit_on); drop cooccurrence or fit on validation")
        ctx.info(f"index {ctx.name}: {why}")
        return {"left_out": why}
    settings = cooccurrence_settings(ctx.cfg.index)
    graph = LabelCooccurrence.fit(Y_train[deployed], settings)
    graph.save(out)
    if held is not None:
        held.mkdir(parents=True, exist_ok=True)
        LabelCooccurrence.fit(Y_train[rows], settings).save(held)
    return {"entries": int(graph.matrix.nnz), "neighbours": settings.neighbours, "power": settings.power,
            "max_entries": settings.max_entries}


def _mining_label_index(ctx: StageContext, kind: str) -> Path | None:
    """Mining's index over the label embeddings when it is the one this stage would build: the deployed encoder
    is the pretrained one (the same embeddings) and the kind and graph settings match."""
    p = ctx.cfg.index
    if ctx.read.model_dir() != ctx.dir("pretrain"):
        return None
    want = label_index_settings(kind, p.hnsw_m, p.hnsw_ef_construction)
    path = ctx.read.path("mining", MINING_LABEL_INDEX)
    if ctx.read.summary("mining").get("label_index") != want or not path.exists():
        return None
    return path


def _build(ctx: StageContext, name: str, vectors: np.ndarray, out: Path, kept: KeptWork, held: str = "") -> str:
    """Build one source's index, write it to ``out`` and let it go (one index in memory at a time: at 1.3M
    labels and 2.25M points all of them together with their vectors held ~20 GB); returns its kind. The label
    graph mining built over the same embeddings is copied instead (a 1.3M-label graph takes ~20 minutes); an
    index a killed run of this stage finished is taken from ``kept`` (``held``: the held-out copies' prefix)."""
    p = ctx.cfg.index
    kind = resolve_kind(p.kind, len(vectors), vectors.shape[1])
    built = _mining_label_index(ctx, kind) if name == "label" else None
    if built is not None:
        shutil.copyfile(built, out / INDEX_FILES[name])
        ctx.info(f"index {name}: mining's {kind} index over the same label embeddings, copied")
        return kind

    def build(path: Path) -> None:
        with in_one_call(f"index {name}", len(vectors), "vectors", ctx.info, f"{p.kind} build") as prog:
            index = LabelIndex(p.kind, vectors, m=p.hnsw_m, ef_construction=p.hnsw_ef_construction,
                               ef_search=p.hnsw_ef_search, checkpoint=kept.graph(held + INDEX_FILES[name]),
                               progress=prog.update)
        index.save(path)

    if kept.artifact(held + INDEX_FILES[name], build, out / INDEX_FILES[name]):
        ctx.info(f"index {name}: the {kind} index a killed run of this stage built, kept")
    kept.drop(held + INDEX_FILES[name])
    return kind


def _summary(p: Any, kinds: dict[str, str], shape: tuple[int, ...], knn_points: int,
             parts: dict[str, Any]) -> dict[str, Any]:
    """The stage's summary: the sources built (a strategy's lexical or co-occurrence source may be left out), their
    index kinds and the lexical / co-occurrence ``parts`` (falsy ones omitted)."""
    cooc = parts.get("cooccurrence")
    built = {"lexical": parts.get("lexical") is not None, "cooccurrence": bool(cooc) and "left_out" not in cooc}
    sources = tuple(s for s in p.sources if built.get(s, True))
    summary = {"kind": p.kind, "kinds": {n: kinds[n] for n in sources if n in kinds}, "sources": list(sources),
               "label_repr": p.label_repr, "labels": int(shape[0]), "dim": int(shape[1]), "knn_points": knn_points,
               "knn_neighbours": int(p.knn_neighbours) if "knn" in p.sources else 0, "knn_power": float(p.knn_power)}
    return {**summary, **{k: v for k, v in parts.items() if v}}


def _sources_with_text(ctx: StageContext, p: Any) -> Any:
    """``p`` without the strategy's sources that read the points' embeddings (``knn``, ``centroid``) when no point
    has text: every point is then the same embedding, and their neighbours and centroids are ties broken by row
    order; with the lexical source over shipped features (``StageContext.lexical_only``) that source alone, the W
    and label embeddings' scores being per-label constants then (and the co-occurrence votes through the label
    source's neighbours, noise). ``index.sources`` set by the user is kept."""
    if ctx.lexical_only() and p.sources != ("lexical",):
        ctx.info(f"index {ctx.name}: no training point has text: the lexical source over the BoW features alone, "
                 f"its classifiers' prior in place of the constant W and label scores (left out: "
                 f"{', '.join(s for s in p.sources if s != 'lexical')})")
        return dataclasses.replace(p, sources=("lexical",))
    gone = [s for s in ("knn", "centroid") if s in p.sources]
    if not gone or "index.sources" in ctx.cfg.explicit or ctx.points_have_text():
        return p
    ctx.info(f"index {ctx.name}: no training point has text: the {' and '.join(gone)} source(s) left out")
    return dataclasses.replace(p, sources=tuple(s for s in p.sources if s not in gone))


def _lexical_summary(lexical: LexicalIndex) -> dict[str, Any]:
    """What the index stage's summary says of its lexical source."""
    clf = lexical.classifier
    return {"input": lexical.input, "points": lexical.num_points, "terms": int(lexical.points.shape[1]),
            "neighbours": lexical.neighbours, "max_postings": lexical.max_postings,
            "label_text": lexical.labels is not None, "feature_words": lexical.words is not None,
            "classifier_weights": 0 if clf is None else len(clf.keys),
            "classifier_history": [] if clf is None else clf.history,
            "classifier_solver": None if clf is None else clf.solver,
            "classifier_stopped_at_deadline": clf is not None and clf.stopped_at_deadline,
            "classifier_skipped_at_deadline": lexical.classifier_skipped,
            "classifier_weight": None if clf is None else clf.settings.weight,
            "classifier_weight_grid": [[g, v] for g, v in lexical.weight_grid]}


def run(ctx: StageContext) -> dict[str, Any]:
    """Build and save the indexes, one at a time; with ``index.include_validation`` the deployed kNN index and
    centroids hold every training point, and ``heldout/`` what the fusion is fitted with: the centroids without
    the validation points and the kNN rows to exclude (the deployed kNN index searched without them: no second
    build)."""
    p = _sources_with_text(ctx, ctx.cfg.index)
    _check(p)
    t0 = time.perf_counter()
    W = ctx.read.W(mmap=True)
    need_centroids = "centroid" in p.sources or p.label_repr == "text+centroid"
    points_knn = "knn" in p.sources or "lexical" in p.sources  # a kNN over training points, held out by rows
    cooc = "cooccurrence" in p.sources
    cooc_summary: dict[str, Any] | None = None
    kinds: dict[str, str] = {}
    with ctx.kept_work({"index": dataclasses.asdict(p)}) as kept:
        note, heldout, knn_points, lexical_summary = "", False, 0, None
        with ctx.writing() as out:
            if need_centroids or points_knn or cooc:
                ds = ctx.read.labels()
                rows = ctx.read.train_rows(ds.num_train)
                # from the deployed encoder's embeddings: mining's centroids are stale once ASTRA/MIPS-s fine-tuned it
                train_emb = ctx.read.embeddings("train", mmap=True)
                heldout = p.include_validation and len(rows) < ds.num_train
                deployed = np.arange(ds.num_train) if heldout else rows
                if "lexical" in p.sources:
                    lexical_summary, note = _kept_lexical(ctx, kept, deployed, ds, rows, out)
                if need_centroids:
                    centroids = label_centroids(train_emb, ds.Y_train, deployed)
                    if "centroid" in p.sources:
                        kinds["centroid"] = _build(ctx, "centroid", centroids, out, kept)
                    np.save(out / CENTROID_FILE, centroids)
                    del centroids
                if cooc:
                    cooc_summary = _cooccurrence(ctx, ds.Y_train, deployed, rows, out,
                                                 out / HELDOUT if heldout else None)
                if "knn" in p.sources:
                    # every point (include_validation): the memory-mapped array, not a copy (3.5 GB at 2.25M x 384)
                    points = train_emb if len(deployed) == len(train_emb) else train_emb[deployed]
                    kinds["knn"] = _build(ctx, "knn", points, out, kept)
                    del points
                    sp.save_npz(out / KNN_LABELS_FILE, ds.Y_train[deployed].tocsr().astype(np.float32))
                    knn_points = len(deployed)
            for name, read in (("W", lambda: W), ("label", lambda: ctx.read.embeddings("label", mmap=True))):
                if name in p.sources:
                    kinds[name] = _build(ctx, name, read(), out, kept)
            if heldout:  # what the fusion is fitted with: the same parts without the validation points
                held = out / HELDOUT
                held.mkdir(parents=True, exist_ok=True)
                if need_centroids:
                    h_centroids = label_centroids(train_emb, ds.Y_train, rows)
                    if "centroid" in p.sources:
                        _build(ctx, "centroid", h_centroids, held, kept, f"{HELDOUT}_")
                    np.save(held / CENTROID_FILE, h_centroids)
                if points_knn:  # the validation rows, excluded from the deployed kNN and lexical neighbours
                    np.save(held / KNN_EXCLUDED_FILE, np.setdiff1d(np.arange(ds.num_train), rows))
            summary = _summary(p, kinds, W.shape, knn_points, {"lexical_left_out": note, "lexical": lexical_summary,
                                                               "cooccurrence": cooc_summary})
            if heldout:
                summary["heldout_knn_points"] = int(len(rows)) if points_knn else 0
            if ctx.lexical_only():  # the classifier and embedding scores 0 wherever the sources are read
                summary["dense"] = False
            summary["seconds"] = time.perf_counter() - t0
            save_json(out / SUMMARY, summary)
        kept.clear()
        return summary
