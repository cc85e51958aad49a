"""The run planner (``xc-dagster plan``, ``xc_dagster.planning``): work counted on the shape x unit costs, the
shape from summaries or options, the CLI's table and JSON, the calibration cache."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from tests.tinydata import tiny_lf_home
from xc_dagster import cli
from xc_dagster.catalog import Catalog
from xc_dagster.config import resolve_config
from xc_dagster.errors import XCConfigError
from xc_dagster.home import Home
from xc_dagster.planning import calibration, dataset_shape, plan_run, plan_stages
from xc_dagster.planning.model import Costs, Shape
from xc_dagster.retrieval.exact_settings import resolve_kind

STAGES = ["ingest", "tokenize", "pretrain", "mining", "classifier", "index", "fusion", "evaluate"]
TINY = ["--points", "300", "--test-points", "100", "--labels", "50", "--labels-per-point", "2", "--tokens", "6"]
FAST = ["--set", "train.calibration_steps=1", "--set", "pretrain.batch_size=8", "--set", "classifier.batch_size=16",
        "--set", "train.budget_minutes=0",
        "--set", "pretrain.epochs=1", "--set", "classifier.epochs=1"]


class FixedUnits:
    """Unit costs of round values, never measured: what the work counts are multiplied by."""

    UNITS = {"encoder": {"dim": 8.0, "encode_texts_per_s": 1000.0, "pretrain_step_s": 0.5, "shape_hidden": 8.0,
                         "shape_layers": 0.0, "shape_heads": 0.0, "shape_intermediate": 0.0,
                         "shape_trainable": 1000.0},
             "exact_topk": {"pair_s": 1e-9}, "hnsw": {"build_s_per_vector_log": 1e-4, "search_s_per_query_log": 1e-5},
             "retrieve": {"s_per_entry": 1e-7}, "classifier": {"step_s": 0.25},
             "texts": {"ingest_s_per_text": 1e-5, "tokenize_texts_per_s": 1e4, "lexical_fit_s_per_text": 1e-4,
                       "lexical_query_s": 1e-3, "lexical_points": 1000.0},
             "fusion": {"s_per_entry": 1e-9, "rank_s_per_entry": 1e-8}}

    def __init__(self):
        self.device, self.machine, self.measured = torch.device("cpu"), "fixed", []

    def get(self, name, settings, measure):
        return self.UNITS[name]


BOTH = "with and without the lexical classifiers"  # the fusion fitted twice (fitted_sources)

def _ngame(**overrides) -> object:
    """The ngame strategy's config (as a catalog entry resolves it) with ``overrides``."""
    return resolve_config("quick", "ngame", ("test", overrides))


def _tiny_shape(n_valid: int = 10) -> Shape:
    return Shape(n_train=1000, n_test=200, n_labels=300, labels_per_point=2.0, tokens=6.0, label_tokens=6.0,
                 n_valid=n_valid)


