"""Unit costs of this machine for the run planner (``xc_dagster.planning``), measured in seconds and cached.

Each unit is measured by running the code the stages run on a small generated sample: ``exact_topk`` on random
unit vectors of the encoder's width, a faiss HNSW build and search (only when a plan has an HNSW index), the
configured encoder's inference and a few timed steps of the pretraining and classifier trainers
(``xc_dagster.training.budget.calibrate``), the tokenizer, the ingest parser, the lexical index and the fusion's
grid search on texts of the generated 131K shape (``xc_dagster.data.synthetic``). A unit is keyed by the
settings it depends on and cached per machine (torch version, threads, CPU, exact search precision) in
``$XC_HOME/cache/plan_calibration.json``; a later plan reuses it, ``recalibrate`` measures again.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import platform
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import scipy.sparse as sp
import torch

from xc_dagster.config import PipelineConfig
from xc_dagster.data import read_dataset, save_dataset
from xc_dagster.data.synthetic import generate, shape_spec
from xc_dagster.device import amp_dtype
from xc_dagster.encoders.encode import encode_tokens
from xc_dagster.encoders.loading import load_encoder
from xc_dagster.encoders.tokenizer import load_tokenizer, tokenize_texts
from xc_dagster.faiss_module import faiss
from xc_dagster.retrieval.ann import exact_topk
from xc_dagster.retrieval.exact_settings import exact_dtype
from xc_dagster.retrieval.fusion import fit_fusion
from xc_dagster.retrieval.lexical import LexicalIndex
from xc_dagster.retrieval.shortlist import Shortlist, build_sources, retrieve, topk_from_scores
from xc_dagster.storage import save_json
from xc_dagster.training.budget import calibrate
from xc_dagster.training.classifier import ClassifierTrainer
from xc_dagster.training.end_to_end import EndToEndTrainer
from xc_dagster.training.memory import EncoderShape
from xc_dagster.training.siamese import SiameseTrainer

CACHE_FILE = "plan_calibration.json"
SAMPLE_SCALE = 0.05  # of the generated 131K shape: 14,740 train / 6,742 test points, 6,554 labels
EXACT_QUERIES, EXACT_KEYS = 2048, 32_768
HNSW_VECTORS, HNSW_QUERIES = 10_000, 1000
ENCODE_TEXTS = 1024
CLASSIFIER_POINTS, CLASSIFIER_LABELS = 8192, 16_384
# a classifier step's cost grows with the distinct rows of W it touches, which grow with L until the batch's
# candidates bound them (bench/SCALE.md: 24.7K rows at 32K labels, 34.2K at 65K): its calibration takes the
# shape's L, rounded up to a power of two, up to this many labels (the encoder-training trainers: CLASSIFIER_LABELS)
CLASSIFIER_MAX_LABELS = 65_536


def classifier_labels(n_labels: int, train_encoder: bool) -> int:
    """The labels a classifier calibration runs with for a dataset of ``n_labels``."""
    cap = CLASSIFIER_LABELS if train_encoder else CLASSIFIER_MAX_LABELS
    return min(max(1024, 1 << max(int(n_labels) - 1, 1).bit_length()), cap)
FUSION_POINTS, FUSION_WIDTH = 2000, 400
LEXICAL_QUERIES = 2000
TRAINER_REPS = 2  # calibrations of a trainer's steps, the least kept
LENGTH_PERCENTILES = 101  # the 0th..100th: a 1% tail of texts cut at max_len sets most batches' padding


def machine_key(device: torch.device) -> str:
    """What the unit costs depend on besides the settings: torch, its threads, the CPU or GPU, exact search's
    scoring dtype (``XC_EXACT_PRECISION``)."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else ""
    return (f"torch {torch.__version__}, {torch.get_num_threads()} threads, {cpu}{', ' + gpu if gpu else ''}, "
            f"exact {exact_dtype(device) or 'fp32'}")


