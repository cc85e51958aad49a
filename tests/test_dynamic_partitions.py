"""Datasets as dynamic partitions: registration by the CLI and at load, a home from the static-partition days,
concurrent registration, and a working directory with its own ``assets``/``resources`` packages."""

from __future__ import annotations

import os
import subprocess
import sys

import dagster as dg
import pytest
from dagster import DagsterRunStatus
from dagster_graphql import DagsterGraphQLClient

from tests.tinydata import (
    free_port,
    graphql,
    ready_home,
    release_together,
    start_server,
    stop_process_group,
    wait_for,
    write_lf_dataset,
)
from xc_dagster.catalog import Catalog, DatasetSpec
from xc_dagster.cli import main as cli_main
from xc_dagster.commands.partitions import PARTITIONS_CMD
from xc_dagster.home import Home, venv_executable

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture()
def home(tmp_path, monkeypatch) -> Home:
    monkeypatch.setenv("XC_HOME", str(tmp_path / "home"))
    for var in ("MLFLOW_TRACKING_URI", "DAGSTER_HOME"):
        monkeypatch.delenv(var, raising=False)
    h = ready_home(tmp_path / "home", instance=True)
    monkeypatch.setenv("DAGSTER_HOME", str(h.dagster_home))
    return h


def _partitions() -> list[str]:
    with dg.DagsterInstance.get() as instance:
        return sorted(instance.get_dynamic_partitions("datasets"))


def test_a_static_partition_home_keeps_its_datasets_and_their_history(home, tmp_path):
    """A home made when partitions were static (the catalog read at load): its runs are keyed by the partition's
    name. The first load of the dynamic definitions registers the catalog's datasets; the history still counts."""
    from xc_dagster.definitions import build_definitions

    Catalog(home.catalog).add(DatasetSpec(name="Old", source=str(tmp_path)))

    @dg.asset(name="dataset", partitions_def=dg.StaticPartitionsDefinition(["Old"]))
    def old_dataset() -> None:  # what the static definitions materialized
        return None

    with dg.DagsterInstance.get() as instance:
        assert dg.materialize([old_dataset], partition_key="Old", instance=instance).success
    assert _partitions() == []
    defs = build_definitions(home)
    assert _partitions() == ["Old"]
    with dg.DagsterInstance.get() as instance:
        assert instance.get_materialized_partitions(dg.AssetKey("dataset")) == {"Old"}
        job = defs.resolve_job_def("xc_pipeline")
        assert job.partitions_def.get_partition_keys(dynamic_partitions_store=instance) == ["Old"]
    build_definitions(home)  # loading again adds nothing twice
    assert _partitions() == ["Old"]


def test_concurrent_registrations_lose_nothing_and_add_nothing_twice(home, tmp_path):
    """Four processes released together once each has imported Dagster, each adding its own name and a shared one,
    against one SQLite instance."""
    imports = "from xc_dagster.project import project_import\nproject_import('resources.partitions')\n"
    procs = release_together(imports, PARTITIONS_CMD.replace("sys.argv[1:]", "sys.argv[4:]"), 4, tmp_path,
                             dict(os.environ), args=lambda i: ["add", f"d{i}", "shared"])
    assert [p.returncode for p in procs] == [0] * 4, [p.stderr[-600:] for p in procs]
    with dg.DagsterInstance.get() as instance:
        keys = list(instance.get_dynamic_partitions("datasets"))
    assert sorted(keys) == sorted([f"d{i}" for i in range(4)] + ["shared"])  # each once


