"""PostgreSQL stores: ``deploy/postgres.sh`` starts a throwaway server for these tests; a tiny dataset partition
is materialized through the CLI with the home's Dagster storages and MLflow tracking store in it; processes of
different homes (as on different hosts) first-use one fresh MLflow database together; the home's ``dagster.yaml``
is rendered for SQLite and PostgreSQL, an older one is migrated and a user's own is kept."""

from __future__ import annotations

import glob
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest
import sqlalchemy as sa

from tests.tinydata import free_port, ready_home, release_together, write_lf_dataset
from xc_dagster.errors import XCConfigError
from xc_dagster.home import OLD_YAML_HEADERS, YAML_HEADER, Home, render_dagster_yaml

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "deploy" / "postgres.sh"
PG_URL = "XC_DAGSTER_POSTGRES_URL"


def _has_binaries() -> bool:
    return bool(os.environ.get("PG_BIN") or shutil.which("initdb") or glob.glob("/usr/lib/postgresql/*/bin/initdb"))


def _script(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout)


def _exports(stdout: str) -> dict[str, str]:
    return dict(ln.removeprefix("export ").split("=", 1) for ln in stdout.splitlines() if ln.startswith("export "))


@pytest.fixture(scope="module")  # the only module that uses it
def pg_server():
    """A server of its own in a fresh folder under the system temp folder (reachable by the `postgres` user when
    the tests run as root, unlike pytest's 0700 tmp_path), on a free port; stopped and removed at the end."""
    if not _has_binaries():
        pytest.skip("PostgreSQL's initdb not found ($PG_BIN, PATH, /usr/lib/postgresql/*/bin): the PostgreSQL store "
                    "tests need a local PostgreSQL installation")
    base = Path(tempfile.mkdtemp(prefix="xc-pg-"))
    base.chmod(0o711)
    folder = base / "pg"
    out = _script("start", str(folder), "--port", str(free_port()))
    if out.returncode == 3:
        shutil.rmtree(base, ignore_errors=True)
        pytest.skip(f"the PostgreSQL server could not start: {out.stderr.strip()[-1500:]}")
    assert out.returncode == 0, out.stderr
    server = {"folder": folder, "stdout": out.stdout, **_exports(out.stdout)}
    try:
        # a throwaway server: no disk flushes at commits, CREATE DATABASE and the shutdown checkpoint (seconds each)
        _admin(server, "ALTER SYSTEM SET fsync = off")
        _admin(server, "SELECT pg_reload_conf()")
        yield server
    finally:
        _script("stop", str(folder))
        shutil.rmtree(base, ignore_errors=True)


def _rows(url: str, sql: str) -> list[tuple]:
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:
            return [tuple(r) for r in conn.execute(sa.text(sql))]
    finally:
        engine.dispose()


def _admin(server: dict, sql: str) -> None:
    """Run SQL as the server's superuser, through its socket (as the server's OS user)."""
    folder, port = server["folder"], server["XC_DAGSTER_POSTGRES_URL"].rsplit(":", 1)[1].split("/")[0]
    psql = str(Path(os.environ.get("PG_BIN") or Path(shutil.which("initdb") or glob.glob(
        "/usr/lib/postgresql/*/bin/initdb")[-1]).resolve().parent) / "psql")
    cmd = [psql, "-X", "-q", "-v", "ON_ERROR_STOP=1", "-h", str(folder / "run"), "-p", port, "-d", "postgres",
           "-c", sql]
    if os.geteuid() == 0:
        cmd = ["runuser", "-u", "postgres", "--", *cmd]
    subprocess.run(cmd, check=True, capture_output=True, text=True, cwd="/")


