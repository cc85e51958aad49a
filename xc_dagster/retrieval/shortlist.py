"""Inference: shortlist from ANNS indexes, exact re-scoring, fusion, top-k.

A shortlist is the union of candidates from one or more *sources* (``SOURCES``):

* ``W``: top neighbours of the query embedding among the classifier vectors (NGAME's MIPS over W);
* ``label``: among the label text embeddings E(z_l) (NGAME's dual MIPS; SiameseXML's ANNS^z);
* ``centroid``: among the label centroids v_l, the normalised mean embedding of the label's training points
  (SiameseXML Module II, ANNS^mu);
* ``knn``: the labels of the query's nearest training points (SiameseXML Module II, ANNS^x), a label scored
  by the summed similarity of the neighbours that carry it;
* ``lexical``: the labels of highest lexical score, TF-IDF cosine to the label's text plus a sparse kNN vote of
  the training points (``xc_dagster.retrieval.lexical``); it reads the queries' TF-IDF rows, not embeddings;
* ``cooccurrence``: the labels co-occurring in training with the query's nearest labels (Gandalf's label points,
  ``xc_dagster.retrieval.cooccurrence``), from the ``label`` source's search.

Each candidate then gets exact scores: the classifier score w_l.e and the embedding score r_l.e, where r_l is
the label representation the model uses (E(z_l), or E(z_l) + v_l as in SiameseXML's fusion), the kNN
score (0 when the knn source did not propose it) and, with the lexical and co-occurrence sources, their scores of
every candidate, whichever source proposed it. The fitted fusion combines them (reading and writing the sources:
``xc_dagster.retrieval.source_files``). Work is done in row blocks so memory
stays bounded; every ANNS step is O(k) per query per source, independent of L.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import scipy.sparse as sp
import torch

from xc_dagster.device import resolve_device
from xc_dagster.errors import XCConfigError
from xc_dagster.progress import Advance, Report, in_one_call
from xc_dagster.retrieval.ann import LabelIndex, gathered_scores
from xc_dagster.retrieval.cooccurrence import LabelCooccurrence
from xc_dagster.retrieval.files import CENTROID_FILE as CENTROID_FILE  # re-exported: stages read the names here
from xc_dagster.retrieval.files import INDEX_FILES as INDEX_FILES
from xc_dagster.retrieval.files import KNN_EXCLUDED_FILE as KNN_EXCLUDED_FILE
from xc_dagster.retrieval.files import KNN_LABELS_FILE as KNN_LABELS_FILE
from xc_dagster.retrieval.hnsw_build import GraphCheckpoint
from xc_dagster.retrieval.lexical import LexicalIndex
from xc_dagster.retrieval.sparse_rows import sparse_lookup, sparse_topk, vote_weights, work_blocks
from xc_dagster.sampling.labels import dedupe_rows

SOURCES = ("W", "label", "centroid", "knn", "lexical", "cooccurrence")
ANN_SOURCES = SOURCES[:4]  # searched with embeddings in an ANNS index; "lexical" with TF-IDF rows, "cooccurrence"
# through the label index's search
POINT_SOURCES = ("centroid", "knn")  # built from training points; "W" and "label" from the labels
LABEL_REPRS = ("text", "text+centroid")
CENTROID_BLOCK_ENTRIES = 1 << 17  # label_centroids: label entries per block (its float64 sums: <= 400 MB at D 384)


@dataclass
class Shortlist:
    ids: np.ndarray  # (n, C) int64, -1 padded, unique per row
    clf: np.ndarray  # (n, C) float32 classifier scores w_l.e (-inf on padding)
    emb: np.ndarray  # (n, C) float32 embedding scores r_l.e (-inf on padding)
    knn: np.ndarray | None = None  # (n, C) float32 kNN scores (0 where knn did not propose the label)
    lex: np.ndarray | None = None  # (n, C) float32 lexical scores of every candidate (0: none, or padding)
    cooc: np.ndarray | None = None  # (n, C) float32 co-occurrence votes of every candidate (0: none, or padding)
    # (n, C) float32 with kNN scores: how many points of the kNN index carry the candidate (0 on padding), the
    # head bias of its votes that the fusion's kNN discount divides out (docs/decisions.md#fusion-knn-discount)
    knn_count: np.ndarray | None = None


@dataclass
class ShortlistSources:
    """The indexes a shortlist is drawn from and the label vectors its candidates are scored with."""

    W: np.ndarray  # (L, D) classifier vectors (at mining time, before classifiers exist: the label vectors)
    label_repr: np.ndarray  # (L, D) label representation r_l of the embedding score
    indexes: dict[str, LabelIndex]  # source name (ANN_SOURCES) -> index; "knn" indexes training points
    knn_labels: sp.csr_matrix | None = None  # (rows of the knn index) x L: labels of each indexed point
    # the kNN score of a candidate: 0 = summed similarity of the query's k retrieved neighbours that carry it
    # (SiameseXML's ANNS^x ranking); K > 0 = mean over the K nearest neighbours of (similarity if the neighbour
    # carries the label, else 0): a fusion input on the scale of the other scores. Candidates come from all k.
    knn_neighbours: int = 0
    knn_power: float = 1.0  # each of the K votes is max(similarity, 0) ** knn_power (1: the similarity)
    # rows of the knn index (and of the lexical index's points, the same rows) never returned as neighbours (the
    # validation points, when the fusion is fitted on them with the deployed index: a held-out kNN without a
    # second index)
    knn_excluded: np.ndarray | None = None
    lexical: LexicalIndex | None = None  # the lexical source (its kNN over the same training points)
    cooccurrence: LabelCooccurrence | None = None  # the co-occurrence source (votes of the label index's neighbours)
    # False: the classifier and embedding scores are 0 on every candidate (no point had text: they would be
    # per-label constants; StageContext.lexical_only)
    dense: bool = True

    def __post_init__(self) -> None:
        check_sources(self.names, "shortlist sources")
        if {"lexical", "cooccurrence"} & set(self.indexes):
            raise ValueError("the lexical and co-occurrence sources are ShortlistSources.lexical / .cooccurrence, "
                             "not ANNS indexes")
        if self.cooccurrence is not None and "label" not in self.indexes:
            raise XCConfigError("index.sources: cooccurrence votes through the label source's neighbours; add label")
        if "knn" in self.indexes and self.knn_labels is None:
            raise ValueError("the knn source needs knn_labels (labels of the indexed training points)")

    @property
    def names(self) -> tuple[str, ...]:
        """The sources, in the order their candidates are merged."""
        return (tuple(self.indexes) + (("lexical",) if self.lexical is not None else ())
                + (("cooccurrence",) if self.cooccurrence is not None else ()))

    @functools.cached_property
    def knn_counts(self) -> np.ndarray:
        """(L,) float32: each label's points in the kNN index, its excluded rows left out (what the votes see)."""
        lab = self.knn_labels
        counts = np.bincount(lab.indices[lab.data != 0], minlength=lab.shape[1])
        if self.knn_excluded is not None and len(self.knn_excluded):
            gone = lab[np.asarray(self.knn_excluded, dtype=np.int64)]
            counts = counts - np.bincount(gone.indices[gone.data != 0], minlength=lab.shape[1])
        return counts.astype(np.float32)


