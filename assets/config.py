"""Typed Dagster ``Config`` classes, one per stage, generated from the library's parameter dataclasses.

Every field is optional: left empty, the value comes from the dataset's preset, strategy and catalog
overrides; set in the launchpad or run config, it overrides them for that run only. Generating the classes
keeps one source of truth for names, types and defaults.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, Optional

import dagster as dg
import pydantic

from xc_dagster.config import STAGES


def _dagster_type(t: Any) -> Any:
    if typing.get_origin(t) is tuple:
        return list[typing.get_args(t)[0]]
    return t


def make_config_class(stage: str) -> type[dg.Config]:
    params = STAGES[stage]
    hints = typing.get_type_hints(params)
    fields: dict[str, Any] = {}
    for f in dataclasses.fields(params):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        fields[f.name] = (Optional[_dagster_type(hints[f.name])],
                          pydantic.Field(default=None, description=f"override (preset value {default!r})"))
    name = "".join(p.capitalize() for p in stage.split("_")) + "Config"
    cls = pydantic.create_model(name, __base__=dg.Config, **fields)
    cls.__doc__ = f"Run-time overrides of the {stage!r} stage ({params.__doc__ or ''})"
    return cls


def run_overrides(stage: str, config: dg.Config) -> dict[str, Any]:
    """The fields set in this run's config as ``stage.field`` overrides."""
    return {f"{stage}.{k}": v for k, v in config.model_dump().items() if v is not None}


CONFIG_CLASSES: dict[str, type[dg.Config]] = {s: make_config_class(s) for s in STAGES}
