"""The training stages launched out of the Dagster step's process (``compute.launcher``: subprocess, torchrun)
through Dagster Pipes: the same artifacts and MLflow step metrics as in process, the child's lines in the Dagster
event log; a child killed mid-stage fails the step naming the stage and the signal and leaves no half-written stage
folder; several processes only under torchrun and for pretraining (``nproc_per_node``, WORLD_SIZE); bad compute
fields named; the Kubernetes pod spec, rendered only."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import dagster as dg
import mlflow
import numpy as np
import pytest
import torch

from assets import build_assets
from resources.compute import ComputeResource, exit_message
from resources.home import dataset_partitions
from tests.test_ddp_pretrain import _no_dropout_bert
from tests.test_pipeline import TINY
from tests.tinydata import dagster_instance, ready_home, write_lf_dataset
from xc_dagster.artifacts import LABEL_EMB, PARAMS, SUMMARY, TRAIN_EMB, W
from xc_dagster.catalog import Catalog, DatasetSpec
from xc_dagster.definitions import pipeline_resources
from xc_dagster.errors import XCConfigError, XCError
from xc_dagster.home import Home
from xc_dagster.storage import ArtifactStore, stage_leftovers
from xc_dagster.training import launch
from xc_dagster.training.launch import LaunchRequest

ROOT = Path(__file__).resolve().parent.parent
# Dagster's Pipes client reads a preview property of its own message reader
pytestmark = pytest.mark.filterwarnings("ignore::dagster.PreviewWarning")
DATASET = "TinyTitles"
# TINY's settings, one pretraining epoch on 60 points: a few steps per stage, seconds per child
SETTINGS = {**TINY, "pretrain.epochs": 1, "classifier.epochs": 2}
TRAINING = ["siamese_encoder", "classifiers"]
ALL_TRAINING = ["dataset", "tokens", "siamese_encoder", "negative_shortlist", "classifiers"]
KILL_ENV = "XC_TEST_KILL_AT_FIRST_STEP"
# loaded by the child's interpreter (PYTHONPATH): with KILL_ENV set, its first step metrics SIGKILL it
KILL_HOOK = textwrap.dedent(f"""
    import os, signal
    if os.environ.get({KILL_ENV!r}):
        from xc_dagster import tracking

        def _die(self, step, values):
            os.kill(os.getpid(), signal.SIGKILL)

        tracking.RunLogger.log_metrics = _die
