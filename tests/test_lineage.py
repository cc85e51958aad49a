"""The artifact contract is the data flow: every stage reads only the stages it declares (and reads each of them
for some strategy), writes only the files it declares, and the Dagster asset graph is built from those reads."""

from __future__ import annotations

import sys
from pathlib import Path

import dagster as dg
import numpy as np
import pytest

from tests.tinydata import dagster_instance, ready_home, tiny_lf_home, write_lf_dataset
from xc_dagster.artifacts import (
    CONTRACT,
    REGISTERED_MODEL,
    STAGE_ORDER,
    ArtifactReader,
    UndeclaredRead,
    UndeclaredWrite,
)
from xc_dagster.catalog import Catalog, DatasetSpec
from xc_dagster.pipeline import STAGES, StageContext
from xc_dagster.storage import ArtifactStore, stage_leftovers

TINY = {
    "pretrain.epochs": 1, "pretrain.batch_size": 16, "pretrain.chunk_size": 8, "mining.shortlist_size": 8,
    "classifier.epochs": 1, "classifier.batch_size": 32, "classifier.num_negatives": 5,
    "index.shortlist_size": 8, "index.hnsw_m": 8, "evaluate.top_k": 10, "ingest.valid_fraction": 0.1,
}
# strategies whose runs between them take every optional read: the end-to-end encoder (tokens, the
# classifier's encoder) and the bag encoder's residual block (SiameseXML Module IV)
RUNS = {
    "ngame": ("ngame", {}),
    "astra": ("astra", {"classifier.epochs": 0.5, "classifier.num_hard": 3, "classifier.num_random": 10}),
    "siamesexml-bag": ("siamesexml", {"tokenize.encoder": "bag:32", "pretrain.batch_size": 8,
                                      "fusion.fit_on": "cross_fit"}),  # its folds read the mined negatives
}


class OpenRecorder:
    """Python-level file opens under one dataset's artifacts, by the stage that was running (an audit hook)."""

    def __init__(self, root: Path):
        self.root = str(root) + "/"
        self.running: str | None = None
        self.opened: dict[str, set[str]] = {}

    def __call__(self, event: str, args: tuple) -> None:
        if event != "open" or self.running is None or not isinstance(args[0], (str, Path)):
            return
        path = str(args[0])
        if path.startswith(self.root):
            stage = path[len(self.root):].split("/")[0]
            if stage in CONTRACT and stage != self.running:
                self.opened.setdefault(self.running, set()).add(stage)


_RECORDER: OpenRecorder | None = None


def _hook(event: str, args: tuple) -> None:  # audit hooks cannot be removed: one per process, forwarding
    if _RECORDER is not None:
        _RECORDER(event, args)


sys.addaudithook(_hook)


def _run(tmp: Path, encoder: Path, strategy: str, overrides: dict) -> tuple[dict, dict]:
    """Every stage of one tiny run; returns the stages each one read through its reader and by opening files."""
    global _RECORDER
    home = ready_home(tmp / "home")
    src = write_lf_dataset(tmp / "src" / "TinyTitles")
    spec = DatasetSpec("TinyTitles", str(src), strategy=strategy,
                       overrides={**TINY, "tokenize.encoder": str(encoder), **overrides}).validate()
    ctx = StageContext(ArtifactStore(home.artifacts), spec, spec.config(), home.cache)
    read: dict[str, set[str]] = {}
    _RECORDER = OpenRecorder(home.artifacts / "TinyTitles")
    try:
        for stage in STAGE_ORDER:
            bound = ctx.for_stage(stage)
            _RECORDER.running = stage
            STAGES[stage](bound)
            _RECORDER.running = None  # the stage's ctx.writing recorded its params.json
            read[stage] = bound.read.opened
        opened = _RECORDER.opened
    finally:
        _RECORDER = None
    return read, opened


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_encoder):
    return {name: _run(tmp_path_factory.mktemp(name), tiny_encoder, strategy, over)
            for name, (strategy, over) in RUNS.items()}


def test_every_stage_reads_what_it_declares_and_nothing_else(runs):
    for name, (read, opened) in runs.items():
        for stage in STAGE_ORDER:
            declared = set(CONTRACT[stage].reads)
            assert read[stage] <= declared, (name, stage)
            assert opened.get(stage, set()) <= declared, (name, stage)  # no file opened behind the reader
    # and each declared read is needed: some strategy's run reads it
    for stage in STAGE_ORDER:
        used = set().union(*(read[stage] for read, _ in runs.values()))
        assert used == set(CONTRACT[stage].reads), stage
    assert runs["astra"][0]["classifier"] >= {"tokenize"} and "tokenize" not in runs["ngame"][0]["classifier"]


