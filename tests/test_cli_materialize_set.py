"""``xc-dagster materialize NAME --set stage.field=value``: the values are checked as ``datasets add`` checks them
and reach that run only, as the run config of the stage assets (``dagster asset materialize --config-json``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tests.tinydata import write_lf_dataset
from xc_dagster import cli
from xc_dagster.catalog import Catalog, DatasetSpec
from xc_dagster.config import parse_set_options
from xc_dagster.config.run_config import run_config_for
from xc_dagster.errors import XCConfigError
from xc_dagster.home import Home


def test_run_config_puts_each_value_under_its_stage_asset_coerced():
    sets = parse_set_options(["pretrain.epochs=2", "pretrain.sampler=ngame", "classifier.negatives=in-batch",
                              "index.sources=W,knn", "fusion.knn_grid=0,0.5", "classifier.normalize=no"])
    assert run_config_for(sets) == {"ops": {
        "siamese_encoder": {"config": {"epochs": 2.0, "sampler": "ngame"}},
        "classifiers": {"config": {"negatives": "in-batch", "normalize": False}},
        "ann_index": {"config": {"sources": ["W", "knn"]}},
        "fusion": {"config": {"knn_grid": [0.0, 0.5]}},
    }}
    assert run_config_for({}) == {}
    # a selection of plain names that holds the asset, and any other selection syntax, take the value
    assert run_config_for({"fusion.method": "tree"}, "fusion,evaluation") == {
        "ops": {"fusion": {"config": {"method": "tree"}}}}
    assert run_config_for({"fusion.method": "tree"}, "fusion+") == {"ops": {"fusion": {"config": {"method": "tree"}}}}
    for select in ("*fusion", "++ann_index", "dataset,tokens", "registered_model", "key:fusion", "tag:x=y"):
        assert run_config_for({}, select) == {}  # known names, and other selection syntax left to Dagster


@pytest.mark.parametrize("sets, select, message", [
    ({"fusion.method": "stack"}, "*",
     "--set: config field 'fusion.method': expected one of 'alpha', 'tree', got 'stack'"),
    ({"fusion.methods": "tree"}, "*", "--set: unknown field 'fusion.methods'; fields of 'fusion' are "),
    ({"train.budget_minutes": "5"}, "*",
     "--set train.budget_minutes: stage 'train' has no asset, so no run config; set it in the catalog instead "
     "(xc-dagster datasets add NAME --source URI --replace --set train.budget_minutes=VALUE); stages with assets: "
     "ingest, tokenize, pretrain, mining, classifier, index, fusion, evaluate"),
    ({"fusion.method": "tree"}, "evaluation",
     "--set fusion.method: the asset of stage 'fusion', 'fusion', is not in --select 'evaluation', so the value "
     "would not be used"),
    ({"strategy": "astra"}, "*", "--set: 'strategy' is not a stage field, so it cannot be set as an override; "
     "choose the strategy with --strategy (xc-dagster datasets add NAME --source URI --replace --strategy STRATEGY)"),
    ({"evaluate.top_k": "inf"}, "*", "--set: config field 'evaluate.top_k': expected int, got 'inf'"),
    ({}, "*tokenize", "--select '*tokenize': no asset 'tokenize' (did you mean 'tokens'?); the assets, in order: "
     "dataset, tokens, siamese_encoder, negative_shortlist, classifiers, ann_index, fusion, evaluation, "
     "registered_model"),
    ({}, "dataset, clasifiers+", "--select 'dataset, clasifiers+': no asset 'clasifiers' (did you mean "
     "'classifiers'?)"),
])
def test_run_config_refuses_what_the_run_would_not_use(sets, select, message):
    with pytest.raises(XCConfigError) as err:
        run_config_for(sets, select)
    assert str(err.value).startswith(message)


def test_materialize_passes_the_run_config_to_dagster(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XC_HOME", str(tmp_path / "home"))
    home = Home.from_env()
    home.catalog.parent.mkdir(parents=True)
    Catalog(home.catalog).add(DatasetSpec("D", "/data/d", overrides={"fusion.method": "alpha"}))
    calls = []
    monkeypatch.setattr(cli.subprocess, "call", lambda cmd, env: calls.append((cmd, env)) or 0)
    assert cli.materialize(home, "D", "fusion", {"fusion.method": "tree", "fusion.grid_step": "0.1"}) == 0
    (cmd, env), = calls
    assert cmd[1:] == ["asset", "materialize", "-m", "xc_dagster.definitions", "--select", "fusion",
                       "--partition", "D", "--config-json", cmd[-1]]
    assert json.loads(cmd[-1]) == {"ops": {"fusion": {"config": {"method": "tree", "grid_step": 0.1}}}}
    assert env["DAGSTER_HOME"] == str(home.dagster_home)
    assert cli.materialize(home, "D") == 0 and "--config-json" not in calls[-1][0]  # no --set: no run config
    assert capsys.readouterr().out.splitlines()[-1].endswith("--select '*' --partition D")
    # the command line: a bad value fails before Dagster starts, naming the field and the allowed values
    assert cli.main(["materialize", "D", "--set", "classifier.loss=hinge"]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        "xc-dagster: error: --set: config field 'classifier.loss': expected one of 'triplet', 'bce', 'siamesexml', "
        "got 'hinge'")
    assert len(calls) == 2
    assert Catalog(home.catalog).get("D").overrides == {"fusion.method": "alpha"}  # the catalog is unchanged


def test_materialize_checks_top_k_against_the_catalogs_ks_before_dagster_starts(tmp_path, monkeypatch):
    """evaluate.top_k's least value depends on evaluate.ks, which the catalog may set: the layered config is checked."""
    monkeypatch.setenv("XC_HOME", str(tmp_path / "home"))
    home = Home.from_env()
    home.catalog.parent.mkdir(parents=True)
    Catalog(home.catalog).add(DatasetSpec("D", "/data/d", overrides={"evaluate.ks": "1,50"}))
    calls = []
    monkeypatch.setattr(cli.subprocess, "call", lambda cmd, env: calls.append(cmd) or 0)
    with pytest.raises(XCConfigError, match="^--set: config field 'evaluate.top_k': expected at least 50, .* got 20$"):
        cli.materialize(home, "D", "evaluation", parse_set_options(["evaluate.top_k=20"]))
    assert calls == []
    assert cli.materialize(home, "D", "evaluation", parse_set_options(["evaluate.top_k=50"])) == 0 and len(calls) == 1