""")


@pytest.fixture
def home(tmp_path, monkeypatch, tiny_encoder):
    monkeypatch.setenv("XC_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    h = ready_home(tmp_path / "home")
    src = write_lf_dataset(tmp_path / "src" / DATASET, n_train=60, n_test=20)
    overrides = {**SETTINGS, "tokenize.encoder": str(tiny_encoder)}
    Catalog(h.catalog).add(DatasetSpec(DATASET, str(src), overrides=overrides))
    threads = torch.get_num_threads()
    yield h
    torch.set_num_threads(threads)  # compute.threads=1 set it in this process for the in-process runs


def materialize(home: Home, selection: list[str], launcher: str = "in_process",
                instance: dg.DagsterInstance | None = None, **compute) -> dg.ExecuteInProcessResult:
    """``selection`` of the tiny partition with one torch thread in process and child alike."""
    resources = {**pipeline_resources(home), "compute": ComputeResource(launcher=launcher, threads=1, **compute)}
    return dg.materialize(build_assets(dataset_partitions()), selection=selection, partition_key=DATASET,
                          resources=resources, instance=instance or dagster_instance(DATASET), raise_on_error=False)


def mlflow_runs(result: dg.ExecuteInProcessResult) -> dict[str, mlflow.entities.Run]:
    """The MLflow run of each materialized asset, by asset name."""
    client = mlflow.MlflowClient(Home.from_env().mlflow_uri)
    return {e.asset_key.to_user_string(): client.get_run(e.materialization.metadata["mlflow_run_id"].value)
            for e in result.get_asset_materialization_events()}


def step_history(run: mlflow.entities.Run, key: str) -> list[tuple[int, float]]:
    client = mlflow.MlflowClient(Home.from_env().mlflow_uri)
    return [(m.step, m.value) for m in sorted(client.get_metric_history(run.info.run_id, key), key=lambda m: m.step)]


def failure_text(result: dg.ExecuteInProcessResult) -> str:
    return "\n".join(e.event_specific_data.error.to_string() for e in result.get_step_failure_events())


def arrays(store: ArtifactStore) -> dict[str, np.ndarray]:
    pre, cls = store.stage_dir(DATASET, "pretrain"), store.stage_dir(DATASET, "classifier")
    return {"train_emb": np.load(pre / TRAIN_EMB), "label_emb": np.load(pre / LABEL_EMB), "W": np.load(cls / W)}


def test_launched_training_stages_match_in_process(home):
    first = materialize(home, ALL_TRAINING)
    assert first.success, failure_text(first)
    store = ArtifactStore(home.artifacts)
    expected, in_runs = arrays(store), mlflow_runs(first)
    params = {s: (store.stage_dir(DATASET, s) / PARAMS).read_text() for s in ("pretrain", "classifier")}

    instance = dagster_instance(DATASET)
    launched = materialize(home, TRAINING, "subprocess", instance)
    assert launched.success, failure_text(launched)
    got, runs = arrays(store), mlflow_runs(launched)
    assert set(runs) == set(TRAINING)
    for name, want in expected.items():  # same seeds, one CPU thread: the same numbers
        assert got[name].shape == want.shape and np.allclose(got[name], want, atol=1e-6, rtol=0), name
    step_keys = {"siamese_encoder": "pretrain_loss", "classifiers": "classifier_loss"}
    for asset, key in step_keys.items():
        run, before = runs[asset], in_runs[asset]
        assert run.info.status == "FINISHED" and run.data.tags["dagster_run_id"] == launched.run_id
        assert set(run.data.metrics) == set(before.data.metrics)  # the child's step metrics, the final numbers
        steps, ref = step_history(run, key), step_history(before, key)
        assert [s for s, _ in steps] == [s for s, _ in ref] and len(steps) >= 1
        assert np.allclose([v for _, v in steps], [v for _, v in ref], atol=1e-5)
    # the child ran with the config the asset resolved (upstream records included) and recorded it
    assert {s: (store.stage_dir(DATASET, s) / PARAMS).read_text() for s in params} == params
    assert runs["classifiers"].data.params["classifier.epochs"] == "2.0"

    # the child's lines reached the step's log through Pipes, written by another process
    logs = [e.user_message for e in instance.all_logs(launched.run_id)]
    for (asset, key), stage in zip(step_keys.items(), ("pretrain", "classifier")):
        first_step = step_history(runs[asset], key)[0][0]  # the line of each step the child logged to MLflow
        assert any(m.startswith(f"{stage} step {first_step}: ") and f"{key}=" in m for m in logs), stage
        pids = {m.split("launched in process ")[1].split()[0] for m in logs
                if m.startswith(f"{stage} {DATASET}: launched in process ")}
        assert len(pids) == 1 and pids != {str(os.getpid())}
    assert sum("[pipes] external process successfully opened dagster pipes" in m for m in logs) == 2
    summary = json.loads((store.stage_dir(DATASET, "classifier") / SUMMARY).read_text())
    meta = {e.asset_key.to_user_string(): e.materialization.metadata
            for e in launched.get_asset_materialization_events()}
    assert meta["classifiers"]["steps"].value == float(summary["steps"]) and "peak_rss_mb" in meta["classifiers"]



def test_a_killed_child_fails_the_step_and_leaves_no_half_written_stage(home, tmp_path, monkeypatch):
    assert materialize(home, ["dataset", "tokens"]).success
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(KILL_HOOK)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(hook), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv(KILL_ENV, "1")
    killed = materialize(home, ["siamese_encoder"], "subprocess")
    assert not killed.success
    error = failure_text(killed)
    assert ("stage 'pretrain' of dataset 'TinyTitles': the training process was killed by signal SIGKILL (9;"
            in error), error[-3000:]
    store = ArtifactStore(home.artifacts)
    final = store.stage_dir(DATASET, "pretrain")
    assert not final.exists() and stage_leftovers(final) == []  # killed before writing: nothing of it is there
    client = mlflow.MlflowClient(home.mlflow_uri)
    (run,) = client.search_runs([client.get_experiment_by_name(f"xc-dagster/{DATASET}").experiment_id],
                                "tags.asset = 'pretrain'")
    assert run.info.status == "FAILED" and run.data.metrics == {}  # the child died at its first step

    monkeypatch.delenv(KILL_ENV)
    again = materialize(home, ["siamese_encoder"], "subprocess")
    assert again.success, failure_text(again)
    assert (final / SUMMARY).is_file() and (final / TRAIN_EMB).is_file() and stage_leftovers(final) == []


def test_one_training_process_only(home):
    # torchrun's variables: the entry point refuses before it reads anything, in a real process
    env = {**os.environ, "WORLD_SIZE": "2", "RANK": "0"}
    out = subprocess.run([sys.executable, "-m", launch.MODULE, "--payload", "{}"], env=env, capture_output=True,
                         text=True, cwd=ROOT, timeout=300)
    assert out.returncode != 0
    assert ("XCConfigError: WORLD_SIZE = 2: only the pretrain stage (data parallel) and the classifier stage (W's "
            "label ranges over the ranks) train with several processes; the others run in one; the payload's stage "
            "is None") in out.stderr
    with pytest.raises(XCConfigError, match="WORLD_SIZE: expected an integer >= 1"):
        launch.main(["--payload", "{}"], environ={"WORLD_SIZE": "two"})
    # nproc_per_node > 1: refused for the training stages at launch, whatever the launcher; other stages run
    compute = ComputeResource(launcher="subprocess", nproc_per_node=2)
    with pytest.raises(XCConfigError, match=r"^compute resource field 'nproc_per_node' = 2: several training "
                                            r"processes need launcher 'torchrun', got 'subprocess'$"):
        compute.launches("classifier")
    torchrun = ComputeResource(launcher="torchrun", nproc_per_node=2)
    assert torchrun.launches("classifier") and torchrun.processes("pretrain") == 2
    assert torchrun.processes("classifier") == 2 and torchrun.processes("index") == 1
    assert compute.launches("index") is False and ComputeResource(nproc_per_node=2).launches("ingest") is False
    failed = materialize(home, ["siamese_encoder"], "subprocess", nproc_per_node=2)
    assert not failed.success and "'nproc_per_node' = 2: several training processes" in failure_text(failed)
    client = mlflow.MlflowClient(home.mlflow_uri)  # refused before the MLflow run opened
    assert client.get_experiment_by_name(f"xc-dagster/{DATASET}") is None

    # a child that fails (here: no upstream artifacts) exits 1, its error reported to the step through Pipes
    instance = dagster_instance(DATASET)
    failed = materialize(home, ["siamese_encoder"], "subprocess", instance)
    assert not failed.success and ("stage 'pretrain' of dataset 'TinyTitles': the training process exited with "
                                   "code 1 (its error is in the step's log and stderr)") in failure_text(failed)
    reported = [str(e.dagster_event.engine_event_data.error) for e in instance.all_logs(failed.run_id)
                if e.dagster_event is not None and "closed with exception" in (e.user_message or "")]
    assert len(reported) == 1 and "MissingArtifact" in reported[0] and "'ingest'" in reported[0], reported


@pytest.mark.parametrize("fields, field, expected", [
    ({"launcher": "docker"}, "launcher", "expected one of 'in_process', 'subprocess', 'torchrun', 'k8s', got 'docker'"),
    ({"launcher": ""}, "launcher", "expected one of 'in_process', 'subprocess', 'torchrun', 'k8s', got ''"),
    ({"nproc_per_node": 0}, "nproc_per_node", "expected an integer >= 1, got 0"),
    ({"gpus_per_pod": -1}, "gpus_per_pod", "expected an integer >= 0 (0: no GPU), got -1"),
    ({"launcher": "k8s"}, "image", "expected the container image the k8s launcher runs the training stages in"),
])
def test_bad_compute_fields_are_refused_naming_the_field(fields, field, expected):
    with pytest.raises(ValueError) as err:
        ComputeResource(**fields)
    assert f"compute resource field {field!r}: {expected}" in str(err.value)
    # the same through the run config (a Dagster run's resources)
    res = dg.materialize([_probe], resources={"compute": ComputeResource()}, raise_on_error=False,
                         run_config={"resources": {"compute": {"config": fields}}})
    assert not res.success and f"compute resource field {field!r}: {expected}" in "\n".join(
        e.event_specific_data.error.to_string() for e in res.all_events if e.is_failure and e.event_specific_data
        and getattr(e.event_specific_data, "error", None))


@dg.asset
def _probe(compute: ComputeResource) -> None:
    pass


def _request() -> LaunchRequest:
    spec = DatasetSpec(DATASET, "/data/TinyTitles", strategy="astra", overrides={"classifier.epochs": 3})
    cfg = spec.config({"classifier.lr": 0.05})
    return LaunchRequest("classifier", spec, cfg, "cuda", 4)


def test_the_payload_carries_exactly_the_resolved_config():
    request = _request()
    back = LaunchRequest.from_payload(request.payload())
    assert back.cfg == request.cfg and back.cfg.flat() == request.cfg.flat()  # tuples come back as tuples
    assert back.cfg.explicit == request.cfg.explicit >= {"classifier.epochs", "classifier.lr"}
    assert (back.stage, back.spec, back.device, back.threads) == ("classifier", request.spec, "cuda", 4)
    payload = json.loads(request.payload())
    with pytest.raises(XCConfigError, match="stage 'index' cannot be launched in a process of its own"):
        LaunchRequest.from_payload(json.dumps({**payload, "stage": "index"}))
    with pytest.raises(XCConfigError, match="unknown field 'classifier.nope'"):
        LaunchRequest.from_payload(json.dumps({**payload, "config": {**payload["config"], "classifier.nope": 1}}))
    with pytest.raises(XCConfigError, match=r"missing or not reproducible values of \['pretrain.lr'\]"):
        LaunchRequest.from_payload(json.dumps({**payload, "config": {k: v for k, v in payload["config"].items()
                                                                     if k != "pretrain.lr"}}))
    with pytest.raises(XCConfigError, match="--payload: not valid JSON"):
        LaunchRequest.from_payload("{")


def test_exit_messages_name_the_stage_and_the_signal():
    msg = exit_message("pretrain", "D", "External execution process failed with code -9")
    assert msg.startswith("stage 'pretrain' of dataset 'D': the training process was killed by signal SIGKILL (9;")
    assert "exited with code 3" in exit_message("classifier", "D", "External execution process failed with code 3")
    assert "(pod failed)" in exit_message("classifier", "D", "pod failed")


def test_the_k8s_pod_spec(monkeypatch):
    monkeypatch.delenv("XC_ARTIFACT_ROOT", raising=False)
    request = _request()
    env = {"XC_HOME": "/xc", "MLFLOW_TRACKING_URI": "http://mlflow:5000", "MLFLOW_RUN_ID": "abc123"}
    compute = ComputeResource(launcher="k8s", image="registry.example/xc-dagster:1.0", namespace="ml",
                              gpus_per_pod=2, k8s_env={"HF_HOME": "/cache/hf", "XC_HOME": "/mnt/xc"})
    command = ["python", "-m", "xc_dagster.training.launch", "--payload", request.payload()]
    assert compute.k8s_pod_spec(request, env) == {
        "containers": [{
            "name": "xc-train", "image": "registry.example/xc-dagster:1.0", "command": command,
            "env": [{"name": "XC_HOME", "value": "/mnt/xc"},  # k8s_env overrides the home the pod sees
                    {"name": "MLFLOW_TRACKING_URI", "value": "http://mlflow:5000"},
                    {"name": "MLFLOW_RUN_ID", "value": "abc123"}, {"name": "HF_HOME", "value": "/cache/hf"}],
            "resources": {"limits": {"nvidia.com/gpu": 2}},
        }],
        "restartPolicy": "Never",
    }
    # no GPU asked: no limit; the remote artifact root goes with the pod
    monkeypatch.setenv("XC_ARTIFACT_ROOT", "s3://bucket/xc")
    (container,) = ComputeResource(launcher="k8s", image="img").k8s_pod_spec(request, env)["containers"]
    assert "resources" not in container and container["image"] == "img" and container["command"] == command
    assert {e["name"]: e["value"] for e in container["env"]} == {**env, "XC_ARTIFACT_ROOT": "s3://bucket/xc"}
    if importlib.util.find_spec("dagster_k8s") is None:  # the k8s extra is not installed: a clear error
        with pytest.raises(XCConfigError, match=r"'k8s' needs the dagster-k8s package: pip install 'xc-dagster"):
            compute._k8s_module()


class _FakePipesK8sClient:
    """dagster_k8s.PipesK8sClient's call as the k8s launcher makes it (no cluster): records it, reports a summary
    or fails as a pod whose container was killed."""

    calls: list[dict] = []
    fail: str | None = None

    def run(self, **kwargs):
        type(self).calls.append(kwargs)
        if self.fail:
            raise RuntimeError(self.fail)
        return types.SimpleNamespace(get_custom_messages=lambda: [{"other": 1}, {"summary": {"steps": 7}}])


def test_the_k8s_launcher_runs_the_rendered_pod(monkeypatch):
    monkeypatch.setitem(sys.modules, "dagster_k8s", types.SimpleNamespace(PipesK8sClient=_FakePipesK8sClient))
    monkeypatch.setattr(_FakePipesK8sClient, "calls", [])
    request, context = _request(), object()
    env = {"XC_HOME": "/xc", "MLFLOW_TRACKING_URI": "http://mlflow:5000", "MLFLOW_RUN_ID": "abc123"}
    compute = ComputeResource(launcher="k8s", image="img", gpus_per_pod=1)
    assert compute.launches("classifier") and compute.launch(context, request, env) == {"steps": 7}
    (call,) = _FakePipesK8sClient.calls
    assert call == {"context": context, "namespace": None, "base_pod_spec": compute.k8s_pod_spec(request, env)}
    monkeypatch.setattr(_FakePipesK8sClient, "fail", "Pod did not exit successfully: container exited with 137")
    with pytest.raises(XCError, match=r"^stage 'classifier' of dataset 'TinyTitles': the training process failed "
                                      r"\(Pod did not exit successfully: container exited with 137\)"):
        ComputeResource(launcher="k8s", image="img", namespace="ml").launch(context, request, env)
    assert _FakePipesK8sClient.calls[-1]["namespace"] == "ml"

def test_the_torchrun_launcher_trains_pretraining_with_two_processes(tmp_path, monkeypatch):
    """``compute: launcher: torchrun, nproc_per_node: 2`` from Dagster: pretraining runs as 2 data-parallel ranks
    (the same embeddings as in process, to 1e-5; one MLflow run with the step metrics), the classifier stage as 2
    ranks each holding half of W's labels (the same W), and the pipeline's later stages read the result as usual."""
    monkeypatch.setenv("XC_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    h = ready_home(tmp_path / "home")
    src = write_lf_dataset(tmp_path / "src" / DATASET, n_train=60, n_test=20)
    encoder = _no_dropout_bert(tmp_path / "bert")  # dropout masks differ per rank: equal only in distribution
    Catalog(h.catalog).add(DatasetSpec(DATASET, str(src), overrides={**SETTINGS, "tokenize.encoder": str(encoder),
                                                                       "pretrain.amp": "off"}))
    first = materialize(h, ALL_TRAINING)
    assert first.success, failure_text(first)
    store = ArtifactStore(h.artifacts)
    want = arrays(store)
    instance = dagster_instance(DATASET)
    ranks = materialize(h, TRAINING, "torchrun", instance, nproc_per_node=2)
    assert ranks.success, failure_text(ranks)
    got = arrays(store)
    summary = json.loads((store.stage_dir(DATASET, "pretrain") / SUMMARY).read_text())
    assert summary["world_size"] == 2
    np.testing.assert_allclose(got["train_emb"], want["train_emb"], atol=1e-5)
    np.testing.assert_allclose(got["W"], want["W"], atol=1e-4)
    runs = mlflow_runs(ranks)
    assert set(runs) == set(TRAINING) and step_history(runs["siamese_encoder"], "pretrain_loss")
    logs = [e.user_message for e in instance.all_logs(ranks.run_id)]
    classifier = json.loads((store.stage_dir(DATASET, "classifier") / SUMMARY).read_text())
    assert classifier["world_size"] == 2 and step_history(runs["classifiers"], "classifier_loss")
    assert not any(m.startswith("classifier: one training process") for m in logs)
    assert any("rank 1 of 2 launched" in m for m in logs) is False  # rank 1 logs to stderr, rank 0 through Pipes
    assert any("rank 0 of 2 launched" in m for m in logs)


RANK_KILL_ENV = "XC_TEST_KILL_RANK_1"
# loaded by each rank's interpreter: with RANK_KILL_ENV set, rank 1 SIGKILLs itself at its first gradient averaging
# once a checkpoint exists under XC_HOME (the first epoch's, which rank 0 writes)
RANK_KILL_HOOK = textwrap.dedent(f"""
    import glob, os, signal
    if os.environ.get({RANK_KILL_ENV!r}) and os.environ.get("RANK") == "1":
        from xc_dagster.training import data_parallel
        _average = data_parallel.average_gradients

        def _average_or_die(params, env):
            if glob.glob(os.path.join(os.environ["XC_HOME"], "**", "state.pt"), recursive=True):
                os.kill(os.getpid(), signal.SIGKILL)
            return _average(params, env)

        data_parallel.average_gradients = _average_or_die