def test_work_counts_of_a_hand_computed_shape(monkeypatch):
    monkeypatch.setenv("XC_EXACT_PRECISION", "fp32")
    cfg = _ngame(**{"pretrain.epochs": 2, "classifier.epochs": 3, "train.budget_minutes": 0,
                    "mining.shortlist_size": 100})
    s = _tiny_shape()
    stages = {p.name: p for p in plan_stages(Costs(FixedUnits(), cfg, s), cfg, s, None)}
    assert list(stages) == STAGES
    mining = stages["mining"]
    # every training point searches the L label embeddings: queries x keys x the per-pair cost
    assert mining.parts["label search (exact, 1,000 x 300)"] == pytest.approx(1000 * 300 * 1e-9)
    assert mining.kinds == {"label": resolve_kind("auto", 300, 8)} == {"label": "exact"}
    # pretraining: ceil(epochs x rows / batch) steps (rows = 990 without the validation points, and ngame's 300
    # label points)
    steps = math.ceil(2 * math.ceil((990 + 300) / 256))
    assert stages["pretrain"].parts[f"{steps:,} training steps (2.0 epochs x batch 256)"] == pytest.approx(steps * 0.5)
    assert stages["pretrain"].parts["encode 1,300 texts"] == pytest.approx(1.3)
    short = dataclasses.replace(s, label_tokens=2.0)  # label names of a third of a point's tokens: a third the time
    assert plan_stages(Costs(FixedUnits(), cfg, short), cfg, short, None)[2].parts["encode 1,300 texts"] == \
        pytest.approx((1000 + 300 / 3) / 1000)
    # placeholder label names (the ingest summary's label_names false): the stage trains no label points, unless set
    unnamed = dataclasses.replace(s, label_names=False)
    plain = math.ceil(2 * math.ceil(990 / 256))
    assert f"{plain:,} training steps (2.0 epochs x batch 256)" in plan_stages(
        Costs(FixedUnits(), cfg, unnamed), cfg, unnamed, None)[2].parts
    told = _ngame(**{"pretrain.epochs": 2, "train.budget_minutes": 0, "pretrain.label_points": True})
    assert f"{steps:,} training steps (2.0 epochs x batch 256)" in plan_stages(
        Costs(FixedUnits(), told, unnamed), told, unnamed, None)[2].parts
    # no training point has text (a BoW source without its vocabulary): nothing to pretrain, as the stage does
    textless = dataclasses.replace(s, point_texts=False)
    bare = plan_stages(Costs(FixedUnits(), cfg, textless), cfg, textless, None)[2]
    assert not any("training steps" in k for k in bare.parts) and "training step" not in bare.memory
    assert bare.notes == ["no training point has text: the encoder is not trained"]
    assert bare.parts == {"encode 301 texts": pytest.approx(301 / 1000.0)}  # one point input and the 300 labels
    # ... and with shipped features the model is the lexical source alone: W untrained, mining one exact search, the
    # lexical source alone indexed (the stages' StageContext.lexical_only); the user's index.sources keep it all
    bow = dataclasses.replace(textless, point_features=True)
    alone = {p.name: p for p in plan_stages(Costs(FixedUnits(), cfg, bow), cfg, bow, None)}
    assert alone["classifier"].parts == {} and "W is not trained" in alone["classifier"].notes[0]
    assert alone["index"].kinds == {} and any("lexical TF-IDF" in k for k in alone["index"].parts)
    assert alone["mining"].kinds == {"label": "exact"} and alone["evaluate"].parts["encode 1 test texts"] > 0
    kept = _ngame(**{"index.sources": "W,label,lexical"})
    as_set = {p.name: p for p in plan_stages(Costs(FixedUnits(), kept, bow), kept, bow, None)}
    assert as_set["classifier"].parts and set(as_set["index"].kinds) == {"W", "label"}
    alone_set = _ngame(**{"index.sources": "lexical"})  # the lexical source alone, set: the same model
    assert not {p.name: p for p in plan_stages(Costs(FixedUnits(), alone_set, bow), alone_set, bow, None)}[
        "classifier"].parts
    cls = stages["classifier"]
    assert cls.parts[f"{3 * math.ceil(990 / 1024)} training steps (3.0 epochs x batch 1024)"] == pytest.approx(0.75)
    assert cls.memory["W and its start"] == 2 * 300 * 8 * 4
    index = stages["index"]
    assert index.kinds == {"W": "exact", "label": "exact", "knn": "exact"}  # lexical: no ANNS index
    # 990 fit points x 300 labels: solved exactly (every pair), no hard negatives searched
    assert not any("hard negatives" in k for k in index.parts)
    # the stochastic trainer's hard negatives: the 990 fit points scored as queries (1 ms each: the index's 1,000
    # points, as calibrated), their passes not planned; none when cross-fitting (the classifiers then never train)
    sgd = _ngame(**{"index.lexical_classifier_solver": "sgd"})
    sgd_index = {p.name: p for p in plan_stages(Costs(FixedUnits(), sgd, s), sgd, s, None)}["index"]
    assert sgd_index.parts["lexical classifiers' hard negatives, 990 points"] == pytest.approx(0.99)
    crossed = _ngame(**{"fusion.fit_on": "cross_fit", "index.lexical_classifier_solver": "sgd"})
    crossed_index = {p.name: p for p in plan_stages(Costs(FixedUnits(), crossed, s), crossed, s, None)}["index"]
    assert "lexical TF-IDF fit, 1,300 texts" in crossed_index.parts
    assert not any("hard negatives" in k for k in crossed_index.parts)
    # one part at a time: the peak is the largest part, here the lexical index of 1,300 texts of 6 tokens (TF-IDF
    # entries and the texts), over the kNN index of every training point (include_validation) and its vectors
    lexical, knn = 1300 * (2 * 6 * 24 + 60 + 5 * 6), 2 * 1000 * 8 * 4
    assert index.memory == {"lexical index and texts (the largest part; one at a time)": lexical} and lexical > knn
    wide = {p.name: p for p in plan_stages(Costs(FixedUnits(), cfg, s), _ngame(**{"index.sources": ["W", "knn"]}),
                                           s, None)}["index"]
    assert wide.memory == {"knn index and its vectors (the largest part; one at a time)": knn}
    ev = stages["evaluate"]
    assert ev.parts["W search (exact, 200 x 300)"] == pytest.approx(200 * 300 * 1e-9)
    assert ev.parts["knn search (exact, 200 x 1,000)"] == pytest.approx(200 * 1000 * 1e-9)
    assert ev.parts["encode 200 test texts"] == pytest.approx(0.2)
    fusion = stages["fusion"]  # ngame: the index's own votes, the weights searched one at a time
    assert fusion.parts[f"label search (exact, 10 x 300), {BOTH}"] == pytest.approx(2 * 10 * 300 * 1e-9)
    width = 100 * 5  # W, label, knn, lexical, cooccurrence
    # 21 alphas x (5 kNN + 5 lexical + 4 co-occurrence weights + 5 kNN discounts + 5 propensity weights) x 2 rounds,
    # fitted with and without the lexical classifiers
    assert fusion.parts[f"alpha fit, 1,008 evaluations x 10 points, {BOTH}"] == pytest.approx(
        2 * 1008 * 10 * width * 1e-9)
    one = {p.name: p for p in plan_stages(Costs(FixedUnits(), cfg, s), _ngame(
        **{"fusion.try_without_lexical_classifiers": False}), s, None)}["fusion"]
    assert one.parts["alpha fit, 1,008 evaluations x 10 points"] == pytest.approx(1008 * 10 * width * 1e-9)
    assert one.seconds == pytest.approx(fusion.seconds / 2)
    grid = {p.name: p for p in plan_stages(Costs(FixedUnits(), cfg, s), _ngame(**{"fusion.search": "grid"}), s,
                                           None)}["fusion"]  # every combination
    assert grid.parts[f"alpha fit, 52,500 grid points x 10 points, {BOTH}"] == pytest.approx(
        2 * 52500 * 10 * width * 1e-9)
    two = {p.name: p for p in plan_stages(Costs(FixedUnits(), cfg, s), _ngame(**{"fusion.vote_grid": "10:2,50:4"}),
                                          s, None)}["fusion"]  # the shortlists and the fit for each candidate
    assert two.parts[f"alpha fit, 1,008 evaluations x 10 points, x 2 vote candidates, {BOTH}"] == pytest.approx(
        4 * 1008 * 10 * width * 1e-9)
    assert two.seconds == pytest.approx(2 * fusion.seconds)
    # the user's own votes without a grid: the index's votes only, as the fusion stage counts them
    mine = {p.name: p for p in plan_stages(Costs(FixedUnits(), cfg, s), _ngame(**{"index.knn_neighbours": 5}), s,
                                           None)}["fusion"]
    assert mine.seconds == pytest.approx(fusion.seconds) and not any("vote candidates" in k for k in mine.parts)


