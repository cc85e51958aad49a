"""A benchmark's result row: printed as JSON and, with a path, appended to that JSON-lines file."""

from __future__ import annotations

import json
from pathlib import Path


def emit(row: dict, path: Path | None = None) -> None:
    print(json.dumps(row), flush=True)
    if path:
        with Path(path).open("a") as f:
            f.write(json.dumps(row) + "\n")
