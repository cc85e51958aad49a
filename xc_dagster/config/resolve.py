"""Presets and how overrides are layered: dataclass default < preset < strategy < dataset options < catalog
overrides < run config, each ``stage.field`` name checked, each value coerced to the field's type and checked
against the field's range (``bounds``)."""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
import typing
from dataclasses import dataclass, field, fields
from typing import Any, Literal, Mapping

from xc_dagster.config.bounds import check_bounds, check_resolved
from xc_dagster.config.params import (
    STAGES,
    ClassifierParams,
    EvaluateParams,
    FusionParams,
    IndexParams,
    IngestParams,
    MiningParams,
    PretrainParams,
    TokenizeParams,
    TrainParams,
)
from xc_dagster.errors import XCConfigError
from xc_dagster.strategies import STRATEGIES

PRESETS: dict[str, dict[str, dict[str, Any]]] = {
    "quick": {},
    "paper": {
        # NGAME Table 9 / code defaults (LF-AmazonTitles-131K), meant for a GPU.
        "pretrain": {"epochs": 300, "batch_size": 1600, "lr": 2e-4, "warmup_steps": 100, "num_negatives": 10,
                     "curriculum": (10, 20, 25, 50, 75, 100, 125, 150, 200)},
        "mining": {"shortlist_size": 300, "hnsw_m": 100, "hnsw_ef_construction": 300, "hnsw_ef_search": 300},
        "classifier": {"epochs": 100, "batch_size": 2048, "num_positives": 3, "num_negatives": 5},
        "index": {"hnsw_m": 100, "hnsw_ef_construction": 300, "hnsw_ef_search": 300, "shortlist_size": 300},
    },
}


@dataclass
class PipelineConfig:
    """The effective hyperparameters of every stage for one dataset and run."""

    preset: str = "quick"
    strategy: str = "ngame"
    train: TrainParams = field(default_factory=TrainParams)
    ingest: IngestParams = field(default_factory=IngestParams)
    tokenize: TokenizeParams = field(default_factory=TokenizeParams)
    pretrain: PretrainParams = field(default_factory=PretrainParams)
    mining: MiningParams = field(default_factory=MiningParams)
    classifier: ClassifierParams = field(default_factory=ClassifierParams)
    fusion: FusionParams = field(default_factory=FusionParams)
    index: IndexParams = field(default_factory=IndexParams)
    evaluate: EvaluateParams = field(default_factory=EvaluateParams)
    # ``stage.field`` names set by the user (dataset options, catalog overrides, run config, --set), not by the
    # preset or the strategy: a planned value (train.budget_minutes) never replaces one of them
    explicit: frozenset[str] = field(default_factory=frozenset, compare=False)

    def stage(self, name: str) -> Any:
        return getattr(self, name)

    def flat(self) -> dict[str, Any]:
        """Every value as ``stage.field`` -> value (what MLflow logs as params)."""
        out: dict[str, Any] = {"preset": self.preset, "strategy": self.strategy}
        for name in STAGES:
            for f in fields(self.stage(name)):
                out[f"{name}.{f.name}"] = getattr(self.stage(name), f.name)
        return out


def _choice(value: Any, allowed: tuple[str, ...], where: str, item: bool = False) -> str:
    """``value`` when it is one of ``allowed`` (an Enum member counts as its value), else raise naming the field
    and every allowed value (``item``: ``value`` is one item of a tuple field)."""
    if isinstance(value, enum.Enum):
        value = value.value
    if isinstance(value, str) and value.strip() in allowed:
        return value.strip()
    expected = "items, each one of" if item else "one of"
    raise XCConfigError(f"config field {where!r}: expected {expected} {', '.join(map(repr, allowed))}, "
                        f"got {value!r}")