def test_the_script_is_idempotent_and_each_tool_has_its_own_database(pg_server):
    urls = {PG_URL: pg_server[PG_URL], "MLFLOW_TRACKING_URI": pg_server["MLFLOW_TRACKING_URI"]}
    assert set(_exports(pg_server["stdout"])) == set(urls)
    port = urls[PG_URL].rsplit(":", 1)[1].split("/")[0]
    assert urls[PG_URL].startswith("postgresql+psycopg2://dagster:")
    assert urls[PG_URL].endswith(f"@127.0.0.1:{port}/dagster")
    assert urls["MLFLOW_TRACKING_URI"].startswith("postgresql+psycopg2://mlflow:")
    again = _script("start", str(pg_server["folder"]))  # running: same port and passwords, nothing made again
    assert again.returncode == 0 and again.stdout == pg_server["stdout"] and "already running" in again.stderr
    assert _script("url", str(pg_server["folder"])).stdout == pg_server["stdout"]
    env_file = pg_server["folder"] / "server.env"
    assert stat.S_IMODE(env_file.stat().st_mode) == 0o600
    assert _rows(urls[PG_URL], "SELECT current_user, current_database()") == [("dagster", "dagster")]
    assert _rows(urls[PG_URL], "SHOW listen_addresses") == [("127.0.0.1",)]
    cross = urls["MLFLOW_TRACKING_URI"].rsplit("/", 1)[0] + "/dagster"  # the mlflow user on dagster's database
    with pytest.raises(sa.exc.OperationalError, match='permission denied for database "dagster"'):
        _rows(cross, "SELECT 1")
    bad = _script("start", str(pg_server["folder"]), "--port", "http")
    assert bad.returncode == 2 and "--port: expected a port number 1-65535, got 'http'" in bad.stderr


def test_a_partition_materialized_with_both_stores_in_postgres(pg_server, tmp_path, tiny_encoder, monkeypatch):
    """`xc-dagster datasets add` then `xc-dagster materialize --select dataset,tokens`, as a user runs them with
    the URLs the script printed (the add through the CLI's main in this process, its Dagster registration and the
    materialize in fresh processes): the run and its materializations are rows of the Dagster database, the
    stages' MLflow runs rows of the MLflow database, and the home holds no SQLite store."""
    import dagster as dg
    from dagster_postgres import PostgresRunStorage

    from xc_dagster.cli import main as cli_main

    home = tmp_path / "home"
    env = {**os.environ, "XC_HOME": str(home), PG_URL: pg_server[PG_URL],
           "MLFLOW_TRACKING_URI": pg_server["MLFLOW_TRACKING_URI"], "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    src = write_lf_dataset(tmp_path / "PgData")
    with monkeypatch.context() as mp:  # a fresh interpreter for the add would spend seconds importing
        for var in ("XC_HOME", PG_URL, "MLFLOW_TRACKING_URI", "OMP_NUM_THREADS", "PYTHONPATH"):
            mp.setenv(var, env[var])
        assert cli_main(["datasets", "add", "PgData", "--source", f"file://{src}", "--text", "title",
                         "--set", f"tokenize.encoder={tiny_encoder}"]) == 0
    cli = [sys.executable, "-m", "xc_dagster.cli"]
    out = subprocess.run(cli + ["materialize", "PgData", "--select", "dataset,tokens"], env=env, capture_output=True,
                         text=True)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]

    dagster_url, mlflow_url = pg_server[PG_URL], pg_server["MLFLOW_TRACKING_URI"]
    assert _rows(dagster_url, "SELECT status, partition FROM runs") == [("SUCCESS", "PgData")]
    mats = _rows(dagster_url, "SELECT DISTINCT asset_key FROM event_logs WHERE dagster_event_type = "
                              "'ASSET_MATERIALIZATION' ORDER BY asset_key")
    assert mats == [('["dataset"]',), ('["tokens"]',)]
    runs = _rows(mlflow_url, "SELECT t.value, r.status FROM runs r JOIN tags t ON t.run_uuid = r.run_uuid "
                             "JOIN experiments e ON e.experiment_id = r.experiment_id "
                             "WHERE t.key = 'asset' AND e.name = 'xc-dagster/PgData' ORDER BY t.value")
    assert runs == [("ingest", "FINISHED"), ("tokenize", "FINISHED")]
    assert not (home / "mlflow.db").exists() and not list((home / "dagster").rglob("*.db"))
    yaml = (home / "dagster" / "dagster.yaml").read_text()
    assert "env: XC_DAGSTER_POSTGRES_URL" in yaml and dagster_url.split(":")[2].split("@")[0] not in yaml
    monkeypatch.setenv(PG_URL, dagster_url)
    with dg.DagsterInstance.from_config(str(home / "dagster")) as instance:  # the UI's and daemon's view of it
        assert isinstance(instance.run_storage, PostgresRunStorage)
        (record,) = instance.get_run_records()
        assert record.dagster_run.tags["dagster/partition"] == "PgData"
        assert instance.get_concurrency_config().pool_config.default_pool_limit == 1


