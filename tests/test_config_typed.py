"""Enum-like config fields are typed from the component registries: a value outside the allowed set fails at once
(``--set``, the catalog, the run config and the generated Dagster ``Config`` classes) naming the field and listing
the allowed values, and the launchpad's descriptions say which value each preset and strategy uses."""

import dataclasses
import typing

import dagster as dg
import pydantic
import pytest
import torch
import yaml

from assets.config import CONFIG_CLASSES, make_config_class, run_overrides
from xc_dagster.catalog import Catalog, DatasetSpec
from xc_dagster.cli import main as cli_main
from xc_dagster.config import STAGES, choices, describe_default, literal_choices, parse_set_options, resolve_config
from xc_dagster.config.bounds import BOUNDS, NON_EMPTY
from xc_dagster.device import amp_dtype
from xc_dagster.errors import XCConfigError
from xc_dagster.home import Home
from xc_dagster.pipeline.cross_fit import FIT_ON
from xc_dagster.retrieval.exact_settings import KINDS
from xc_dagster.retrieval.fusion import FUSIONS
from xc_dagster.retrieval.fusion.alpha import FUSION_SEARCHES
from xc_dagster.retrieval.lexical_exact import SOLVERS
from xc_dagster.retrieval.shortlist import ANN_SOURCES, LABEL_REPRS, SOURCES
from xc_dagster.sampling.batches import BATCH_SAMPLERS
from xc_dagster.sampling.hard_negatives import HARD_NEGATIVE_POOLS
from xc_dagster.sampling.negatives import SAMPLED_NEGATIVES
from xc_dagster.strategies import STRATEGIES
from xc_dagster.training.end_to_end import ENCODER_NEGATIVES
from xc_dagster.training.losses import CLASSIFIER_LOSSES, PAIR_LOSSES
from xc_dagster.training.memory import GRAD_CACHE_MODES
from xc_dagster.training.sharded import ROW_OPTIMIZERS

# every enum-like field and its allowed values, as the registries that define them hold them
REGISTRY_FIELDS = {
    "pretrain.sampler": tuple(BATCH_SAMPLERS),
    "pretrain.loss": tuple(PAIR_LOSSES),
    "pretrain.grad_cache": GRAD_CACHE_MODES,
    "pretrain.amp": choices.AMP_MODES,
    "pretrain.pooling": choices.POOLINGS,
    "mining.sources": ANN_SOURCES,
    "mining.index": KINDS,
    "classifier.init": LABEL_REPRS,
    "classifier.negatives": tuple(HARD_NEGATIVE_POOLS) + tuple(SAMPLED_NEGATIVES),
    "classifier.w_optimizer": tuple(ROW_OPTIMIZERS),
    "classifier.loss": tuple(CLASSIFIER_LOSSES),
    "classifier.sampler_index": tuple(k for k in KINDS if k != "auto"),
    "classifier.encoder_negatives": ENCODER_NEGATIVES,
    "classifier.grad_cache": GRAD_CACHE_MODES,
    "fusion.method": tuple(FUSIONS),
    "fusion.fit_on": FIT_ON,
    "fusion.search": FUSION_SEARCHES,
    "index.kind": KINDS,
    "index.sources": SOURCES,
    "index.label_repr": LABEL_REPRS,
    "index.lexical_classifier_solver": SOLVERS,
    "ingest.text": ("auto", "title", "title+content"),
    "ingest.label_text": ("title", "title+content", "same"),
}
FusionConfig = make_config_class("fusion")
# the str fields whose values are open: a path or hub name, a folder, a formula of metric names
FREE_TEXT = {"tokenize.encoder", "pretrain.warm_start", "fusion.objective"}


def _hints(stage: str) -> dict[str, typing.Any]:
    return typing.get_type_hints(STAGES[stage])


def test_every_enum_like_field_is_typed_with_exactly_its_registry_names():
    typed = {f"{s}.{n}": literal_choices(t) for s in STAGES for n, t in _hints(s).items()
             if literal_choices(t) is not None}
    assert sorted(typed) == sorted(REGISTRY_FIELDS)
    for key, names in REGISTRY_FIELDS.items():
        assert sorted(typed[key]) == sorted(names), key
    # the str fields left are the open ones (a new enum-like field must be typed, or listed here on purpose)
    plain = {f"{s}.{n}" for s in STAGES for n, t in _hints(s).items() if t is str}
    assert plain == FREE_TEXT
    for mode in choices.AMP_MODES:  # the amp modes are the ones the device accepts
        amp_dtype(torch.device("cpu"), mode)