def check_sources(sources: tuple[str, ...], where: str, allowed: tuple[str, ...] = SOURCES) -> None:
    """A non-empty subset of ``allowed`` without repeats, or a config error naming ``where``."""
    bad = [s for s in sources if s not in allowed]
    if not sources or bad or len(set(sources)) != len(sources):
        raise XCConfigError(f"{where}: expected distinct names from {', '.join(allowed)}, got {list(sources)}")


def check_label_repr(label_repr: str, where: str) -> None:
    if label_repr not in LABEL_REPRS:
        raise XCConfigError(f"{where}: expected one of {', '.join(LABEL_REPRS)}, got {label_repr!r}")


def label_centroids(point_emb: np.ndarray, Y: sp.csr_matrix, rows: np.ndarray | None = None,
                    block_entries: int = CENTROID_BLOCK_ENTRIES) -> np.ndarray:
    """v_l = normalise(mean of E(x_i) over training points i with y_il = 1) (SiameseXML); 0 for unseen labels.

    O(nnz(Y) * D), streamed over blocks of rows holding about ``block_entries`` label entries, so ``point_emb``
    may be a memmap and memory is L x D float32 plus one block's sums: each block's product is taken over only
    the labels it has (a dense L x D product per block held 4 GB at 1.3M labels), in float64, then added.
    """
    Y = Y.tocsr()
    rows = np.arange(Y.shape[0]) if rows is None else np.asarray(rows, dtype=np.int64)
    acc = np.zeros((Y.shape[1], point_emb.shape[1]), dtype=np.float32)
    for s, e in work_blocks(np.diff(Y.indptr)[rows], block_entries, len(rows)):
        r = rows[s:e]
        Yr = Y[r]
        cols, inv = np.unique(Yr.indices, return_inverse=True)
        sub = sp.csr_matrix((Yr.data.astype(np.float64), inv.ravel(), Yr.indptr), shape=(len(r), len(cols)))
        acc[cols] += sub.T @ np.asarray(point_emb[r], dtype=np.float64)
    norm = np.linalg.norm(acc, axis=1, keepdims=True)
    np.divide(acc, norm, out=acc, where=norm > 0)  # rows of unseen labels stay 0
    return acc


