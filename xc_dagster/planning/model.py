"""The work of every stage on a dataset's shape, counted from the stages' code and configuration, times this
machine's unit costs (``xc_dagster.planning.calibration``): each stage's predicted wall seconds, by part, and
its peak memory from the arrays it holds and the encoder training step's predicted peak
(``xc_dagster.training.memory.plan_step_memory``)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from xc_dagster.config import PipelineConfig
from xc_dagster.device import amp_dtype
from xc_dagster.errors import XCConfigError
from xc_dagster.planning.calibration import (
    UnitCosts,
    classifier_labels,
    classifier_unit,
    encoder_units,
    exact_unit,
    fusion_unit,
    grid_points,
    hnsw_unit,
    retrieve_unit,
    text_units,
)
from xc_dagster.retrieval.exact_settings import exact_block_entries, exact_dtype, resolve_kind
from xc_dagster.retrieval.shortlist import STREAM_ROWS
from xc_dagster.sampling.negatives import SAMPLERS
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
                    "pretrain": _fields(cfg.pretrain, "batch_size", "sampler", "loss", "amp", "pooling", "chunk_size",
                                        "grad_cache", "encode_batch_size", "freeze_layers", "label_points",
                                        "symmetric", "centroid_points", "epochs")}
        self.encoder = units.get("encoder", settings, lambda: encoder_units(
            cfg, shape.tokens, shape.label_tokens, shape.labels_per_point, self.device))
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
                                    **_fields(i, "lexical_neighbours", "lexical_min_df", "lexical_max_postings",
                                              "lexical_exact_points")}, lambda: text_units(self.u, self.cfg))

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

    def encode_s(self, texts: float) -> float:
        return texts / self.encoder["encode_texts_per_s"]


def _fields(params: Any, *names: str) -> dict[str, Any]:
    return {n: (list(v) if isinstance(v, tuple) else v) for n in names for v in [getattr(params, n)]}


def index_work(c: Costs, plan: StagePlan, name: str, kind: str, keys: int, queries: int, k: int,
               hnsw: tuple[int, int, int], build: bool = True) -> None:
    """An index over ``keys`` vectors of kind ``kind`` (``auto`` as ``resolve_kind``): its build (HNSW: per vector x
    ln n) and ``queries`` top-``k`` searches (exact: queries x keys pairs; HNSW: per query x ln n), with its memory."""
    plan.kinds[name] = kind = resolve_kind(kind, keys, c.dim)
    if kind == "exact":
        plan.memory[f"{name} index"] = keys * c.dim * (F32 + getattr(exact_dtype(c.device), "itemsize", 0))  # + bf16/int8
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
    examples = s.n_labels if p.sampler == "siamesexml" else s.rows + (s.n_labels if p.label_points else 0)
    spe = math.ceil(examples / p.batch_size)
    epochs, note = p.epochs, ""
    if b.budget_minutes > 0 and "pretrain.epochs" not in cfg.explicit and p.epochs > 0 and step_s > 0:
        budget = 60.0 * b.budget_minutes
        epochs = math.floor(max(0.0, budget - encode_s - b.reserve * budget) / (step_s * spe) * 100) / 100
        if b.max_epochs > 0:
            epochs = min(epochs, b.max_epochs)
        note = f"pretrain.epochs {epochs} planned from train.budget_minutes={b.budget_minutes}"
    return epochs, (max(1, math.ceil(epochs * spe)) if epochs > 0 else 0), note


def stage_pretrain(c: Costs, cfg: PipelineConfig, s: Shape, available: int | None) -> StagePlan:
    p, e = cfg.pretrain, c.encoder
    encode = c.encode_s(s.n_train + s.n_labels)
    epochs, steps, note = pretrain_steps(cfg, s, e["pretrain_step_s"], encode)
    plan = StagePlan("pretrain", notes=[note] if note else [])
    if steps:
        plan.parts[f"{steps:,} training steps ({epochs} epochs x batch {p.batch_size})"] = steps * e["pretrain_step_s"]
    plan.parts[f"encode {s.n_train + s.n_labels:,} texts"] = encode
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
    m = cfg.mining
    plan = StagePlan("mining")
    k = min(m.shortlist_size, s.n_labels)
    keys = {"label": s.n_labels, "centroid": s.n_labels, "knn": s.rows}
    for name in m.sources:
        index_work(c, plan, name, m.index, keys[name], s.n_train, k + (name == "knn"),
                   (m.hnsw_m, m.hnsw_ef_construction, m.hnsw_ef_search))
    width = k * len(m.sources)
    plan.parts["merge and score the shortlists"] = s.n_train * width * c.retrieve_entry_s(k)
    shortlist_memory(plan, s.n_train, width, c.dim, 3)
    plan.memory["embeddings (points, labels, centroids)"] = (s.n_train + 2 * s.n_labels) * c.dim * F32
    plan.memory["shortlist (ids, scores)"] = s.n_train * k * 8
    return plan


def stage_classifier(c: Costs, cfg: PipelineConfig, s: Shape, spent: float) -> StagePlan:
    p, b = cfg.classifier, cfg.train
    sampled = p.negatives in SAMPLERS
    examples = s.rows + (s.n_labels if p.label_points else 0)
    spe = math.ceil(examples / p.batch_size)
    steps = math.ceil(p.epochs * spe) if sampled else int(p.epochs) * spe
    plan = StagePlan("classifier")
    train_s = steps * c.classifier_step_s()
    if b.budget_minutes > 0 and "classifier.epochs" not in cfg.explicit and p.epochs > 0:
        tail = b.reserve / 3
        left = max(0.0, 60.0 * b.budget_minutes * (1 - tail) - spent)
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
        plan.parts[f"encode {s.n_train + s.n_labels:,} texts"] = c.encode_s(s.n_train + s.n_labels)
    plan.memory["embeddings (points, labels)"] = (s.n_train + s.n_labels) * c.dim * F32
    plan.memory["W and its start"] = 2 * s.n_labels * c.dim * F32
    plan.memory["W's optimizer state"] = (2 if p.w_optimizer == "sparse-adam" else 0) * s.n_labels * c.dim * F32
    plan.memory["shortlist"] = s.n_train * min(cfg.mining.shortlist_size, s.n_labels) * 4
    if sampled:
        plan.memory["embedding bank"] = examples * c.dim * F32
    return plan


def source_keys(cfg: PipelineConfig, s: Shape) -> dict[str, int]:
    """Vectors per source's index: L; the kNN index every training point with include_validation, else rows."""
    knn = s.n_train if cfg.index.include_validation and s.n_valid else s.rows
    return {"W": s.n_labels, "label": s.n_labels, "centroid": s.n_labels, "knn": knn}


