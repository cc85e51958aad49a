"""The work of every stage on a dataset's shape, counted from the stages' code and configuration, times this
machine's unit costs (``xc_dagster.planning.calibration``): each stage's predicted wall seconds, by part, and
its peak memory from the arrays it holds and the encoder training step's predicted peak
(``xc_dagster.training.memory.plan_step_memory``). The training stages here; the index, fusion and evaluation
in ``xc_dagster.planning.inference``."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from xc_dagster.config import PipelineConfig
from xc_dagster.data.companions import lexical_alone
from xc_dagster.device import amp_dtype
from xc_dagster.errors import XCConfigError
from xc_dagster.planning.calibration import (
    UnitCosts,
    classifier_labels,
    classifier_unit,
    encoder_units,
    exact_unit,
    fusion_unit,
    hnsw_unit,
    retrieve_unit,
    text_units,
)
from xc_dagster.retrieval.exact_settings import exact_block_entries, exact_dtype, resolve_kind
from xc_dagster.retrieval.shortlist import STREAM_ROWS
from xc_dagster.sampling.negatives import SAMPLERS
from xc_dagster.training.budget import reserve_seconds
from xc_dagster.training.memory import EncoderShape, plan_step_memory, step_loss_bytes

F32 = 4
HNSW_LOG_MODEL_UP_TO = 1 << 19  # HNSW graphs measured within ~1.5x of the ln n model up to here (bench/SCALE.md)
# above, memory-bound: measured / (ln n model) at 1.3M and 2.25M vectors, 2-core Xeon (bench/SCALE.md)
MEMORY_BOUND_BUILD, MEMORY_BOUND_SEARCH = 6.2, 3.1
HNSW_AT_A_MILLION = "hnsw-at-a-million-vectors-measured-against-the-plan"
TEXT_BYTES, TEXT_BYTES_PER_TOKEN = 60, 5  # a Python str of a title: header + characters
LEXICAL_BYTES_PER_TOKEN = 2 * 12  # TF-IDF entries (word 1-2 grams) per token, index and value (float32, int64)


@dataclass(frozen=True)
class Shape:
    """What the plan scales with: points, labels, labels per point, mean tokens per text, validation points."""

    n_train: int
    n_test: int
    n_labels: int
    labels_per_point: float
    tokens: float  # mean tokens per point text
    label_tokens: float  # mean tokens per label text
    n_valid: int
    token_percentiles: tuple[int, ...] = ()  # 0th..100th percentiles of the point texts' token lengths; () unknown
    label_token_percentiles: tuple[int, ...] = ()  # the same of the label texts' (both: the tokenize stage's)
    label_names: bool = True  # the labels have names (Y.txt): the ingest summary's; placeholders train no label points
    point_texts: bool = True  # some training point has text (the ingest summary's train_texts): else no pretraining
    point_features: bool = False  # the layout shipped BoW features (the ingest summary's n_features)

    def lexical_alone(self, cfg: PipelineConfig) -> bool:
        """As the pipeline's StageContext.lexical_only: the model is the lexical source alone, W not trained."""
        return lexical_alone(self.point_texts, self.point_features, cfg.index.sources,
                             "index.sources" in cfg.explicit)

    @property
    def rows(self) -> int:
        """Training points the models train on (validation points held out)."""
        return self.n_train - self.n_valid


@dataclass
class StagePlan:
    """One stage's prediction: seconds by part, bytes by array, the index kinds built, notes."""

    name: str
    parts: dict[str, float] = field(default_factory=dict)
    memory: dict[str, float] = field(default_factory=dict)
    kinds: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @property
    def seconds(self) -> float:
        return float(sum(self.parts.values()))

    @property
    def peak_bytes(self) -> float:
        return float(sum(self.memory.values()))

    @property
    def dominant(self) -> str:
        return max(self.parts, key=self.parts.get) if self.parts else ""


