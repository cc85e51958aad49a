"""The run planner (``xc-dagster plan``): each stage's wall seconds and peak memory on this machine, predicted
before a run from the dataset's shape and its resolved configuration.

The shape (training, test and validation points, labels, labels per point, tokens per text, the percentiles of
the texts' token lengths) comes from the ingest and tokenize stages' artifacts when they have run, else from the
options; the work of each stage is counted from the code it runs (``xc_dagster.planning.model``) and multiplied
by unit costs measured on this machine in a short calibration (``xc_dagster.planning.calibration``), cached under
``$XC_HOME/cache``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from xc_dagster.artifacts import SUMMARY, token_files
from xc_dagster.config import PipelineConfig
from xc_dagster.data.companions import points_have_text
from xc_dagster.device import resolve_device
from xc_dagster.errors import XCConfigError
from xc_dagster.planning.calibration import CACHE_FILE, UnitCosts, length_percentiles
from xc_dagster.planning.inference import stage_evaluate, stage_fusion, stage_index
from xc_dagster.planning.model import (
    Costs,
    Shape,
    StagePlan,
    stage_classifier,
    stage_ingest,
    stage_mining,
    stage_pretrain,
    stage_tokenize,
)
from xc_dagster.storage import load_json
from xc_dagster.training.memory import GIB, available_memory

OPTIONS = {"n_train": "--points", "n_test": "--test-points", "n_labels": "--labels",
           "labels_per_point": "--labels-per-point", "tokens": "--tokens"}

__all__ = ["OPTIONS", "RunPlan", "Shape", "StagePlan", "dataset_shape", "plan_run", "format_plan"]


@dataclass
class RunPlan:
    """The plan of one run: the shape and where it came from, the stages, the machine and its memory."""

    dataset: str
    shape: Shape
    shape_from: dict[str, str]
    stages: list[StagePlan]
    machine: str
    available_bytes: int | None
    calibrated: list[str]  # units measured for this plan (the rest came from the cache)

    @property
    def seconds(self) -> float:
        return sum(s.seconds for s in self.stages)

    @property
    def peak_bytes(self) -> float:
        return max((s.peak_bytes for s in self.stages), default=0.0)

    @property
    def fits(self) -> bool | None:
        return None if self.available_bytes is None else self.peak_bytes <= self.available_bytes

    def to_dict(self) -> dict[str, Any]:
        return {"dataset": self.dataset, "shape": asdict(self.shape), "shape_from": self.shape_from,
                "machine": self.machine, "calibrated": self.calibrated,
                "stages": [{"stage": s.name, "seconds": s.seconds, "minutes": s.seconds / 60,
                            "peak_gb": s.peak_bytes / GIB, "dominant": s.dominant, "kinds": s.kinds,
                            "parts": s.parts, "memory_gb": {k: v / GIB for k, v in s.memory.items()},
                            "notes": s.notes} for s in self.stages],
                "total_seconds": self.seconds, "total_minutes": self.seconds / 60,
                "peak_gb": self.peak_bytes / GIB,
                "available_gb": None if self.available_bytes is None else self.available_bytes / GIB,
                "fits": self.fits}


def _summary(artifacts: Path, name: str, stage: str) -> dict[str, Any]:
    path = artifacts / name / stage / SUMMARY
    return load_json(path) if path.is_file() else {}


def dataset_shape(artifacts: Path, name: str, cfg: PipelineConfig,
                  given: Mapping[str, float | None]) -> tuple[Shape, dict[str, str]]:
    """The shape from the ingest / tokenize summaries under ``artifacts``, each value given in ``given``
    (``OPTIONS``' fields) winning; an XCConfigError names the options still missing."""
    ingest, tok = _summary(artifacts, name, "ingest"), _summary(artifacts, name, "tokenize")
    found = {"n_train": ingest.get("n_train"), "n_test": ingest.get("n_test"), "n_labels": ingest.get("n_labels"),
             "labels_per_point": ingest.get("avg_labels_per_point"), "tokens": tok.get("train_mean_len")}
    values, source = {}, {}
    for key in OPTIONS:
        if given.get(key) is not None:
            values[key], source[key] = given[key], f"option {OPTIONS[key]}"
        elif found[key] is not None:
            values[key] = found[key]
            source[key] = f"{'tokenize' if key == 'tokens' else 'ingest'} summary"
    missing = [OPTIONS[k] for k in OPTIONS if k not in values]
    if missing:
        raise XCConfigError(f"plan {name}: the dataset's shape is not known: no ingest/tokenize summary under "
                            f"{artifacts / name} gives it; pass {', '.join(missing)}")
    for key in ("n_train", "n_test", "n_labels"):
        if not (float(values[key]) >= 1 and float(values[key]) == int(values[key])):
            raise XCConfigError(f"plan {name}: {OPTIONS[key]} expects a whole number >= 1, got {values[key]!r}")
    if not float(values["labels_per_point"]) > 0 or not float(values["tokens"]) >= 1:
        raise XCConfigError(f"plan {name}: --labels-per-point expects > 0 and --tokens >= 1, got "
                            f"{values['labels_per_point']!r} and {values['tokens']!r}")
    n_train = int(values["n_train"])
    if "n_valid" in ingest and source["n_train"] == "ingest summary":
        n_valid, source["n_valid"] = int(ingest["n_valid"]), "ingest summary"
    else:
        i = cfg.ingest
        n_valid = min(int(round(n_train * i.valid_fraction)), i.valid_max, max(n_train - 1, 0))
        n_valid = 0 if n_valid < i.valid_min else n_valid
        source["n_valid"] = "ingest.valid_fraction / valid_max / valid_min"
    tokens = min(float(values["tokens"]), cfg.tokenize.max_len)
    label_tokens = float(tok.get("label_mean_len") or tokens)
    label_max = cfg.tokenize.label_max_len or cfg.tokenize.max_len
    lengths: tuple[tuple[int, ...], ...] = ((), ())
    if source["tokens"] == "tokenize summary":  # the real length distributions (not with --tokens: other texts)
        lengths = (_percentiles(artifacts, name, "train", cfg.tokenize.max_len),
                   _percentiles(artifacts, name, "label", label_max))
    if lengths[0]:
        source["token lengths"] = "tokenize lengths (percentiles)"
    return Shape(n_train, int(values["n_test"]), int(values["n_labels"]), float(values["labels_per_point"]),
                 tokens, min(label_tokens, label_max), n_valid, *lengths, bool(ingest.get("label_names", True)),
                 points_have_text(ingest), int(ingest.get("n_features") or 0) > 0), source


def _percentiles(artifacts: Path, name: str, split: str, max_len: int) -> tuple[int, ...]:
    """The percentiles of ``split``'s token lengths that the tokenize stage wrote under ``artifacts``; () if none."""
    path = artifacts / name / "tokenize" / token_files(split)[1]
    try:
        return length_percentiles(np.load(path), max_len)
    except (OSError, ValueError):
        return ()


def plan_stages(c: Costs, cfg: PipelineConfig, s: Shape, available: int | None) -> list[StagePlan]:
    """Every stage's plan, in the pipeline's order."""
    out = [stage_ingest(c, s), stage_tokenize(c, s), stage_pretrain(c, cfg, s, available), stage_mining(c, cfg, s)]
    out.append(stage_classifier(c, cfg, s, out[2].seconds + out[3].seconds))
    if s.lexical_alone(cfg):  # the index stage's sources then (docs/decisions.md#lexical-only-without-text)
        cfg = dataclasses.replace(cfg, index=dataclasses.replace(cfg.index, sources=("lexical",)))
    out += [stage_index(c, cfg, s), stage_fusion(c, cfg, s, out[4].seconds), stage_evaluate(c, cfg, s)]
    return out


def plan_run(cache_dir: Path, artifacts: Path, name: str, cfg: PipelineConfig, given: Mapping[str, float | None],
             recalibrate: bool = False) -> RunPlan:
    """The plan of a run of dataset ``name`` with ``cfg`` on this machine (unit costs cached in ``cache_dir``)."""
    shape, source = dataset_shape(artifacts, name, cfg, given)
    device = resolve_device("auto")
    units = UnitCosts(Path(cache_dir) / CACHE_FILE, device, recalibrate)
    available = available_memory(device)
    stages = plan_stages(Costs(units, cfg, shape), cfg, shape, available)
    return RunPlan(name, shape, source, stages, units.machine, available, list(units.measured))


def format_plan(plan: RunPlan) -> str:
    """The plan as a table, a row per stage, with its notes and the verdict on memory."""
    s = plan.shape
    lines = [f"Plan for {plan.dataset}: {s.n_train:,} train ({s.n_valid:,} validation) / {s.n_test:,} test points, "
             f"{s.n_labels:,} labels, {s.labels_per_point:.2f} labels per point, {s.tokens:.1f} tokens per text",
             "shape from: " + ", ".join(f"{k} {v}" for k, v in plan.shape_from.items()),
             f"machine: {plan.machine}" + (f" (measured now: {len(plan.calibrated)} unit costs)"
                                           if plan.calibrated else " (unit costs from the cache)"), ""]
    head = f"{'stage':<11}{'seconds':>10}{'minutes':>9}{'peak GB':>9}  {'index kinds':<32}dominated by"
    lines += [head, "-" * len(head)]
    for st in plan.stages:
        kinds = ",".join(f"{k}={v}" for k, v in st.kinds.items()) or "-"
        lines.append(f"{st.name:<11}{st.seconds:>10.1f}{st.seconds / 60:>9.2f}{st.peak_bytes / GIB:>9.2f}  "
                     f"{kinds:<32} {st.dominant}")
    lines += ["-" * len(head),
              f"{'total':<11}{plan.seconds:>10.1f}{plan.seconds / 60:>9.2f}{plan.peak_bytes / GIB:>9.2f}  "
              f"(peak: the largest stage's)"]
    if plan.fits is None:
        lines.append("available memory: unknown on this machine (no check)")
    else:
        verdict = "fits" if plan.fits else "does NOT fit"
        lines.append(f"memory: the largest stage's {plan.peak_bytes / GIB:.2f} GB {verdict} in the "
                     f"{plan.available_bytes / GIB:.2f} GB available now")
    notes = [f"  {st.name}: {n}" for st in plan.stages for n in st.notes]
    return "\n".join(lines + (["", "notes:"] + notes if notes else []))