def test_hnsw_above_the_exact_limit_scales_with_log_n(monkeypatch):
    monkeypatch.setenv("XC_EXACT_PRECISION", "fp32")
    cfg = _ngame(**{"train.budget_minutes": 0})
    s = Shape(400_000, 1000, 300, 2.0, 6.0, 6.0, 5000)
    stages = {p.name: p for p in plan_stages(Costs(FixedUnits(), cfg, s), cfg, s, None)}
    assert stages["index"].kinds["knn"] == resolve_kind("auto", 400_000, 8) == "hnsw"
    assert stages["index"].parts["knn build (hnsw, 400,000)"] == pytest.approx(400_000 * math.log(400_000) * 1e-4)
    assert stages["evaluate"].parts["knn search (hnsw, 1,000)"] == pytest.approx(1000 * math.log(400_000) * 1e-5)


def test_classifier_calibration_follows_the_labels_up_to_its_cap():
    """The classifier's calibration runs with the shape's L rounded up to a power of two (its step cost grows
    with the distinct W rows a batch touches), at least 1,024, at most CLASSIFIER_MAX_LABELS (CLASSIFIER_LABELS
    when the trainer also trains the encoder)."""
    assert calibration.classifier_labels(300, False) == 1024
    assert calibration.classifier_labels(20_000, False) == 32_768
    assert calibration.classifier_labels(32_768, False) == 32_768
    assert calibration.classifier_labels(131_073, False) == calibration.CLASSIFIER_MAX_LABELS == 65_536
    assert calibration.classifier_labels(131_073, True) == calibration.CLASSIFIER_LABELS


