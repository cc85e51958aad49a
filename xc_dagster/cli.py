"""``xc-dagster``: manage the dataset catalog and drive the pipeline from the shell.

  xc-dagster datasets add NAME --source URI [--text title|title+content] [--strategy S] [--preset P]
                                            [--sha256 HEX] [--set stage.field=value ...]
                                            [--gate-tolerance PP]
                                 (a known public dataset, e.g. LF-AmazonTitles-131K, needs only --source)
  xc-dagster datasets list | remove NAME
  xc-dagster clicks build NAME --logs PATH [--start ISO] [--end ISO] [--previous MAP] [--register]
                                   click logs of a time window -> a dataset (see docs/CLICKLOGS.md)
  xc-dagster quickstart            register the embedded LF-WordNetNouns (Titles) and materialize it
  xc-dagster materialize NAME [--select SEL] [--set stage.field=value ...]
                                   every asset of one partition (or --select's), through `dagster asset
                                   materialize`; --set values go to that run's config only
  xc-dagster plan NAME [--set stage.field=value ...] [--points N --test-points N --labels L
                  --labels-per-point X --tokens T] [--json] [--recalibrate]
                                   each stage's predicted seconds and peak memory on this machine, before a
                                   run (docs/planning.md)
  xc-dagster metrics NAME          the test metrics of the last evaluation
  xc-dagster compare NAME          the dataset's evaluation runs from MLflow, best first, with the papers'
                                   published numbers for it as reference rows
  xc-dagster strategies [NAME]     the strategies, or one strategy's help and the settings it changes
  xc-dagster ui                    the commands that open the Dagster UI and the MLflow UI
  xc-dagster retrain check         changed dataset sources and click-log feeds (docs/AUTOMATION.md)
  xc-dagster env                   shell exports of XC_HOME, DAGSTER_HOME, MLFLOW_TRACKING_URI

The library stays importable without Dagster: Dagster runs in a subprocess with ``DAGSTER_HOME`` set to
``$XC_HOME/dagster`` so CLI runs appear in the UI. The commands that need torch, MLflow or pandas (plan, compare,
clicks, retrain) are modules of ``xc_dagster.commands``, imported when they run (:data:`COMMAND_MODULES`).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any, Mapping
from urllib.parse import unquote, urlsplit
from urllib.request import url2pathname

from xc_dagster.catalog import BUILTIN_PREFIX, LAYOUTS, TEXT_CHOICES, Catalog, DatasetSpec
from xc_dagster.commands.partitions import dagster_partitions
from xc_dagster.config import PRESETS, parse_set_options
from xc_dagster.config.run_config import run_config_for
from xc_dagster.contract import METRICS
from xc_dagster.errors import XCConfigError, XCDatasetNotFound, XCError
from xc_dagster.home import Home, venv_executable
from xc_dagster.strategies import STRATEGIES, strategy_help

DEFAULT_DATASET = "LF-WordNetNounsTitles"
DEFAULT_SOURCE = f"{BUILTIN_PREFIX}LF-WordNetNouns"
REPORT_METRICS = ("precision_at_1", "precision_at_3", "precision_at_5", "ndcg_at_3", "ndcg_at_5",
                  "psprecision_at_1", "psprecision_at_3", "psprecision_at_5", "psndcg_at_3", "psndcg_at_5",
                  "shortlist_recall")

# the commands whose dependencies are heavy, each in a module of its own imported by name when it runs, so that the
# others start without them (docs/decisions.md#add-imports): the module's run(args, home) returns the exit code
COMMAND_MODULES = {"plan": "xc_dagster.commands.plan",  # torch, transformers, faiss (the planner's calibration)
                   "compare": "xc_dagster.commands.compare",  # MLflow
                   "clicks": "xc_dagster.commands.clicks",  # pandas
                   "retrain": "xc_dagster.commands.retrain"}  # pandas


def checked_source(source: str) -> str:
    """``--source`` as the catalog stores it: a local path made absolute (``~`` expanded) and refused when it
    does not exist, a ``file://`` URL refused when its path does not exist; other URLs and ``builtin:`` as given;
    an empty one refused (as a path it would be the current directory)."""
    if not source.strip():
        raise XCConfigError(f"--source {source!r}: expected a dataset source (a folder, a file or a URI), "
                            "got an empty value")
    parts = urlsplit(source)
    scheme = parts.scheme.lower()
    plain = scheme == "" or (len(scheme) == 1 and os.name == "nt")  # a path (or a Windows drive letter)
    if source.startswith(BUILTIN_PREFIX) or not (plain or scheme == "file"):
        return source
    if scheme == "file":
        path = Path(url2pathname(unquote(parts.path)))
        if parts.netloc in ("", "localhost") and not path.exists():
            raise XCDatasetNotFound(f"dataset source {source} does not exist (no {path})")
        return source
    path = Path(os.path.abspath(Path(source).expanduser()))  # absolute, symlinks kept (the user may repoint them)
    if not path.exists():
        raise XCDatasetNotFound(f"dataset source {source!r} does not exist (looked for {path})")
    return str(path)


def cmd_add(args: argparse.Namespace, home: Home) -> int:
    overrides = parse_set_options(args.set or [])
    pa, pb = (args.propensity or (None, None))
    spec = DatasetSpec(name=args.name, source=checked_source(args.source), layout=args.layout, text=args.text,
                       max_len=args.max_len, propensity_a=pa, propensity_b=pb, strategy=args.strategy,
                       preset=args.preset, overrides=overrides, sha256=args.sha256,
                       gate_tolerance=args.gate_tolerance)
    catalog = Catalog(home.catalog)
    existed = args.name in catalog.names()
    catalog.add(spec, replace=args.replace)
    try:
        dagster_partitions(home, "add", [args.name])
    except XCError:
        if not existed:  # nothing half-made: the entry goes with the failed registration
            catalog.remove(args.name)
        raise
    print(f"added dataset {args.name!r} (text: {spec.text_fields}, strategy: {spec.strategy}, "
          f"preset: {spec.preset}) to {home.catalog}")
    known = spec.known
    if known is not None:
        opts = spec.option_overrides()
        feats = f", {known.n_features:,} features" if known.n_features else ""
        print(f"known public dataset {known.name}: {known.n_train:,} train / {known.n_test:,} test points, "
              f"{known.n_labels:,} labels{feats} (checked at ingest); defaults: text {opts['ingest.text']}, "
              f"max_len {opts['tokenize.max_len']}, propensity A/B {opts['evaluate.propensity_a']}/"
              f"{opts['evaluate.propensity_b']}")
    print(f"materialize it with: xc-dagster materialize {args.name}")
    return 0


def cmd_list(args: argparse.Namespace, home: Home) -> int:
    ds = Catalog(home.catalog).load()
    if not ds:
        print(f"no datasets in {home.catalog}; add one with 'xc-dagster datasets add NAME --source URI'")
        return 0
    w = max(len(n) for n in ds)
    for name, spec in sorted(ds.items()):
        print(f"{name:<{w}}  {spec.strategy:<10} {spec.preset:<6} {spec.text_fields:<14} {spec.source}")
    return 0


def cmd_remove(args: argparse.Namespace, home: Home) -> int:
    Catalog(home.catalog).remove(args.name)
    dagster_partitions(home, "remove", [args.name])  # its runs and materializations stay in the instance
    print(f"removed dataset {args.name!r} from {home.catalog} (artifacts under {home.artifacts / args.name} kept)")
    return 0


def materialize(home: Home, name: str, select: str = "*", overrides: Mapping[str, Any] | None = None) -> int:
    """Run ``dagster asset materialize`` for one partition with this home's Dagster instance; ``overrides``
    (``stage.field`` -> value, as ``--set`` gives them) go to that run's config only (``--config-json``)."""
    spec = Catalog(home.catalog).get(name)  # clear error before Dagster starts
    run_config = run_config_for(overrides or {}, select)
    try:
        spec.config(dict(overrides or {}))  # the ranges that depend on another layer's value (evaluate.top_k)
    except XCConfigError as exc:
        raise XCConfigError(f"--set: {exc}") from None
    cmd = [venv_executable("dagster"), "asset", "materialize", "-m", "xc_dagster.definitions", "--select", select,
           "--partition", name]
    if run_config:
        cmd += ["--config-json", json.dumps(run_config)]
    print("$ " + shlex.join(cmd), flush=True)
    return subprocess.call(cmd, env=home.environ())


