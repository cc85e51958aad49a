"""The work of the inference stages (index, fusion, evaluate) on a dataset's shape, as ``xc_dagster.planning.model``
counts the training stages': the indexes built and searched, the shortlists merged and scored, the fusion's grid
fitted per candidate of the kNN votes, the test points ranked."""

from __future__ import annotations

from xc_dagster.config import PipelineConfig
from xc_dagster.planning.calibration import grid_points
from xc_dagster.planning.model import (
    F32,
    LEXICAL_BYTES_PER_TOKEN,
    TEXT_BYTES,
    TEXT_BYTES_PER_TOKEN,
    Costs,
    Shape,
    StagePlan,
    index_work,
    shortlist_memory,
)
from xc_dagster.retrieval.cooccurrence import BLOCK_ENTRIES as COOCCURRENCE_BLOCK
from xc_dagster.retrieval.lexical_classifier import ClassifierSettings
from xc_dagster.retrieval.lexical_exact import solver_for
from xc_dagster.retrieval.votes import vote_candidates
from xc_dagster.training.budget import SKIP_SLACK


def source_keys(cfg: PipelineConfig, s: Shape) -> dict[str, int]:
    """Vectors per source's index: L; the kNN index every training point with include_validation, else rows."""
    knn = s.n_train if cfg.index.include_validation and s.n_valid else s.rows
    return {"W": s.n_labels, "label": s.n_labels, "centroid": s.n_labels, "knn": knn}


def lexical_query_s(c: Costs, cfg: PipelineConfig, s: Shape) -> float:
    """Seconds to score one query against the lexical index: the calibrated query's, scaled by the indexed points
    a query's terms' postings reach (up to ``index.lexical_max_postings`` where the index caps them)."""
    p, t, knn = cfg.index, c.text(), source_keys(cfg, s)["knn"]
    capped = p.lexical_max_postings if knn > p.lexical_exact_points else 0
    cal_capped = p.lexical_max_postings if t["lexical_points"] > p.lexical_exact_points else 0
    scale = min(knn, capped or knn) / min(t["lexical_points"], cal_capped or t["lexical_points"])
    return t["lexical_query_s"] * max(scale, 1.0)


def cross_fits(cfg: PipelineConfig, s: Shape) -> bool:
    """The fusion is cross-fitted: ``fusion.fit_on`` cross_fit, or auto without a validation split (as the fusion
    stage resolves it, ``xc_dagster.pipeline.cross_fit.fit_on``)."""
    return cfg.fusion.fit_on == "cross_fit" or (cfg.fusion.fit_on == "auto" and not s.n_valid)


def stage_index(c: Costs, cfg: PipelineConfig, s: Shape) -> StagePlan:
    """Each part is built, written and let go in turn: the peak is the largest part (an index with the copy of
    the vectors it is built from, or the lexical index with its texts), not their sum."""
    p, plan, keys, parts = cfg.index, StagePlan("index"), source_keys(cfg, s), {}
    hnsw = (p.hnsw_m, p.hnsw_ef_construction, p.hnsw_ef_search)
    held_out = "centroid" in p.sources and cfg.index.include_validation and s.n_valid
    builds = [(n, keys[n]) for n in p.sources if n in keys] + [("centroid", s.n_labels)] * bool(held_out)
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
        if p.lexical_classifier and not cross_fits(cfg, s):
            solver = solver_for(ClassifierSettings(solver=p.lexical_classifier_solver), s.rows, s.n_labels)
            if solver != "liblinear":  # their hard negatives: every fit point scored
                plan.parts[f"lexical classifiers' hard negatives, {s.rows:,} points"] = \
                    s.rows * lexical_query_s(c, cfg, s)
            work = "passes" if solver == "sgd" else "solves"
            plan.notes.append(f"the lexical classifiers' {work} are not planned (under train.budget_minutes they stop "
                              f"at its deadline, {SKIP_SLACK:.0%} of it past at most)")
        per_token = 2 * LEXICAL_BYTES_PER_TOKEN + TEXT_BYTES_PER_TOKEN
        parts["lexical index and texts"] = n * (s.tokens * per_token + TEXT_BYTES)
    if "cooccurrence" in p.sources:  # CSR rows capped at max_entries (float64, int32), and one block's products
        products = min(COOCCURRENCE_BLOCK, s.n_train * s.labels_per_point ** 2)  # sum over points of |y_i|^2
        parts["label co-occurrence"] = 12 * (s.n_labels * min(p.cooccurrence_max_entries, s.n_labels) + products)
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
        if name in keys:
            index_work(c, plan, name, p.kind, keys[name], queries, p.shortlist_size, hnsw, build=False)
    if "lexical" in p.sources:
        plan.parts[f"lexical scoring, {queries:,} queries"] = queries * lexical_query_s(c, cfg, s)
        plan.memory["lexical index"] = 2 * (keys["knn"] + s.n_labels) * s.tokens * LEXICAL_BYTES_PER_TOKEN
    width = p.shortlist_size * len(p.sources)
    plan.parts["merge and score the shortlists"] = queries * width * c.retrieve_entry_s(p.shortlist_size)
    scores = 2 + sum(n in p.sources for n in ("knn", "lexical", "cooccurrence"))
    shortlist_memory(plan, queries, width, c.dim, scores)
    # W and the label embeddings are scored from their indexes' copies (exact, HNSW), else read in
    apart = sum(n not in p.sources or plan.kinds.get(n) == "ivf" for n in ("W", "label"))
    apart += p.label_repr == "text+centroid"  # E(z_l) + v_l (the centroids it is made from are let go)
    plan.memory["W, label embeddings, centroids (besides the indexes)"] = apart * s.n_labels * c.dim * F32
    return width