class Costs:
    """The unit costs a plan needs, measured on first use (cached by ``UnitCosts``)."""

    def __init__(self, units: UnitCosts, cfg: PipelineConfig, shape: Shape):
        self.u, self.cfg, self.shape, self.device = units, cfg, shape, units.device
        t = cfg.tokenize
        settings = {"encoder": t.encoder, "max_len": t.max_len, "label_max_len": t.label_max_len,
                    "tokens": round(shape.tokens, 1), "label_tokens": round(shape.label_tokens, 1),
                    "lengths": [list(shape.token_percentiles), list(shape.label_token_percentiles)],
                    "pretrain": _fields(cfg.pretrain, "batch_size", "sampler", "loss", "amp", "pooling", "chunk_size",
                                        "grad_cache", "encode_batch_size", "freeze_layers", "label_points",
                                        "symmetric", "centroid_points", "epochs")}
        self.encoder = units.get("encoder", settings, lambda: encoder_units(
            cfg, shape.tokens, shape.label_tokens, shape.labels_per_point, self.device, shape.token_percentiles,
            shape.label_token_percentiles))
        self.dim = int(self.encoder["dim"])

    def exact_pair_s(self, k: int) -> float:
        return self.u.get("exact_topk", {"dim": self.dim, "k": k},
                          lambda: exact_unit(self.dim, k, self.device))["pair_s"]

    def hnsw(self, m: int, efc: int, efs: int, k: int) -> dict[str, float]:
        return self.u.get("hnsw", {"dim": self.dim, "m": m, "efc": efc, "efs": efs, "k": k},
                          lambda: hnsw_unit(self.dim, m, efc, efs, k))

    def retrieve_entry_s(self, k: int) -> float:
        return self.u.get("retrieve", {"dim": self.dim, "k": k},
                          lambda: retrieve_unit(self.dim, k, self.exact_pair_s(k)))["s_per_entry"]

    def text(self) -> dict[str, float]:
        i = self.cfg.index
        return self.u.get("texts", {"encoder": self.cfg.tokenize.encoder, "max_len": self.cfg.tokenize.max_len,
                                    **_fields(i, "lexical_neighbours", "lexical_min_df", "lexical_char_weight",
                                              "lexical_max_postings", "lexical_exact_points")},
                          lambda: text_units(self.u, self.cfg))

    def classifier_step_s(self) -> float:
        c = self.cfg.classifier
        labels = classifier_labels(self.shape.n_labels, c.train_encoder)
        settings = {"dim": self.dim, "k": self.cfg.mining.shortlist_size, "encoder": self.cfg.tokenize.encoder,
                    "labels": labels,
                    "classifier": _fields(c, "batch_size", "negatives", "num_positives", "num_negatives", "loss",
                                          "w_optimizer", "train_encoder", "num_hard", "num_random", "sampler_index",
                                          "propensity_weight", "cluster_size", "chunk_size")}
        return self.u.get("classifier", settings, lambda: classifier_unit(
            self.cfg, self.dim, self.cfg.mining.shortlist_size, self.shape.labels_per_point, self.shape.tokens,
            self.device, labels))["step_s"]

    def fusion(self, knn: bool, lexical: bool) -> dict[str, float]:
        f = self.cfg.fusion
        settings = {"knn": knn, "lexical": lexical, **_fields(f, "method", "objective", "grid_step", "knn_grid",
                                                               "lexical_grid", "propensity_grid", "smoothing",
                                                               "tree_depth", "tree_max_samples")}
        return self.u.get("fusion", settings, lambda: fusion_unit(self.cfg, knn, lexical))

    def encode_s(self, texts: float, labels: float = 0.0) -> float:
        """Seconds to encode ``texts`` point texts and ``labels`` label texts, a label at its mean tokens over a
        point's (the pipeline's estimate counts them by padded tokens: ``budget.encoding_seconds``)."""
        t, s = self.cfg.tokenize, self.shape
        ratio = min(s.label_tokens, t.label_max_len or t.max_len) / max(min(s.tokens, t.max_len), 1.0)
        return (texts + labels * ratio) / self.encoder["encode_texts_per_s"]