def test_shape_from_summaries_and_missing_options(tmp_path):
    cfg = resolve_config()
    with pytest.raises(XCConfigError) as e:
        dataset_shape(tmp_path, "D", cfg, {"n_train": 10})
    msg = str(e.value)
    for opt in ("--test-points", "--labels", "--labels-per-point", "--tokens"):
        assert opt in msg
    assert "--points" not in msg
    (tmp_path / "D" / "ingest").mkdir(parents=True)
    (tmp_path / "D" / "ingest" / "summary.json").write_text(json.dumps(
        {"n_train": 500, "n_test": 70, "n_labels": 40, "avg_labels_per_point": 1.5, "n_valid": 25}))
    with pytest.raises(XCConfigError, match="pass --tokens$"):
        dataset_shape(tmp_path, "D", cfg, {})
    (tmp_path / "D" / "tokenize").mkdir()
    (tmp_path / "D" / "tokenize" / "summary.json").write_text(json.dumps({"train_mean_len": 9.5,
                                                                          "label_mean_len": 4.0}))
    shape, source = dataset_shape(tmp_path, "D", cfg, {"n_test": 80})
    assert shape == Shape(500, 80, 40, 1.5, 9.5, 4.0, 25)
    assert source["n_test"] == "option --test-points" and source["n_train"] == "ingest summary"


@pytest.fixture
def small_calibration(monkeypatch):
    """The calibration's samples made small: the same measurements in a fraction of a second each."""
    for name, value in {"SAMPLE_SCALE": 0.002, "EXACT_QUERIES": 64, "EXACT_KEYS": 512, "HNSW_VECTORS": 500,
                        "HNSW_QUERIES": 50, "ENCODE_TEXTS": 64, "CLASSIFIER_POINTS": 256, "CLASSIFIER_LABELS": 128,
                        "FUSION_POINTS": 50, "FUSION_WIDTH": 40, "LEXICAL_QUERIES": 50, "TRAINER_REPS": 1}.items():
        monkeypatch.setattr(calibration, name, value)


