"""Two dataset partitions materialized at the same time on one home with the embedded SQLite stores, as two
`xc-dagster materialize` processes (each a Dagster run, multiprocess executor), one of them also checked as the
CLI add + materialize a user runs; and the training assets' pool."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import dagster as dg
import mlflow
import numpy as np
import pytest

from assets import build_assets, build_lifecycle_assets
from resources.home import dataset_partitions
from tests.test_pipeline import TINY
from tests.tinydata import label_prior_metrics, ready_home, write_lf_dataset, write_tiny_encoder
from xc_dagster.artifacts import CONTRACT, PARAMS, STAGE_ORDER, SUMMARY
from xc_dagster.cli import main as cli_main
from xc_dagster.data import load_dataset
from xc_dagster.home import TRAINING_POOL
from xc_dagster.storage import load_json
from xc_dagster.tracking import experiment_name

# two datasets of different sizes (and seeds): a file or run of one landing in the other's place shows
SIZES = {"TinyA": (120, 40, 0), "TinyB": (90, 30, 1)}  # name -> (n_train, n_test, data seed)
TRAINING_ASSETS = {"siamese_encoder", "classifiers", "fusion"}  # pretrain, classifier, fusion (cross-fitting)


def test_training_assets_take_a_slot_of_the_training_pool():
    assets = build_assets(dataset_partitions()) + build_lifecycle_assets(dataset_partitions())
    pools = {k.to_user_string(): a.op.pool for a in assets for k in a.keys}
    assert {k: p for k, p in pools.items() if p is not None} == {k: "xc_training" for k in TRAINING_ASSETS}
    assert set(pools) - TRAINING_ASSETS == {"dataset", "tokens", "negative_shortlist", "ann_index", "evaluation",
                                             "registered_model"}


def training_spans(instance: dg.DagsterInstance, run_id: str) -> list[tuple[float, float, str]]:
    """(start, end, step) of the run's training steps, from its STEP_START / STEP_SUCCESS events."""
    times: dict[str, list[float]] = {}
    for e in instance.all_logs(run_id, of_type={dg.DagsterEventType.STEP_START, dg.DagsterEventType.STEP_SUCCESS}):
        if e.step_key in TRAINING_ASSETS:
            times.setdefault(e.step_key, []).append(e.timestamp)
    return [(t[0], t[-1], step) for step, t in times.items()]


def add_two_datasets(tmp_path, stores: dict[str, str] | None = None, names: tuple[str, ...] = tuple(SIZES)) -> tuple:
    """A fresh home holding TinyA and TinyB (or those of ``names``; added with the CLI, the tiny encoder and TINY's
    fast settings), its stores SQLite under the home or those ``stores`` names (XC_DAGSTER_POSTGRES_URL,
    MLFLOW_TRACKING_URI)."""
    # one torch thread per process: two runs share the machine's cores without oversubscribing them
    env = {**os.environ, "XC_HOME": str(tmp_path / "home"), "OMP_NUM_THREADS": "1"}
    for var in ("MLFLOW_TRACKING_URI", "DAGSTER_HOME", "XC_TRAINING_CONCURRENCY", "XC_DAGSTER_POSTGRES_URL"):
        env.pop(var, None)  # the default pool limit: 1
    env.update(stores or {})
    encoder = write_tiny_encoder(tmp_path / "tiny-bert")
    sets = [a for k, v in {**TINY, "tokenize.encoder": str(encoder)}.items() for a in ("--set", f"{k}={v}")]
    # the CLI's main in this process, under the materialize processes' environment: a fresh interpreter per add
    # would spend seconds importing for what is set-up here (its Dagster registration still runs in a process)
    with pytest.MonkeyPatch.context() as mp:
        for var in set(os.environ) - set(env):
            mp.delenv(var)
        for var, value in env.items():
            mp.setenv(var, value)
        if not stores:  # the SQLite stores from a copy of a home made once: seconds of migrations saved
            ready_home(tmp_path / "home", instance=True)
        for name in names:
            n_train, n_test, seed = SIZES[name]
            src = write_lf_dataset(tmp_path / "src" / name, n_train=n_train, n_test=n_test, seed=seed)
            source = f"file://{src}" if name == "TinyA" else str(src)  # both forms a user gives
            assert cli_main(["datasets", "add", name, "--source", source, "--text", "title"] + sets) == 0, name
    return tmp_path / "home", env