def _fields(params: Any, *names: str) -> dict[str, Any]:
    return {n: (list(v) if isinstance(v, tuple) else v) for n in names for v in [getattr(params, n)]}


def index_work(c: Costs, plan: StagePlan, name: str, kind: str, keys: int, queries: int, k: int,
               hnsw: tuple[int, int, int], build: bool = True) -> None:
    """An index over ``keys`` vectors of kind ``kind`` (``auto`` as ``resolve_kind``): its build (HNSW: per vector x
    ln n) and ``queries`` top-``k`` searches (exact: queries x keys pairs; HNSW: per query x ln n), with its memory."""
    plan.kinds[name] = kind = resolve_kind(kind, keys, c.dim)
    if kind == "exact":
        # the float32 keys, plus their bf16/int8 copy where the exact search scores in one
        plan.memory[f"{name} index"] = keys * c.dim * (F32 + getattr(exact_dtype(c.device), "itemsize", 0))
        if queries:
            plan.parts[f"{name} search (exact, {queries:,} x {keys:,})"] = queries * keys * c.exact_pair_s(k)
            plan.memory.setdefault("exact search block", exact_block_entries(c.device) * F32)
        return
    if kind == "ivf":
        plan.notes.append(f"{name}: an ivf index is planned as an exact scan of the keys (an upper bound)")
        index_work(c, plan, name, "exact", keys, queries, k, hnsw, build)
        plan.kinds[name] = "ivf"
        return
    u, log_n = c.hnsw(*hnsw, k), math.log(max(keys, 2))
    build_x, search_x = (MEMORY_BOUND_BUILD, MEMORY_BOUND_SEARCH) if keys > HNSW_LOG_MODEL_UP_TO else (1.0, 1.0)
    if keys > HNSW_LOG_MODEL_UP_TO:
        plan.notes.append(f"{name}: HNSW over {keys:,} vectors is memory-bound: ln n scaling x{build_x} (build) / "
                          f"x{search_x} (search), measured on a 2-core Xeon (bench/SCALE.md#{HNSW_AT_A_MILLION})")
    if build:
        plan.parts[f"{name} build (hnsw, {keys:,})"] = keys * log_n * u["build_s_per_vector_log"] * build_x
    if queries:
        plan.parts[f"{name} search (hnsw, {queries:,})"] = queries * log_n * u["search_s_per_query_log"] * search_x
    plan.memory[f"{name} index"] = keys * (c.dim * F32 + 2 * hnsw[0] * F32 * 1.1)


def shortlist_memory(plan: StagePlan, queries: int, width: int, dim: int, scores: int) -> None:
    """A block of retrieved shortlists (ids and ``scores`` score arrays) and a block's gathered label rows."""
    rows = min(queries, STREAM_ROWS)
    plan.memory["shortlists of a block"] = rows * width * (8 + F32 * scores)
    plan.memory["candidate rows of a block"] = min(queries, 1024) * width * dim * F32 * 2


def stage_ingest(c: Costs, s: Shape) -> StagePlan:
    texts = s.n_train + s.n_test + s.n_labels
    plan = StagePlan("ingest", {f"parse and write {texts:,} texts": texts * c.text()["ingest_s_per_text"]})
    plan.memory["texts"] = texts * (TEXT_BYTES + TEXT_BYTES_PER_TOKEN * s.tokens)
    plan.memory["label matrices"] = (s.n_train + s.n_test) * s.labels_per_point * 12
    return plan


def stage_tokenize(c: Costs, s: Shape) -> StagePlan:
    texts = s.n_train + s.n_test + s.n_labels
    plan = StagePlan("tokenize", {f"tokenizer, {texts:,} texts": texts / c.text()["tokenize_texts_per_s"]})
    plan.memory["texts"] = texts * (TEXT_BYTES + TEXT_BYTES_PER_TOKEN * s.tokens)
    return plan