def test_cli_prints_a_row_per_stage_and_json(tmp_path, monkeypatch, capsys, small_calibration):
    tiny_lf_home(tmp_path, monkeypatch, {})
    assert cli.main(["plan", "TinyTitles", *TINY, *FAST]) == 0
    out = capsys.readouterr().out
    rows = [line.split()[0] for line in out.splitlines() if line.split() and line.split()[0] in STAGES]
    assert rows == STAGES
    assert "total" in out and "available" in out
    assert cli.main(["plan", "TinyTitles", *TINY, *FAST, "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert [s["stage"] for s in plan["stages"]] == STAGES
    assert plan["shape"]["n_train"] == 300 and plan["shape"]["n_valid"] == 15  # 5% of 300
    assert plan["calibrated"] == []  # the first call's unit costs, from the cache
    assert plan["total_seconds"] == pytest.approx(sum(s["seconds"] for s in plan["stages"]))


def test_cli_missing_shape_fails_naming_the_options(tmp_path, monkeypatch, capsys):
    tiny_lf_home(tmp_path, monkeypatch, {})
    assert cli.main(["plan", "TinyTitles", "--points", "300"]) == 2
    err = capsys.readouterr().err
    assert "--test-points, --labels, --labels-per-point, --tokens" in err and "ingest" in err


def test_calibration_is_cached_and_recalibrate_measures_again(tmp_path, monkeypatch, small_calibration):
    tiny_lf_home(tmp_path, monkeypatch, {})
    home = Home.from_env()
    cfg = Catalog(home.catalog).get("TinyTitles").config({"train.budget_minutes": 0, "pretrain.batch_size": 8,
                                                          "classifier.batch_size": 16, "train.calibration_steps": 1})
    given = {"n_train": 300, "n_test": 100, "n_labels": 50, "labels_per_point": 2.0, "tokens": 6.0}
    first = plan_run(home.cache, home.artifacts, "TinyTitles", cfg, given)
    assert {k.split()[0] for k in first.calibrated} >= {"encoder", "exact_topk", "classifier", "texts", "fusion"}
    cached = json.loads((home.cache / calibration.CACHE_FILE).read_text())[first.machine]
    assert set(cached) == set(first.calibrated)

    def no_measuring(*args, **kwargs):
        raise AssertionError("measured although cached")

    for name in ("exact_unit", "encoder_units", "classifier_unit", "text_units", "fusion_unit", "retrieve_unit"):
        monkeypatch.setattr(f"xc_dagster.planning.model.{name}", no_measuring)
    second = plan_run(home.cache, home.artifacts, "TinyTitles", cfg, given)
    assert second.calibrated == []
    assert [s.seconds for s in second.stages] == [s.seconds for s in first.stages]
    with pytest.raises(AssertionError, match="measured although cached"):
        plan_run(home.cache, home.artifacts, "TinyTitles", cfg, given, recalibrate=True)


def test_hnsw_graphs_of_millions_are_flagged_as_beyond_the_ln_n_model(monkeypatch):
    """Above 2^19 vectors the ln n scaling of a 10,000-vector calibration under-predicted the 1.3M shape's graphs
    6.2x (build) and 3.1x (search): the plan scales them by those factors and says so for each such index, and
    not below."""
    from xc_dagster.planning.model import HNSW_LOG_MODEL_UP_TO, MEMORY_BOUND_BUILD, MEMORY_BOUND_SEARCH

    monkeypatch.setenv("XC_EXACT_PRECISION", "fp32")
    cfg = _ngame(**{"train.budget_minutes": 0})
    big = Shape(2_248_619, 1000, 1_305_265, 22.0, 6.0, 6.0, 5000)
    stages = {p.name: p for p in plan_stages(Costs(FixedUnits(), cfg, big), cfg, big, None)}
    notes = [n for n in stages["index"].notes if "memory-bound" in n]
    assert [n.split(":")[0] for n in notes] == ["W", "label", "knn"] and HNSW_LOG_MODEL_UP_TO == 1 << 19
    units, n = FixedUnits().get("hnsw", {}, None), 2_248_619  # the kNN graph: n x ln n x unit x factor
    assert stages["index"].parts["knn build (hnsw, 2,248,619)"] == pytest.approx(
        n * math.log(n) * units["build_s_per_vector_log"] * MEMORY_BOUND_BUILD)
    assert (MEMORY_BOUND_BUILD, MEMORY_BOUND_SEARCH) == (6.2, 3.1)
    small = Shape(400_000, 1000, 300, 2.0, 6.0, 6.0, 5000)
    stages = {p.name: p for p in plan_stages(Costs(FixedUnits(), cfg, small), cfg, small, None)}
    assert stages["index"].kinds["knn"] == "hnsw" and not any("memory-bound" in n for n in stages["index"].notes)
