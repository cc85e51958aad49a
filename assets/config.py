"""Typed Dagster ``Config`` classes, one per stage, generated from the library's parameter dataclasses.

Every field is optional: left empty, the value comes from the dataset's preset, strategy and catalog
overrides; set in the launchpad or run config, it overrides them for that run only. Generating the classes
keeps one source of truth for names, types and defaults.

A field whose values are a fixed set (``Literal[...]`` in the dataclass, ``xc_dagster.config.choices``) becomes
an Enum whose members are those values (Dagster's config schema takes no optional ``Literal``): the launchpad
offers exactly them and refuses anything else before the run starts, and the class itself (pydantic) refuses a
bad value listing the allowed ones. Each field's description lists the allowed values and the value each
preset and strategy gives it (``xc_dagster.config.describe``).
"""

from __future__ import annotations

import dataclasses
import enum
import typing
from typing import Any, Optional

import dagster as dg
import pydantic

from xc_dagster.catalog import DatasetSpec
from xc_dagster.config import STAGES, describe_stage, literal_choices

# fields a dataset's options set (text fields, max_len, propensity A/B: from its name, the registry of known
# datasets or its catalog entry), so their value also depends on the dataset
DATASET_OPTION_FIELDS = frozenset(DatasetSpec(name="X", source="X").option_overrides())


def _camel(*parts: str) -> str:
    return "".join(w.capitalize() for p in parts for w in p.split("_"))


def choice_enum(stage: str, name: str, choices: tuple[str, ...]) -> type[enum.Enum]:
    """A ``str`` Enum whose members are named and valued as ``choices`` (Dagster's run config takes the names)."""
    return enum.Enum(_camel(stage, name), {c: c for c in choices}, type=str)  # type: ignore[return-value]


def _dagster_type(stage: str, name: str, t: Any) -> Any:
    choices = literal_choices(t)
    if typing.get_origin(t) is tuple:
        return list[choice_enum(stage, name, choices) if choices else typing.get_args(t)[0]]  # type: ignore[misc]
    return choice_enum(stage, name, choices) if choices else t


def make_config_class(stage: str) -> type[dg.Config]:
    params = STAGES[stage]
    hints = typing.get_type_hints(params)
    descriptions = describe_stage(stage)
    fields: dict[str, Any] = {}
    for f in dataclasses.fields(params):
        description = descriptions[f.name]
        if f"{stage}.{f.name}" in DATASET_OPTION_FIELDS:
            description += (" (the dataset's options set it: from its name, the known-dataset registry or "
                            "--text, --max-len, --propensity of datasets add)")
        fields[f.name] = (Optional[_dagster_type(stage, f.name, hints[f.name])],
                          pydantic.Field(default=None, description=description))
    name = _camel(stage) + "Config"
    cls = pydantic.create_model(name, __base__=dg.Config, **fields)
    cls.__doc__ = f"Run-time overrides of the {stage!r} stage ({params.__doc__ or ''})"
    return cls


def _plain(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def run_overrides(stage: str, config: dg.Config) -> dict[str, Any]:
    """The fields set in this run's config as ``stage.field`` overrides (an Enum member as its value)."""
    return {f"{stage}.{k}": _plain(v) for k, v in config.model_dump().items() if v is not None}


CONFIG_CLASSES: dict[str, type[dg.Config]] = {s: make_config_class(s) for s in STAGES}