def pretrain_steps(cfg: PipelineConfig, s: Shape, step_s: float, encode_s: float) -> tuple[float, int, str]:
    """(epochs, steps, note): the configured epochs, or those ``train.budget_minutes`` plans from the step time
    (``xc_dagster.training.budget.plan_epochs``); an epoch is the sampler's batches."""
    p, b = cfg.pretrain, cfg.train
    if not s.point_texts:  # as the pretrain stage does (StageContext.points_have_text)
        return 0.0, 0, "no training point has text: the encoder is not trained"
    # the pretrain stage's label points: ngame's default leaves placeholder label names out (label_points_named)
    label_points = p.label_points and (s.label_names or "pretrain.label_points" in cfg.explicit)
    examples = s.n_labels if p.sampler == "siamesexml" else s.rows + (s.n_labels if label_points else 0)
    spe = math.ceil(examples / p.batch_size)
    epochs, note = p.epochs, ""
    if b.budget_minutes > 0 and "pretrain.epochs" not in cfg.explicit and p.epochs > 0 and step_s > 0:
        budget = 60.0 * b.budget_minutes
        left = budget - encode_s - reserve_seconds(b.reserve, budget, encode_s)
        epochs = math.floor(max(0.0, left) / (step_s * spe) * 100) / 100
        if b.max_epochs > 0:
            epochs = min(epochs, b.max_epochs)
        note = f"pretrain.epochs {epochs} planned from train.budget_minutes={b.budget_minutes}"
    return epochs, (max(1, math.ceil(epochs * spe)) if epochs > 0 else 0), note


def stage_pretrain(c: Costs, cfg: PipelineConfig, s: Shape, available: int | None) -> StagePlan:
    p, e = cfg.pretrain, c.encoder
    points = s.n_train if s.point_texts else 1  # points without text: one input, once
    texts, encode = points + s.n_labels, c.encode_s(points, s.n_labels)
    epochs, steps, note = pretrain_steps(cfg, s, e["pretrain_step_s"], encode)
    plan = StagePlan("pretrain", notes=[note] if note else [])
    if steps:
        plan.parts[f"{steps:,} training steps ({epochs} epochs x batch {p.batch_size})"] = steps * e["pretrain_step_s"]
    plan.parts[f"encode {texts:,} texts"] = encode
    shape = EncoderShape(*(int(e[f"shape_{k}"]) for k in ("hidden", "layers", "heads", "intermediate", "trainable")))
    plan.memory["encoder weights"] = shape.trainable * F32
    if steps:
        plan.memory["training step"] = step_memory(cfg, s, shape, available, plan, c.device)
    plan.memory["embeddings (points, labels)"] = (s.n_train + s.n_labels) * c.dim * F32
    plan.memory["token ids"] = (s.n_train + s.n_labels) * cfg.tokenize.max_len * F32
    if p.sampler == "ngame":
        plan.memory["memory bank"] = s.rows * c.dim * F32
    return plan


def step_memory(cfg: PipelineConfig, s: Shape, shape: EncoderShape, available: int | None, plan: StagePlan,
                device: torch.device) -> float:
    """The pretraining step's predicted peak (``plan_step_memory``, as ``pretrain_memory_plan`` asks it); a step
    that fits no chunk is noted and counted whole."""
    p, t = cfg.pretrain, cfg.tokenize
    B = min(p.batch_size, s.n_labels if p.sampler == "siamesexml" else s.rows)
    n_points = B * (1 + p.centroid_points) if p.sampler == "siamesexml" else B
    groups = [(n_points, t.max_len, min(s.tokens, t.max_len)),
              (B, t.label_max_len or t.max_len, min(s.label_tokens, t.label_max_len or t.max_len))]
    loss = step_loss_bytes(n_points + B, B * B * (2 if p.sampler == "siamesexml" else 1), shape.hidden)
    dtype = amp_dtype(device, p.amp)
    try:
        m = plan_step_memory(shape, groups, dtype, p.grad_cache, p.chunk_size, available,
                             {"pretrain.batch_size": p.batch_size}, loss, "pretrain.grad_cache")
    except XCConfigError as exc:
        plan.notes.append(f"training step does not fit: {exc}")
        return float(plan_step_memory(shape, groups, dtype, "on", p.chunk_size, None, {}, loss).plain_bytes)
    if m.grad_cache:
        plan.notes.append(f"grad caching on, chunk {m.chunk_size}")
    return float(m.predicted_bytes)


