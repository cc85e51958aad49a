"""Overrides for one run as the Dagster run config of the stage assets (``xc-dagster materialize --set``)."""

from __future__ import annotations

import difflib
import re
from typing import Any, Mapping

from xc_dagster.config.resolve import PipelineConfig, apply_overrides
from xc_dagster.contract import CONTRACT, REGISTERED_MODEL
from xc_dagster.errors import XCConfigError

PLAIN_ASSET = re.compile(r"^[A-Za-z0-9_]+$")  # an asset name in --select (no selection syntax)
# an asset name with Dagster's graph operators around it: "*fusion", "fusion+", "++ann_index"
OPERATED_ASSET = re.compile(r"^[*+]*([A-Za-z0-9_]+)[*+]*$")
ASSETS = (*(e.asset for e in CONTRACT.values()), REGISTERED_MODEL.asset)


def check_selection(select: str) -> None:
    """Every asset that ``select`` names with plain names and graph operators (``*a``, ``a+``, ``a,b``) is one of
    the pipeline's, else an error naming it and the assets there are (Dagster would fail with a traceback after
    loading the whole definitions); other selection syntax (``key:``, ``tag:``, ``group:``) is Dagster's."""
    for part in select.split(","):
        m = OPERATED_ASSET.match(part.strip())
        if m and m.group(1) not in ASSETS:
            close = difflib.get_close_matches(m.group(1), ASSETS, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise XCConfigError(f"--select {select!r}: no asset {m.group(1)!r}{hint}; the assets, in order: "
                                f"{', '.join(ASSETS)}")


def run_config_for(overrides: Mapping[str, Any], select: str = "*") -> dict[str, Any]:
    """The Dagster run config that sets ``{"stage.field": value}`` for one run, each under its stage asset's op
    (``ops: <asset>: config: <field>: value``), the values checked and coerced as catalog overrides are; ``{}``
    for none. A field of a stage without an asset (``train``), or of an asset left out by a ``select`` of plain
    names (other selection syntax, ``*``, ``a+``, is Dagster's to resolve), fails naming it."""
    check_selection(select)
    # names, types, allowed values and ranges; `preset` / `strategy` fail there, advising --preset / --strategy
    cfg = apply_overrides(PipelineConfig(), overrides, "--set")
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