class UnitCosts:
    """The unit costs of one machine, read from and written to the cache file ``path``; ``measured`` lists the
    units this object measured (not found in the cache)."""

    def __init__(self, path: Path, device: torch.device, recalibrate: bool = False):
        self.path, self.device = Path(path), device
        self.machine = machine_key(device)
        self.measured: list[str] = []
        cache = _read(self.path)
        self.units: dict[str, dict[str, float]] = {} if recalibrate else dict(cache.get(self.machine, {}))
        self._sample: dict[str, Any] | None = None
        if recalibrate:
            self._save()

    def get(self, name: str, settings: dict[str, Any], measure: Callable[[], dict[str, float]]) -> dict[str, float]:
        """The unit ``name`` at ``settings``: cached, or measured now by ``measure`` and cached."""
        key = f"{name} {json.dumps(settings, sort_keys=True)}"
        if key not in self.units:
            self.units[key] = {k: float(v) for k, v in measure().items()}
            self.measured.append(key)
            self._save()
        return self.units[key]

    def _save(self) -> None:
        cache = _read(self.path)
        cache[self.machine] = self.units
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
        save_json(tmp, cache)
        tmp.replace(self.path)  # whole or not at all

    def sample(self) -> dict[str, Any]:
        """The generated calibration sample (LF folder, texts, label matrix), made once per object."""
        if self._sample is None:
            self._sample = _generated_sample()
        return self._sample