""")


def test_a_killed_rank_fails_the_step_clearly_and_the_re_run_resumes(tmp_path, monkeypatch):
    """torchrun with 2 ranks, rank 1 SIGKILLed in the second epoch: the step fails saying what torchrun did, the
    pretrain stage is not half-written, and the re-run resumes from the first epoch's checkpoint."""
    monkeypatch.setenv("XC_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    h = ready_home(tmp_path / "home")
    src = write_lf_dataset(tmp_path / "src" / DATASET, n_train=60, n_test=20)
    Catalog(h.catalog).add(DatasetSpec(DATASET, str(src), overrides={
        **SETTINGS, "tokenize.encoder": str(_no_dropout_bert(tmp_path / "bert")), "pretrain.epochs": 2}))
    instance = dagster_instance(DATASET)
    assert materialize(h, ["dataset", "tokens"], instance=instance).success
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(RANK_KILL_HOOK)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(hook), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv(RANK_KILL_ENV, "1")
    killed = materialize(h, ["siamese_encoder"], "torchrun", instance, nproc_per_node=2)
    assert not killed.success
    error = failure_text(killed)
    assert ("stage 'pretrain' of dataset 'TinyTitles': torchrun's 2 training processes exited with code 1: a rank "
            "failed or was killed" in error), error[-3000:]
    final = ArtifactStore(h.artifacts).stage_dir(DATASET, "pretrain")
    assert not final.exists() and stage_leftovers(final) == []

    monkeypatch.delenv(RANK_KILL_ENV)
    again = materialize(h, ["siamese_encoder"], "torchrun", instance, nproc_per_node=2)
    assert again.success, failure_text(again)
    summary = json.loads((final / SUMMARY).read_text())
    assert summary["world_size"] == 2 and summary["resumed_from_epoch"] == 1
