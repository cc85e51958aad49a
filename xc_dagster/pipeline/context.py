"""What a stage runs with: where artifacts live, which dataset and stage, the effective config, logging hooks."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch

from xc_dagster.artifacts import CONTRACT, REGISTERED_MODEL, ArtifactReader, check_writes
from xc_dagster.catalog import DatasetSpec
from xc_dagster.config import PipelineConfig
from xc_dagster.data.companions import lexical_alone, points_have_text
from xc_dagster.device import resolve_device
from xc_dagster.errors import XCError
from xc_dagster.evaluation.metrics import inverse_propensity
from xc_dagster.pipeline.kept import KeptWork
from xc_dagster.pipeline.provenance import write_params
from xc_dagster.progress import Progress
from xc_dagster.storage import ArtifactStore
from xc_dagster.training.checkpoint import fingerprint

log = logging.getLogger("xc_dagster")


@dataclass
class StageContext:
    """A stage's view of the world. ``stage`` names the stage (or ``registered_model``) being run: it bounds what
    ``read`` may open to the stage's declared reads (``xc_dagster.artifacts.CONTRACT``) and names the folder
    ``writing`` publishes; None is a script's context, which reads every stage and writes none."""

    store: ArtifactStore
    spec: DatasetSpec
    cfg: PipelineConfig
    cache_dir: Path
    device: torch.device = field(default_factory=lambda: resolve_device("auto"))
    log_metrics: Callable[[int, dict[str, float]], None] | None = None
    info: Callable[[str], None] = log.info
    tracking_uri: str | None = None  # the MLflow store (pretrain.warm_start=champion finds the champion there)
    stage: str | None = None
    _reader: ArtifactReader | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def name(self) -> str:
        return self.spec.name

    def for_stage(self, stage: str) -> "StageContext":
        """This context bound to ``stage`` (with a fresh reader that records that stage's reads)."""
        return self if stage == self.stage else dataclasses.replace(self, stage=stage)

    @property
    def read(self) -> ArtifactReader:
        """The upstream artifacts this stage may read."""
        if self._reader is None:
            consumer = (CONTRACT[self.stage] if self.stage in CONTRACT
                        else REGISTERED_MODEL if self.stage == REGISTERED_MODEL.stage else None)
            if self.stage is not None and consumer is None:
                raise XCError(f"unknown stage {self.stage!r}; stages are {', '.join(CONTRACT)}")
            self._reader = ArtifactReader(self.store, self.name, consumer)
        return self._reader

    def dir(self, stage: str) -> Path:
        """The folder of ``stage``'s artifacts (a declared read of this stage)."""
        return self.read.dir(stage)

    @contextlib.contextmanager
    def writing(self) -> Iterator[Path]:
        """A temporary folder that replaces this stage's artifacts when the block succeeds; what it holds must be
        what the contract declares. The config the stage ran with is written into it (``params.json``)."""
        if self.stage not in CONTRACT:
            raise XCError(f"writing: the context runs no stage ({self.stage!r})")
        with self.store.writing(self.name, self.stage) as out:
            yield out
            write_params(out, self.cfg)  # in the version before its switch: never current without its record
            check_writes(CONTRACT[self.stage], out)

    def progress(self, name: str, total: int, unit: str) -> Progress:
        """A ``Progress`` of this stage's work: its lines to ``info``, its rate to ``log_metrics``."""
        return Progress(name, total, unit, self.info, self.log_metrics)

    def checkpoint_dir(self, stage: str | None = None) -> Path:
        """Where ``stage`` (default: this one) keeps its per-epoch training checkpoint (removed once its artifacts
        are written)."""
        return self.store.root / self.name / "_checkpoints" / str(stage or self.stage)

    def encoded_dir(self) -> Path:
        """Where embeddings encoded by an earlier run are kept for reuse (``xc_dagster.pipeline.encoded``)."""
        return self.store.root / self.name / "_cache" / "encoded"

    def kept_work(self, settings: dict[str, Any], *arrays: np.ndarray) -> KeptWork:
        """Where this stage keeps the work a killed run of it finished (row blocks, built indexes), valid for
        ``settings``, the versions of every upstream artifact it reads and ``arrays`` (docs/decisions.md#kept-work)."""
        return KeptWork(self.checkpoint_dir(), fingerprint({**settings, "versions": self.read.versions()}, *arrays))

    def propensity(self) -> tuple[float, float]:
        """The configured propensity A / B (``evaluate.propensity_a/b``), 0 read as the dataset family's value (as
        ``DatasetSpec.config`` resolves it; also for a config built another way)."""
        return self.spec.propensity(self.cfg.evaluate.propensity_a, self.cfg.evaluate.propensity_b)

    def inv_prop(self, Y_train) -> np.ndarray:
        """The labels' inverse propensities with :meth:`propensity`'s A / B."""
        return inverse_propensity(Y_train, *self.propensity())

    def points_have_text(self) -> bool:
        """Whether the encoder has anything to read on the training points: a pre-tokenized layout, or some point
        with text (the ingest summary's ``train_texts``; a BoW layout without its vocabulary has none)."""
        return points_have_text(self.read.summary("ingest", missing_ok=True) or {})

    def lexical_only(self) -> bool:
        """Whether the model is the strategy's lexical source alone: no training point has text, so every point
        embeds as the same empty input and the classifier and embedding scores are per-label constants, while the
        shipped BoW features give the lexical source (and its classifiers' prior) the points' content. The
        classifier stage then trains no W and the index serves the lexical source only, its dense scores 0
        (docs/decisions.md#lexical-only-without-text); ``index.sources`` set by the user is kept as set (the lexical
        source alone set: this model)."""
        ingest = self.read.summary("ingest", missing_ok=True) or {}
        return lexical_alone(points_have_text(ingest), int(ingest.get("n_features") or 0) > 0, self.cfg.index.sources,
                             "index.sources" in self.cfg.explicit)