def stage_mining(c: Costs, cfg: PipelineConfig, s: Shape) -> StagePlan:
    m, plan = cfg.mining, StagePlan("mining")
    k = min(m.shortlist_size, s.n_labels)
    keys = {"label": s.n_labels, "centroid": s.n_labels, "knn": s.rows}
    alone = s.lexical_alone(cfg)  # one exact search, its shortlist every point's (the mining stage)
    queries = 1 if alone else s.n_train
    for name in m.sources:
        index_work(c, plan, name, "exact" if alone else m.index, keys[name], queries, k + (name == "knn"),
                   (m.hnsw_m, m.hnsw_ef_construction, m.hnsw_ef_search))
    width = k * len(m.sources)
    plan.parts["merge and score the shortlists"] = queries * width * c.retrieve_entry_s(k)
    shortlist_memory(plan, s.n_train, width, c.dim, 3)
    plan.memory["embeddings (points, labels, centroids)"] = (s.n_train + 2 * s.n_labels) * c.dim * F32
    plan.memory["shortlist (ids, scores)"] = s.n_train * k * 8
    return plan


def stage_classifier(c: Costs, cfg: PipelineConfig, s: Shape, spent: float) -> StagePlan:
    p, b = cfg.classifier, cfg.train
    if s.lexical_alone(cfg):  # as the classifier stage: nothing to learn on one input
        return StagePlan("classifier", notes=["no training point has text: W is not trained (the lexical source "
                                              "alone scores labels)"],
                         memory={"W": s.n_labels * c.dim * F32})
    sampled = p.negatives in SAMPLERS
    examples = s.rows + (s.n_labels if p.label_points else 0)
    spe = math.ceil(examples / p.batch_size)
    steps = math.ceil(p.epochs * spe) if sampled else int(p.epochs) * spe
    plan, train_s = StagePlan("classifier"), steps * c.classifier_step_s()
    if b.budget_minutes > 0 and "classifier.epochs" not in cfg.explicit and p.epochs > 0:
        budget = 60.0 * b.budget_minutes  # the index and fusion keep a third of the pretraining's reserve
        planned = "pretrain.epochs" not in cfg.explicit and cfg.pretrain.epochs > 0
        encode = c.encode_s(s.n_train, s.n_labels) if planned else 0.0
        left = max(0.0, budget - reserve_seconds(b.reserve, budget, encode) / 3 - spent)
        if train_s > left:
            plan.notes.append(f"classifier training cut at the budget's deadline ({left:.0f} s left of "
                              f"train.budget_minutes={b.budget_minutes})")
            train_s = left
    plan.parts[f"{steps:,} training steps ({p.epochs} epochs x batch {p.batch_size})"] = train_s
    if sampled and p.negatives in ("astra", "mips"):
        refreshes = math.ceil(p.epochs / max(p.refresh_every, 1e-9))
        plan.notes.append(f"{refreshes} refreshes of the sampler's {p.sampler_index} index over W "
                          f"({'background' if p.refresh_async and p.negatives == 'astra' else 'in line'}) "
                          "counted in the step time measured on 16,384 labels")
    if p.train_encoder or (p.train_residual and cfg.tokenize.encoder.startswith("bag")):
        plan.parts[f"encode {s.n_train + s.n_labels:,} texts"] = c.encode_s(s.n_train, s.n_labels)
    plan.memory["embeddings (points, labels)"] = (s.n_train + s.n_labels) * c.dim * F32
    plan.memory["W and its start"] = 2 * s.n_labels * c.dim * F32
    plan.memory["W's optimizer state"] = (2 if p.w_optimizer == "sparse-adam" else 0) * s.n_labels * c.dim * F32
    plan.memory["shortlist"] = s.n_train * min(cfg.mining.shortlist_size, s.n_labels) * 4
    if sampled:
        plan.memory["embedding bank"] = examples * c.dim * F32
    return plan
