"""Artifacts on a remote root (``XC_ARTIFACT_ROOT``) against a real S3 API: moto's server on a free local port.

Publish then fetch into an empty cache; a publisher SIGKILLed halfway leaves the previous version whole; a local
rewrite during a publish fails it; a fetch never replaces a local write its run has not published yet, and always
replaces one older than the remote version or without a record; a changed object is refused on fetch; MLflow's run
artifacts and a logged model go to the bucket; a tiny partition end to end, then read from a second home whose cache
is empty."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import boto3
import mlflow
import numpy as np
import pytest
from moto.server import ThreadedMotoServer
from s3fs import S3FileSystem

from tests.test_pipeline import tiny_home  # noqa: F401  (fixture)
from tests.tinydata import kill_at_marker
from xc_dagster import storage
from xc_dagster.artifacts import METRICS, PREDICTIONS, STAGE_ORDER, ArtifactReader
from xc_dagster.catalog import Catalog
from xc_dagster.pipeline import StageContext, run_all
from xc_dagster.remote_store import ROOT_ENV, RemoteArtifactError, RemoteStore
from xc_dagster.storage import ArtifactStore, MissingArtifact, load_json
from xc_dagster.tracking import Tracker, use_tracking_uri

ROOT = Path(__file__).resolve().parent.parent
BUCKET = "xc-artifacts"
DUMMY_AWS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


@pytest.fixture(scope="module")  # one server for the module's tests (only this module uses it)
def s3_endpoint():
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    url = f"http://{host}:{port}"
    boto3.client("s3", endpoint_url=url, **{k.lower(): v for k, v in DUMMY_AWS.items()
                                            if k != "AWS_DEFAULT_REGION"},
                 region_name="us-east-1").create_bucket(Bucket=BUCKET)
    yield url
    S3FileSystem.clear_instance_cache()  # its clients name this server's endpoint
    server.stop()


@pytest.fixture
def s3(s3_endpoint, monkeypatch):
    """Dummy credentials and the endpoint for botocore (s3fs reads AWS_ENDPOINT_URL) and MLflow; the S3 client."""
    for key in ("AWS_PROFILE", "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE", ROOT_ENV):
        monkeypatch.delenv(key, raising=False)
    for key, value in {**DUMMY_AWS, "AWS_ENDPOINT_URL": s3_endpoint, "MLFLOW_S3_ENDPOINT_URL": s3_endpoint}.items():
        monkeypatch.setenv(key, value)
    return boto3.client("s3", endpoint_url=s3_endpoint)


def keys(client, prefix: str) -> list[str]:
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix)
    return sorted(o["Key"] for page in pages for o in page.get("Contents", []))


def write_stage(store: ArtifactStore, files: dict[str, bytes], empty_dirs: tuple[str, ...] = (),
                dataset: str = "D", stage: str = "ingest") -> Path:
    with store.writing(dataset, stage) as out:
        for rel, data in files.items():
            (out / rel).parent.mkdir(parents=True, exist_ok=True)
            (out / rel).write_bytes(data)
        for rel in empty_dirs:
            (out / rel).mkdir(parents=True)
    return store.stage_dir(dataset, stage)


def tree(folder: Path) -> dict[str, bytes | None]:
    """Every file's bytes and every folder (None) under ``folder``, by relative path."""
    return {p.relative_to(folder).as_posix(): (p.read_bytes() if p.is_file() else None)
            for p in sorted(folder.rglob("*"))}


FILES = {"summary.json": b'{"n": 3}\n', "dataset/train.npy": bytes(range(256)) * 40,
         "dataset/texts/label.txt": "étiquette\n".encode(), "checks.json": b""}


def test_the_root_comes_from_the_environment_and_unset_keeps_everything_local(s3, tmp_path, monkeypatch):
    assert ArtifactStore(tmp_path).remote is None and Tracker("sqlite:///:memory:").remote_root is None
    monkeypatch.setenv(ROOT_ENV, f"s3://{BUCKET}/env/")
    store = ArtifactStore(tmp_path)
    assert store.remote.root == f"s3://{BUCKET}/env" and Tracker("sqlite:///:memory:").remote_root == store.remote.root
    assert ArtifactStore(tmp_path, remote=None).remote is None
    with pytest.raises(MissingArtifact, match=f"nor under s3://{BUCKET}/env/D/ingest; materialize it first"):
        store.require("D", "ingest")
    local = ArtifactStore(tmp_path / "local", remote=None)
    write_stage(local, FILES)
    assert local.publish("D", "ingest") is None and not (tmp_path / "local" / "D" / "_remote").exists()