@pytest.fixture(scope="module")
def sqlite_two(tmp_path_factory):
    """One home whose TinyA and TinyB were materialized at once with the SQLite stores: (home, folder of the
    processes' logs, their exit codes), shared by the tests below, which check different things of it."""
    tmp_path = tmp_path_factory.mktemp("sqlite-two")
    home, env = add_two_datasets(tmp_path)
    return home, tmp_path, run_two_at_once(env, tmp_path)


def test_two_partitions_materialized_at_once_on_sqlite(sqlite_two):
    home, logs, codes = sqlite_two
    check_two_at_once(home, logs, codes, f"sqlite:///{home / 'mlflow.db'}")


def test_cli_add_then_dagster_cli_materialize(sqlite_two):
    """`xc-dagster datasets add` then `xc-dagster materialize` (= `dagster asset materialize` with
    DAGSTER_HOME under XC_HOME) as a user runs them, the materialize in a fresh process: the run lands in that
    instance and trains as the library run does. TinyA's run of the home above (a partition of its own, added by
    file:// URL), so the pipeline's CLI run is not paid twice."""
    home, logs, codes = sqlite_two
    out, err = (logs / "TinyA.out").read_text(), (logs / "TinyA.err").read_text()
    assert codes["TinyA"] == 0, out[-3000:] + err[-3000:]
    assert "Test metrics for TinyA" in out and "precision_at_1" in out
    for name in ("pretrain", "encode test", "retrieve test", "index W"):  # progress through Dagster's log (stderr)
        assert re.search(rf" - {name}: \d+/\d+ \w+ \(\d+%\), \S+/s, ETA \S+, elapsed \d+:\d\d", err), name
    metrics = json.loads((home / "artifacts" / "TinyA" / "evaluate" / "metrics.json").read_text())
    # the run a user starts from the CLI trains as the library run does: far above the label prior
    ds = load_dataset(home / "artifacts" / "TinyA" / "ingest" / "dataset", texts=False, features=False)
    base = label_prior_metrics(ds.Y_train, ds.Y_test, ds.filter_test)
    assert metrics["precision_at_1"] >= base["precision_at_1"] + 0.5, (metrics["precision_at_1"], base)
    with dg.DagsterInstance.from_config(str(home / "dagster")) as inst:
        records = [r for r in inst.get_run_records() if r.dagster_run.tags.get("dagster/partition") == "TinyA"]
    assert len(records) == 1 and records[0].dagster_run.status == dg.DagsterRunStatus.SUCCESS


def run_two_at_once(env: dict[str, str], tmp_path) -> dict[str, int]:
    """Both partitions materialized by two `xc-dagster materialize` processes started together (environment
    ``env``), stdout and stderr of each in ``tmp_path``/NAME.out and .err; their exit codes."""
    t0 = time.perf_counter()
    procs = {}
    for name in SIZES:
        with open(tmp_path / f"{name}.out", "w") as out, open(tmp_path / f"{name}.err", "w") as err:
            procs[name] = subprocess.Popen([sys.executable, "-m", "xc_dagster.cli", "materialize", name], env=env,
                                           stdout=out, stderr=err, text=True)
    for name, proc in procs.items():
        proc.wait(timeout=900)
    print(f"two partitions materialized at once in {time.perf_counter() - t0:.0f} s")
    return {name: proc.returncode for name, proc in procs.items()}


def materialize_two_at_once(home, env: dict[str, str], tmp_path, mlflow_uri: str) -> None:
    """Both partitions materialized by two `xc-dagster materialize` processes started together (environment
    ``env``); every Dagster run, MLflow run (store ``mlflow_uri``) and artifact checked."""
    check_two_at_once(home, tmp_path, run_two_at_once(env, tmp_path), mlflow_uri)