def knn_label_scores(nbr_ids: np.ndarray, nbr_sims: np.ndarray, knn_labels: sp.csr_matrix,
                     k: int) -> tuple[np.ndarray, np.ndarray]:
    """Top-k labels per query from its neighbours: score(l) = sum of sims of neighbours labelled l.

    ``nbr_ids`` (n, m) rows of ``knn_labels`` (-1 = none); returns (ids int64, scores float32), -1 / 0 padded,
    by score descending then label id. Vectorised with one sparse product (n x rows) @ (rows x L).
    """
    n, m = nbr_ids.shape
    ok = nbr_ids >= 0
    r = np.repeat(np.arange(n), m)[ok.ravel()]
    S = sp.csr_matrix((nbr_sims[ok].astype(np.float64), (r, nbr_ids[ok])), shape=(n, knn_labels.shape[0]))
    # float64 sums; the sources hold the matrix in float64 already (converting it per call is O(training points):
    # half of the 1.3M shape's evaluation time)
    labels = knn_labels if knn_labels.dtype == np.float64 else knn_labels.astype(np.float64)
    return sparse_topk(S @ labels, k)


def nearest_knn_scores(nbrs: np.ndarray, sims: np.ndarray, knn_labels: sp.csr_matrix, K: int,
                       extra: int, power: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """Every label of the K nearest neighbours with its mean vote sum(vote) / K, vote = ``vote_weights(sim,
    power)`` (``knn_label_scores`` over the first K + ``extra`` columns; ``extra`` = 1 when the query's own row
    may be among them as -1)."""
    near = nbrs[:, :K + extra].copy()
    if extra:  # keep K neighbours per row: drop the last one of rows that lost none to exclusion
        near[(near >= 0).sum(1) > K, -1] = -1
    carried = np.where(near >= 0, np.diff(knn_labels.indptr)[np.maximum(near, 0)], 0).sum(1)
    ids, scores = knn_label_scores(near, vote_weights(sims[:, :K + extra], power), knn_labels,
                                   max(int(carried.max(initial=0)), 1))
    return ids, scores / K


STREAM_ROWS = 65_536  # queries a stage shortlists at once before keeping their top k: a million queries' whole
# shortlists (ids and up to four scores per candidate) would hold about 7 GB


def retrieve(queries: np.ndarray, src: ShortlistSources, k: int, exclude_knn: np.ndarray | None = None,
             block: int = 1024, lexical_queries: sp.spmatrix | None = None,
             progress: Advance | None = None, device: torch.device | None = None,
             classifier_scores: bool = True) -> Shortlist:
    """Union of every source's top-k candidates per query, each with exact classifier/embedding/kNN/lexical scores.

    ``queries``: (n, D) embeddings; ``lexical_queries``: their (n, V) TF-IDF rows (``src.lexical.transform``),
    needed when ``src`` has the lexical source. ``exclude_knn[i]``: a knn-index row (and lexical-index point) never
    used as query i's neighbour (the point itself when the queries are the indexed training points), or -1.
    ``progress(rows)`` follows each block of queries (``xc_dagster.progress.Progress.update``). ``device``: where
    the union's classifier and embedding scores are computed (default: where exact search runs, a GPU when there
    is one: the host's cores are busy with the lexical source). ``classifier_scores=False``: the classifier scores
    are left -inf and the kNN counts None (mining, whose ``W`` is the label embeddings and which ranks by the others).
    """
    n = len(queries)
    names = list(src.indexes)
    lexical = src.lexical
    if lexical is not None:
        if lexical_queries is None or lexical_queries.shape[0] != n:
            raise ValueError(f"the lexical source needs the {n} queries' TF-IDF rows (lexical_queries), got "
                             f"{None if lexical_queries is None else lexical_queries.shape}")
        lexical_queries = sp.csr_matrix(lexical_queries, dtype=np.float32)
    # a block's lexical score rows bounded by its queries' postings, not by the worst case (lexical.block_rows: 64
    # queries at capped postings, where per-block costs dominate; docs/decisions.md#retrieval-blocks)
    blocks = (lexical.query_blocks(lexical_queries, block) if lexical is not None
              else [(s, min(s + block, n)) for s in range(0, n, block)])
    width = k * len(src.names)
    ids_all = np.full((n, width), -1, dtype=np.int64)
    clf_all = np.full((n, width), -np.inf, dtype=np.float32)
    emb_all = np.full((n, width), -np.inf, dtype=np.float32)
    knn_all = np.zeros((n, width), dtype=np.float32) if "knn" in names else None
    lex_all = np.zeros((n, width), dtype=np.float32) if lexical is not None else None
    cooc_all = np.zeros((n, width), dtype=np.float32) if src.cooccurrence is not None else None
    dev = device or resolve_device("auto")
    Wt, Rt = (torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32)).to(dev) if use else None  # not dense: 0
              for a, use in ((src.W, classifier_scores and src.dense), (src.label_repr, src.dense)))
    for s, e in blocks:
        q = np.ascontiguousarray(queries[s:e], dtype=np.float32)
        parts, knn_ids, knn_sc = [], None, None
        for name in names:
            if name == "knn":
                extra = 0 if exclude_knn is None else 1
                sims, nbrs = src.indexes[name].search(q, k + extra, exclude=src.knn_excluded)
                if exclude_knn is not None:
                    nbrs = np.where(nbrs == exclude_knn[s:s + len(q), None], -1, nbrs)
                knn_ids, knn_sc = knn_label_scores(nbrs, sims, src.knn_labels, k)
                parts.append(knn_ids)
                if src.knn_neighbours > 0:
                    knn_ids, knn_sc = nearest_knn_scores(nbrs, sims, src.knn_labels, src.knn_neighbours, extra,
                                                          src.knn_power)
            else:
                sims, nbrs = src.indexes[name].search(q, k)
                parts.append(nbrs)
                if name == "label" and src.cooccurrence is not None:
                    cooc = src.cooccurrence.votes(nbrs, sims)
                    parts.append(sparse_topk(cooc, k, unique=True)[0])
        if lexical is not None:
            lex = lexical.scores(lexical_queries[s:s + len(q)], src.knn_excluded,
                                 None if exclude_knn is None else exclude_knn[s:s + len(q)])
            parts.append(sparse_topk(lex, k)[0])
        ids = dedupe_rows(np.concatenate(parts, axis=1))
        safe, qt = torch.from_numpy(np.maximum(ids, 0)).to(dev), torch.from_numpy(q).to(dev)
        pad, rows = ids < 0, slice(s, s + len(q))
        ids_all[rows] = ids
        if classifier_scores:
            clf_all[rows] = np.where(pad, -np.inf, 0.0 if Wt is None else gathered_scores(qt, Wt, safe).cpu().numpy())
        emb_all[rows] = np.where(pad, -np.inf, 0.0 if Rt is None else gathered_scores(qt, Rt, safe).cpu().numpy())
        if knn_all is not None:
            knn_all[rows] = _lookup(ids, knn_ids, knn_sc, len(src.W))
        if lex_all is not None:
            lex_all[rows] = sparse_lookup(lex, ids)
        if cooc_all is not None:
            cooc_all[rows] = sparse_lookup(cooc, ids)
        if progress is not None:
            progress(len(q))
    fused = knn_all is not None and classifier_scores  # the counts are the fusion's (mining never fuses)
    count_all = np.where(ids_all < 0, 0.0, src.knn_counts[np.maximum(ids_all, 0)]) if fused else None
    return Shortlist(ids_all, clf_all, emb_all, knn_all, lex_all, cooc_all, count_all)


