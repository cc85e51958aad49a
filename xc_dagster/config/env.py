"""Positive numbers set by environment variables (limits and intervals a deployment sets without a run config)."""

from __future__ import annotations

import os
from collections.abc import Mapping

from xc_dagster.errors import XCConfigError


def env_positive(name: str, default: float | None, cast: type = int, maximum: float | None = None,
                 environ: Mapping[str, str] | None = None) -> float | None:
    """``$name`` (of ``environ``, default ``os.environ``) as a positive ``cast`` (int or float) of at most
    ``maximum``, ``default`` when unset or blank; anything else fails naming the variable and what it holds."""
    raw = (os.environ if environ is None else environ).get(name, "").strip()
    if not raw:
        return default
    kind = "number" if cast is float else "integer"
    bound = "" if maximum is None else (f" from 1 to {maximum}" if cast is int else f" up to {maximum}")
    try:
        value = cast(raw)
    except ValueError:
        value = None
    if value is None or not value > 0 or (maximum is not None and value > maximum):
        raise XCConfigError(f"{name}: expected a positive {kind}{bound}, got {raw!r}")
    return value
