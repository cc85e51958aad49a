"""The lexical source's classifiers: one sparse logistic regression per label over the TF-IDF rows.

The third part of the lexical score (``xc_dagster.retrieval.lexical``), in (0, 1): sigmoid(w_l . q + b_l) for each
label the other two parts propose, where what the linear peers (Omikuji, napkinXC, Parabel) win with lives: a
one-vs-all linear model on the sparse features (DiSMEC, Babbar & Schoelkopf, WSDM 2017), made O(N log L):

* **sparse weights**: label l's weights live only on the terms of its training positives (the support of its
  TF-IDF centroid Y^T X), at most ``max_terms`` of them (the largest centroid weights: PPDSparse / Parabel-style
  pruning), so the model holds at most min(nnz(Y^T X), L x max_terms) weights whatever the vocabulary;
* **sampled negatives**: each point trains against its positives, its ``hard_negatives`` hardest lexical
  negatives (the labels the label-text and kNN parts score highest that it does not carry: Slice's shortlisted
  negatives, Jain et al., WSDM 2019) and ``random_negatives`` labels drawn uniformly per epoch, which calibrate the
  biases (with the hard ones alone a label's bias only meets the points that vote for it: 28 P@1 on Delicious
  against 66 with both; docs/decisions.md#lexical-classifier).

The weights are one flat vector over the (label, term) keys l * V + t, sorted, so that a (point, label) pair's
logit is a ``searchsorted`` lookup of the point's terms (torch, vectorised over a batch of pairs); the model is
trained by Adagrad, with sparse gradients from SPARSE_FROM weights (a step then costs what its batch reads, not the
model's size), on mini-batches of pairs with an L2 penalty on the weights a batch reads, ``epochs`` passes over
at most ``max_pairs`` pairs in all (fewer epochs, or a seeded sample of the points, beyond it). A model of few
(label, term) cells (a small vocabulary: the BoW sets; DENSE_UP_TO, DENSE_READS, DENSE_SCORING_LABELS) trains and
scores as a dense (labels, terms) table zero off the keys instead, the same function and steps: a batch's logits are
one sparse x dense product, where lookups cost searchsorted steps per (pair, term) (Mediamill's 120 dense features:
~55 s a pass by lookups).

By default (``index.lexical_classifier_solver`` auto) the classifiers are instead liblinear's squared-hinge SVMs
(``xc_dagster.retrieval.lexical_exact``): solved on every pair where every (fit point, label) pair is cheap to
visit, else on the same sampled pairs as here (up to SAMPLED_LABELS labels); this trainer serves beyond.

:class:`LexicalClassifier` owns its files (``classifier_*.npy`` and the settings in the lexical index's JSON).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import scipy.sparse as sp
import torch

from xc_dagster.config.bounds import is_finite_number
from xc_dagster.errors import XCConfigError, XCError
from xc_dagster.retrieval.lexical_exact import SOLVERS, fit_exact, solver_for
from xc_dagster.retrieval.lexical_tables import (
    DenseTable,
    KeyTable,
    csr_tensors,
    scores_dense,
    trains_dense,
    weights_by_term,
)
from xc_dagster.retrieval.sparse_rows import row_postings, sparse_topk, topped_up, work_blocks

KEYS_FILE = "classifier_keys.npy"
WEIGHTS_FILE = "classifier_weights.npy"
BIAS_FILE = "classifier_bias.npy"
LOOKUP_BUDGET = 1 << 22  # (pair, term) lookups held at once when scoring: 4M x ~24 bytes
OWN_LABELS = 10  # per query: its labels of largest w_l . q + b_l, scored too (lexical-classifier-candidates)
OWN_FIRST = 1e6  # their pattern value: above the other parts' scores (each in [0, 1], summed), so kept first


@dataclass(frozen=True)
class ClassifierSettings:
    """``index.lexical_classifier_*``: how the classifiers are trained (module docstring)."""

    epochs: float = 10.0
    hard_negatives: int = 50
    random_negatives: int = 100
    max_terms: int = 1024
    max_pairs: int = 50_000_000
    candidates: int = 200
    lr: float = 0.3
    l2: float = 1e-3
    batch_pairs: int = 4096
    seed: int = 0
    solver: str = "auto"  # lexical_exact.SOLVERS: liblinear (every pair where cheap, else sampled pairs), else sgd
    c: float = 0.25  # the exact solver's SVM cost
    weight: float = 1.0  # g: the classifiers' scores count g times in the lexical score (lexical_weight chooses it)

    def check(self) -> ClassifierSettings:
        for name in ("hard_negatives", "random_negatives", "max_terms", "max_pairs", "candidates", "batch_pairs"):
            v = getattr(self, name)
            least = 0 if name.endswith("negatives") else 1
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < least:
                raise XCConfigError(f"index.lexical_classifier_{name}: expected an int >= {least}, got {v!r}")
        if self.solver not in SOLVERS:
            raise XCConfigError(f"index.lexical_classifier_solver: expected one of {list(SOLVERS)}, "
                                f"got {self.solver!r}")
        for name, field in (("epochs", "epochs"), ("lr", "lr"), ("l2", "l2"), ("c", "c"), ("weight", "weights")):
            v = getattr(self, name)
            if not is_finite_number(v) or v < 0 or (v == 0 and name != "l2"):
                raise XCConfigError(f"index.lexical_classifier_{field}: expected a number "
                                    f"{'>= 0' if name == 'l2' else '> 0'}, got {v!r}")
        return self


def pruned_support(X: sp.csr_matrix, Y: sp.csr_matrix, max_terms: int) -> np.ndarray:
    """The sorted keys l * V + t of each label's weights: the terms t of its positives' TF-IDF centroid, at most
    ``max_terms`` of the largest (ties: smaller term)."""
    C = sp.csr_matrix(Y.T @ X, dtype=np.float32)
    C.sum_duplicates()
    lengths = np.diff(C.indptr)
    rows = np.repeat(np.arange(C.shape[0], dtype=np.int64), lengths)
    if lengths.max(initial=0) > max_terms:  # keep each row's max_terms largest: one sort by (row, -weight, term)
        order = np.lexsort((C.indices, -C.data, rows))
        rank = np.arange(C.nnz) - np.repeat(C.indptr[:-1], lengths)
        keep = order[rank < max_terms]
        rows, cols = rows[keep], C.indices[keep]
    else:
        cols = C.indices
    return np.sort(rows * np.int64(X.shape[1]) + cols.astype(np.int64))


class LexicalClassifier:
    """Sparse per-label logistic regressions over TF-IDF rows (module docstring): ``keys`` (sorted l * V + t),
    their ``weights`` and one ``bias`` per label."""

    def __init__(self, keys: np.ndarray, weights: np.ndarray, bias: np.ndarray, num_terms: int,
                 settings: ClassifierSettings | None = None):
        self.keys = torch.from_numpy(np.ascontiguousarray(keys, dtype=np.int64))
        self.weights = torch.from_numpy(np.ascontiguousarray(weights, dtype=np.float32))
        self.bias = torch.from_numpy(np.ascontiguousarray(bias, dtype=np.float32))
        self.num_terms, self.settings = int(num_terms), settings or ClassifierSettings()
        self.history: list[float] = []  # the held-out value after each training pass (fit's ``judge``)
        self.stopped_at_deadline = False  # fit's ``deadline`` cut the training short
        self._prior: np.ndarray | None = None  # labels by decreasing bias (:meth:`prior`), once asked for
        self._by_term: tuple[int, sp.csr_matrix] | None = None  # (cap, the weights by term): :meth:`top_labels`
        self._by_term_lock = threading.Lock()
        self.solver = "sgd"  # how fit trained it: "liblinear" / "liblinear_sampled" (lexical_exact) or "sgd"
        if self.keys.shape != self.weights.shape or self.keys.ndim != 1:
            raise ValueError(f"{tuple(self.keys.shape)} keys for {tuple(self.weights.shape)} weights")
        if len(self.keys) and (int(self.keys[-1]) >= self.num_labels * self.num_terms or int(self.keys[0]) < 0):
            raise ValueError(f"keys outside {self.num_labels} labels x {self.num_terms} terms")

    @property
    def num_labels(self) -> int:
        return int(self.bias.shape[0])

    def _lookup(self, X: tuple[torch.Tensor, torch.Tensor, torch.Tensor], rows: torch.Tensor,
                labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Each pair (rows[i], labels[i])'s terms found among the keys: (pair, weight position, term value)."""
        indptr, indices, data = X
        count = indptr[rows + 1] - indptr[rows]
        pair = torch.repeat_interleave(torch.arange(len(rows)), count)
        entry = torch.arange(int(count.sum())) + torch.repeat_interleave(indptr[rows] - (torch.cumsum(count, 0)
                                                                                         - count), count)
        key = labels[pair] * self.num_terms + indices[entry]
        at = torch.searchsorted(self.keys, key).clamp_(max=max(len(self.keys) - 1, 0))
        hit = self.keys[at] == key if len(self.keys) else torch.zeros(len(key), dtype=torch.bool)
        return pair[hit], at[hit], data[entry[hit]]

    def _logits(self, found: tuple[torch.Tensor, torch.Tensor, torch.Tensor], labels: torch.Tensor,
                weights: torch.Tensor, bias: torch.Tensor, sparse: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(w_l . x_r + b_l of each pair, the weights read), from the terms :meth:`_lookup` found. ``weights`` and
        ``bias``: (keys, 1) and (labels, 1) tables, gathered as embeddings (``sparse``: with sparse gradients, so
        that a training step costs what the batch reads, not the model's size)."""
        pair, at, values = found
        w = torch.nn.functional.embedding(at, weights, sparse=sparse)[:, 0]
        b = torch.nn.functional.embedding(labels, bias, sparse=sparse)[:, 0]
        return torch.zeros(len(labels), dtype=weights.dtype).index_add(0, pair, w * values) + b, w

    def prior(self, k: int) -> np.ndarray:
        """The ``k`` labels of largest bias (ties to the smaller id): the top of a query sharing no term with them.
        Sorted once (a trained model's biases do not change), not per scored block or served request."""
        if self._prior is None:
            self._prior = np.argsort(-self.bias.numpy(), kind="stable")
        return self._prior[:k]

    def top_labels(self, Q: sp.csr_matrix, k: int, max_postings: int = 0) -> np.ndarray:
        """(queries, k) int64, -1 padded: each query's ``k`` labels of largest w_l . q + b_l among those whose
        weights meet one of its terms (a label no term meets scores b_l: :meth:`prior`'s), by a sparse product with
        the weights held by term, in row blocks of at most LOOKUP_BUDGET products; ``max_postings`` P > 0 (the
        lexical index's, at scale): each term keeps its P largest weights, a query costing at most its terms x P."""
        Q = sp.csr_matrix(Q, dtype=np.float32)
        with self._by_term_lock:  # built once, not by each thread scoring a block at first (LexicalIndex.scores)
            if self._by_term is None or self._by_term[0] != max_postings:
                self._by_term = (max_postings, weights_by_term(self, max_postings))
        by_term = self._by_term[1]
        out, bias = np.full((Q.shape[0], k), -1, dtype=np.int64), self.bias.numpy()
        work = row_postings(Q, np.diff(by_term.indptr))
        for s, e in work_blocks(work, LOOKUP_BUDGET, max(Q.shape[0], 1)) if k > 0 else []:
            S = sp.csr_matrix(Q[s:e] @ by_term)
            S.data += bias[S.indices]
            out[s:e] = sparse_topk(S, k, unique=True)[0]
        return out

    def candidates(self, Q: sp.csr_matrix, S: sp.csr_matrix, prior: np.ndarray,
                   max_postings: int = 0) -> sp.csr_matrix:
        """What :meth:`on_pattern` scores for the other parts' scores ``S``: their labels, ``prior``'s where a row
        stores fewer (docs/decisions.md#lexical-prior), and each query's own OWN_LABELS (:meth:`top_labels`; a
        label no other part proposes, where the kNN votes miss what the weights read), these kept first where a
        row stores more than ``candidates`` (their pattern value over any score of the other parts)."""
        P, n = topped_up(S, prior), Q.shape[0]
        own = self.top_labels(Q, OWN_LABELS, max_postings)
        ok = own >= 0
        rows = np.repeat(np.arange(n), own.shape[1])[ok.ravel()]
        first = sp.csr_matrix((np.full(rows.size, OWN_FIRST, dtype=np.float32), (rows, own[ok])), shape=S.shape)
        return sp.csr_matrix(P + first)

    def pair_scores(self, Q: sp.csr_matrix, rows: np.ndarray, labels: np.ndarray) -> np.ndarray:
        """sigmoid(w_l . q + b_l) (float32) of each pair (``rows[i]`` of ``Q``, ``labels[i]``), in chunks of at
        most LOOKUP_BUDGET term lookups."""
        Q = sp.csr_matrix(Q, dtype=np.float32)
        if Q.shape[1] != self.num_terms:
            raise XCError(f"TF-IDF rows of {Q.shape[1]} terms, the lexical classifiers read {self.num_terms}")
        rows, labels = np.asarray(rows, dtype=np.int64), np.asarray(labels, dtype=np.int64)
        if scores_dense(self):
            return self._dense_pair_scores(Q, rows, labels)
        X = csr_tensors(Q)
        work = np.cumsum(np.diff(Q.indptr)[rows] + 1)
        ends = np.unique(np.append(np.searchsorted(work, np.arange(LOOKUP_BUDGET, work[-1], LOOKUP_BUDGET),
                                                   side="right"), len(rows))) if len(rows) else []
        out = np.empty(len(rows), dtype=np.float32)
        with torch.no_grad():
            for s, e in zip(np.concatenate([[0], ends[:-1]]).astype(np.int64), ends):
                r, lab = torch.from_numpy(rows[s:e]), torch.from_numpy(labels[s:e])
                out[s:e] = torch.sigmoid(self._logits(self._lookup(X, r, lab), lab, self.weights[:, None],
                                                       self.bias[:, None])[0]).numpy()
        return out

    def _dense_pair_scores(self, Q: sp.csr_matrix, rows: np.ndarray, labels: np.ndarray) -> np.ndarray:
        """:meth:`pair_scores` through the dense table: the queries' logits for every label, by blocks of at most
        LOOKUP_BUDGET (query, label) cells, each pair's read off its block."""
        W = DenseTable.of(self).numpy()
        queries, at = np.unique(rows, return_inverse=True)
        order = np.argsort(at, kind="stable")
        step = max(1, LOOKUP_BUDGET // max(self.num_labels, 1))
        bounds = np.searchsorted(at[order], np.arange(0, len(queries) + step, step))
        out, bias = np.empty(len(rows), dtype=np.float32), self.bias.numpy()
        for b, (s, e) in enumerate(zip(bounds[:-1], bounds[1:])):
            pick = order[s:e]
            Z = np.asarray(Q[queries[b * step:(b + 1) * step]] @ W.T)
            logits = Z[at[pick] - b * step, labels[pick]] + bias[labels[pick]]
            out[pick] = 1.0 / (1.0 + np.exp(-logits))
        return out

    def on_pattern(self, Q: sp.csr_matrix, S: sp.csr_matrix) -> sp.csr_matrix:
        """The classifiers' scores of the (query, label) entries ``S`` stores, or of each row's ``candidates``
        highest-scored ones where it stores more (the others get none): a query costs at most ``candidates`` x its
        terms lookups however many labels share a term with it."""
        S = sp.csr_matrix(S)
        c = self.settings.candidates
        if S.shape[0] and np.diff(S.indptr).max() > c:
            rows, cols = _top_entries(S, c)
            return sp.csr_matrix((self.pair_scores(Q, rows, cols), (rows, cols)), shape=S.shape)
        rows = np.repeat(np.arange(S.shape[0]), np.diff(S.indptr))
        return sp.csr_matrix((self.pair_scores(Q, rows, S.indices), S.indices.copy(), S.indptr.copy()),
                             shape=S.shape)

    @classmethod
    def fit(cls, X: sp.csr_matrix, Y: sp.csr_matrix, hard: sp.csr_matrix, settings: ClassifierSettings,
            judge: Callable[[LexicalClassifier], float] | None = None,
            deadline: float | None = None, hard_stop: float | None = None) -> LexicalClassifier:
        """Train on the TF-IDF rows ``X`` (n, V) with their labels ``Y`` (n, L, binary): each point against its
        positives, its hard negatives (the stored entries of its row of ``hard``, n x L: :func:`hard_negatives`)
        and ``random_negatives`` uniform labels per epoch (module docstring). ``judge``: the model's value on
        held-out points, called after each pass: the best pass's weights are kept (None: the last pass's).
        ``deadline``: a ``time.perf_counter()`` value past which training stops, after one pass at least (the
        training budget's: ``xc_dagster.training.budget.stage_deadline``); the cut pass is judged as the others.
        ``hard_stop``: past it the first pass stops too, after a batch."""
        settings = settings.check()
        X, Y = sp.csr_matrix(X, dtype=np.float32), sp.csr_matrix(Y, dtype=np.float32, copy=True)
        n, num_labels = Y.shape
        if X.shape[0] != n or hard.shape != Y.shape:
            raise ValueError(f"{X.shape[0]} TF-IDF rows, labels {Y.shape}, hard negatives {hard.shape}")
        Y.eliminate_zeros()  # before the binarising, which would make a stored 0 a positive
        Y.data[:] = 1.0
        keys = pruned_support(X, Y, settings.max_terms)
        model = cls(keys, np.zeros(len(keys), np.float32), np.zeros(num_labels, np.float32), X.shape[1], settings)
        solver = solver_for(settings, n, num_labels)
        if solver != "sgd":
            fit_exact(model, X, Y, judge, hard_stop if hard_stop is not None else deadline,
                      None if solver == "liblinear" else sp.csr_matrix(hard))
            return model
        _train(model, X, Y, sp.csr_matrix(hard), np.random.default_rng(settings.seed), judge, deadline, hard_stop)
        return model

    def save(self, folder: str | Path) -> dict[str, Any]:
        """Write the weights into ``folder``; the settings and sizes to keep in the index's JSON."""
        folder = Path(folder)
        np.save(folder / KEYS_FILE, self.keys.numpy(), allow_pickle=False)
        np.save(folder / WEIGHTS_FILE, self.weights.numpy(), allow_pickle=False)
        np.save(folder / BIAS_FILE, self.bias.numpy(), allow_pickle=False)
        return {"num_terms": self.num_terms, "settings": asdict(self.settings)}

    @classmethod
    def load(cls, folder: str | Path, config: dict[str, Any]) -> LexicalClassifier:
        folder = Path(folder)
        return cls(np.load(folder / KEYS_FILE, allow_pickle=False), np.load(folder / WEIGHTS_FILE, allow_pickle=False),
                   np.load(folder / BIAS_FILE, allow_pickle=False), int(config["num_terms"]),
                   ClassifierSettings(**config.get("settings", {})))


PROJECT_AFTER = 0.1  # share of the work done before its rate projects its end: first blocks run slower


def ends_past(deadline: float | None, started: float, done: int, total: int) -> bool:
    """Whether work of ``total`` units, ``done`` of them in the seconds since ``started`` (``time.perf_counter()``),
    ends past ``deadline`` at its rate so far; never without a deadline or before PROJECT_AFTER of it is done (the
    131K shape's hard negatives: the first block's rate projected 245 s, the whole took ~120)."""
    if deadline is None or done <= 0 or done < PROJECT_AFTER * total:
        return False
    now = time.perf_counter()
    return now + (now - started) * (total - done) / done > deadline


def hard_negatives(candidates: sp.csr_matrix, Y: sp.csr_matrix, m: int) -> sp.csr_matrix:
    """Each row's ``m`` highest-scored ``candidates`` (n, L; ties: smaller label) that are not among its labels
    ``Y``, as a binary CSR (n, L)."""
    C = sp.csr_matrix(candidates, dtype=np.float32, copy=True)
    C.sum_duplicates()
    C = C - C.multiply(sp.csr_matrix(Y) != 0)  # positives out
    C.eliminate_zeros()
    C.data[C.data < 0] = 0  # (scores are >= 0; a negative one would vanish below)
    C.eliminate_zeros()
    if m == 0 or C.nnz == 0:
        return sp.csr_matrix(Y.shape, dtype=np.float32)
    rows, cols = _top_entries(C, m)
    return sp.csr_matrix((np.ones(len(rows), np.float32), (rows, cols)), shape=C.shape)


def _top_entries(S: sp.csr_matrix, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(rows, columns) of each row's ``k`` largest stored entries of ``S`` (ties: smaller column)."""
    ids, _ = sparse_topk(S, k)
    ok = ids >= 0
    return np.repeat(np.arange(S.shape[0]), k)[ok.ravel()], ids[ok]


def _batch_pairs(points: np.ndarray, Y: sp.csr_matrix, hard: sp.csr_matrix, random: int, num_labels: int,
                 rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(rows, labels, targets) of ``points``: their positives (1), hard negatives and random negatives (0; a
    random draw that hits a positive is dropped)."""
    Yp, Hp = Y[points], hard[points]
    pr, pc = np.repeat(points, np.diff(Yp.indptr)), Yp.indices
    hr, hc = np.repeat(points, np.diff(Hp.indptr)), Hp.indices
    rr = np.repeat(points, random)
    rc = rng.integers(0, num_labels, len(rr))
    if len(rr):
        ok = np.asarray(Y[rr, rc]).ravel() == 0
        rr, rc = rr[ok], rc[ok]
    rows = np.concatenate([pr, hr, rr]).astype(np.int64)
    labels = np.concatenate([pc, hc, rc]).astype(np.int64)
    targets = np.concatenate([np.ones(len(pr), np.float32), np.zeros(len(hr) + len(rr), np.float32)])
    return rows, labels, targets


def _train(model: LexicalClassifier, X: sp.csr_matrix, Y: sp.csr_matrix, hard: sp.csr_matrix,
           rng: np.random.Generator, judge: Callable[[LexicalClassifier], float] | None,
           deadline: float | None = None, hard_stop: float | None = None) -> None:
    """Adagrad on the logistic loss of mini-batches of ``batch_pairs`` pairs (a batch = whole points, shuffled
    each epoch), ``epochs`` passes capped at ``max_pairs`` pairs: beyond the cap, a seeded sample of the points.
    ``judge``: after each pass, the model's value on held-out points; the best pass is kept (the first of ties).
    Past ``deadline`` (``time.perf_counter()``), after the first pass, the pass in progress is the last; past
    ``hard_stop``, after a batch, the first pass too."""
    s = model.settings
    n = X.shape[0]
    per_point = (Y.nnz + hard.nnz) / max(n, 1) + s.random_negatives
    total = min(s.epochs * n, s.max_pairs / max(per_point, 1e-9))  # point visits
    points_per_batch = max(1, int(s.batch_pairs / max(per_point, 1e-9)))
    table = DenseTable(model, X) if trains_dense(model, X, s.batch_pairs) else KeyTable(model, X)
    bias = model.bias[:, None].clone().requires_grad_(True)  # (labels, 1): an embedding table
    opt = torch.optim.Adagrad([table.weights, bias], lr=s.lr)  # takes sparse gradients too
    seen, best = 0, (-math.inf, model.weights, model.bias)
    while seen < total and n:
        order = rng.permutation(n)[:int(min(n, math.ceil(total - seen)))]
        trained = 0
        for start in range(0, len(order), points_per_batch):
            limits = [t for t, on in ((deadline, model.history), (hard_stop, trained)) if t is not None and on]
            if limits and time.perf_counter() > min(limits):
                model.stopped_at_deadline = True
                break
            points = order[start:start + points_per_batch]
            rows, labels, targets = _batch_pairs(points, Y, hard, s.random_negatives, model.num_labels, rng)
            logits, squares = table.logits(points, rows, labels, bias)
            loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, torch.from_numpy(targets),
                                                                        reduction="sum")
            # L2 on the weights the batch reads, once per reading
            loss = (loss + 0.5 * s.l2 * squares) / max(len(rows), 1)
            opt.zero_grad()
            loss.backward()
            with torch.sparse.check_sparse_tensor_invariants(enable=False):  # torch's own coalesced gradients
                opt.step()
            trained += 1
        if not trained:  # stopped before this pass's first batch: nothing new to judge
            break
        seen += len(order)
        model.weights, model.bias = table.values(), bias.detach()[:, 0].clone()
        value = judge(model) if judge is not None else 0.0
        model.history.append(round(float(value), 6))
        if judge is None or value > best[0]:
            best = (value, model.weights, model.bias)
        if model.stopped_at_deadline:
            break
    model.weights, model.bias = best[1], best[2]
