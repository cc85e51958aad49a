"""The config each stage's artifacts were built with, recorded next to them, so downstream runs use and log it.

A stage's run resolves its config from the preset, the strategy, the catalog and its own run config; another
stage's run config is not part of it. An override given to an upstream stage's run (run config
``ops: fusion: config: method: tree``) would otherwise be invisible to a later run of a downstream stage,
which would log (and, where it reads that section, use) the catalog's value. So each stage writes the
effective config it ran with to ``<artifacts>/<dataset>/<stage>/params.json`` (``write_params``, into the new
version folder before it is switched in), and a
downstream run takes the section of every upstream stage from that stage's record (``with_upstream_params``):
what those artifacts were actually built with. Its own section and the downstream ones stay as it resolved
them. A stage whose artifacts have no record (written before records existed) keeps the run's resolution.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from xc_dagster.artifacts import PARAMS
from xc_dagster.config import STAGES, PipelineConfig, apply_overrides
from xc_dagster.errors import XCConfigError
from xc_dagster.storage import ArtifactStore

PARAMS_FILE = PARAMS


def params_path(store: ArtifactStore, dataset: str, stage: str) -> Path:
    return store.stage_dir(dataset, stage) / PARAMS_FILE


def write_params(folder: Path, cfg: PipelineConfig) -> Path:
    """Write ``cfg`` (every ``stage.field`` value, as MLflow logs them) into a stage's new version folder, before
    it is fsynced and switched in (``StageContext.writing``): the version is never current without its record,
    and a concurrent run's record never lands in it."""
    path = Path(folder) / PARAMS_FILE
    path.write_text(json.dumps(cfg.flat(), indent=2, sort_keys=True) + "\n")
    return path


def recorded_params(store: ArtifactStore, dataset: str, stage: str) -> dict[str, Any] | None:
    """The config ``stage``'s artifacts were built with, or None when they carry no record."""
    path = params_path(store, dataset, stage)
    if not path.is_file():
        return None
    try:
        rec = json.loads(path.read_text())
    except ValueError as exc:
        raise XCConfigError(f"{path}: not valid JSON ({exc}); re-materialize stage {stage!r}") from None
    if not isinstance(rec, dict):
        raise XCConfigError(f"{path}: expected a JSON object of stage.field values; re-materialize {stage!r}")
    return rec


@dataclass
class UpstreamConfig:
    """A run's config with the upstream sections as recorded, and what that changed."""

    cfg: PipelineConfig
    recorded: list[str] = field(default_factory=list)  # upstream stages whose section came from their record
    unrecorded: list[str] = field(default_factory=list)  # upstream stages with artifacts but no record
    differs: dict[str, dict[str, Any]] = field(default_factory=dict)  # key -> {"recorded": .., "resolved": ..}

    def report(self) -> dict[str, Any]:
        return {"recorded": self.recorded, "unrecorded": self.unrecorded, "differs": self.differs}


def with_upstream_params(cfg: PipelineConfig, store: ArtifactStore, dataset: str,
                         upstream: Sequence[str]) -> UpstreamConfig:
    """``cfg`` (not changed) with each ``upstream`` stage's section replaced by the values its artifacts
    were built with. Recorded fields the config no longer has are ignored; fields it has gained since keep
    ``cfg``'s values."""
    out = copy.deepcopy(cfg)
    result = UpstreamConfig(out)
    for stage in upstream:
        store.sync(dataset, stage)  # with a remote artifact root: the published version's record
        rec = recorded_params(store, dataset, stage)
        if rec is None:
            if store.stage_dir(dataset, stage).is_dir():
                result.unrecorded.append(stage)
            continue
        names = {f.name for f in dataclasses.fields(STAGES[stage])}
        prefix = f"{stage}."
        values = {k: v for k, v in rec.items() if k.startswith(prefix) and k[len(prefix):] in names}
        apply_overrides(out, values, f"{params_path(store, dataset, stage)}")
        result.recorded.append(stage)
    before, after = cfg.flat(), out.flat()
    result.differs = {k: {"recorded": after[k], "resolved": before[k]} for k in after if after[k] != before[k]}
    return result