def test_publish_then_fetch_into_an_empty_cache_gives_identical_files(s3, tmp_path):
    root = f"s3://{BUCKET}/roundtrip"
    a = ArtifactStore(tmp_path / "a", RemoteStore(root))
    src = write_stage(a, FILES, empty_dirs=("dataset/empty",))
    manifest = a.publish("D", "ingest")
    base = f"roundtrip/D/ingest/versions/{manifest.version}"
    assert keys(s3, "roundtrip/") == sorted(["roundtrip/D/ingest/MANIFEST.json"]
                                            + [f"{base}/{rel}" for rel in FILES])
    body = json.loads(s3.get_object(Bucket=BUCKET, Key="roundtrip/D/ingest/MANIFEST.json")["Body"].read())
    assert body["version"] == manifest.version and body["dirs"] == ["dataset/empty"]
    assert body["files"] == {rel: {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
                             for rel, data in FILES.items()}

    b = ArtifactStore(tmp_path / "b", RemoteStore(root))
    got = b.require("D", "ingest")
    assert tree(got) == tree(src) and tree(got)["dataset/train.npy"] == FILES["dataset/train.npy"]
    link = os.readlink(got)
    assert ArtifactStore(tmp_path / "b", RemoteStore(root)).require("D", "ingest") == got
    assert os.readlink(got) == link  # the same version is not fetched again

    write_stage(a, {**FILES, "summary.json": b'{"n": 4}\n'})  # machine a materializes the stage again
    a.publish("D", "ingest")
    again = ArtifactStore(tmp_path / "b", RemoteStore(root))
    assert (again.require("D", "ingest") / "summary.json").read_bytes() == b'{"n": 4}\n'
    assert os.readlink(got) != link and sorted(p.name for p in (tmp_path / "b" / "D").iterdir()) == sorted(
        [".ingest.lock", os.readlink(got), "_remote", "ingest"])  # the replaced version is gone
    assert len(keys(s3, "roundtrip/D/ingest/versions/")) == 2 * len(FILES)  # old versions are kept


# publishes the stage of the tree in argv[1] to argv[2], printing "halfway" after argv[3] uploads and waiting there
PUBLISHER = """
import sys, time
from pathlib import Path
from xc_dagster.remote_store import RemoteStore
from xc_dagster.storage import ArtifactStore
upload, done = RemoteStore._upload, []
def counting(self, src, key):
    out = upload(self, src, key)
    done.append(key)
    if len(done) == int(sys.argv[3]):
        print("halfway", flush=True)
        time.sleep(600)
    return out
RemoteStore._upload = counting
ArtifactStore(Path(sys.argv[1]), RemoteStore(sys.argv[2])).publish("D", "ingest")
"""


def test_a_publish_killed_halfway_leaves_the_previous_version_whole(s3, s3_endpoint, tmp_path):
    root = f"s3://{BUCKET}/killed"
    old = {f"part{i}.bin": f"old {i}\n".encode() * 100 for i in range(6)}
    new = {f"part{i}.bin": f"new {i}\n".encode() * 150 for i in range(6)}
    writer = ArtifactStore(tmp_path / "w", RemoteStore(root))
    write_stage(writer, old)
    v1 = writer.publish("D", "ingest").version
    write_stage(writer, new)  # the new version, complete locally; a child process publishes it
    env = {k: v for k, v in os.environ.items() if k not in ("AWS_ENDPOINT_URL", "MLFLOW_S3_ENDPOINT_URL")}
    child = subprocess.Popen([sys.executable, "-c", PUBLISHER, str(tmp_path / "w"), root, "3"],
                             stdout=subprocess.PIPE, text=True,
                             env={**env, "FSSPEC_S3_ENDPOINT_URL": s3_endpoint})  # fsspec's variable alone
    kill_at_marker(child, "halfway")

    versions = {k.split("/")[4] for k in keys(s3, "killed/D/ingest/versions/")}
    partial = versions - {v1}
    assert len(partial) == 1 and len(keys(s3, f"killed/D/ingest/versions/{partial.pop()}/")) == 3
    assert RemoteStore(root).manifest("D", "ingest").version == v1
    reader = ArtifactStore(tmp_path / "r", RemoteStore(root))
    assert tree(reader.require("D", "ingest")) == old
    # the writer's own unpublished copy is newer work than the root's: kept, for the stage's next publish to send
    assert tree(ArtifactStore(tmp_path / "w", RemoteStore(root)).require("D", "ingest")) == new


def test_a_changed_missing_or_hostile_remote_object_is_refused_and_nothing_is_cached(s3, tmp_path):
    root = f"s3://{BUCKET}/tampered"
    a = ArtifactStore(tmp_path / "a", RemoteStore(root))
    write_stage(a, FILES)
    version = a.publish("D", "ingest").version
    key = f"tampered/D/ingest/versions/{version}/dataset/train.npy"
    data = bytearray(FILES["dataset/train.npy"])
    data[1000] ^= 1  # one bit: the same size
    s3.put_object(Bucket=BUCKET, Key=key, Body=bytes(data))
    b = tmp_path / "b"
    with pytest.raises(RemoteArtifactError, match=rf"^s3://{BUCKET}/{key}: size 10240 sha256 [0-9a-f]{{64}}, but the "
                                                  rf"manifest s3://{BUCKET}/tampered/D/ingest/MANIFEST.json says"):
        ArtifactStore(b, RemoteStore(root)).require("D", "ingest")
    assert sorted(p.name for p in (b / "D").iterdir()) == [".ingest.lock", "_remote"]  # no stage, no leftover

    s3.put_object(Bucket=BUCKET, Key=key, Body=FILES["dataset/train.npy"] + b"more")
    with pytest.raises(RemoteArtifactError, match=f"{key}: size over 10240 sha256 \\(not read to its end\\), but"):
        ArtifactStore(b, RemoteStore(root)).require("D", "ingest")
    s3.delete_object(Bucket=BUCKET, Key=key)
    with pytest.raises(RemoteArtifactError, match=f"{key}: missing, though the manifest .* names it"):
        ArtifactStore(b, RemoteStore(root)).require("D", "ingest")

    manifest = json.loads(s3.get_object(Bucket=BUCKET, Key="tampered/D/ingest/MANIFEST.json")["Body"].read())
    manifest["files"]["../../escape.txt"] = manifest["files"].pop("summary.json")
    s3.put_object(Bucket=BUCKET, Key="tampered/D/ingest/MANIFEST.json", Body=json.dumps(manifest).encode())
    with pytest.raises(RemoteArtifactError, match="MANIFEST.json: field 'files'/'dirs': expected relative paths "
                                                  "inside the version, got '../../escape.txt'"):
        ArtifactStore(b, RemoteStore(root)).require("D", "ingest")
    assert not (b / "D" / "ingest").exists() and not (tmp_path / "escape.txt").exists()

    manifest["files"]["summary.json"] = manifest["files"].pop("../../escape.txt")
    manifest["stage"] = "evaluate"  # another stage's manifest copied here
    s3.put_object(Bucket=BUCKET, Key="tampered/D/ingest/MANIFEST.json", Body=json.dumps(manifest).encode())
    with pytest.raises(RemoteArtifactError, match="MANIFEST.json: field 'stage': expected 'ingest', got 'evaluate'"):
        ArtifactStore(b, RemoteStore(root)).require("D", "ingest")


def test_a_local_folder_root_publishes_by_rename(tmp_path):
    root = tmp_path / "shared"  # a mounted file system: the manifest is written to a temporary file and renamed
    a = ArtifactStore(tmp_path / "a", RemoteStore(str(root)))
    write_stage(a, FILES)
    version = a.publish("D", "ingest").version
    assert sorted(p.name for p in (root / "D" / "ingest").iterdir()) == ["MANIFEST.json", "versions"]
    assert json.loads((root / "D" / "ingest" / "MANIFEST.json").read_text())["version"] == version
    assert tree(ArtifactStore(tmp_path / "b", RemoteStore(f"file://{root}")).require("D", "ingest")) == tree(
        a.stage_dir("D", "ingest"))


# publishes the stage of the tree in argv[1] to argv[2]; after uploading the file named argv[3] it prints "paused"
# and waits for the file argv[4]
PAUSED_PUBLISHER = """
import sys, time
from pathlib import Path
from xc_dagster.remote_store import RemoteStore
from xc_dagster.storage import ArtifactStore
upload = RemoteStore._upload
def pausing(self, src, key):
    out = upload(self, src, key)
    if src.name == sys.argv[3]:
        print("paused", flush=True)
        while not Path(sys.argv[4]).exists():
            time.sleep(0.01)
    return out
RemoteStore._upload = pausing
ArtifactStore(Path(sys.argv[1]), RemoteStore(sys.argv[2])).publish("D", "ingest")
"""


@pytest.mark.parametrize("pause_after, files", [
    ("a.json", {"a.json": b"1", "encoder/w.bin": b"w" * 100}),  # its sub-folder is removed before it is listed
    ("b.json", {"a.json": b"1", "b.json": b"2"}),  # every file sent, then the version is replaced before the manifest
])
def test_a_local_rewrite_during_a_publish_fails_it_and_leaves_the_previous_version(tmp_path, pause_after, files):
    root = str(tmp_path / "shared")
    store = ArtifactStore(tmp_path / "home", RemoteStore(root))
    write_stage(store, {"a.json": b"0"})
    v1 = store.publish("D", "ingest").version
    write_stage(store, files)
    go = tmp_path / "go"
    child = subprocess.Popen([sys.executable, "-c", PAUSED_PUBLISHER, str(tmp_path / "home"), root, pause_after,
                              str(go)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "paused"
        write_stage(store, {"a.json": b"3"})  # a concurrent run of the stage: the version being sent is retired
    finally:
        go.touch()
    _, err = child.communicate(timeout=60)
    assert child.returncode == 1 and "RemoteArtifactError" in err, err
    assert RemoteStore(root).manifest("D", "ingest").version == v1  # nothing incomplete was made current


# writes the stage of the tree in argv[1] (remote root argv[2]), prints "switched", waits for the file argv[3], then
# publishes it: a run paused between its write and its publish
WRITE_THEN_PUBLISH = """
import sys, time
from pathlib import Path
from xc_dagster.remote_store import RemoteStore
from xc_dagster.storage import ArtifactStore
store = ArtifactStore(Path(sys.argv[1]), RemoteStore(sys.argv[2]))
with store.writing("D", "ingest") as out:
    (out / "summary.json").write_text("new run")
print("switched", flush=True)
while not Path(sys.argv[3]).exists():
    time.sleep(0.01)
store.publish("D", "ingest")
"""


def test_a_fetch_never_replaces_a_write_its_run_has_not_published_yet(tmp_path):
    root = str(tmp_path / "shared")
    a, b = tmp_path / "a", tmp_path / "b"
    write_stage(ArtifactStore(a, RemoteStore(root)), {"summary.json": b"old run"})
    ArtifactStore(a, RemoteStore(root)).publish("D", "ingest")
    assert tree(ArtifactStore(b, RemoteStore(root)).require("D", "ingest")) == {"summary.json": b"old run"}  # first
    go = tmp_path / "go"
    child = subprocess.Popen([sys.executable, "-c", WRITE_THEN_PUBLISH, str(a), root, str(go)], cwd=ROOT,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "switched"
        # another run on home a reads the stage while the remote still names the old run's version
        assert tree(ArtifactStore(a, RemoteStore(root)).require("D", "ingest")) == {"summary.json": b"new run"}
    finally:
        go.touch()
    _, err = child.communicate(timeout=60)
    assert child.returncode == 0, err
    manifest = RemoteStore(root).manifest("D", "ingest")
    assert (tmp_path / "shared/D/ingest/versions" / manifest.version / "summary.json").read_text() == "new run"
    link = os.readlink(a / "D" / "ingest")
    assert tree(ArtifactStore(a, RemoteStore(root)).require("D", "ingest")) == {"summary.json": b"new run"}
    assert os.readlink(a / "D" / "ingest") == link  # its own published version is not fetched again
    # the remote moved on: home b's copy of the old version is replaced by the new one
    assert tree(ArtifactStore(b, RemoteStore(root)).require("D", "ingest")) == {"summary.json": b"new run"}


def test_a_write_older_than_the_remote_version_or_without_a_record_is_replaced_by_it(tmp_path, monkeypatch):
    """Home a's pretrain, whose publish failed, then home b's newer publish: a's next read fetches b's version, so a
    never publishes a classifier built on a pretrain the remote does not have. A stage written before the remote
    root was set, or recorded for another root string, is no unpublished write of this root: replaced too."""
    root = str(tmp_path / "shared")
    a = ArtifactStore(tmp_path / "a", RemoteStore(root))
    write_stage(a, {"summary.json": b"a's pretrain"}, stage="pretrain")

    def store_down(key, data):
        raise OSError("store down")

    monkeypatch.setattr(a.remote, "_put_manifest", store_down)
    with pytest.raises(RemoteArtifactError, match="store down"):
        a.publish("D", "pretrain")
    monkeypatch.undo()
    assert tree(ArtifactStore(tmp_path / "a", RemoteStore(root)).require("D", "pretrain")) == {
        "summary.json": b"a's pretrain"}  # the remote has no version yet: the local write is all there is
    b = ArtifactStore(tmp_path / "b", RemoteStore(root))
    write_stage(b, {"summary.json": b"b's pretrain"}, stage="pretrain")
    b.publish("D", "pretrain")
    assert tree(ArtifactStore(tmp_path / "a", RemoteStore(root)).require("D", "pretrain")) == {
        "summary.json": b"b's pretrain"}

    write_stage(ArtifactStore(tmp_path / "c", remote=None), {"summary.json": b"local only"}, stage="pretrain")
    write_stage(ArtifactStore(tmp_path / "d", RemoteStore(f"file://{root}")), {"summary.json": b"other root"},
                stage="pretrain")  # written after b's publish, but recorded for another root string
    for home in ("c", "d"):
        got = ArtifactStore(tmp_path / home, RemoteStore(root)).require("D", "pretrain")
        assert tree(got) == {"summary.json": b"b's pretrain"}, home


@pytest.mark.parametrize("skew_days", [1, -1])
def test_which_of_a_write_and_a_publish_came_first_does_not_rest_on_the_hosts_clocks(tmp_path, monkeypatch,
                                                                                      skew_days):
    """A write records the remote version it was made over, not its time: home a's clock a day ahead or behind the
    publishing home's changes nothing. a's write whose publish failed, then b's publish: replaced by b's (a clock
    ahead had kept a's older data, to be published over b's); b's publish, then a's write: kept (a clock behind had
    replaced a's newer write). The remote unreadable at the write: recorded by its time, and the write stands."""
    day = 86_400 * 10**9
    monkeypatch.setattr(storage, "time", SimpleNamespace(time_ns=lambda: time.time_ns() + skew_days * day,
                                                         sleep=time.sleep))
    root = str(tmp_path / "shared")
    a = ArtifactStore(tmp_path / "a", RemoteStore(root))
    write_stage(a, {"summary.json": b"a's older write"}, stage="pretrain")  # its publish failed: not published
    b = ArtifactStore(tmp_path / "b", RemoteStore(root))
    write_stage(b, {"summary.json": b"b's publish"}, stage="pretrain")
    b.publish("D", "pretrain")
    assert tree(ArtifactStore(tmp_path / "a", RemoteStore(root)).require("D", "pretrain")) == {
        "summary.json": b"b's publish"}
    write_stage(ArtifactStore(tmp_path / "a", RemoteStore(root)), {"summary.json": b"a's newer write"},
                stage="pretrain")
    assert tree(ArtifactStore(tmp_path / "a", RemoteStore(root)).require("D", "pretrain")) == {
        "summary.json": b"a's newer write"}
    marker = json.loads((tmp_path / "a/D/_remote/pretrain.json").read_text())
    assert list(marker["pending"].values()) == [{"base": RemoteStore(root).manifest("D", "pretrain").version}]

    def unreadable(self, dataset, stage):
        raise RemoteArtifactError("store down")

    monkeypatch.setattr(RemoteStore, "manifest", unreadable)
    write_stage(ArtifactStore(tmp_path / "c", RemoteStore(root)), {"summary.json": b"c"}, stage="pretrain")
    assert (tmp_path / "c/D/pretrain/summary.json").read_bytes() == b"c"
    assert [type(v) for v in json.loads((tmp_path / "c/D/_remote/pretrain.json").read_text())["pending"].values()] \
        == [int]


def test_a_manifest_without_a_creation_time_is_older_than_any_unpublished_write(tmp_path):
    root = str(tmp_path / "shared")
    a = ArtifactStore(tmp_path / "a", RemoteStore(root))
    write_stage(a, {"summary.json": b"published"})
    assert a.publish("D", "ingest").created_ns > 0
    path = tmp_path / "shared/D/ingest/MANIFEST.json"
    manifest = json.loads(path.read_text())
    del manifest["created_ns"]  # as written before the field
    path.write_text(json.dumps(manifest))
    assert RemoteStore(root).manifest("D", "ingest").created_ns == 0
    write_stage(ArtifactStore(tmp_path / "a", RemoteStore(root)), {"summary.json": b"unpublished"})
    assert tree(ArtifactStore(tmp_path / "a", RemoteStore(root)).require("D", "ingest")) == {
        "summary.json": b"unpublished"}
    manifest["created_ns"] = "yesterday"
    path.write_text(json.dumps(manifest))
    with pytest.raises(RemoteArtifactError, match="field 'created_ns': expected an integer >= 0"):
        RemoteStore(root).manifest("D", "ingest")


class Doubler(mlflow.pyfunc.PythonModel):
    def predict(self, context, model_input: list[int], params=None) -> list[int]:
        return [2 * x for x in model_input]


def test_mlflow_run_artifacts_and_a_logged_model_go_to_the_bucket_and_load_back(s3, tmp_path, monkeypatch):
    monkeypatch.setenv(ROOT_ENV, f"s3://{BUCKET}/team")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    tracker = Tracker(f"sqlite:///{tmp_path / 'mlflow.db'}", tmp_path / "mlartifacts")
    exp = tracker.client.get_experiment(tracker.experiment_id("D"))
    assert exp.artifact_location == f"s3://{BUCKET}/team/mlflow/D"
    with tracker.run("D", "evaluate", {"k": 5}, {}) as run:
        run.log_dict({"p@1": 0.5}, "metrics/summary.json")
        with use_tracking_uri(tracker.tracking_uri), mlflow.start_run(run_id=run.run_id):
            info = mlflow.pyfunc.log_model(name="model", python_model=Doubler(), pip_requirements=["mlflow"])
    stored = keys(s3, "team/mlflow/D/")
    assert f"team/mlflow/D/{run.run_id}/artifacts/metrics/summary.json" in stored
    assert f"team/mlflow/D/models/{info.model_id}/artifacts/MLmodel" in stored
    assert not any((tmp_path / "mlartifacts").rglob("*.json"))
    with use_tracking_uri(tracker.tracking_uri):
        assert mlflow.artifacts.load_dict(f"runs:/{run.run_id}/metrics/summary.json") == {"p@1": 0.5}
        assert mlflow.pyfunc.load_model(info.model_uri).predict([1, 2, 3]) == [2, 4, 6]


def test_a_partition_end_to_end_on_the_bucket_is_read_by_a_second_home(s3, tiny_home, tmp_path,  # noqa: F811
                                                                        monkeypatch):
    monkeypatch.setenv(ROOT_ENV, f"s3://{BUCKET}/e2e")
    spec = Catalog(tiny_home.catalog).get("TinyTitles")
    first = ArtifactStore(tiny_home.artifacts)
    out = run_all(StageContext(first, spec, spec.config({"pretrain.epochs": 1}), tiny_home.cache))
    assert {s: out[s]["published_version"] for s in STAGE_ORDER} == {
        s: RemoteStore(f"s3://{BUCKET}/e2e").manifest("TinyTitles", s).version for s in STAGE_ORDER}

    second = ArtifactStore(tmp_path / "home2" / "artifacts")  # another machine: an empty cache, the same root
    read = ArtifactReader(second, "TinyTitles")
    assert load_json(read.path("evaluate", METRICS)) == load_json(first.stage_dir("TinyTitles", "evaluate") / METRICS)
    ours, theirs = (np.load(s.stage_dir("TinyTitles", "evaluate") / PREDICTIONS) for s in (first, second))
    assert sorted(ours.files) == sorted(theirs.files)
    assert all(np.array_equal(ours[k], theirs[k]) for k in ours.files)
    assert sorted(p.name for p in (tmp_path / "home2" / "artifacts" / "TinyTitles").iterdir()
                  if not p.name.startswith(".")) == ["_remote", "evaluate"]  # only what was read was fetched
