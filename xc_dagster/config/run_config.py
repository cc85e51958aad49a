"""Overrides for one run as the Dagster run config of the stage assets (``xc-dagster materialize --set``)."""

from __future__ import annotations

import re
from typing import Any, Mapping

from xc_dagster.config.resolve import PipelineConfig, apply_overrides
from xc_dagster.contract import CONTRACT
from xc_dagster.errors import XCConfigError

PLAIN_ASSET = re.compile(r"^[A-Za-z0-9_]+$")  # an asset name in --select (no selection syntax)


def run_config_for(overrides: Mapping[str, Any], select: str = "*") -> dict[str, Any]:
    """The Dagster run config that sets ``{"stage.field": value}`` for one run, each under its stage asset's op
    (``ops: <asset>: config: <field>: value``), the values checked and coerced as catalog overrides are; ``{}``
    for none. A field of a stage without an asset (``train``), or of an asset left out by a ``select`` of plain
    names (other selection syntax, ``*``, ``a+``, is Dagster's to resolve), fails naming it."""
    cfg = apply_overrides(PipelineConfig(), overrides, "--set")  # names, types and allowed values
    parts = {p.strip() for p in select.split(",")}
    selected = parts if all(PLAIN_ASSET.match(p) for p in parts) else None
    ops: dict[str, Any] = {}
    for key in overrides:
        stage, _, field = key.partition(".")
        if stage not in CONTRACT:
            raise XCConfigError(
                f"--set {key}: stage {stage!r} has no asset, so no run config; set it in the catalog instead "
                f"(xc-dagster datasets add NAME --source URI --replace --set {key}=VALUE); stages with assets: "
                f"{', '.join(CONTRACT)}")
        asset = CONTRACT[stage].asset
        if selected is not None and asset not in selected:
            raise XCConfigError(f"--set {key}: the asset of stage {stage!r}, {asset!r}, is not in --select "
                                f"{select!r}, so the value would not be used")
        value = getattr(cfg.stage(stage), field)
        ops.setdefault(asset, {"config": {}})["config"][field] = list(value) if isinstance(value, tuple) else value
    return {"ops": ops} if ops else {}