def _lookup(ids: np.ndarray, keys: np.ndarray, values: np.ndarray, num_labels: int) -> np.ndarray:
    """Row-wise ``values[i, j']`` where ``keys[i, j'] == ids[i, j]``, else 0 (keys unique per row, -1 = none).

    Keys become ``row * L + label`` so one sorted search serves every row.
    """
    rows = np.arange(len(ids), dtype=np.int64)[:, None]
    ok = keys >= 0
    flat = (rows * num_labels + keys)[ok]
    order = np.argsort(flat)
    flat, vals = flat[order], values[ok][order]
    if flat.size == 0:
        return np.zeros(ids.shape, dtype=np.float32)
    probe = rows * num_labels + np.maximum(ids, 0)
    pos = np.minimum(np.searchsorted(flat, probe), flat.size - 1)
    return np.where((flat[pos] == probe) & (ids >= 0), vals[pos], 0.0).astype(np.float32)


def label_representation(label_emb: np.ndarray, centroids: np.ndarray | None, label_repr: str) -> np.ndarray:
    """r_l for the embedding score: E(z_l) ("text") or E(z_l) + v_l ("text+centroid", SiameseXML)."""
    check_label_repr(label_repr, "label representation")
    if label_repr == "text":
        return label_emb
    if centroids is None:
        raise ValueError("label_repr text+centroid needs the label centroids")
    return (np.asarray(label_emb, dtype=np.float32) + centroids).astype(np.float32)