def test_reading_an_undeclared_stage_is_refused(tmp_path):
    store = ArtifactStore(tmp_path)
    (tmp_path / "Data" / "classifier").mkdir(parents=True)
    reader = ArtifactReader(store, "Data", CONTRACT["mining"])
    with pytest.raises(UndeclaredRead, match="'mining' reads the artifacts of 'classifier'"):
        reader.dir("classifier")
    assert reader.opened == set()
    assert ArtifactReader(store, "Data").dir("classifier") == tmp_path / "Data" / "classifier"  # a script's


def test_a_stage_publishes_only_declared_files(tmp_path):
    spec = DatasetSpec("Data", "/nowhere")
    ctx = StageContext(ArtifactStore(tmp_path), spec, spec.config(), tmp_path / "cache", stage="fusion")
    with ctx.writing() as out:
        (out / "fusion.json").write_text("{}")
    with pytest.raises(UndeclaredWrite, match=r"stage 'fusion' wrote \['scratch.npy'\]"):
        with ctx.writing() as out:
            (out / "fusion.json").write_text('{"method": "alpha"}')
            np.save(out / "scratch.npy", np.zeros(1))
    folder = tmp_path / "Data" / "fusion"
    assert sorted(p.name for p in tmp_path.joinpath("Data").iterdir() if not p.name.startswith(".")) == ["fusion"]
    assert stage_leftovers(folder) == []  # no temporary folder left
    assert (folder / "fusion.json").read_text() == "{}"  # the published folder is unchanged


def test_the_asset_graph_is_the_declared_data_flow(tmp_path, monkeypatch):
    from xc_dagster.definitions import build_definitions

    monkeypatch.setenv("XC_HOME", str(tmp_path / "home"))
    home = ready_home(tmp_path / "home")
    Catalog(home.catalog).add(DatasetSpec("TinyTitles", str(tmp_path / "src")))
    defs = build_definitions(home)
    for entry in (*CONTRACT.values(), REGISTERED_MODEL):
        asset = defs.get_assets_def(dg.AssetKey(entry.asset))
        parents = {k.to_user_string() for k in asset.dependency_keys}
        assert parents == {CONTRACT[s].asset for s in entry.reads}, entry.asset
    # a re-materialized encoder reaches every asset that read it directly, not through a chain
    readers = {e.asset for e in CONTRACT.values() if "pretrain" in e.reads}
    assert readers == {"negative_shortlist", "classifiers", "ann_index", "fusion", "evaluation"}


def test_contract_entries_are_consistent():
    assert list(STAGES) == list(STAGE_ORDER)
    for i, stage in enumerate(STAGE_ORDER):
        entry = CONTRACT[stage]
        assert all(STAGE_ORDER.index(r) < i for r in entry.reads), stage  # reads only what runs before it
        assert len(set(entry.writes)) == len(entry.writes) and {"summary.json", "params.json"} <= set(entry.writes)


def test_rematerializing_the_encoder_marks_every_asset_that_read_it_stale(tmp_path, monkeypatch, tiny_encoder):
    """As the UI shows it: the stale status Dagster computes from the asset graph and the materializations (its
    resolver is internal API; the check is what a user sees after re-running ``siamese_encoder``)."""
    from dagster._core.definitions.data_version import CachingStaleStatusResolver, StaleStatus
    from dagster._core.loader import LoadingContextForTest

    from assets import build_assets
    from resources.home import dataset_partitions
    from xc_dagster.definitions import pipeline_resources

    home = tiny_lf_home(tmp_path, monkeypatch, TINY, encoder=tiny_encoder)
    assets = build_assets(dataset_partitions())
    instance = dagster_instance("TinyTitles")
    for selection in (None, ["siamese_encoder"]):
        assert dg.materialize(assets, selection=selection, partition_key="TinyTitles", instance=instance,
                              resources=pipeline_resources(home)).success
    graph = dg.Definitions(assets=assets, resources=pipeline_resources(home)).resolve_asset_graph()
    resolver = CachingStaleStatusResolver(instance, graph, LoadingContextForTest(instance))
    stale = {}
    for entry in CONTRACT.values():
        key = dg.AssetKey(entry.asset)
        if resolver.get_status(key, "TinyTitles") == StaleStatus.STALE:
            stale[entry.asset] = {c.dependency.asset_key.to_user_string()
                                  for c in resolver.get_stale_causes(key, "TinyTitles") if c.dependency}
    readers = {e.asset for e in CONTRACT.values() if "pretrain" in e.reads}
    assert set(stale) == readers
    assert all(causes == {"siamese_encoder"} for causes in stale.values())