def test_two_partitions_materialized_at_once_on_postgres(pg_server, tmp_path, monkeypatch):
    """The SQLite test of tests/test_concurrent_partitions.py with both stores in fresh PostgreSQL databases."""
    from tests.test_concurrent_partitions import add_two_datasets, materialize_two_at_once

    _admin(pg_server, "CREATE DATABASE dagster_two OWNER dagster")
    _admin(pg_server, "CREATE DATABASE mlflow_two OWNER mlflow")
    stores = {PG_URL: pg_server[PG_URL].rsplit("/", 1)[0] + "/dagster_two",
              "MLFLOW_TRACKING_URI": pg_server["MLFLOW_TRACKING_URI"].rsplit("/", 1)[0] + "/mlflow_two"}
    home, env = add_two_datasets(tmp_path, stores)
    monkeypatch.setenv(PG_URL, stores[PG_URL])  # the home's dagster.yaml reads it when the test opens the instance
    materialize_two_at_once(home, env, tmp_path, stores["MLFLOW_TRACKING_URI"])
    assert not (home / "mlflow.db").exists() and not list((home / "dagster").rglob("*.db"))


# one host's first use of the tracking store: import, say ready, wait for the start signal (WAIT_FOR_GO), prepare
# a home of its own (other hosts share no flock) and log a run
IMPORTS = textwrap.dedent("""
    from xc_dagster.home import Home
    from xc_dagster.tracking import Tracker
""")
CHILD = textwrap.dedent("""
    home = Home(Path(sys.argv[4])).ensure()
    with Tracker(home.mlflow_uri, home.mlflow_artifacts).run("Race", "ingest", {"i": i}, {}) as run:
        run.log_final({"value": float(i)})
""")