def print_metrics(home: Home, name: str) -> int:
    path = home.artifacts / name / "evaluate" / METRICS
    if not path.exists():
        print(f"no evaluation for {name!r} yet ({path} missing)", file=sys.stderr)
        return 1
    m = json.loads(path.read_text())
    print(f"\nTest metrics for {name} (%):")
    for k in REPORT_METRICS:
        if k in m:
            print(f"  {k:<20} {100 * m[k]:6.2f}")
    return 0


def print_ui(home: Home) -> None:
    repo = Path(__file__).resolve().parent.parent
    ws = repo / "workspace.yaml"
    target = f"-w {ws}" if ws.exists() else "-m xc_dagster.definitions"
    print("\nOpen the results:")
    dagster = venv_executable("dagster")
    print(f"  Dagster UI:  XC_HOME={home.root} DAGSTER_HOME={home.dagster_home} {dagster} dev {target}")
    print(f"  MLflow UI:   {venv_executable('mlflow')} ui --backend-store-uri {home.mlflow_uri} --port 5000")
    print("  (`dagster dev` also runs the daemon: switch on click_log_sensor / retrain_schedule under "
          "Automation; docs/AUTOMATION.md)")


def cmd_quickstart(args: argparse.Namespace, home: Home) -> int:
    over = {} if args.budget_minutes is None else {"train.budget_minutes": args.budget_minutes}
    added = []

    def keep_or_add(old: DatasetSpec | None) -> DatasetSpec:  # under the catalog's lock: two quickstarts agree
        added.append(old is None)
        return old or DatasetSpec(name=DEFAULT_DATASET, source=DEFAULT_SOURCE, text="title", preset=args.preset,
                                  overrides=over)

    Catalog(home.catalog).update(DEFAULT_DATASET, keep_or_add)
    if added[-1]:
        dagster_partitions(home, "add", [DEFAULT_DATASET])
        print(f"registered the embedded dataset {DEFAULT_DATASET} in {home.catalog}")
    rc = materialize(home, DEFAULT_DATASET)
    if rc != 0:
        print(f"materialization failed (exit {rc})", file=sys.stderr)
        return rc
    print_metrics(home, DEFAULT_DATASET)
    print_ui(home)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="xc-dagster", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    ds = sub.add_parser("datasets", help="the dataset catalog (= Dagster partitions)")
    dsub = ds.add_subparsers(dest="dcmd", required=True)
    add = dsub.add_parser("add", help="add a dataset")
    add.add_argument("name")
    add.add_argument("--source", required=True, help="local folder/file, file://, http(s)://, or fsspec URI")
    add.add_argument("--layout", default="auto", choices=LAYOUTS)
    add.add_argument("--text", choices=TEXT_CHOICES,
                     help="default: the registry's for a known dataset, else title if the name contains 'Titles'")
    add.add_argument("--max-len", type=int,
                     help="token max_len (default: the registry's, else 32 for titles, 128 full text)")
    add.add_argument("--propensity", nargs=2, type=float, metavar=("A", "B"),
                     help="propensity A B, each >= 0 (default, and 0: the registry's, else by family: Amazon "
                          "0.6 2.6, Wiki 0.5 0.4, else 0.55 1.5)")
    add.add_argument("--sha256", help="hex SHA-256 of the source file/archive, verified before ingest")
    add.add_argument("--strategy", default="ngame", choices=sorted(STRATEGIES))
    add.add_argument("--preset", default="quick", choices=sorted(PRESETS))
    add.add_argument("--set", action="append", metavar="STAGE.FIELD=VALUE", help="hyperparameter override")
    add.add_argument("--gate-tolerance", metavar="PP",
                     help="champion gate: percentage points of test P@1 and PSP@1 a new version may lose and "
                          "still be promoted, in runs without run config (sensor, schedule; default 0)")
    add.add_argument("--replace", action="store_true", help="replace an existing entry")
    dsub.add_parser("list", help="list datasets")
    rm = dsub.add_parser("remove", help="remove a dataset from the catalog")
    rm.add_argument("name")
    qs = sub.add_parser("quickstart", help="register the embedded default dataset and materialize it")
    qs.add_argument("--preset", default="quick", choices=sorted(PRESETS))
    qs.add_argument("--budget-minutes", type=float, default=None,
                    help="training budget in minutes (train.budget_minutes; default: the preset's, 30)")
    mat = sub.add_parser("materialize", help="materialize assets of one dataset partition")
    mat.add_argument("name")
    mat.add_argument("--select", default="*", help="Dagster asset selection (default: all)")
    mat.add_argument("--set", action="append", metavar="STAGE.FIELD=VALUE",
                     help="hyperparameter override for this run only (the stage asset's run config); repeatable")
    pl = sub.add_parser("plan", help="predict each stage's seconds and peak memory on this machine, before a run")
    pl.add_argument("name")
    pl.add_argument("--set", action="append", metavar="STAGE.FIELD=VALUE",
                    help="hyperparameter override, as materialize --set takes it; repeatable")
    pl.add_argument("--points", type=int, help="training points (default: the ingest summary's)")
    pl.add_argument("--test-points", type=int, help="test points (default: the ingest summary's)")
    pl.add_argument("--labels", type=int, help="labels (default: the ingest summary's)")
    pl.add_argument("--labels-per-point", type=float, help="mean labels per training point (default: ingest's)")
    pl.add_argument("--tokens", type=float, help="mean tokens per text (default: the tokenize summary's)")
    pl.add_argument("--json", action="store_true", help="machine-readable output")
    pl.add_argument("--recalibrate", action="store_true", help="measure this machine's unit costs again")
    met = sub.add_parser("metrics", help="print the last evaluation's test metrics")
    met.add_argument("name")
    cmp_ = sub.add_parser("compare", help="compare the evaluation runs of a dataset (MLflow), best first")
    cmp_.add_argument("name")
    cmp_.add_argument("--sort", default="precision_at_1", help="metric to rank by (default precision_at_1)")
    cmp_.add_argument("--limit", type=int, default=50, help="at most this many runs")
    st = sub.add_parser("strategies", help="the strategies (NGAME, SiameseXML, ASTRA, MIPS-s) and their settings")
    st.add_argument("name", nargs="?", choices=sorted(STRATEGIES), help="one strategy's help and settings")
    sub.add_parser("ui", help="print the commands that open the Dagster and MLflow UIs")
    sub.add_parser("env", help="print shell exports for XC_HOME, DAGSTER_HOME, MLFLOW_TRACKING_URI")
    clk = sub.add_parser("clicks", help="click logs -> dataset partitions")
    csub = clk.add_subparsers(dest="ccmd", required=True)
    cb = csub.add_parser("build", help="build a dataset from click logs over a time window (docs/CLICKLOGS.md)")
    cb.add_argument("name")
    cb.add_argument("--logs", action="append", required=True, metavar="PATH_OR_GLOB",
                    help="click-log file, folder or glob (.parquet, .csv[.gz], .jsonl[.gz]); repeatable")
    cb.add_argument("--start", help="window start, ISO-8601, inclusive (naive = UTC)")
    cb.add_argument("--end", help="window end, ISO-8601, exclusive (naive = UTC)")
    cb.add_argument("--previous", metavar="LABEL_MAP_JSON",
                    help="the previous window's label_map.json (or its folder): keeps label ids stable")
    cb.add_argument("--test-fraction", type=float, default=0.2, help="latest fraction of queries -> test")
    cb.add_argument("--min-clicks", type=int, default=1, help="clicks for a (query, label) pair to count")
    cb.add_argument("--register", action="store_true", help="add/update catalog entry NAME with this folder")
    rt = sub.add_parser("retrain", help="retraining automation (docs/AUTOMATION.md)")
    rsub = rt.add_subparsers(dest="rcmd", required=True)
    rsub.add_parser("check", help="which datasets' sources changed since their last ingest; the click-log feeds")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        # the home's first use (stores and Dagster instance) once, under its lock, before a `dagster` process races
        home = Home.from_env().ensure(instance=True)
        if args.cmd == "datasets":
            return {"add": cmd_add, "list": cmd_list, "remove": cmd_remove}[args.dcmd](args, home)
        if args.cmd == "quickstart":
            return cmd_quickstart(args, home)
        if args.cmd == "materialize":
            rc = materialize(home, args.name, args.select, parse_set_options(args.set or []))
            if rc == 0 and args.select == "*":
                print_metrics(home, args.name)
            return rc
        if args.cmd == "metrics":
            return print_metrics(home, args.name)
        if args.cmd in COMMAND_MODULES:
            return importlib.import_module(COMMAND_MODULES[args.cmd]).run(args, home)
        if args.cmd == "strategies":
            print(strategy_help(args.name))
            return 0
        if args.cmd == "ui":
            print_ui(home)
            return 0
        if args.cmd == "env":
            env = home.environ()
            for k in ("XC_HOME", "DAGSTER_HOME", "MLFLOW_TRACKING_URI"):
                print(f"export {k}={env[k]}")
            return 0
    except XCError as exc:
        print(f"xc-dagster: error: {exc}", file=sys.stderr)
        return 2
    return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