def build_sources(sources: tuple[str, ...], W: np.ndarray, label_emb: np.ndarray, centroids: np.ndarray | None,
                  point_emb: np.ndarray | None, knn_labels: sp.csr_matrix | None, label_repr: str, kind: str,
                  m: int, ef_construction: int, ef_search: int,
                  lexical: LexicalIndex | None = None, report: Report | None = None,
                  built: dict[str, LabelIndex] | None = None,
                  on_built: Callable[[str, LabelIndex], None] | None = None,
                  checkpoints: Callable[[str], GraphCheckpoint | None] | None = None,
                  cooccurrence: LabelCooccurrence | None = None) -> ShortlistSources:
    """Build the ANNS index of every source; ``point_emb`` / ``knn_labels``: the indexed training points;
    ``lexical`` / ``cooccurrence``: the fitted lexical / co-occurrence source, when ``sources`` name it;
    ``report``: where each build's start and
    end lines go (``xc_dagster.progress.in_one_call``); ``built``: indexes already built over the same vectors
    (a killed run's, kept), used as they are; ``on_built(name, index)``: called as each new index is built;
    ``checkpoints(name)``: where an HNSW build of source ``name`` keeps its graph as it goes (``hnsw_build``)."""
    vectors = {"W": W, "label": label_emb, "centroid": centroids, "knn": point_emb}
    indexes = {}
    for name in sources:
        if name in ("lexical", "cooccurrence"):
            if {"lexical": lexical, "cooccurrence": cooccurrence}[name] is None:
                part = {"lexical": "LexicalIndex", "cooccurrence": "LabelCooccurrence"}[name]
                raise ValueError(f"source {name!r} needs its {part}")
            continue
        if vectors[name] is None:
            raise ValueError(f"source {name!r} needs its vectors")
        if built and name in built:
            indexes[name] = built[name]
            continue
        with in_one_call(f"index {name}", len(vectors[name]), "vectors", report, f"{kind} build") as prog:
            indexes[name] = LabelIndex(kind, vectors[name], m=m, ef_construction=ef_construction, ef_search=ef_search,
                                       checkpoint=checkpoints(name) if checkpoints else None, progress=prog.update)
        if on_built is not None:
            on_built(name, indexes[name])
    return ShortlistSources(W, label_representation(label_emb, centroids, label_repr), indexes,
                            knn_labels.tocsr().astype(np.float64) if knn_labels is not None else None,
                            lexical=lexical if "lexical" in sources else None,
                            cooccurrence=cooccurrence if "cooccurrence" in sources else None)