def test_hosts_first_using_one_fresh_mlflow_database_together_all_succeed(pg_server, tmp_path):
    """Three processes with homes of their own start together on an empty MLflow database: MLflow's
    check-then-create of its tables would race; the advisory lock lets one create them and the others wait."""
    _admin(pg_server, "DROP DATABASE IF EXISTS mlflow_race")
    _admin(pg_server, "CREATE DATABASE mlflow_race OWNER mlflow")
    uri = pg_server["MLFLOW_TRACKING_URI"].rsplit("/", 1)[0] + "/mlflow_race"
    env = {**{k: v for k, v in os.environ.items() if k != PG_URL}, "MLFLOW_TRACKING_URI": uri,
           "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    n = 3
    procs = release_together(IMPORTS, CHILD, n, tmp_path, env, args=lambda i: [str(tmp_path / f"home-{i}")])
    errors = [(p.stderr.strip().splitlines()[-1] if p.stderr.strip() else f"exit {p.returncode}")
              for p in procs if p.returncode != 0]
    assert errors == []
    values = _rows(uri, "SELECT m.value FROM metrics m JOIN runs r ON r.run_uuid = m.run_uuid "
                        "WHERE m.key = 'value' ORDER BY m.value")
    assert values == [(float(i),) for i in range(n)]
    for i in range(n):  # each home records the store without its password
        ready_file = (tmp_path / f"home-{i}" / ".home-ready.json").read_text()
        assert "mlflow:postgresql+psycopg2://mlflow@127.0.0.1:" in ready_file and uri.split(":")[2] not in ready_file


# --- dagster.yaml: rendering, migration of an older one, a user's own kept ---------------------------------------

SQLITE_YAML = (YAML_HEADER + "\ntelemetry:\n  enabled: false\nconcurrency:\n  pools:\n"
               "    default_limit: 1  # every pool without a limit of its own: xc_training, the training assets'\n")


def test_dagster_yaml_for_sqlite_and_postgres(tmp_path, monkeypatch):
    import dagster as dg

    monkeypatch.delenv(PG_URL, raising=False)
    monkeypatch.delenv("XC_TRAINING_CONCURRENCY", raising=False)
    assert render_dagster_yaml() == SQLITE_YAML
    url = "postgresql+psycopg2://dagster:s3cret@db.internal:5433/dagster"
    assert render_dagster_yaml({PG_URL: url, "XC_TRAINING_CONCURRENCY": "3"}) == (
        YAML_HEADER + "\ntelemetry:\n  enabled: false\n"
        "storage:\n  postgres:\n    postgres_url:\n      env: XC_DAGSTER_POSTGRES_URL\n"
        "concurrency:\n  pools:\n"
        "    default_limit: 3  # every pool without a limit of its own: xc_training, the training assets'\n")
    for value, msg in (("0", "XC_TRAINING_CONCURRENCY: expected .* from 1 to 1000, got '0'"),
                       ("two", "XC_TRAINING_CONCURRENCY: expected .* got 'two'")):
        with pytest.raises(XCConfigError, match=msg):
            render_dagster_yaml({"XC_TRAINING_CONCURRENCY": value})
    with pytest.raises(XCConfigError, match=r"XC_DAGSTER_POSTGRES_URL: expected a PostgreSQL URL .*"
                                            r"'mysql://dagster@db:3306/dagster'"):
        render_dagster_yaml({PG_URL: "mysql://dagster:pw@db:3306/dagster"})  # the password is not echoed
    with pytest.raises(XCConfigError, match="XC_DAGSTER_POSTGRES_URL: .*'postgresql\\+nodriver://dagster@db/x'"):
        render_dagster_yaml({PG_URL: "postgresql+nodriver://dagster:pw@db/x"})

    # Dagster reads what the home writes: SQLite storages under the home, the pools' default limit
    monkeypatch.setenv("XC_TRAINING_CONCURRENCY", "2")
    home = ready_home(tmp_path / "home")  # a copy of a home made once, its yaml rewritten for this environment
    assert home.dagster_yaml.read_text() == SQLITE_YAML.replace("default_limit: 1", "default_limit: 2")
    with dg.DagsterInstance.from_config(str(home.dagster_home)) as instance:
        assert type(instance.run_storage).__name__ == "SqliteRunStorage"
        assert instance.get_concurrency_config().pool_config.default_pool_limit == 2


def test_an_older_yaml_is_migrated_and_a_users_own_is_kept(tmp_path, monkeypatch):
    monkeypatch.delenv(PG_URL, raising=False)
    monkeypatch.delenv("XC_TRAINING_CONCURRENCY", raising=False)
    home = ready_home(tmp_path / "home")
    old = OLD_YAML_HEADERS[0] + "\ntelemetry:\n  enabled: false\n"  # what releases before this one wrote
    home.dagster_yaml.write_text(old)
    assert not home.is_prepared()
    home.ensure()
    assert home.dagster_yaml.read_text() == SQLITE_YAML and home.is_prepared()

    monkeypatch.setenv("XC_TRAINING_CONCURRENCY", "4")  # ours follows the environment
    assert not home.is_prepared()
    assert "default_limit: 4" in Home(home.root).ensure().dagster_yaml.read_text()

    own = "# my instance\ntelemetry:\n  enabled: true\nconcurrency:\n  pools:\n    default_limit: 7\n"
    home.dagster_yaml.write_text(own)
    monkeypatch.setenv(PG_URL, "postgresql+psycopg2://dagster:pw@db:5432/dagster")
    assert home.is_prepared()  # nothing of ours to write
    home.ensure()
    assert home.dagster_yaml.read_text() == own
    home.dagster_yaml.unlink()  # a removed yaml is written again
    monkeypatch.delenv(PG_URL)
    assert home.ensure().dagster_yaml.read_text() == SQLITE_YAML.replace("default_limit: 1", "default_limit: 4")


def test_the_training_pool_row_is_made_at_load_and_follows_the_default(pg_server, tmp_path, monkeypatch):
    """Dagster makes a pool's row when a run first claims it, racing other runs (on PostgreSQL the loser fails);
    `resources.pools.ensure_pool` makes it when the definitions load, follows a changed default and keeps a limit
    set by hand."""
    import dagster as dg

    from resources.pools import ensure_pool

    _admin(pg_server, "CREATE DATABASE dagster_pool OWNER dagster")
    monkeypatch.setenv(PG_URL, pg_server[PG_URL].rsplit("/", 1)[0] + "/dagster_pool")
    monkeypatch.setenv("XC_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)

    def limits() -> list[tuple]:
        with dg.DagsterInstance.from_config(str(home.dagster_home)) as instance:
            return [(p.name, p.limit, p.from_default) for p in instance.event_log_storage.get_pool_limits()]

    def ensure() -> bool:
        with dg.DagsterInstance.from_config(str(home.dagster_home)) as instance:
            return ensure_pool(instance)

    ready_home(tmp_path / "home")  # the MLflow store (SQLite here, not under test) from a copy
    home = Home.from_env().ensure(instance=True)
    assert limits() == [] and ensure() and limits() == [("xc_training", 1, True)]
    assert not ensure()  # made once
    monkeypatch.setenv("XC_TRAINING_CONCURRENCY", "3")
    home = Home.from_env().ensure(instance=True)  # the yaml rendered again with the new default
    assert ensure() and limits() == [("xc_training", 3, True)]
    with dg.DagsterInstance.from_config(str(home.dagster_home)) as instance:
        instance.event_log_storage.set_concurrency_slots("xc_training", 5)  # `dagster instance concurrency set`
    assert not ensure() and limits() == [("xc_training", 5, False)]


def test_two_steps_assigned_the_one_slot_at_once_do_not_both_take_it_on_postgres(pg_server, tmp_path, monkeypatch):
    """As tests/test_pool_claims.py on SQLite: Dagster's claim reads the free slot row FOR UPDATE outside a
    transaction, so both steps write it; as a compare-and-set one takes it."""
    import dagster as dg
    from dagster._core.storage.event_log.sql_event_log import SqlEventLogStorage

    from resources.pools import repair_lost_assignments
    from tests.test_pool_claims import _DAGSTERS_CLAIM, _both_claim_the_freed_row

    _admin(pg_server, "CREATE DATABASE dagster_slots OWNER dagster")
    monkeypatch.setenv(PG_URL, pg_server[PG_URL].rsplit("/", 1)[0] + "/dagster_slots")
    monkeypatch.setenv("XC_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("XC_TRAINING_CONCURRENCY", raising=False)
    ready_home(tmp_path / "home")
    home = Home.from_env().ensure(instance=True)
    with dg.DagsterInstance.from_config(str(home.dagster_home)) as instance:
        storage = instance.event_log_storage
        storage.initialize_concurrency_limit_to_default("xc_training")
        monkeypatch.setattr(SqlEventLogStorage, "_claim_concurrency_slot", _DAGSTERS_CLAIM)
        assert _both_claim_the_freed_row(home.dagster_home) == [True, True]  # Dagster's own
        for run_id in ("run-a", "run-b"):
            storage.free_concurrency_slots_for_run(run_id)
        repair_lost_assignments()
        assert sorted(_both_claim_the_freed_row(home.dagster_home)) == [False, True]
        assert len(storage.get_concurrency_info("xc_training").claimed_slots) == 1