def stage_index(c: Costs, cfg: PipelineConfig, s: Shape) -> StagePlan:
    """Each part is built, written and let go in turn: the peak is the largest part (an index with the copy of
    the vectors it is built from, or the lexical index with its texts), not their sum."""
    p, plan, keys, parts = cfg.index, StagePlan("index"), source_keys(cfg, s), {}
    hnsw = (p.hnsw_m, p.hnsw_ef_construction, p.hnsw_ef_search)
    held_out = "centroid" in p.sources and cfg.index.include_validation and s.n_valid
    builds = [(n, keys[n]) for n in p.sources if n != "lexical"] + [("centroid", s.n_labels)] * bool(held_out)
    for name, n in builds:
        part = StagePlan("index")
        index_work(c, part, name, p.kind, n, 0, p.shortlist_size, hnsw)
        label = name if name not in plan.kinds else f"held-out {name}"
        plan.kinds.setdefault(name, part.kinds[name])
        plan.parts.update({k.replace(name, label, 1): v for k, v in part.parts.items()})
        plan.notes += [t.replace(name, label, 1) for t in part.notes]
        parts[f"{label} index and its vectors"] = sum(part.memory.values()) + n * c.dim * F32
    if "lexical" in p.sources:
        n = keys["knn"] + s.n_labels
        plan.parts[f"lexical TF-IDF fit, {n:,} texts"] = n * c.text()["lexical_fit_s_per_text"]
        per_token = 2 * LEXICAL_BYTES_PER_TOKEN + TEXT_BYTES_PER_TOKEN
        parts["lexical index and texts"] = n * (s.tokens * per_token + TEXT_BYTES)
    if cfg.index.label_repr == "text+centroid":
        parts["label centroids"] = s.n_labels * c.dim * F32  # computed and written before the indexes
    largest = max(parts, key=parts.get, default=None)
    if largest is not None:
        plan.memory[f"{largest} (the largest part; one at a time)"] = parts[largest]
    return plan