def stage_fusion(c: Costs, cfg: PipelineConfig, s: Shape, classifier_s: float) -> StagePlan:
    plan, f, p = StagePlan("fusion"), cfg.fusion, cfg.index
    cross = cross_fits(cfg, s)
    if not s.n_valid and not cross:
        plan.notes.append("no validation points: a default blend, nothing fitted")
        return plan
    n = min(f.cross_fit_max_points, s.n_train) if cross else s.n_valid
    width = inference_work(c, cfg, s, plan, n)
    knn, lexical = "knn" in p.sources, "lexical" in p.sources
    grid = grid_points(cfg, knn, lexical)
    unit = "grid points" if f.search == "grid" else "evaluations"
    plan.parts[f"{f.method} fit, {grid:,} {unit} x {n:,} points"] = grid * n * width * c.fusion(knn, lexical)[
        "s_per_entry"]
    # the shortlists and the fit once per candidate: each kNN vote of fusion.vote_grid, with and without the lexical
    # classifiers (xc_dagster.retrieval.fitted_sources)
    votes = len(vote_candidates(f.vote_grid, p.sources, cfg.explicit))
    both = lexical and p.lexical_classifier and f.try_without_lexical_classifiers and not cross
    if (fits := votes * (1 + both)) > 1:
        what = ", ".join(([f"x {votes} vote candidates"] if votes > 1 else [])
                         + (["with and without the lexical classifiers"] if both else []))
        plan.parts = {f"{k}, {what}": v * fits for k, v in plan.parts.items()}
    if cross:
        folds = f.cross_fit_folds
        plan.parts[f"{folds} fold classifiers"] = folds * classifier_s * (1 - 1 / folds)
        plan.notes.append("cross-fitting: each fold's classifier planned as the classifier stage's training")
    if f.method == "alpha" and (knn or lexical or f.propensity_grid_extend):
        plan.notes.append("fusion grids extended when their largest weight wins (*_grid_extend) add to this")
    return plan


def stage_evaluate(c: Costs, cfg: PipelineConfig, s: Shape) -> StagePlan:
    texts = s.n_test if s.point_texts else 1  # points without text: the one empty input, encoded once
    plan = StagePlan("evaluate", {f"encode {texts:,} test texts": c.encode_s(texts)})
    width = inference_work(c, cfg, s, plan, s.n_test)
    rankings = 3 + ("lexical" in cfg.index.sources) + ("cooccurrence" in cfg.index.sources)  # fused + each alone
    fz = c.fusion("knn" in cfg.index.sources, "lexical" in cfg.index.sources)
    plan.parts[f"fuse and rank ({rankings} rankings)"] = rankings * s.n_test * width * fz["rank_s_per_entry"]
    plan.memory["test embeddings"] = s.n_test * c.dim * F32
    plan.memory["predictions"] = s.n_test * cfg.evaluate.top_k * 12
    return plan