@pytest.mark.parametrize("item, message", [
    ("classifier.negatives=bogus", "--set: config field 'classifier.negatives': expected one of 'shortlist', "
                                   "'in-batch', 'both', 'uniform', 'astra', 'mips', got 'bogus'"),
    ("fusion.method=Tree", "--set: config field 'fusion.method': expected one of 'alpha', 'tree', got 'Tree'"),
    ("index.sources=W,bogus", "--set: config field 'index.sources': expected items, each one of 'W', 'label', "
                              "'centroid', 'knn', 'lexical', 'cooccurrence', got 'bogus'"),
    ("mining.sources=label,lexical", "--set: config field 'mining.sources': expected items, each one of 'W', "
                                     "'label', 'centroid', 'knn', got 'lexical'"),
])
def test_set_refuses_a_value_outside_the_allowed_set(item, message):
    with pytest.raises(XCConfigError) as err:
        parse_set_options([item])
    assert str(err.value) == message


def test_allowed_values_pass_and_resolve_to_plain_strings():
    sets = parse_set_options(["classifier.negatives= in-batch", "index.sources=W,knn", "fusion.fit_on=cross_fit"])
    assert sets == {"classifier.negatives": "in-batch", "index.sources": "W,knn", "fusion.fit_on": "cross_fit"}
    cfg = resolve_config("quick", "ngame", ("--set", sets))
    assert cfg.classifier.negatives == "in-batch" and type(cfg.classifier.negatives) is str
    assert cfg.index.sources == ("W", "knn") and cfg.fusion.fit_on == "cross_fit"
    for name in STRATEGIES:  # every strategy's own values are allowed ones
        resolve_config("paper", name)


@pytest.mark.parametrize("item, message", [
    ("pretrain.batch_size=inf", "config field 'pretrain.batch_size': expected int, got 'inf'"),
    ("pretrain.batch_size=1e400", "config field 'pretrain.batch_size': expected int, got '1e400'"),
    ("pretrain.batch_size=-inf", "config field 'pretrain.batch_size': expected int, got '-inf'"),
    ("pretrain.lr=nan", "config field 'pretrain.lr': expected a finite number, got 'nan'"),
    ("fusion.knn_grid=0,inf", "config field 'fusion.knn_grid': expected a finite number, got 'inf'"),
    ("tokenize.max_len=1", "config field 'tokenize.max_len': expected 2 <= value <= 32768"),
    ("tokenize.label_max_len=-1", "config field 'tokenize.label_max_len': expected 0 or 2 <= value <= 32768"),
    ("ingest.valid_fraction=-0.5", "config field 'ingest.valid_fraction': expected 0 <= value <= 1"),
    ("ingest.valid_fraction=nan", "config field 'ingest.valid_fraction': expected a finite number, got 'nan'"),
    ("ingest.valid_max=-5", "config field 'ingest.valid_max': expected a value >= 0"),
    ("ingest.seed=-1", "config field 'ingest.seed': expected a value >= 0, a seed; got -1"),
    ("evaluate.ks=0,5", "config field 'evaluate.ks': expected items each 1 <= value <= 10000"),
    ("evaluate.top_k=0", "config field 'evaluate.top_k': expected 1 <= value <= 10000"),
    ("evaluate.propensity_b=-1", "config field 'evaluate.propensity_b': expected a value >= 0"),
    ("index.lexical_char_weight=-0.5", "config field 'index.lexical_char_weight': expected a value >= 0"),
    ("index.sources=", "config field 'index.sources': expected one or more values, got none"),
    ("mining.sources= ,", "config field 'mining.sources': expected one or more values, got none"),
    ("evaluate.ks=", "config field 'evaluate.ks': expected one or more values, got none"),
    ("index.lexical_classifier_weights=", "config field 'index.lexical_classifier_weights': expected one or more"),
    # each of these hung, grew memory without bound or failed in a stage with a raw error before it had a range
    ("pretrain.encode_batch_size=0", "config field 'pretrain.encode_batch_size': expected a value >= 1"),
    ("train.reserve=5", "config field 'train.reserve': expected 0 <= value < 1"),
    ("train.reserve=1", "config field 'train.reserve': expected 0 <= value < 1"),
    ("tokenize.max_len=99999999999", "config field 'tokenize.max_len': expected 2 <= value <= 32768"),
    ("pretrain.lr=1e-400", "config field 'pretrain.lr': expected a value > 0, a positive number; got 0.0"),
    ("pretrain.temperature=0", "config field 'pretrain.temperature': expected a value > 0"),
    ("pretrain.chunk_size=0", "config field 'pretrain.chunk_size': expected a value >= 1"),
    ("pretrain.curriculum=1,-1", "config field 'pretrain.curriculum': expected items each a value >= 0"),
    ("classifier.epochs=-2", "config field 'classifier.epochs': expected a value >= 0"),
    ("classifier.dropout=1", "config field 'classifier.dropout': expected 0 <= value < 1"),
    ("mining.hnsw_m=1", "config field 'mining.hnsw_m': expected a value >= 2"),
    ("index.knn_power=-3", "config field 'index.knn_power': expected a value > 0"),
    ("fusion.grid_step=0", "config field 'fusion.grid_step': expected 0 < value <= 1"),
    ("fusion.cross_fit_folds=1", "config field 'fusion.cross_fit_folds': expected a value >= 2"),
    ("train.budget_minutes=-1", "config field 'train.budget_minutes': expected a value >= 0"),
    ("evaluate.top_k=100000000000000", "config field 'evaluate.top_k': expected 1 <= value <= 10000"),
])
def test_set_refuses_a_number_outside_its_range(item, message):
    """Infinite, nan and out-of-range numbers fail at --set naming the field, not in a stage with a numpy error."""
    with pytest.raises(XCConfigError) as err:
        parse_set_options([item])
    assert str(err.value).startswith(f"--set: {message}")


