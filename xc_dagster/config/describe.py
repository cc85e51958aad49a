"""What a field's value is before a user sets it: per preset and strategy (the launchpad's field descriptions)."""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

from xc_dagster.config.choices import literal_choices
from xc_dagster.config.params import STAGES
from xc_dagster.config.resolve import PRESETS, PipelineConfig, resolve_config
from xc_dagster.strategies import STRATEGIES


def _configs() -> dict[tuple[str, str], PipelineConfig]:
    return {(p, s): resolve_config(p, s) for p in PRESETS for s in STRATEGIES}


def field_defaults(stage: str, name: str,
                   configs: dict[tuple[str, str], PipelineConfig] | None = None) -> dict[tuple[str, str], Any]:
    """``(preset, strategy)`` -> the field's value under that preset and strategy, before dataset options and
    user overrides."""
    configs = configs if configs is not None else _configs()
    return {key: getattr(cfg.stage(stage), name) for key, cfg in configs.items()}


def _show(value: Any) -> str:
    if isinstance(value, tuple):
        return repr(",".join(map(str, value)))  # as --set takes it
    return repr(value)


def _by_strategy(values: dict[str, Any]) -> str:
    if len(set(map(_show, values.values()))) == 1:
        return _show(next(iter(values.values())))
    return ", ".join(f"{s}: {_show(v)}" for s, v in values.items())


def describe_default(stage: str, name: str, configs: dict[tuple[str, str], PipelineConfig] | None = None) -> str:
    """The value each strategy uses for ``stage.name``: ``'x'`` where every preset and strategy agree, else
    ``ngame: 'x', siamesexml: 'y', ...``, per preset where the presets differ."""
    values = field_defaults(stage, name, configs)
    per_preset = {p: _by_strategy({s: v for (p2, s), v in values.items() if p2 == p}) for p in PRESETS}
    if len(set(per_preset.values())) == 1:
        return f"default {next(iter(per_preset.values()))}"
    return "default " + "; ".join(f"{p} preset: {text}" for p, text in per_preset.items())


def describe_field(stage: str, name: str, configs: dict[tuple[str, str], PipelineConfig] | None = None) -> str:
    """A run-config field's description: what leaving it empty means, the allowed values of an enum-like
    field, and the value each preset and strategy uses."""
    choices = literal_choices(typing.get_type_hints(STAGES[stage])[name])
    allowed = f"; one of {', '.join(map(repr, choices))}" if choices else ""
    return (f"{stage}.{name} for this run only (empty: the dataset's value){allowed}; "
            f"{describe_default(stage, name, configs)}")


def describe_stage(stage: str) -> dict[str, str]:
    """``describe_field`` of every field of ``stage`` (the presets and strategies resolved once)."""
    configs = _configs()
    return {f.name: describe_field(stage, f.name, configs) for f in dataclasses.fields(STAGES[stage])}
