"""The lexical shortlist source: TF-IDF over the training points' texts (or shipped BoW features) and the labels'.

A query is its L2-normalised TF-IDF row q. Its lexical score for label l sums up to three parts in [0, 1] each:

* label text: cos(q, t_l), with t_l the TF-IDF row of the label's text (left out, 0, when the labels have no
  text in the feature space: BoW features without label features);
* sparse kNN: (1 / K) * sum over the query's K nearest training points j (TF-IDF cosine, ties by smaller row;
  fewer when fewer share a term) of cos(q, x_j) ** p * [j carries l] (p: ``index.lexical_power``), as the dense
  kNN score (``index.knn_neighbours``) in the encoder's space;
* classifier (``index.lexical_classifier``): g * sigmoid(w_l . q + b_l), a sparse linear model per label over the
  TF-IDF rows (``xc_dagster.retrieval.lexical_classifier``; g chosen on validation,
  ``xc_dagster.retrieval.lexical_weight``) re-ranking the other two parts' labels: the one-vs-all linear model the
  linear peers win with on BoW data. A query they give fewer than ``PRIOR_LABELS`` labels (no term shared with a label
  or point) also gets those of largest b_l: the classifiers' prior.

The TF-IDF model is scikit-learn's (``xc_dagster.retrieval.tfidf``): ``TfidfVectorizer`` (sublinear tf, word 1-2 grams,
``index.lexical_min_df``, 1 when that leaves no term; ``index.lexical_char_weight``: char 3-5 grams beside them, read
by the classifiers alone, ``tfidf.word_postings``) on the points' and labels' texts, or ``TfidfTransformer`` on the
shipped BoW features (sublinear tf and idf for counts; real values, already weighted, only L2-normalised); validation
points are indexed (excluded from the fusion's kNN, as the dense kNN excludes them) but left out of the fit. Both parts
are sparse products in row blocks holding at most ``PRODUCT_BUDGET`` entries each (:attr:`LexicalIndex.block_rows`
queries, split further by their terms' postings); the kNN part of dense feature rows (most terms in most points:
``sparse_rows.dense_postings``) is one dense product per block instead.

At scale the products are bounded by static index pruning (Carmel et al., SIGIR 2001): with ``max_postings`` P > 0
(``index.lexical_max_postings``) each term keeps only the P points, and the P labels, where its TF-IDF weight is
largest, so a query costs at most (its terms) x P products at any N (the whole postings of a common term: O(N) per
query). A score then sums only kept terms, exact for terms in at most P points (decisions.md#lexical-postings-cap).

A features index given the dataset's feature words (its BoW vocabulary, one per column) reads every feature row as the
set of its words (:class:`FeatureWords`), as it reads raw texts split on single spaces (how the BoW layouts rebuild a
point's text, ``xc_dagster.data.companions``): the same TF-IDF row either way, so the index serves raw text; without
the words it cannot (a clear error).

:class:`LexicalIndex` owns its files, one folder (``LEXICAL_DIR`` in the index stage's), no pickle: ``lexical.json``
(input kind, K, the vectorizer's settings), ``vocabulary.json`` (the terms, by column; text input only),
``feature_words.json`` (the feature words, by column; features input with words only), ``idf.npy``, ``points.npz`` /
``point_labels.npz`` (TF-IDF rows and labels of the indexed training points, in the rows of the dense kNN index) and
``labels.npz`` (TF-IDF rows of the label texts, when there are any).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import scipy.sparse as sp
import torch

from xc_dagster.device import on_threads
from xc_dagster.errors import XCConfigError, XCError
from xc_dagster.retrieval import tfidf
from xc_dagster.retrieval.feature_words import FeatureWords
from xc_dagster.retrieval.files import LEXICAL_DIR as LEXICAL_DIR  # the folder's name, re-exported with the index
from xc_dagster.retrieval.lexical_classifier import ClassifierSettings, LexicalClassifier, ends_past, hard_negatives
from xc_dagster.retrieval.lexical_exact import solves_exactly
from xc_dagster.retrieval.sparse_rows import (
    cap_postings,
    check_power,
    dense_postings,
    dense_topk,
    row_postings,
    sparse_lookup,
    sparse_topk,
    vote_weights,
    work_blocks,
)
from xc_dagster.storage import load_json, save_json

CONFIG_FILE = "lexical.json"
VOCABULARY_FILE = "vocabulary.json"
FEATURE_WORDS_FILE = "feature_words.json"
IDF_FILE = "idf.npy"
POINTS_FILE = "points.npz"
POINT_LABELS_FILE = "point_labels.npz"
LABELS_FILE = "labels.npz"
FORMAT = 1
INPUTS = ("text", "features")  # what the TF-IDF model reads: raw texts, or the shipped BoW feature rows
DENSE_TOPK_SHARE = 0.02  # a product block filling more than this share of its packed rows is partitioned, not sorted
PRODUCT_BUDGET = 1 << 24  # at most this many (query, training point) products held at once (~200 MB)
# the kNN votes (K, p) of the other parts when they pick the classifiers' hard negatives and training pass: fixed,
# so that the classifiers do not depend on the votes an index is built or fitted with (fusion.vote_grid)
CLASSIFIER_VOTES = (10, 1.0)
CAPPED_TERMS = 64  # block_rows of a capped index: a query's products taken as at most this many terms x P
PRIOR_LABELS = 10  # a query the other parts give fewer labels is topped up with the classifiers' largest biases


class LexicalIndex:
    """TF-IDF rows of the indexed training points (with their labels) and of the labels' texts, and the model that
    maps a query to its row; :meth:`scores` gives every label's lexical score (module docstring)."""

    def __init__(self, model: Any, points: sp.csr_matrix, point_labels: sp.csr_matrix,
                 labels: sp.csr_matrix | None, neighbours: int,
                 feature_words: FeatureWords | Sequence[str] | None = None, max_postings: int = 0,
                 power: float = 1.0, classifier: LexicalClassifier | None = None):
        self.model, self.neighbours, self.power = model, int(neighbours), check_power(power, "index.lexical_power")
        if not (isinstance(max_postings, (int, np.integer)) and not isinstance(max_postings, bool)
                and max_postings >= 0):
            raise XCConfigError(f"index.lexical_max_postings: expected an int >= 0 (0: no cap), got {max_postings!r}")
        self.max_postings = int(max_postings)
        self.input = "text" if hasattr(model, "build_analyzer") else "features"  # a vectorizer reads texts
        self.words = feature_words if feature_words is None or isinstance(feature_words, FeatureWords) \
            else FeatureWords(feature_words)
        self.points = sp.csr_matrix(points, dtype=np.float32)
        self.point_labels = sp.csr_matrix(point_labels, dtype=np.float32)
        self.labels = None if labels is None else sp.csr_matrix(labels, dtype=np.float32)
        if self.neighbours < 1:
            raise XCConfigError(f"index.lexical_neighbours: expected an int >= 1, got {neighbours!r}")
        if self.points.shape[0] != self.point_labels.shape[0]:
            raise ValueError(f"{self.points.shape[0]} indexed points but {self.point_labels.shape[0]} label rows")
        if self.labels is not None and self.labels.shape != (self.num_labels, self.points.shape[1]):
            raise ValueError(f"label rows {self.labels.shape}, expected ({self.num_labels}, {self.points.shape[1]})")
        if self.words is not None and (self.input == "text" or len(self.words.terms) != self.points.shape[1]):
            raise ValueError(f"feature words: a features index over their {len(self.words.terms)} terms, got a "
                             f"{self.input} index of {self.points.shape[1]} columns")
        cap = self.max_postings  # the term-major rows, once: blocks then CSR @ CSR
        self._points_t, self._labels_t = (None if X is None else cap_postings(tfidf.word_postings(model, X), cap)
                                          for X in (self.points, self.labels))
        self._points_dense = dense_postings(self._points_t)  # dense feature rows: one BLAS product per block
        self._work = np.diff(self._points_t.indptr) * (self._points_dense is None)  # dense: num_points per query
        self._work += 0 if self._labels_t is None else np.diff(self._labels_t.indptr)
        # skipped: fit() left them out; weight_grid: the (g, value) the index stage chose the classifiers' g on
        self.classifier, self.classifier_skipped, self.weight_grid = classifier, False, []  # (neither saved)
        if classifier is not None and (classifier.num_labels, classifier.num_terms) != (self.num_labels,
                                                                                       self.points.shape[1]):
            raise ValueError(f"classifiers of {classifier.num_labels} labels x {classifier.num_terms} terms for an "
                             f"index of {self.num_labels} labels x {self.points.shape[1]} terms")

    @property
    def num_points(self) -> int:
        return int(self.points.shape[0])

    @property
    def num_features(self) -> int:
        """Columns of the feature rows (or terms of the texts) it reads: the feature words', when it has them."""
        return len(self.words.words) if self.words is not None else int(self.points.shape[1])

    @property
    def num_labels(self) -> int:
        return int(self.point_labels.shape[1])

    @property
    def block_rows(self) -> int:
        """Queries scored at once: their products with the points, and with the labels, hold at most
        ``PRODUCT_BUDGET`` entries each (capped postings: at most CAPPED_TERMS x P per query, the blocks then split
        by their terms' postings in :meth:`scores`)."""
        width = max(self.num_points, self.num_labels, 1)
        if self.max_postings:
            width = min(width, CAPPED_TERMS * self.max_postings)
        return max(1, PRODUCT_BUDGET // width)

    @classmethod
    def fit(cls, points: Sequence[str] | sp.spmatrix, labels: Sequence[str] | sp.spmatrix | None,
            point_labels: sp.spmatrix, neighbours: int, min_df: int = 2, fit_on: np.ndarray | None = None,
            feature_words: Sequence[str] | None = None, max_postings: int = 0, power: float = 1.0,
            classifier: ClassifierSettings | None = None, valid: tuple[Sequence[str] | sp.spmatrix, sp.spmatrix]
            | None = None, deadline: float | None = None, skip_after: float | None = None,
            char_weight: float = 0.0) -> LexicalIndex:
        """Index the training points' texts with the label texts, or their BoW feature rows with the labels' (``labels``
        None: no label-text part). The TF-IDF model is fitted on the labels and the points ``fit_on`` (positions in
        ``points``; default all): the validation points, indexed but excluded from the fusion's kNN, stay out of the idf
        too. ``point_labels``: (points, L), binarised (a neighbour carries a label or not). ``max_postings``: each
        term's postings capped at this many points and labels (0: none; module docstring). ``feature_words``: with
        feature rows, one word per column, read as word sets (:class:`FeatureWords`) so that the index serves raw text
        too. ``classifier``: train the third part, the sparse per-label logistic regressions, on the points ``fit_on``
        (``lexical_classifier``; None: none); ``valid``: held-out points (texts or feature rows, as ``points``) and
        their labels that pick its training pass, when they are not indexed (else the indexed points outside ``fit_on``
        do); ``deadline``, ``skip_after``: as :meth:`fit_classifier`'s (``classifier_skipped``: it left them out).
        ``char_weight`` > 0: texts also as char n-grams, that block weighed so (``tfidf.WordsAndChars``)."""
        if not (isinstance(min_df, int) and not isinstance(min_df, bool) and min_df >= 1):
            raise XCConfigError(f"index.lexical_min_df: expected an int >= 1, got {min_df!r}")
        Y = sp.csr_matrix(point_labels, dtype=np.float32, copy=True)
        Y.eliminate_zeros()  # first: a stored 0 is no label, and would be one after the binarising
        Y.data[:] = 1.0
        fit_rows = np.arange(Y.shape[0]) if fit_on is None else np.asarray(fit_on, dtype=np.int64)
        words = None
        if feature_words is not None:
            if not sp.issparse(points):
                raise ValueError("feature_words go with feature rows; a text index has its own vocabulary")
            words = FeatureWords(feature_words)
            if points.shape[1] != len(words.words):
                raise ValueError(f"{len(words.words)} feature words for feature rows of {points.shape[1]} columns")
            points, labels = words.of_features(points), None if labels is None else words.of_features(labels)
        if sp.issparse(points):
            points = tfidf.nonzero(points)
            fitted = sp.vstack([points[fit_rows]] + ([tfidf.nonzero(labels)] if labels is not None else []), "csr")
            model = tfidf.transformer(values=not tfidf.are_counts(fitted)).fit(fitted)
        else:
            points = list(points)
            model = tfidf.fit_texts([points[i] for i in fit_rows] + (list(labels) if labels is not None else []),
                                    min_df, char_weight)
        P, T = model.transform(points), None if labels is None else tfidf.word_block(model, model.transform(labels))
        if sp.csr_matrix(P).nnz == 0:
            raise XCConfigError("index.sources: the lexical source needs the training points' texts or BoW "
                                "features, and these points have none (no term in any of them)")
        index = cls(model, P, Y, T, neighbours, words, max_postings, power)
        if classifier is not None:
            held = None if valid is None else (index.transform(valid[0]), valid[1])
            index.classifier = index.fit_classifier(fit_rows, classifier, held, deadline, skip_after)
            index.classifier_skipped = index.classifier is None
        return index

    def fit_classifier(self, rows: np.ndarray, settings: ClassifierSettings,
                       valid: tuple[sp.csr_matrix, sp.spmatrix] | None = None,
                       deadline: float | None = None, skip_after: float | None = None) -> LexicalClassifier | None:
        """The classifiers trained on the indexed points ``rows``, each against its hard negatives: the labels its
        label-text and kNN parts (CLASSIFIER_VOTES; neighbours among ``rows``, itself left out) score highest that it
        does not carry. Held-out points (``valid``, else the indexed points outside ``rows``) pick the pass of the
        best P@1 + P@5. ``deadline``: as ``LexicalClassifier.fit``; None (no classifiers) where the hard negatives
        would end past ``skip_after``, where the first pass stops too (its ``hard_stop``)."""
        settings = settings.check()
        rows = np.asarray(rows, dtype=np.int64)
        held = np.setdiff1d(np.arange(self.num_points), rows)  # never neighbours of the fit
        plain = copy.copy(self)  # the other two parts only, with the votes of CLASSIFIER_VOTES whatever the index's
        plain.classifier, (plain.neighbours, plain.power) = None, CLASSIFIER_VOTES

        def parts(Q: sp.csr_matrix, own: np.ndarray | None, Y: sp.csr_matrix | None = None,
                  stop_at: float | None = None) -> sp.csr_matrix | None:
            """The other parts' scores of ``Q`` by blocks, or with ``Y``, each block's hard negatives; None once
            the blocks' projected end is past ``stop_at`` (:func:`ends_past`)."""
            out, started = [], time.perf_counter()
            for s, e in self.query_blocks(Q, 4096):
                S = plain.scores(Q[s:e], held, None if own is None else own[s:e])
                out.append(S if Y is None else hard_negatives(S, Y[s:e], settings.hard_negatives))
                if e < Q.shape[0] and ends_past(stop_at, started, e, Q.shape[0]):
                    return None
            return sp.vstack(out, format="csr") if out else sp.csr_matrix((0, self.num_labels), dtype=np.float32)

        Y, Q = self.point_labels[rows], self.points[rows]
        if solves_exactly(settings, len(rows), self.num_labels):  # every point against every label: none sampled
            hard = sp.csr_matrix(Y.shape, dtype=np.float32)
        elif (hard := parts(Q, rows, Y, skip_after)) is None:  # would outlast the budget: no classifier part
            return None
        Qv, Yv = valid if valid is not None else (self.points[held], self.point_labels[held])
        judge = None
        if Qv.shape[0]:
            Qv, Yv, Sv = sp.csr_matrix(Qv, dtype=np.float32), sp.csr_matrix(Yv, dtype=np.float32), parts(Qv, None)
            Yv.sum_duplicates()

            def judge(model: LexicalClassifier) -> float:
                top, _ = sparse_topk(Sv + model.on_pattern(Qv, Sv), 5)
                hits = sparse_lookup(Yv, top) > 0
                return float(hits[:, 0].mean() + hits.mean())

        return LexicalClassifier.fit(Q, Y, hard, settings, judge, deadline, skip_after)

    def transform(self, inputs: Sequence[str] | sp.spmatrix) -> sp.csr_matrix:
        """The L2-normalised TF-IDF rows (float32 CSR) of raw texts (an index fitted on texts, or on feature rows
        with their feature words) or of BoW feature rows (one fitted on the shipped features)."""
        if self.input == "text":
            if sp.issparse(inputs):
                raise XCError("this lexical index was fitted on texts; give it texts, not feature rows")
            rows = list(inputs)
        elif not sp.issparse(inputs):
            if self.words is None:
                raise XCConfigError("index.sources: this lexical index was fitted on the dataset's shipped BoW "
                                    "features, which raw text cannot be mapped to without the dataset's feature "
                                    "words (X_vocab.txt / vocab.txt); leave lexical out of index.sources to serve "
                                    "text")
            rows = self.words.of_texts(inputs)
        elif inputs.shape[1] != self.num_features:
            raise XCError(f"feature rows of {inputs.shape[1]} columns, the lexical index reads {self.num_features}")
        else:
            rows = tfidf.nonzero(inputs) if self.words is None else self.words.of_features(inputs)
        if (rows.shape[0] if sp.issparse(rows) else len(rows)) == 0:  # sklearn refuses zero rows
            return sp.csr_matrix((0, self.points.shape[1]), dtype=np.float32)
        return sp.csr_matrix(self.model.transform(rows), dtype=np.float32)

    def nearest(self, queries: sp.csr_matrix, drop: np.ndarray | None = None,
                own: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """The K nearest indexed points of each query by TF-IDF cosine: (rows, similarities), -1 / 0 padded.
        ``drop``: (points,) bool, points never returned; ``own[i]``: a point never returned for query i (-1: none).
        Dense postings: the positive cosines of one dense product, ranked as the sparse product's."""
        if self._points_dense is not None:
            # torch's GEMM, not numpy's: OpenBLAS's threads spin after a product, stalling the torch work around it
            D = (torch.from_numpy(sp.csr_matrix(queries, dtype=np.float32).toarray())
                 @ torch.from_numpy(self._points_dense)).numpy()
            if drop is not None:
                D[:, drop] = 0.0
            if own is not None and (mine := np.flatnonzero(np.asarray(own) >= 0)).size:
                D[mine, np.asarray(own)[mine]] = 0.0
            return dense_topk(D, self.neighbours)
        S = sp.csr_matrix(queries @ self._points_t)
        if drop is not None or own is not None:
            bad = np.zeros(S.nnz, dtype=bool) if drop is None else drop[S.indices]
            if own is not None:
                bad |= S.indices == np.repeat(np.asarray(own), np.diff(S.indptr))
            S.data[bad] = 0.0
            S.eliminate_zeros()
        # common terms: rows of similar length; a product stores each (query, point) once
        return sparse_topk(S, self.neighbours, packed_share=DENSE_TOPK_SHARE, unique=True)

    def query_work(self, queries: sp.csr_matrix) -> np.ndarray:
        """Per query (a row of :meth:`transform`), its products with the points and the labels: the sum of its
        terms' postings, what bounds the memory of a block of :meth:`scores`."""
        return row_postings(queries, self._work) + (0 if self._points_dense is None else self.num_points)

    def query_blocks(self, queries: sp.csr_matrix, step: int) -> list[tuple[int, int]]:
        """Row ranges of at most ``step`` queries whose products (and so score entries) total at most
        PRODUCT_BUDGET: a caller's blocks sized by its queries' postings, not by the worst case of ``block_rows``."""
        return work_blocks(self.query_work(queries), PRODUCT_BUDGET, step)

    def scores(self, queries: sp.spmatrix, excluded: np.ndarray | None = None,
               own: np.ndarray | None = None) -> sp.csr_matrix:
        """Every nonzero lexical score: (queries, L) float32 CSR with sorted indices.

        ``queries``: rows of :meth:`transform`; ``excluded``: indexed points never used as neighbours (the
        validation points when the fusion is fitted on them); ``own[i]``: a point never used as query i's
        neighbour, or -1 (the query itself when it is an indexed point)."""
        Q = sp.csr_matrix(queries, dtype=np.float32)
        drop = None
        if excluded is not None and len(excluded):
            drop = np.zeros(self.num_points, dtype=bool)
            drop[np.asarray(excluded, dtype=np.int64)] = True
        work = self.query_work(Q)
        # scipy's sparse products release the GIL: the blocks run on the process's threads, each with 1 / threads
        # of the budget, so the products held at once stay within PRODUCT_BUDGET; at most block_rows rows each (a
        # block of 64 rows with capped postings scores 1.6x faster than one of 512: its product stays in cache)
        threads = max(1, min(torch.get_num_threads(), Q.shape[0]))
        blocks = work_blocks(work, max(PRODUCT_BUDGET // threads, 1), min(self.block_rows, -(-Q.shape[0] // threads)))

        prior = None if self.classifier is None else self.classifier.prior(PRIOR_LABELS)  # decisions.md#lexical-prior

        def block(se: tuple[int, int]) -> sp.csr_matrix:
            q = Q[se[0]:se[1]]
            nbrs, sims = self.nearest(q, drop, None if own is None else np.asarray(own[se[0]:se[1]]))
            ok = nbrs >= 0
            rows = np.repeat(np.arange(q.shape[0]), nbrs.shape[1])[ok.ravel()]
            votes = sp.csr_matrix((vote_weights(sims[ok], self.power), (rows, nbrs[ok])),
                                  shape=(q.shape[0], self.num_points))
            part = (votes @ self.point_labels) * np.float32(1.0 / self.neighbours)
            part = part if self._labels_t is None else sp.csr_matrix(part + q @ self._labels_t)
            return part if prior is None else part + np.float32(self.classifier.settings.weight) * \
                self.classifier.on_pattern(q, self.classifier.candidates(q, part, prior, self.max_postings))

        parts = on_threads(block, blocks, threads)
        out = sp.csr_matrix(sp.vstack(parts, format="csr") if parts else (0, self.num_labels), dtype=np.float32)
        out.sum_duplicates()
        return out

    def save(self, folder: str | Path) -> None:
        """Write the index's files into ``folder`` (``lexical.json`` last)."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        config = {"format": FORMAT, "input": self.input, "neighbours": self.neighbours,
                  "num_features": self.num_features, "label_text": self.labels is not None,
                  "feature_words": self.words is not None, "max_postings": self.max_postings, "power": self.power}
        if self.input == "text":
            vocab = self.model.vocabulary_
            save_json(folder / VOCABULARY_FILE, sorted(vocab, key=vocab.get))
            config.update(tfidf.text_settings(self.model))
        if self.words is not None:
            save_json(folder / FEATURE_WORDS_FILE, self.words.words)
        if self.model.use_idf:
            np.save(folder / IDF_FILE, np.asarray(self.model.idf_, dtype=np.float64), allow_pickle=False)
        else:
            config["values"] = True  # real-valued features: L2-normalised only (``tfidf.transformer``)
        sp.save_npz(folder / POINTS_FILE, self.points)
        sp.save_npz(folder / POINT_LABELS_FILE, self.point_labels)
        if self.labels is not None:
            sp.save_npz(folder / LABELS_FILE, self.labels)
        if self.classifier is not None:
            config["classifier"] = self.classifier.save(folder)
        save_json(folder / CONFIG_FILE, config)

    @classmethod
    def load(cls, folder: str | Path) -> LexicalIndex:
        """The index :meth:`save` wrote (JSON, .npy, .npz; no pickle)."""
        folder = Path(folder)
        config = read_config(folder)
        if config["input"] == "text":
            model = tfidf.load_text_model(config, load_json(folder / VOCABULARY_FILE))
        else:
            model = tfidf.transformer(values=bool(config.get("values")))
        if model.use_idf:
            model.idf_ = np.load(folder / IDF_FILE, allow_pickle=False)
        else:
            model.n_features_in_ = int(config["num_features"])  # nothing else is fitted: marks it so for sklearn
        labels = sp.load_npz(folder / LABELS_FILE) if config.get("label_text") else None
        words = load_json(folder / FEATURE_WORDS_FILE) if config.get("feature_words") else None
        classifier = LexicalClassifier.load(folder, config["classifier"]) if config.get("classifier") else None
        return cls(model, sp.load_npz(folder / POINTS_FILE), sp.load_npz(folder / POINT_LABELS_FILE), labels,
                   int(config["neighbours"]), words, int(config.get("max_postings", 0)),
                   float(config.get("power", 1.0)), classifier)  # power: 1 in indexes written before the setting


def read_config(folder: str | Path) -> dict[str, Any]:
    """The ``lexical.json`` of a saved index (its input kind, K, settings), checked."""
    path = Path(folder) / CONFIG_FILE
    if not path.is_file():
        raise XCError(f"{folder}: no {CONFIG_FILE}; not a lexical index written by LexicalIndex.save")
    config = load_json(path)
    if config.get("format") != FORMAT or config.get("input") not in INPUTS:
        raise XCError(f"{path}: format {config.get('format')!r} / input {config.get('input')!r}, this code reads "
                      f"format {FORMAT} with input one of {', '.join(INPUTS)}")
    return config