def check_two_at_once(home, tmp_path, codes: dict[str, int], mlflow_uri: str) -> None:
    """The checks of :func:`materialize_two_at_once` on the processes' exit ``codes`` and logs in ``tmp_path``."""
    for name, code in codes.items():
        out, err = (tmp_path / f"{name}.out").read_text(), (tmp_path / f"{name}.err").read_text()
        assert code == 0, (name, out[-2000:] + err[-4000:])
        assert "database is locked" not in (out + err).lower(), name
        assert f"Test metrics for {name}" in out

    # two Dagster runs, one per partition, both successful, and they did overlap in time; the training steps
    # (pool xc_training, default limit 1) ran one at a time over both runs
    with dg.DagsterInstance.from_config(str(home / "dagster")) as instance:  # Postgres: URL in this process's env
        records = instance.get_run_records()
        assert instance.event_log_storage.get_concurrency_info(TRAINING_POOL).slot_count == 1
        spans = sorted(s for r in records for s in training_spans(instance, r.dagster_run.run_id))
    runs = {r.dagster_run.tags["dagster/partition"]: r for r in records}
    assert len(records) == 2 and set(runs) == set(SIZES)
    assert all(r.dagster_run.status == dg.DagsterRunStatus.SUCCESS for r in records)
    assert max(r.start_time for r in records) < min(r.end_time for r in records)
    assert len(spans) == 2 * len(TRAINING_ASSETS)
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), spans

    # every stage's MLflow run of both datasets, FINISHED, tagged with its own partition's Dagster run
    client = mlflow.MlflowClient(mlflow_uri)
    for name in SIZES:
        exp = client.get_experiment_by_name(experiment_name(name))
        mruns = client.search_runs([exp.experiment_id])  # the stages' runs (tag asset) and any run grouping them
        assert sorted(r.data.tags["asset"] for r in mruns if "asset" in r.data.tags) == sorted(
            [*STAGE_ORDER, "registered_model"])
        assert {r.info.status for r in mruns} == {"FINISHED"}, [
            (r.data.tags.get("asset", r.info.run_name), r.info.status, r.data.tags.get("xc.ended_by")) for r in mruns]
        assert {r.data.tags["dagster_run_id"] for r in mruns} == {runs[name].dagster_run.run_id}
        assert str(client.get_model_version_by_alias(f"xc-{name}", "champion").version) == "1"

    # the artifacts of both are complete and each is its own dataset's
    for name, (n_train, n_test, _) in SIZES.items():
        root = home / "artifacts" / name
        for stage in STAGE_ORDER:  # each stage's folder holds its summary and params, and only declared names
            names = {p.name for p in (root / stage).iterdir()}
            assert {SUMMARY, PARAMS} <= names <= set(CONTRACT[stage].writes), (name, stage, names)
            assert load_json(root / stage / SUMMARY), (name, stage)
        ds = load_dataset(root / "ingest" / "dataset", texts=False, features=False)
        assert (ds.num_train, ds.num_test, ds.num_labels) == (n_train, n_test, 20)
        assert np.load(root / "tokenize" / "train_ids.npy", mmap_mode="r").shape == (n_train, 32)
        assert (root / "pretrain" / "encoder" / "model.safetensors").is_file()
        assert np.load(root / "pretrain" / "train_emb.npy", mmap_mode="r").shape == (n_train, 32)
        assert np.load(root / "mining" / "shortlist.npy").shape == (n_train, 8)
        assert np.load(root / "classifier" / "W.npy").shape == (20, 32)
        assert 0.0 <= load_json(root / "fusion" / "fusion.json")["alpha"] <= 1.0
        assert np.load(root / "evaluate" / "predictions.npz")["ids"].shape == (n_test, 10)
        assert 0.0 <= load_json(root / "evaluate" / "metrics.json")["precision_at_1"] <= 1.0