def _coerce(value: Any, typ: Any, where: str) -> Any:
    """Convert a string or YAML value to the field type, or raise naming the field (and, for a field whose
    values are a fixed set, the allowed values)."""
    origin = typing.get_origin(typ)
    if origin is Literal:
        return _choice(value, typing.get_args(typ), where)
    try:
        if typ is bool:
            if isinstance(value, bool):
                return value
            s = str(value).strip().lower()
            if s in {"1", "true", "yes", "on"}:
                return True
            if s in {"0", "false", "no", "off"}:
                return False
            raise ValueError(value)
        if typ is int:
            if isinstance(value, bool):
                raise ValueError(value)
            f = float(value)
            if not math.isfinite(f) or f != int(f):  # inf, 1e400 and nan are no int (int(inf) overflows)
                raise ValueError(value)
            return int(f)
        if typ is float:
            if isinstance(value, bool):
                raise ValueError(value)
            f = float(value)
            if not math.isfinite(f):  # no float field gives nan or inf a meaning
                raise XCConfigError(f"config field {where!r}: expected a finite number, got {value!r}")
            return f
        if typ is str:
            return str(value)
        if origin is tuple:
            (inner, *_rest) = typing.get_args(typ)
            if isinstance(value, str):
                items = value.replace(",", " ").split()
            elif isinstance(value, (int, float)) and not isinstance(value, bool):
                items = [value]  # YAML `knn_grid: 0` means the one-value grid
            else:
                items = list(value)
            if typing.get_origin(inner) is Literal:
                return tuple(_choice(v, typing.get_args(inner), where, item=True) for v in items)
            return tuple(_coerce(v, inner, where) for v in items)
    except XCConfigError:
        raise  # an item outside a fixed set: its message lists the allowed values
    except (TypeError, ValueError, OverflowError):
        raise XCConfigError(f"config field {where!r}: expected {getattr(typ, '__name__', typ)}, got {value!r}")
    raise XCConfigError(f"config field {where!r}: unsupported type {typ}")


@functools.lru_cache(maxsize=None)
def _stage_types(name: str) -> dict[str, Any]:
    return typing.get_type_hints(STAGES[name])  # resolved once: every override of every layer looks it up


def apply_overrides(cfg: PipelineConfig, overrides: Mapping[str, Any], source: str,
                    explicit: bool = False) -> PipelineConfig:
    """Return ``cfg`` with ``{"stage.field": value}`` or ``{"stage": {"field": value}}`` applied; ``explicit``:
    the user set them (recorded in ``cfg.explicit``)."""
    flat: dict[str, Any] = {}
    for key, value in overrides.items():
        if isinstance(value, Mapping):
            for k2, v2 in value.items():
                flat[f"{key}.{k2}"] = v2
        else:
            flat[key] = value
    for key, value in flat.items():
        if value is None:
            continue
        if key in ("preset", "strategy"):  # chosen before overrides are layered: as an override it would be ignored
            raise XCConfigError(
                f"{source}: {key!r} is not a stage field, so it cannot be set as an override; choose the {key} with "
                f"--{key} (xc-dagster datasets add NAME --source URI --replace --{key} {key.upper()})")
        stage, _, fname = key.partition(".")
        if stage not in STAGES:
            raise XCConfigError(f"{source}: unknown stage {stage!r} in {key!r}; stages are {', '.join(STAGES)}")
        types = _stage_types(stage)
        if fname not in types:
            raise XCConfigError(
                f"{source}: unknown field {key!r}; fields of {stage!r} are {', '.join(types)}")
        try:
            coerced = _coerce(value, types[fname], key)
            check_bounds(key, coerced)
        except XCConfigError as exc:
            raise XCConfigError(f"{source}: {exc}") from None
        setattr(cfg, stage, dataclasses.replace(cfg.stage(stage), **{fname: coerced}))
        if explicit:
            cfg.explicit = cfg.explicit | {key}
    return cfg


def resolve_config(preset: str = "quick", strategy: str = "ngame",
                   *layers: tuple[str, Mapping[str, Any]]) -> PipelineConfig:
    """Layer the preset, the strategy's settings for that preset (``Strategy.settings``) and then each
    ``(source_name, overrides)`` in order onto the dataclass defaults; the preset's and the strategy's values are
    defaults, the layers' the user's explicit settings (``PipelineConfig.explicit``)."""
    if preset not in PRESETS:
        raise XCConfigError(f"unknown preset {preset!r}; presets are {', '.join(PRESETS)}")
    if strategy not in STRATEGIES:
        raise XCConfigError(f"unknown strategy {strategy!r}; strategies are {', '.join(STRATEGIES)}")
    cfg = PipelineConfig(preset=preset, strategy=strategy)
    cfg = apply_overrides(cfg, PRESETS[preset], f"preset {preset!r}")
    cfg = apply_overrides(cfg, STRATEGIES[strategy].settings(preset), f"strategy {strategy!r}")
    for source, overrides in layers:
        cfg = apply_overrides(cfg, overrides, source, explicit=True)
    check_resolved(cfg)  # the ranges that depend on another field's final value
    return cfg


def parse_set_options(items: list[str] | tuple[str, ...]) -> dict[str, str]:
    """Parse CLI ``--set stage.field=value`` items, checking every name and value now (an unknown field, a value
    of the wrong type, outside a field's allowed set or range, ``preset`` or ``strategy`` fails naming the field);
    the values stay the strings given (they are coerced again at resolve time)."""
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise XCConfigError(f"--set {item!r}: expected stage.field=value")
        out[key.strip()] = value.strip()
    apply_overrides(PipelineConfig(), out, "--set")  # validates names and types now
    return out