def test_materialize_set_reaches_that_run_only(tmp_path):
    """`xc-dagster materialize NAME --select dataset --set ingest.valid_fraction=0.25` in a fresh process: the
    ingest asset runs with 0.25 (its recorded params, its validation split), the catalog keeps its value."""
    env = {**os.environ, "XC_HOME": str(tmp_path / "home")}
    env.pop("MLFLOW_TRACKING_URI", None)
    (tmp_path / "home").mkdir()
    catalog = Catalog(tmp_path / "home" / "catalog.yaml")
    catalog.add(DatasetSpec("Tiny", str(write_lf_dataset(tmp_path / "Tiny")), text="title",
                            overrides={"ingest.valid_fraction": "0.1"}))
    out = subprocess.run([sys.executable, "-m", "xc_dagster.cli", "materialize", "Tiny", "--select", "dataset",
                          "--set", "ingest.valid_fraction=0.25"], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    ingest = tmp_path / "home" / "artifacts" / "Tiny" / "ingest"
    assert json.loads((ingest / "params.json").read_text())["ingest.valid_fraction"] == 0.25
    assert len(np.load(ingest / "valid_rows.npy")) == 30  # 25% of the 120 training points (10% would be 12)
    assert catalog.get("Tiny").overrides == {"ingest.valid_fraction": "0.1"}