def label_index_settings(kind: str, m: int, ef_construction: int) -> dict[str, Any]:
    """What decides a built label index's graph (the index stage reuses mining's when they match)."""
    return {"kind": kind, "m": int(m), "ef_construction": int(ef_construction)}


def shortlist(queries: np.ndarray, W: np.ndarray, label_emb: np.ndarray, w_index: LabelIndex,
              e_index: LabelIndex, k: int, block: int = 1024) -> Shortlist:
    """Dual MIPS (NGAME): union of the W and label-embedding indexes' top-k, with both scores."""
    return retrieve(queries, ShortlistSources(W, label_emb, {"W": w_index, "label": e_index}), k, block=block)


def fuse(sl: Shortlist, alpha: float, knn_weight: float = 0.0, lexical_weight: float = 0.0,
         cooccurrence_weight: float = 0.0, knn_discount: float = 0.0) -> np.ndarray:
    """Fused score a * classifier + (1 - a) * embedding (+ c * kNN score when ``knn_weight`` c > 0, divided by
    each label's count ** ``knn_discount``: ``discounted_knn``) (+ d * lexical score when ``lexical_weight`` d > 0)
    (+ e * co-occurrence votes when ``cooccurrence_weight`` e > 0); -inf on padding."""
    with np.errstate(invalid="ignore"):
        s = alpha * sl.clf + (1.0 - alpha) * sl.emb
        if knn_weight:
            s = s + knn_weight * discounted_knn(sl, knn_discount)
        if lexical_weight:
            s = s + lexical_weight * sl.lex
        if cooccurrence_weight:
            s = s + cooccurrence_weight * sl.cooc
    return np.where(sl.ids < 0, -np.inf, s).astype(np.float32)


def discounted_knn(sl: Shortlist, discount: float) -> np.ndarray:
    """The kNN scores, each divided by max(n_l, 1) ** ``discount``, n_l the kNN index's points carrying the label:
    a label on many points collects votes from any query near its crowd, so its summed votes overstate it against
    a tail label's (docs/decisions.md#fusion-knn-discount); 0 = the scores as they are."""
    if not discount:
        return sl.knn
    if sl.knn_count is None:
        raise XCConfigError("the fusion discounts kNN scores by their labels' counts, but the shortlist has no "
                            "knn_count (shortlists from retrieve with a knn source have)")
    return sl.knn * np.maximum(sl.knn_count, np.float32(1.0)) ** np.float32(-discount)


def topk_from_scores(ids: np.ndarray, scores: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Top-k (ids, scores) per row by score descending, ties broken by smaller label id; -1 padded."""
    tie = np.where(ids < 0, np.iinfo(np.int64).max, ids)
    order = np.lexsort((tie, -scores), axis=1)[:, :k]
    out_ids = np.take_along_axis(ids, order, 1)
    out_s = np.take_along_axis(scores, order, 1)
    out_ids = np.where(np.isfinite(out_s), out_ids, -1)
    if out_ids.shape[1] < k:
        pad = k - out_ids.shape[1]
        out_ids = np.pad(out_ids, ((0, 0), (0, pad)), constant_values=-1)
        out_s = np.pad(out_s, ((0, 0), (0, pad)), constant_values=-np.inf)
    return out_ids, out_s