def test_the_registration_process_imports_no_torch_or_mlflow(home):
    """The process `datasets add` starts imports Dagster, not the library's heavy dependencies
    (docs/decisions.md#add-imports)."""
    code = (PARTITIONS_CMD.replace("sys.exit(", "rc = (")
            + "; print(rc, sorted(m for m in ('torch', 'mlflow', 'transformers', 'faiss') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code, "add", "Light"], cwd=home.root, capture_output=True, text=True)
    assert out.stdout.strip() == "0 []", out.stderr[-2000:]
    assert _partitions() == ["Light"]


# the light commands in one process: add, list, env, metrics, and materialize up to its `dagster` process (its launch
# replaced by a stub that records the command)
LIGHT_COMMANDS = """
import sys
from xc_dagster import cli
launched = []
cli.subprocess.call = lambda cmd, env: launched.append(cmd) or 0
rcs = [cli.main(["datasets", "add", "Light", "--source", sys.argv[1]]), cli.main(["datasets", "list"]),
       cli.main(["env"]), cli.main(["metrics", "Light"]),
       cli.main(["materialize", "Light", "--select", "fusion", "--set", "fusion.method=tree"])]
print(rcs, len(launched), sorted(m for m in ("torch", "mlflow", "transformers", "faiss") if m in sys.modules))
"""


def test_the_light_commands_import_no_torch_or_mlflow(home, tmp_path):
    """`datasets add/list`, `env`, `metrics` and `materialize` (until it starts Dagster) import none of torch,
    transformers, faiss and MLflow: the commands that need them are modules the CLI imports when they run
    (docs/decisions.md#add-imports)."""
    env = {**os.environ, "XC_HOME": str(home.root)}
    out = subprocess.run([sys.executable, "-c", LIGHT_COMMANDS, str(tmp_path)], env=env, capture_output=True,
                         text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[0, 0, 0, 1, 0] 1 []", out.stdout[-2000:] + out.stderr[-2000:]
    assert _partitions() == ["Light"]


def test_a_failed_registration_leaves_no_catalog_entry(home, tmp_path, capsys):
    (home.dagster_home / "dagster.yaml").write_text("storage: [unclosed\n")  # the instance cannot load
    assert cli_main(["datasets", "add", "New", "--source", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "could not add the Dagster partition(s) New" in err and str(home.dagster_home) in err
    assert "New" not in Catalog(home.catalog).names()


def test_runs_from_a_folder_with_its_own_assets_and_resources_packages(home, tmp_path):
    """``python -m``/``dagster -m`` put the working directory first on sys.path: a user's own ``assets`` and
    ``resources`` packages there must not replace the project's."""
    user = tmp_path / "user_project"
    for pkg in ("assets", "resources"):
        (user / pkg).mkdir(parents=True)
        (user / pkg / "__init__.py").write_text("MINE = True\n")
    env = {**os.environ, "DAGSTER_HOME": str(home.dagster_home)}
    add = subprocess.run([sys.executable, "-m", "xc_dagster.cli", "datasets", "add", "Mine", "--source",
                          str(tmp_path)], cwd=user, env=env, capture_output=True, text=True)
    assert add.returncode == 0, add.stderr[-2000:]
    assert _partitions() == ["Mine"]
    listed = subprocess.run([venv_executable("dagster"), "asset", "list", "-m", "xc_dagster.definitions"], cwd=user,
                            env=env, capture_output=True, text=True)
    assert listed.returncode == 0, listed.stderr[-2000:]
    assert {"dataset", "evaluation", "registered_model"} <= set(listed.stdout.split())
    # a foreign package already imported under that name is refused by name, not loaded over
    probe = subprocess.run([sys.executable, "-c", "import assets; import xc_dagster.definitions"], cwd=user, env=env,
                           capture_output=True, text=True)
    assert probe.returncode != 0 and "a package named 'assets' from" in probe.stderr


def test_a_dataset_added_while_dagster_dev_runs_is_launchable_without_a_reload(home, tmp_path):
    """`dagster dev` (webserver + daemon) loaded before the dataset exists: `datasets add` makes it a partition
    the running UI lists, and a run of it launched through the UI's GraphQL API succeeds; nothing reloaded."""
    write_lf_dataset(tmp_path / "src")
    port = free_port()
    env = {**os.environ, "DAGSTER_HOME": str(home.dagster_home)}
    log_path = tmp_path / "dagster-dev.log"
    dev = start_server([venv_executable("dagster"), "dev", "-m", "xc_dagster.definitions", "-p", str(port)], log_path,
                       cwd=home.root, env=env)

    def dataset_node():
        nodes = graphql(port, '{ assetNodes(assetKeys: [{path: ["dataset"]}]) { partitionKeys } }')["assetNodes"]
        return nodes[0] if nodes else None  # none until the code location has loaded

    try:
        assert wait_for("code location loaded", dataset_node, 180, log_path, dev)["partitionKeys"] == []
        assert cli_main(["datasets", "add", "Late", "--source", str(tmp_path / "src"), "--text", "title"]) == 0
        assert dataset_node()["partitionKeys"] == ["Late"]
        client = DagsterGraphQLClient("127.0.0.1", port_number=port)
        run_id = client.submit_job_execution("xc_pipeline", tags={"dagster/partition": "Late"},
                                             asset_selection=["dataset"])
        ended = (DagsterRunStatus.SUCCESS, DagsterRunStatus.FAILURE, DagsterRunStatus.CANCELED)
        status = wait_for("run ended", lambda: (st := client.get_run_status(run_id)) in ended and st, 240, log_path,
                          dev)
        assert status == DagsterRunStatus.SUCCESS
        assert (home.artifacts / "Late" / "ingest" / "summary.json").is_file()
    finally:
        stop_process_group(dev)


def test_steps_fork_from_a_server_that_preloaded_the_code_location(home):
    """The job's multiprocess executor starts step processes from a forkserver that imported the definitions and
    the modules the stages would otherwise import on first use (torch's compiler front end, scikit-learn's text
    features)."""
    from xc_dagster.definitions import build_definitions

    executor = build_definitions(home).resolve_job_def("xc_pipeline").executor_def
    assert executor.name == "multiprocess"
    config = executor.config_schema.resolve_config({}).value["config"]
    assert config["start_method"] == {"forkserver": {"preload_modules": [
        "xc_dagster.definitions", "torch._dynamo", "sklearn.feature_extraction.text"]}}
