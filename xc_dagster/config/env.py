"""Positive numbers set by environment variables (limits and intervals a deployment sets without a run config)."""

from __future__ import annotations

import os

from xc_dagster.errors import XCConfigError


def env_positive(name: str, default: float | None, cast: type = int) -> float | None:
    """``$name`` as a positive ``cast`` (int or float), ``default`` when unset or blank; anything else fails naming
    the variable and what it holds."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    kind = "number" if cast is float else "integer"
    try:
        value = cast(raw)
    except ValueError:
        raise XCConfigError(f"{name}: expected a positive {kind}, got {raw!r}") from None
    if not value > 0:
        raise XCConfigError(f"{name}: expected a positive {kind}, got {raw!r}")
    return value