def _read(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _generated_sample() -> dict[str, Any]:
    """A small dataset of the generated 131K shape, written and parsed as ingest parses it (timed)."""
    spec = shape_spec("131k", SAMPLE_SCALE)
    with tempfile.TemporaryDirectory(prefix="xc-plan-") as tmp:
        folder = Path(tmp) / "src"
        generate(spec, folder)
        t0 = time.perf_counter()
        ds = read_dataset(folder, layout="auto", text_fields=("title",), label_text_fields=("title",))
        save_dataset(ds, Path(tmp) / "out")
        ingest_s = time.perf_counter() - t0
    texts = ds.num_train + ds.num_test + ds.num_labels
    return {"ds": ds, "ingest_s_per_text": ingest_s / texts}


def best_seconds(fn: Callable[[], Any], reps: int = 3) -> float:
    """The least wall seconds of ``reps`` calls of ``fn`` after one untimed call: the machine's speed when
    other work leaves it alone (the least is the least disturbed)."""
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def unit_vectors(rng: np.random.Generator, n: int, dim: int, rank: int = 16) -> np.ndarray:
    """Unit vectors spread like trained embeddings: a ``rank``-dimensional signal plus noise, so that a query's
    best keys stand out (isotropic random vectors in D dimensions all score near 0, the bf16 pass of exact
    search then cannot certify its top k and searches again in fp32, which trained embeddings rarely need)."""
    basis = np.random.default_rng(1).standard_normal((rank, dim))
    x = (rng.standard_normal((n, rank)) @ basis + 0.5 * rng.standard_normal((n, dim))).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def _steps(make_trainer: Callable[[Any], Any], encoder: Any, steps: int) -> float:
    """The least seconds per step of ``TRAINER_REPS`` calibrations (``xc_dagster.training.budget.calibrate``)."""
    return min(calibrate(make_trainer, encoder, steps)[0] for _ in range(TRAINER_REPS))


def exact_unit(dim: int, k: int, device: torch.device) -> dict[str, float]:
    """``exact_topk`` seconds per (query x key) at width ``dim`` and top ``k`` (bf16 where it pays: its pass and
    fp32 re-rank, without the second search of uncertain queries, which trained embeddings rarely need but
    random vectors, whose scores crowd together, mostly would). In the precision of a search too large to skip
    the probes (``exact_dtype``), whatever this sample's size."""
    rng = np.random.default_rng(0)
    q, keys = unit_vectors(rng, EXACT_QUERIES, dim), unit_vectors(rng, EXACT_KEYS, dim)
    cache: dict = {}
    low = {torch.bfloat16: "bf16", torch.int8: "int8"}.get(exact_dtype(device), "fp32")
    sec = best_seconds(lambda: exact_topk(q, keys, k, device=device, cache=cache, certify=False, precision=low),
                       reps=4)
    return {"pair_s": sec / (EXACT_QUERIES * EXACT_KEYS)}


def hnsw_unit(dim: int, m: int, ef_construction: int, ef_search: int, k: int) -> dict[str, float]:
    """faiss HNSW (inner product) build seconds per vector and search seconds per query on ``HNSW_VECTORS``
    vectors, both divided by ln(n): the graph's depth, how they grow with n."""
    rng = np.random.default_rng(0)
    x, q = unit_vectors(rng, HNSW_VECTORS, dim), unit_vectors(rng, HNSW_QUERIES, dim)
    idx = faiss.IndexHNSWFlat(dim, m, faiss.METRIC_INNER_PRODUCT)
    idx.hnsw.efConstruction = ef_construction
    t0 = time.perf_counter()
    idx.add(x)
    build = time.perf_counter() - t0
    idx.hnsw.efSearch = max(ef_search, k)
    search = best_seconds(lambda: idx.search(q, k), reps=1)
    log_n = math.log(HNSW_VECTORS)
    return {"build_s_per_vector_log": build / HNSW_VECTORS / log_n,
            "search_s_per_query_log": search / HNSW_QUERIES / log_n}


def length_percentiles(lens: np.ndarray, max_len: int) -> tuple[int, ...]:
    """The 0th..100th percentiles of a split's token lengths (at most ``max_len``): the distribution a
    calibration draws its texts' lengths from (``synthetic_tokens``)."""
    lens = np.minimum(np.asarray(lens, dtype=np.float64), max_len)
    return tuple(int(v) for v in np.rint(np.percentile(lens, np.arange(LENGTH_PERCENTILES)))) if len(lens) else ()


def synthetic_tokens(rng: np.random.Generator, n: int, mean_len: float, max_len: int, vocab: int,
                     percentiles: tuple[int, ...] = ()) -> tuple[np.ndarray, np.ndarray]:
    """Token ids (n, max_len) and lengths (1..max_len): what the trainers and the encoder read, without a
    tokenizer. Lengths follow the dataset's ``percentiles`` (``length_percentiles``) when known, else a normal
    around ``mean_len``. A batch pads to its longest rows, so a long tail (a few texts cut at max_len) costs
    far more than its mean says."""
    if len(percentiles) > 1:  # inverse CDF: uniform draws through the percentiles
        draws = np.interp(rng.random(n), np.linspace(0.0, 1.0, len(percentiles)), np.asarray(percentiles, float))
    else:
        draws = rng.normal(mean_len, mean_len / 3, n)
    lens = np.clip(np.rint(draws), 1, max_len).astype(np.int32)
    ids = rng.integers(1000, max(vocab, 1001), (n, max_len)).astype(np.int32)
    ids[np.arange(max_len)[None, :] >= lens[:, None]] = 0
    return ids, lens


def random_targets(rng: np.random.Generator, n: int, labels: int, per_point: float) -> sp.csr_matrix:
    """A label matrix with about ``per_point`` labels per row (at least one), Zipf-like label frequencies."""
    counts = np.maximum(1, rng.poisson(max(per_point - 1, 0), n) + 1)
    cols = np.minimum((rng.pareto(1.0, counts.sum()) * labels / 50).astype(np.int64), labels - 1)
    rows = np.repeat(np.arange(n), counts)
    Y = sp.csr_matrix((np.ones(len(rows), np.float32), (rows, cols)), shape=(n, labels))
    Y.data[:] = 1.0
    return Y


def vocab_size(encoder: torch.nn.Module) -> int:
    """Token ids the encoder takes: the bag encoder's table rows, a transformer's vocabulary."""
    if hasattr(encoder, "vocab_size"):
        return int(encoder.vocab_size)
    return int(encoder.transformer.config.vocab_size)


def encoder_units(cfg: PipelineConfig, mean_len: float, label_len: float, per_point: float,
                  device: torch.device, point_percentiles: tuple[int, ...] = (),
                  label_percentiles: tuple[int, ...] = ()) -> dict[str, float]:
    """The configured encoder's width and inference texts/s, and the pretraining trainer's seconds per step
    (``calibrate``: one warm-up step, then ``train.calibration_steps`` timed) at the configured batch, on texts
    whose lengths follow the dataset's percentiles when known (``synthetic_tokens``)."""
    p, t = cfg.pretrain, cfg.tokenize
    encoder = load_encoder(t.encoder, p.pooling).to(device)
    dtype = amp_dtype(device, p.amp)
    vocab = vocab_size(encoder)
    rng = np.random.default_rng(0)
    label_max = t.label_max_len or t.max_len
    pt = synthetic_tokens(rng, ENCODE_TEXTS, mean_len, t.max_len, vocab, point_percentiles)
    enc_s = best_seconds(lambda: encode_tokens(encoder, *pt, device, dtype, p.encode_batch_size))
    out = {"dim": float(encoder.dim), "encode_texts_per_s": ENCODE_TEXTS / enc_s, "pretrain_step_s": 0.0,
           **{f"shape_{k}": float(v) for k, v in dataclasses.asdict(EncoderShape.of(encoder)).items()}}
    if p.epochs > 0:
        n = max(4 * p.batch_size, 1024)
        pt, lt = synthetic_tokens(rng, n, mean_len, t.max_len, vocab, point_percentiles), \
            synthetic_tokens(rng, n, label_len, label_max, vocab, label_percentiles)
        Y = random_targets(rng, n, n, per_point)
        one = dataclasses.replace(p, epochs=1.0, seed_bank=False)
        out["pretrain_step_s"] = _steps(lambda enc: SiameseTrainer(enc, pt, lt, Y, np.arange(n), one, device, dtype),
                                        encoder, cfg.train.calibration_steps)  # in train mode (calibrate)
    return out


def classifier_unit(cfg: PipelineConfig, dim: int, k: int, per_point: float, mean_len: float,
                    device: torch.device, labels: int = CLASSIFIER_LABELS) -> dict[str, float]:
    """Seconds per step of the configured classifier trainer (hardest negatives, or BCE over sampled negatives
    with the encoder when ``classifier.train_encoder``) on random unit embeddings of ``labels`` labels and a random
    shortlist."""
    p = dataclasses.replace(cfg.classifier, epochs=1.0)
    rng = np.random.default_rng(0)
    n, L = CLASSIFIER_POINTS, labels
    X, E = unit_vectors(rng, n, dim), unit_vectors(rng, L, dim)
    Y = random_targets(rng, n, L, per_point)
    sl = rng.integers(0, L, (n, k)).astype(np.int32)
    lw = np.ones(L, dtype=np.float32) if p.propensity_weight else None
    if p.negatives in ("shortlist", "in-batch", "both"):
        def make(_enc: Any) -> Any:
            return ClassifierTrainer(X, E, Y, sl, np.arange(n), p, device, label_weight=lw, label_point_emb=E)
        return {"step_s": _steps(make, None, cfg.train.calibration_steps)}
    kw: dict[str, Any] = {}
    if p.train_encoder:
        encoder = load_encoder(cfg.tokenize.encoder, cfg.pretrain.pooling).to(device)
        t, vocab = cfg.tokenize, vocab_size(encoder)
        kw = {"point_tokens": synthetic_tokens(rng, n, mean_len, t.max_len, vocab),
              "label_tokens": synthetic_tokens(rng, L, mean_len, t.label_max_len or t.max_len, vocab),
              "dtype": amp_dtype(device, cfg.pretrain.amp)}
    else:
        encoder = None
    return {"step_s": _steps(lambda enc: EndToEndTrainer(X, E, E.copy(), Y, np.arange(n), p, device,
                                                         **{**kw, "encoder": enc}, shortlist=sl, label_weight=lw),
                             encoder, cfg.train.calibration_steps)}


def text_units(costs: UnitCosts, cfg: PipelineConfig) -> dict[str, float]:
    """Ingest seconds per text, tokenizer texts/s, the lexical index's fit seconds per text and scoring seconds
    per query, on the generated sample's titles."""
    s = costs.sample()
    ds = s["ds"]
    tok = load_tokenizer(cfg.tokenize.encoder)
    texts = list(ds.train_texts)
    tok_s = best_seconds(lambda: tokenize_texts(tok, texts[:4096], cfg.tokenize.max_len))
    p = cfg.index
    t0 = time.perf_counter()
    lex = LexicalIndex.fit(texts, list(ds.label_texts), ds.Y_train, p.lexical_neighbours, p.lexical_min_df,
                           max_postings=p.lexical_max_postings if len(texts) > p.lexical_exact_points else 0,
                           char_weight=p.lexical_char_weight)
    fit_s = time.perf_counter() - t0
    queries = list(ds.test_texts)[:LEXICAL_QUERIES]
    score_s = best_seconds(lambda: lex.scores(lex.transform(queries)), reps=2)
    return {"ingest_s_per_text": s["ingest_s_per_text"], "tokenize_texts_per_s": 4096 / tok_s,
            "lexical_fit_s_per_text": fit_s / (len(texts) + ds.num_labels),
            "lexical_query_s": score_s / len(queries), "lexical_points": float(len(texts))}


def fusion_unit(cfg: PipelineConfig, knn: bool, lexical: bool) -> dict[str, float]:
    """The fusion's grid search seconds per (grid point x validation point x shortlist entry): the configured
    ``fusion.*`` on a random shortlist, the grids not extended."""
    rng = np.random.default_rng(0)
    n, w, L = FUSION_POINTS, FUSION_WIDTH, 50_000
    ids = np.stack([rng.choice(L, w, replace=False) for _ in range(n)]).astype(np.int64)
    sl = Shortlist(ids, rng.random((n, w), dtype=np.float32), rng.random((n, w), dtype=np.float32),
                   rng.random((n, w), dtype=np.float32) if knn else None,
                   rng.random((n, w), dtype=np.float32) if lexical else None, None,
                   rng.integers(1, 100, (n, w)).astype(np.float32) if knn else None)
    Y = sp.csr_matrix((np.ones(n * 2, np.float32), (np.repeat(np.arange(n), 2), ids[:, :2].ravel())), shape=(n, L))
    # the whole grid: seconds per evaluation, whatever fusion.search (grid_points counts the search's evaluations)
    p = dataclasses.replace(cfg.fusion, search="grid", knn_grid_extend=0, lexical_grid_extend=0,
                            cooccurrence_grid_extend=0, propensity_grid_extend=0,
                            tree_max_samples=min(cfg.fusion.tree_max_samples or n * w, n * w))
    inv = 1.0 + rng.random(L)
    t0 = time.perf_counter()
    fit_fusion(sl, Y, p, inv, None)
    sec = time.perf_counter() - t0
    rank = best_seconds(lambda: topk_from_scores(ids, sl.emb, 100))
    grid = grid_points(dataclasses.replace(cfg, fusion=p), knn, lexical)
    return {"s_per_entry": sec / (grid * n * w), "rank_s_per_entry": rank / (n * w)}


def retrieve_unit(dim: int, k: int, pair_s: float) -> dict[str, float]:
    """``retrieve``'s own seconds per (query x shortlist entry): merging two sources' candidates and scoring each
    with W and the label representation, less the exact searches' share (``pair_s`` per query x key)."""
    rng = np.random.default_rng(0)
    n, L = 4096, max(2 * k, 2048)
    W, E, q = unit_vectors(rng, L, dim), unit_vectors(rng, L, dim), unit_vectors(rng, n, dim)
    src = build_sources(("W", "label"), W, E, None, None, None, "text", "exact", 32, 200, 200)
    sec = best_seconds(lambda: retrieve(q, src, k), reps=2)
    return {"s_per_entry": max(sec - 2 * n * L * pair_s, 0.0) / (n * 2 * k)}


COORDINATE_ROUNDS_PLANNED = 2  # fusion.search=coordinate: a round that moves the weights, one that finds none to move


def grid_points(cfg: PipelineConfig, knn: bool, lexical: bool) -> int:
    """The fusion's objective evaluations before any extension (``xc_dagster.retrieval.fusion.alpha.fit_alpha``):
    alpha values x kNN weights x lexical weights x co-occurrence weights x kNN discounts x propensity weights on the
    whole grid (``fusion.search=grid``), alpha values x their sum per round of the coordinate search, two rounds planned
    (each weight value once per round: an over-count, as a round's held point repeats); 1 for the tree."""
    f = cfg.fusion
    if f.method != "alpha":
        return 1
    alphas = len(np.arange(0.0, 1.0 + 1e-9, f.grid_step))
    cs = len(set(f.knn_grid)) if knn else 1
    ds = len(set(f.lexical_grid) | {0.0}) if lexical else 1
    es = len(set(f.cooccurrence_grid) | {0.0}) if "cooccurrence" in cfg.index.sources else 1
    fs = len(set(f.knn_discount_grid) | {0.0}) if knn else 1
    bs = len(set(f.propensity_grid) | {0.0})
    if f.search == "grid":
        return alphas * cs * ds * es * fs * bs
    return alphas * (cs + ds + es + (fs if fs > 1 else 0) + bs) * COORDINATE_ROUNDS_PLANNED  # f off: no sweep