@pytest.mark.parametrize("preset", ["quick", "paper"])
def test_every_strategys_defaults_lie_within_the_ranges(preset):
    """The ranges refuse no value the presets and strategies set themselves."""
    from xc_dagster.config.bounds import check_bounds

    for name in STRATEGIES:
        cfg = resolve_config(preset, name, ("--set", {}))
        for key in BOUNDS:
            stage, field = key.split(".")
            check_bounds(key, getattr(getattr(cfg, stage), field))


def test_the_edges_of_the_ranges_pass():
    sets = parse_set_options(["ingest.valid_fraction=1", "ingest.valid_max=0", "tokenize.max_len=2",
                              "tokenize.label_max_len=0", "evaluate.top_k=10", "evaluate.propensity_a=0"])
    cfg = resolve_config("quick", "ngame", ("--set", sets))
    assert (cfg.ingest.valid_fraction, cfg.tokenize.max_len, cfg.evaluate.top_k) == (1.0, 2, 10)
    edges = parse_set_options(["train.reserve=0", "pretrain.epochs=0", "classifier.dropout=0", "index.knn_neighbours=0",
                               "fusion.grid_step=1", "tokenize.max_len=32768", "pretrain.contrastive_c=1"])
    assert resolve_config("quick", "ngame", ("--set", edges)).index.knn_neighbours == 0
    wide = resolve_config("quick", "ngame", ("--set", {"evaluate.ks": "1,20", "evaluate.top_k": 20}))
    assert wide.evaluate.top_k == 20
    assert [k for k in {*BOUNDS, *NON_EMPTY} if k.partition(".")[2] not in _hints(k.partition(".")[0])] == []
    assert parse_set_options(["fusion.vote_grid="]) == {"fusion.vote_grid": ""}  # empty: the index stage's votes


def test_top_k_below_the_largest_reported_k_fails_when_the_config_is_resolved(tmp_path):
    """The evaluation reports evaluate.ks and k = 1..10: a shorter prediction list would read P@k short."""
    with pytest.raises(XCConfigError) as err:
        resolve_config("quick", "ngame", ("--set", parse_set_options(["evaluate.top_k=9"])))
    assert str(err.value) == ("config field 'evaluate.top_k': expected at least 10, the largest k the evaluation "
                              "reports (evaluate.ks 1,3,5 and k = 1..10 for the curves), got 9")
    with pytest.raises(XCConfigError, match="'evaluate.top_k': expected at least 200, .* got 100"):
        resolve_config("quick", "ngame", ("run config", {"evaluate.ks": "1,200"}))
    # datasets add: the entry's layered config is checked before the catalog is written
    spec = DatasetSpec("D", "/d", overrides=parse_set_options(["evaluate.top_k=5"]))
    with pytest.raises(XCConfigError, match="^datasets add: dataset 'D': config field 'evaluate.top_k': expected at "
                                            "least 10, .* got 5$"):
        Catalog(tmp_path / "cat.yaml").add(spec)
    assert not (tmp_path / "cat.yaml").exists()


