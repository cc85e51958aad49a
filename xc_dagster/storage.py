"""Artifacts on disk: one folder per (dataset, stage), written atomically.

A stage writes into a temporary sibling folder and renames it into place only when every file is written,
so a failed or killed run never leaves a half-written artifact where a downstream stage would read it.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from xc_dagster.errors import XCError


class MissingArtifact(XCError, FileNotFoundError):
    """An upstream stage has not been materialized for this dataset."""


@contextlib.contextmanager
def atomic_dir(final: Path) -> Iterator[Path]:
    """Yield a temp folder; on success it replaces ``final`` (old content removed), on error it is deleted."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".{final.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = None
    if final.exists():
        old = final.parent / f".{final.name}.old-{uuid.uuid4().hex[:8]}"
        os.replace(final, old)
    os.replace(tmp, final)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def atomic_write_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.write_text(text)
    os.replace(tmp, path)


class ArtifactStore:
    """Paths of every stage's artifacts under ``root/<dataset>/<stage>``."""

    def __init__(self, root: Path):
        self.root = Path(root)

    def stage_dir(self, dataset: str, stage: str) -> Path:
        return self.root / dataset / stage

    def require(self, dataset: str, stage: str) -> Path:
        d = self.stage_dir(dataset, stage)
        if not d.is_dir():
            raise MissingArtifact(
                f"dataset {dataset!r}: stage {stage!r} has no artifacts at {d}; materialize it first")
        return d

    @contextlib.contextmanager
    def writing(self, dataset: str, stage: str) -> Iterator[Path]:
        with atomic_dir(self.stage_dir(dataset, stage)) as tmp:
            yield tmp


def save_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True, default=_jsonable))


def load_json(path: Path) -> Any:
    return json.loads(Path(path).read_text())


def _jsonable(o: Any) -> Any:
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    if isinstance(o, np.ndarray):
        return o.tolist()
    if isinstance(o, Path):
        return str(o)
    if isinstance(o, tuple):
        return list(o)
    raise TypeError(f"not JSON serialisable: {type(o)}")