def inference_work(c: Costs, cfg: PipelineConfig, s: Shape, plan: StagePlan, queries: int) -> int:
    """Shortlisting ``queries`` points from every ``index.sources`` source (searches, lexical scoring, merging
    and scoring the candidates), as ``retrieve`` does; returns the shortlist's width."""
    p = cfg.index
    keys = source_keys(cfg, s)
    hnsw = (p.hnsw_m, p.hnsw_ef_construction, p.hnsw_ef_search)
    for name in p.sources:
        if name != "lexical":
            index_work(c, plan, name, p.kind, keys[name], queries, p.shortlist_size, hnsw, build=False)
    if "lexical" in p.sources:
        t = c.text()
        capped = p.lexical_max_postings if keys["knn"] > p.lexical_exact_points else 0
        cal_capped = p.lexical_max_postings if t["lexical_points"] > p.lexical_exact_points else 0
        # a query's cost: its terms' postings, ~ the indexed points up to the cap
        scale = min(keys["knn"], capped or keys["knn"]) / min(t["lexical_points"], cal_capped or t["lexical_points"])
        plan.parts[f"lexical scoring, {queries:,} queries"] = queries * t["lexical_query_s"] * max(scale, 1.0)
        plan.memory["lexical index"] = 2 * (keys["knn"] + s.n_labels) * s.tokens * LEXICAL_BYTES_PER_TOKEN
    width = p.shortlist_size * len(p.sources)
    plan.parts["merge and score the shortlists"] = queries * width * c.retrieve_entry_s(p.shortlist_size)
    shortlist_memory(plan, queries, width, c.dim, 2 + ("knn" in p.sources) + ("lexical" in p.sources))
    # W and the label embeddings are scored from their indexes' copies (exact, HNSW), else read in
    apart = sum(n not in p.sources or plan.kinds.get(n) == "ivf" for n in ("W", "label"))
    apart += p.label_repr == "text+centroid"  # E(z_l) + v_l (the centroids it is made from are let go)
    plan.memory["W, label embeddings, centroids (besides the indexes)"] = apart * s.n_labels * c.dim * F32
    return width


def stage_fusion(c: Costs, cfg: PipelineConfig, s: Shape, classifier_s: float) -> StagePlan:
    plan = StagePlan("fusion")
    f, p = cfg.fusion, cfg.index
    if not s.n_valid and f.fit_on in ("auto", "cross_fit"):
        n = min(f.cross_fit_max_points, s.n_train)
        folds = f.cross_fit_folds
        plan.parts[f"{folds} fold classifiers"] = folds * classifier_s * (1 - 1 / folds)
        plan.notes.append("cross-fitting: each fold's classifier planned as the classifier stage's training")
    elif not s.n_valid:
        plan.notes.append("no validation points: a default blend, nothing fitted")
        return plan
    else:
        n = s.n_valid
    width = inference_work(c, cfg, s, plan, n)
    knn, lexical = "knn" in p.sources, "lexical" in p.sources
    grid = grid_points(cfg, knn, lexical)
    plan.parts[f"{f.method} fit, {grid:,} grid points x {n:,} points"] = grid * n * width * c.fusion(knn, lexical)[
        "s_per_entry"]
    if f.method == "alpha" and (knn or lexical or f.propensity_grid_extend):
        plan.notes.append("fusion grids extended when their largest weight wins (*_grid_extend) add to this")
    return plan


def stage_evaluate(c: Costs, cfg: PipelineConfig, s: Shape) -> StagePlan:
    plan = StagePlan("evaluate")
    plan.parts[f"encode {s.n_test:,} test texts"] = c.encode_s(s.n_test)
    width = inference_work(c, cfg, s, plan, s.n_test)
    rankings = 3 + ("lexical" in cfg.index.sources)  # fused + each ranking on its own
    fz = c.fusion("knn" in cfg.index.sources, "lexical" in cfg.index.sources)
    plan.parts[f"fuse and rank ({rankings} rankings)"] = rankings * s.n_test * width * fz["rank_s_per_entry"]
    plan.memory["test embeddings"] = s.n_test * c.dim * F32
    plan.memory["predictions"] = s.n_test * cfg.evaluate.top_k * 12
    return plan


def plan_stages(c: Costs, cfg: PipelineConfig, s: Shape, available: int | None) -> list[StagePlan]:
    """Every stage's plan, in the pipeline's order."""
    out = [stage_ingest(c, s), stage_tokenize(c, s), stage_pretrain(c, cfg, s, available), stage_mining(c, cfg, s)]
    out.append(stage_classifier(c, cfg, s, out[2].seconds + out[3].seconds))
    out += [stage_index(c, cfg, s), stage_fusion(c, cfg, s, out[4].seconds), stage_evaluate(c, cfg, s)]
    return out