@pytest.mark.parametrize("key", ["strategy", "preset"])
def test_preset_and_strategy_are_refused_as_overrides_naming_their_option(tmp_path, key):
    """Overrides are layered after the preset and the strategy are chosen: there they would be ignored."""
    with pytest.raises(XCConfigError) as err:
        parse_set_options([f"{key}=astra"])
    assert str(err.value) == (f"--set: {key!r} is not a stage field, so it cannot be set as an override; choose the "
                              f"{key} with --{key} (xc-dagster datasets add NAME --source URI --replace --{key} "
                              f"{key.upper()})")
    with pytest.raises(XCConfigError, match=f"datasets add: dataset 'D' overrides: '{key}' is not a stage field"):
        Catalog(tmp_path / "cat.yaml").add(DatasetSpec("D", "/d", overrides={key: "paper"}))
    assert not (tmp_path / "cat.yaml").exists()
    path = tmp_path / "catalog.yaml"  # an old catalog that stored the key (never applied): loads without it
    path.write_text(yaml.safe_dump({"datasets": {"D": {"source": "/d", "overrides": {key: "paper"}}}}))
    assert Catalog(path).load()["D"].overrides == {}


def test_datasets_add_with_a_bad_value_fails_before_writing_the_catalog(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XC_HOME", str(tmp_path / "home"))
    src = tmp_path / "src"
    src.mkdir()
    rc = cli_main(["datasets", "add", "Bad", "--source", str(src), "--set", "classifier.negatives=bogus"])
    err = capsys.readouterr().err.splitlines()[-1]
    assert rc == 2
    assert err == ("xc-dagster: error: --set: config field 'classifier.negatives': expected one of 'shortlist', "
                   "'in-batch', 'both', 'uniform', 'astra', 'mips', got 'bogus'")
    assert not Home.from_env().catalog.exists()
    with pytest.raises(XCConfigError, match="'pretrain.sampler': expected one of 'random', 'ngame', 'siamesexml'"):
        Catalog(tmp_path / "cat.yaml").add(DatasetSpec("Bad", str(src), overrides={"pretrain.sampler": "clusters"}))
    assert not (tmp_path / "cat.yaml").exists()


def test_a_catalog_entry_with_a_bad_value_fails_naming_the_file_and_the_allowed_values(tmp_path):
    path = tmp_path / "catalog.yaml"
    path.write_text(yaml.safe_dump({"datasets": {"D": {"source": "/d", "overrides": {"fusion.fit_on": "folds"}}}}))
    with pytest.raises(XCConfigError) as err:
        Catalog(path).load()
    assert str(err.value) == (f"{path}: dataset 'D' overrides: config field 'fusion.fit_on': expected one of "
                              "'auto', 'validation', 'cross_fit', got 'folds'")


def test_the_dagster_config_class_refuses_a_bad_value_listing_the_allowed_ones():
    cls = CONFIG_CLASSES["classifier"]
    with pytest.raises(pydantic.ValidationError) as err:
        cls(negatives="bogus")
    assert ("Input should be 'shortlist', 'in-batch', 'both', 'uniform', 'astra' or 'mips'"
            in str(err.value))
    with pytest.raises(pydantic.ValidationError,
                       match="Input should be 'W', 'label', 'centroid', 'knn', 'lexical' or 'cooccurrence'"):
        CONFIG_CLASSES["index"](sources=["W", "bogus"])
    assert run_overrides("classifier", cls(negatives="in-batch", epochs=2)) == {
        "classifier.epochs": 2.0, "classifier.negatives": "in-batch"}
    assert run_overrides("index", CONFIG_CLASSES["index"](sources=["W", "knn"])) == {"index.sources": ["W", "knn"]}
    assert resolve_config("quick", "ngame", ("run config", run_overrides(
        "index", CONFIG_CLASSES["index"](sources=["W", "knn"], kind="exact")))).index.sources == ("W", "knn")


def test_dagster_run_config_refuses_a_bad_value_before_the_asset_runs():
    seen = []

    @dg.asset
    def fusion(config: FusionConfig):  # type: ignore[valid-type]  (no `from __future__ import annotations` here:
        # Dagster reads the annotation as a class)
        seen.append(run_overrides("fusion", config))

    with pytest.raises(dg.DagsterInvalidConfigError, match="not in enum type FusionMethod got stack"):
        dg.materialize([fusion], run_config={"ops": {"fusion": {"config": {"method": "stack"}}}})
    assert seen == []
    res = dg.materialize([fusion], run_config={"ops": {"fusion": {"config": {"method": "tree", "knn_grid": [0.5]}}}})
    assert res.success and seen == [{"fusion.method": "tree", "fusion.knn_grid": [0.5]}]


def test_descriptions_show_each_strategys_value():
    desc = {s: {n: f.description for n, f in CONFIG_CLASSES[s].model_fields.items()} for s in CONFIG_CLASSES}
    assert desc["pretrain"]["sampler"] == (
        "pretrain.sampler for this run only (empty: the dataset's value); one of 'random', 'ngame', 'siamesexml'; "
        "default ngame: 'ngame', siamesexml: 'siamesexml', astra: 'random', mips: 'random'")
    assert desc["fusion"]["method"].endswith("; one of 'alpha', 'tree'; default 'alpha'")
    assert desc["classifier"]["negatives"].endswith(
        "default ngame: 'shortlist', siamesexml: 'shortlist', astra: 'astra', mips: 'mips'")
    assert desc["index"]["sources"].endswith("default ngame: 'W,label,knn,lexical,cooccurrence', "
                                             "siamesexml: 'label,centroid,knn', "
                                             "astra: 'W,label,knn', mips: 'W,label,knn'")
    assert desc["pretrain"]["batch_size"].endswith("default quick preset: 256; paper preset: 1600")
    assert desc["pretrain"]["epochs"].endswith("default quick preset: ngame: 1.0, siamesexml: 3.0, astra: 0.0, "
                                               "mips: 0.0; paper preset: ngame: 300.0, siamesexml: 3.0, astra: 0.0, "
                                               "mips: 0.0")
    assert desc["classifier"]["epochs"].endswith("default quick preset: ngame: 10.0, siamesexml: 5, astra: 0.75, "
                                                 "mips: 1.0; paper preset: ngame: 100.0, siamesexml: 100.0, "
                                                 "astra: 0.75, mips: 1.0")
    assert "the dataset's options set it" in desc["tokenize"]["max_len"]
    assert "the dataset's options set it" not in desc["tokenize"]["encoder"]
    # every field's description is the library's, and each strategy's value under the quick preset is in it
    quick = {name: resolve_config("quick", name) for name in STRATEGIES}
    for stage, params in STAGES.items():
        for f in dataclasses.fields(params):
            assert describe_default(stage, f.name) in desc[stage][f.name], (stage, f.name)
            text = describe_default(stage, f.name).split("; paper preset:")[0]
            for name, cfg in quick.items():
                value = getattr(cfg.stage(stage), f.name)
                shown = repr(",".join(map(str, value))) if isinstance(value, tuple) else repr(value)
                assert shown in text, (stage, f.name, name)


def test_a_strategys_quick_settings_apply_under_the_quick_preset_only(tmp_path):
    """ngame's ten classifier epochs are the quick preset's (a default, so a budget may plan them); the paper
    preset keeps the paper's 100, and siamesexml keeps the dataclass's 5."""
    cfgs = {(p, s): DatasetSpec(name="D", source="x", strategy=s, preset=p).config()
            for p in ("quick", "paper") for s in ("ngame", "siamesexml")}
    assert {k: c.classifier.epochs for k, c in cfgs.items()} == {
        ("quick", "ngame"): 10, ("paper", "ngame"): 100, ("quick", "siamesexml"): 5, ("paper", "siamesexml"): 100}
    assert "classifier.epochs" not in cfgs["quick", "ngame"].explicit
    assert DatasetSpec(name="D", source="x", strategy="ngame", overrides={"classifier.epochs": 3}
                       ).config().classifier.epochs == 3
    assert STRATEGIES["ngame"].settings("paper") == STRATEGIES["ngame"].overrides


def test_resolve_config_layers_the_named_strategy_itself():
    """A config resolved from a strategy's name alone is the one a catalog entry of that strategy gets (the strategy's
    values are defaults, not the user's); an unknown strategy fails naming the known ones."""
    for preset in ("quick", "paper"):
        for name in STRATEGIES:
            spec = DatasetSpec(name="D", source="x", strategy=name, preset=preset)
            assert resolve_config(preset, name, ("options", spec.option_overrides())) == spec.config(), (preset, name)
            assert not resolve_config(preset, name).explicit
    assert resolve_config("quick", "ngame").classifier.epochs == 10
    assert resolve_config("quick", "ngame", ("test", {"classifier.epochs": 4})).explicit == {"classifier.epochs"}
    with pytest.raises(XCConfigError, match="unknown strategy 'ngam'.*ngame, siamesexml, astra, mips"):
        resolve_config("quick", "ngam")
