"""Unit tests of the library's building blocks: config layering, catalog, sampling, losses, ANNS, ranking."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import scipy.sparse as sp
import torch
import yaml

from xc_dagster.catalog import Catalog, DatasetSpec, default_propensity, default_text
from xc_dagster.config import parse_set_options, resolve_config
from xc_dagster.data.splits import validation_split
from xc_dagster.errors import XCConfigError, XCDatasetNotFound
from xc_dagster.retrieval.ann import LabelIndex, exact_topk
from xc_dagster.retrieval.shortlist import topk_from_scores
from xc_dagster.sampling.labels import dedupe_rows, positive_mask, sample_positives
from xc_dagster.storage import atomic_dir, stage_leftovers
from xc_dagster.training.losses import infonce_loss, masked_bce_loss, multi_positive_triplet_loss, ohnm_triplet_loss

# ------------------------------------------------------------------------------------------- config

def test_config_layers_last_wins_and_coerces():
    cfg = resolve_config("quick", "ngame", ("catalog", {"pretrain.epochs": "2", "classifier.loss": "triplet"}),
                         ("run", {"pretrain": {"epochs": 3}, "evaluate.ks": "1,3"}))
    assert cfg.pretrain.epochs == 3.0
    assert cfg.classifier.loss == "triplet"
    assert cfg.evaluate.ks == (1, 3)
    assert cfg.flat()["pretrain.epochs"] == 3.0
    # a scalar for a grid (YAML `propensity_grid: 0`, `--set fusion.knn_grid=0.5`) is the one-value grid
    one = resolve_config("quick", "ngame", ("catalog", {"fusion.propensity_grid": 0, "fusion.knn_grid": "0.5"}))
    assert one.fusion.propensity_grid == (0.0,) and one.fusion.knn_grid == (0.5,)


def test_paper_preset_changes_values():
    cfg = resolve_config("paper")
    assert cfg.pretrain.batch_size == 1600 and cfg.pretrain.epochs == 300
    assert cfg.classifier.loss == "triplet" and cfg.classifier.margin == 0.2


@pytest.mark.parametrize("bad, msg", [
    ({"pretrain.epoch": 1}, "unknown field 'pretrain.epoch'"),
    ({"pretrian.epochs": 1}, "unknown stage 'pretrian'"),
    ({"pretrain.batch_size": "lots"}, "'pretrain.batch_size': expected int"),
    ({"classifier.normalize": "maybe"}, "'classifier.normalize': expected bool"),
])
def test_config_errors_name_the_field(bad, msg):
    with pytest.raises(XCConfigError, match=msg.replace("(", r"\(").replace(")", r"\)")):
        resolve_config("quick", "ngame", ("catalog", bad))


def test_unknown_preset_and_set_syntax():
    with pytest.raises(XCConfigError, match="unknown preset 'fast'"):
        resolve_config("fast")
    with pytest.raises(XCConfigError, match="expected stage.field=value"):
        parse_set_options(["pretrain.epochs"])
    assert parse_set_options(["pretrain.epochs=2"]) == {"pretrain.epochs": "2"}


# ------------------------------------------------------------------------------------------ catalog

def test_dataset_defaults_follow_xc_conventions():
    assert default_text("LF-AmazonTitles-131K") == "title"
    assert default_text("LF-Amazon-131K") == "title+content"
    assert default_propensity("LF-AmazonTitles-131K") == (0.6, 2.6)
    assert default_propensity("LF-WikiSeeAlso-320K") == (0.5, 0.4)
    assert default_propensity("LF-WordNetNouns") == (0.55, 1.5)
    cfg = DatasetSpec("LF-WordNetNounsTitles", "x").config()
    assert cfg.ingest.text == "title" and cfg.tokenize.max_len == 32
    cfg = DatasetSpec("LF-WordNetNouns", "x").config()
    assert cfg.ingest.text == "title+content" and cfg.tokenize.max_len == 128


def test_catalog_add_list_remove_roundtrip(tmp_path):
    cat = Catalog(tmp_path / "catalog.yaml")
    assert cat.names() == []
    cat.add(DatasetSpec("A-Titles", "/data/a", overrides={"pretrain.epochs": "2"}))
    cat.add(DatasetSpec("B", "s3://bucket/b", text="title", max_len=16))
    assert cat.names() == ["A-Titles", "B"]
    b = cat.get("B")
    assert b.source == "s3://bucket/b" and b.max_len == 16
    assert cat.get("A-Titles").config().pretrain.epochs == 2.0
    with pytest.raises(XCConfigError, match="already in"):
        cat.add(DatasetSpec("B", "/elsewhere"))
    cat.remove("B")
    assert cat.names() == ["A-Titles"]
    with pytest.raises(XCDatasetNotFound, match="'B' is not in the catalog"):
        cat.get("B")


@pytest.mark.parametrize("spec, msg", [
    (DatasetSpec("bad name!", "x"), "must match"),
    (DatasetSpec("ok", "x", strategy="nope"), "strategy 'nope'"),
    (DatasetSpec("ok", "x", text="body"), "text 'body'"),
    (DatasetSpec("ok", "x", overrides={"pretrain.nope": 1}), "unknown field 'pretrain.nope'"),
    (DatasetSpec("Foo\n", "x"), r"dataset name 'Foo\\n' must match"),  # `$` alone matches before a final \n
    (DatasetSpec("ok", " "), "dataset 'ok' has no source"),
    (DatasetSpec("ok", "x", propensity_a=float("nan")), r"propensity_a \(evaluate.propensity_a\): expected a finite"),
    (DatasetSpec("ok", "x", propensity_b=-1.0), r"propensity_b \(evaluate.propensity_b\): expected a finite number "
                                                r">= 0 \(0 = by dataset family\), got -1.0"),
    (DatasetSpec("ok", "x", overrides={"strategy": "astra"}), "'strategy' is not a stage field.* --strategy"),
    (DatasetSpec("ok", "x", overrides={"tokenize.max_len": 1}), "'tokenize.max_len': expected 2 <= value <= 32768"),
])
def test_catalog_rejects_bad_entries(tmp_path, spec, msg):
    with pytest.raises(XCConfigError, match=msg):
        Catalog(tmp_path / "c.yaml").add(spec)
    assert not (tmp_path / "c.yaml").exists()


def test_an_old_catalogs_ignored_strategy_override_still_loads(tmp_path, caplog):
    """Earlier versions stored `--set strategy=...` in an entry's overrides and never applied it; refusing the key
    now must not make such a catalog unreadable (every partition would go): it loads with its preset and strategy
    as it always ran, the key dropped with a warning, and the next edit saves it without the key."""
    p = tmp_path / "catalog.yaml"
    p.write_text("datasets:\n  A:\n    source: x\n    overrides:\n      strategy: astra\n      preset: paper\n"
                 "      pretrain.epochs: 2\n  B:\n    source: y\n")
    with caplog.at_level("WARNING"):
        a = Catalog(p).get("A")
    assert a.strategy == "ngame" and a.preset == "quick" and a.overrides == {"pretrain.epochs": 2}
    assert a.config().pretrain.epochs == 2.0 and "never applied" in caplog.text
    Catalog(p).remove("B")
    assert yaml.safe_load(p.read_text())["datasets"]["A"]["overrides"] == {"pretrain.epochs": 2}
    assert Catalog(p).names() == ["A"]


def test_catalog_bad_yaml_names_file_and_line(tmp_path):
    p = tmp_path / "catalog.yaml"
    p.write_text("datasets:\n  A:\n    source: [unclosed\n")
    with pytest.raises(XCConfigError, match=r"catalog.yaml:\d+: not valid YAML"):
        Catalog(p).load()
    p.write_text("datasets:\n  A:\n    source: x\n    colour: red\n")
    with pytest.raises(XCConfigError, match=r"unknown keys \['colour'\]"):
        Catalog(p).load()


def test_catalog_gate_tolerance_validated_saved_and_resolved(tmp_path):
    """The champion gate's per-dataset tolerance: checked when the entry is added or loaded (the error names
    the field), kept through save/load, and below an explicit run config value."""
    cat = Catalog(tmp_path / "catalog.yaml")
    cat.add(DatasetSpec("A", "/data/a", gate_tolerance="0.5"))  # numeric text, as from the CLI
    cat.add(DatasetSpec("B", "/data/b"))
    a, b = cat.get("A"), cat.get("B")
    assert a.gate_tolerance == 0.5 and "gate_tolerance: 0.5" in cat.path.read_text()
    assert a.champion_tolerance() == (0.5, "catalog gate_tolerance")
    assert a.champion_tolerance(0.0) == (0.0, "run config")  # an explicit 0 in run config still wins
    assert a.champion_tolerance(2) == (2.0, "run config")
    assert b.gate_tolerance is None and b.champion_tolerance() == (0.0, "default")
    for bad in (-0.1, "half a point", float("nan"), float("inf"), True, [1.0]):
        with pytest.raises(XCConfigError, match=r"dataset 'C' gate_tolerance: expected a finite number of "
                                                r"percentage points >= 0"):
            cat.add(DatasetSpec("C", "/data/c", gate_tolerance=bad))
    assert cat.names() == ["A", "B"]
    cat.path.write_text("datasets:\n  D:\n    source: /data/d\n    gate_tolerance: -1\n")
    with pytest.raises(XCConfigError, match=r"catalog.yaml: dataset 'D' gate_tolerance: .* got -1"):
        cat.load()
    with pytest.raises(XCConfigError, match="run config registered_model.tolerance"):
        b.champion_tolerance(-1.0)


def test_a_stage_version_is_switched_in_with_its_own_config_record(tmp_path, monkeypatch):
    """StageContext.writing puts params.json into the version before the link names it: a run killed right after
    its switch leaves its record, and a concurrent run's record never lands in another run's version."""
    from xc_dagster import storage
    from xc_dagster.pipeline.context import StageContext
    from xc_dagster.pipeline.provenance import recorded_params, with_upstream_params

    at_switch, real_switch = [], storage._switch

    def switch(final, version):
        at_switch.append(json.loads((version / "params.json").read_text())["pretrain.epochs"])
        real_switch(final, version)

    monkeypatch.setattr(storage, "_switch", switch)
    store = storage.ArtifactStore(tmp_path, remote=None)
    for epochs in (7, 9):
        cfg = resolve_config("quick", "ngame", ("run config", {"pretrain.epochs": epochs}))
        with StageContext(store, DatasetSpec("D", "src"), cfg, tmp_path).for_stage("pretrain").writing() as out:
            (out / "summary.json").write_text("{}")
        assert at_switch[-1] == epochs and recorded_params(store, "D", "pretrain")["pretrain.epochs"] == epochs
    up = with_upstream_params(resolve_config("quick", "ngame"), store, "D", ["pretrain"])
    assert up.recorded == ["pretrain"] and up.cfg.pretrain.epochs == 9


def test_upstream_sections_come_from_the_stage_records(tmp_path):
    """with_upstream_params: each upstream stage's section as recorded next to its artifacts; the run's own
    section, downstream sections and stages without a record keep the run's resolution."""
    from xc_dagster.pipeline.provenance import recorded_params, with_upstream_params, write_params
    from xc_dagster.storage import ArtifactStore

    store = ArtifactStore(tmp_path)
    built = resolve_config("quick", "ngame", ("run config", {"fusion.method": "tree", "index.shortlist_size": 50,
                                                              "mining.sources": "label knn"}))
    for stage in ("mining", "index", "fusion"):
        store.stage_dir("D", stage).mkdir(parents=True)
        write_params(store.stage_dir("D", stage), built)
    store.stage_dir("D", "classifier").mkdir(parents=True)  # artifacts from before records existed
    path = store.stage_dir("D", "fusion") / "params.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "fusion.gone": 1}))  # a field since removed
    run = resolve_config("quick", "ngame", ("run config", {"evaluate.top_k": 20, "fusion.grid_step": 0.1}))
    up = with_upstream_params(run, store, "D", ("ingest", "mining", "classifier", "index", "fusion"))
    assert up.cfg.fusion.method == "tree" and up.cfg.index.shortlist_size == 50
    assert up.cfg.mining.sources == ("label", "knn")  # a tuple again after JSON
    assert up.cfg.fusion.grid_step == 0.05  # fusion's section as recorded, not this run's value
    assert up.cfg.evaluate.top_k == 20  # not upstream: this run's
    assert run.fusion.method == "alpha" and run.index.shortlist_size == 100  # the input is not changed
    assert up.recorded == ["mining", "index", "fusion"] and up.unrecorded == ["classifier"]
    assert up.differs == {"fusion.grid_step": {"recorded": 0.05, "resolved": 0.1},
                          "fusion.method": {"recorded": "tree", "resolved": "alpha"},
                          "index.shortlist_size": {"recorded": 50, "resolved": 100},
                          "mining.sources": {"recorded": ("label", "knn"), "resolved": ("label",)}}
    assert recorded_params(store, "D", "classifier") is None
    path.write_text("{not json")
    with pytest.raises(XCConfigError, match="fusion/params.json: not valid JSON"):
        with_upstream_params(run, store, "D", ("fusion",))


def test_atomic_dir_leaves_nothing_on_failure(tmp_path):
    final = tmp_path / "stage"
    with atomic_dir(final) as d:
        (d / "a.txt").write_text("old")
    with pytest.raises(RuntimeError):
        with atomic_dir(final) as d:
            (d / "a.txt").write_text("half")
            raise RuntimeError("killed")
    assert (final / "a.txt").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == ["stage"]
    assert stage_leftovers(final) == []  # the failed write's version folder is gone


# ----------------------------------------------------------------------------------------- sampling

def _Y():
    # row 0: {1, 3}; row 1: {}; row 2: {0, 2, 4}
    return sp.csr_matrix(np.array([[0, 1, 0, 1, 0], [0, 0, 0, 0, 0], [1, 0, 1, 0, 1]], dtype=np.float32))


def test_sample_positives_distinct_padded_and_from_row():
    Y = _Y()
    out = sample_positives(Y, np.array([0, 1, 2]), 2, np.random.default_rng(0))
    assert out.shape == (3, 2)
    assert set(out[0]) == {1, 3}
    assert list(out[1]) == [-1, -1]
    assert len(set(out[2])) == 2 and set(out[2]) <= {0, 2, 4}


def test_sample_positives_uniform_over_row():
    Y = _Y()
    rng = np.random.default_rng(1)
    draws = np.concatenate([sample_positives(Y, np.array([2]), 1, rng)[:, 0] for _ in range(3000)])
    freq = np.bincount(draws, minlength=5)[[0, 2, 4]] / 3000
    assert np.all(np.abs(freq - 1 / 3) < 0.04)


def test_positive_mask_and_dedupe():
    Y = _Y()
    cands = np.array([[3, 0, -1, 1], [0, 1, 2, 3], [4, 4, 1, 2]])
    m = positive_mask(Y, np.array([0, 1, 2]), cands)
    assert m.tolist() == [[True, False, False, True], [False] * 4, [True, True, False, True]]
    assert dedupe_rows(np.array([[5, 3, 5, -1, 3, 7]])).tolist() == [[5, 3, -1, -1, -1, 7]]


def test_validation_split_seeded_sorted_capped():
    a = validation_split(1000, 0.05, 30, seed=3)
    assert len(a) == 30 and np.all(np.diff(a) > 0)
    assert np.array_equal(a, validation_split(1000, 0.05, 30, seed=3))
    assert len(validation_split(1000, 0.05, 5000, seed=3)) == 50
    assert len(validation_split(10, 0.0, 5, 0)) == 0


# ------------------------------------------------------------------------------------------- losses

def test_ohnm_triplet_loss_hand_computed():
    # 2 points; sim rows: point0 pos 0.5, negs 0.6 and 0.1; point1 pos 0.9, negs 0.2 (masked) and 0.0
    sim = torch.tensor([[0.5, 0.6, 0.1], [0.2, 0.9, 0.0]], requires_grad=True)
    mask = torch.tensor([[True, False, False], [True, True, False]])
    # point 0, k=2: hinge(0.6-0.5+0.3)=0.4, hinge(0.1-0.5+0.3)=0 -> weighted by softmax([6,1]) -> 0.4*w0
    w0 = math.exp(6) / (math.exp(6) + math.exp(1))
    # point 1: only one valid negative (0.0): hinge(0-0.9+0.3)=0 -> 0
    # (sim is not square here; the diagonal of the first 2 columns is the positive)
    loss = ohnm_triplet_loss(sim, mask, margin=0.3, num_negatives=2, temperature=0.1)
    assert loss.item() == pytest.approx(0.4 * w0 / 2, rel=1e-5)
    loss.backward()
    # d loss / d s_pos(point 0) = -w0 / 2 (weights are treated through softmax too, but hinge of 2nd is 0)
    assert sim.grad[0, 0].item() == pytest.approx(-w0 / 2, rel=1e-4)


def test_infonce_loss_hand_computed_with_masked_true_positive():
    # row 0: positive 0.5, negatives 0.6 and 0.1; row 1: positive 0.9, column 0 (0.2) is also a true positive
    # of row 1, so it leaves the denominator; temperature 0.5
    sim = torch.tensor([[0.5, 0.6, 0.1], [0.2, 0.9, 0.0]], requires_grad=True)
    mask = torch.tensor([[True, False, False], [True, True, False]])
    t = 0.5
    row0 = -0.5 / t + math.log(math.exp(0.5 / t) + math.exp(0.6 / t) + math.exp(0.1 / t))
    row1 = -0.9 / t + math.log(math.exp(0.9 / t) + math.exp(0.0 / t))
    loss = infonce_loss(sim, mask, temperature=t)
    assert loss.item() == pytest.approx((row0 + row1) / 2, rel=1e-6)
    loss.backward()
    # d/d s_pos(row 0) = (softmax_0 - 1) / (t * 2); the masked true positive gets no gradient
    z0 = math.exp(0.5 / t) + math.exp(0.6 / t) + math.exp(0.1 / t)
    assert sim.grad[0, 0].item() == pytest.approx((math.exp(0.5 / t) / z0 - 1) / (2 * t), rel=1e-5)
    assert sim.grad[0, 1].item() == pytest.approx(math.exp(0.6 / t) / z0 / (2 * t), rel=1e-5)
    assert sim.grad[1, 0].item() == 0.0


def test_multi_positive_triplet_and_bce_hand_computed():
    scores = torch.tensor([[0.8, 0.7, 0.75, 0.0]])
    is_pos = torch.tensor([[True, True, False, False]])
    valid = torch.tensor([[True, True, True, False]])
    # pairs: (0.8 vs 0.75): 0.75-0.8+0.2=0.15 ; (0.7 vs 0.75): 0.25 -> mean 0.2
    assert multi_positive_triplet_loss(scores, is_pos, valid, 0.2).item() == pytest.approx(0.2)
    # positive weights 2 and 0.5: (2 * 0.15 + 0.5 * 0.25) / 2 pairs
    pw = torch.tensor([[2.0, 0.5, 1.0, 1.0]])
    assert multi_positive_triplet_loss(scores, is_pos, valid, 0.2, pw).item() == pytest.approx(0.2125)
    logits = torch.tensor([[0.0, 2.0, -1.0]])
    bce = masked_bce_loss(logits, torch.tensor([[True, False, False]]), torch.tensor([[True, True, False]]))
    assert bce.item() == pytest.approx(math.log(2) + math.log(1 + math.exp(2)), rel=1e-6)


# -------------------------------------------------------------------------------------- ANNS, top-k

def test_hnsw_recall_against_exact_search():
    rng = np.random.default_rng(0)
    keys = rng.standard_normal((3000, 32)).astype(np.float32)
    keys /= np.linalg.norm(keys, axis=1, keepdims=True)
    q = rng.standard_normal((200, 32)).astype(np.float32)
    _, exact = exact_topk(q, keys, 10)
    _, approx = LabelIndex("hnsw", keys, m=16, ef_construction=100, ef_search=100).search(q, 10)
    recall = np.mean([len(set(a) & set(e)) / 10 for a, e in zip(approx, exact)])
    assert recall >= 0.95


@pytest.mark.parametrize("kind", ["exact", "hnsw", "ivf"])
def test_search_without_excluded_ids_matches_exact_search_over_the_rest(kind):
    """``exclude`` (the held-out kNN's validation points) gives the neighbours among the remaining keys, with
    the ids of the full index; the excluded keys are queried too and never come back, not even themselves."""
    rng = np.random.default_rng(1)
    keys = rng.standard_normal((2000, 16)).astype(np.float32)
    keys /= np.linalg.norm(keys, axis=1, keepdims=True)
    excluded = np.sort(rng.choice(2000, 500, replace=False))
    rest = np.setdiff1d(np.arange(2000), excluded)
    q = keys[excluded[:100]]
    want_s, want = exact_topk(q, keys[rest], 10)
    idx = LabelIndex(kind, keys, m=16, ef_construction=100, ef_search=100, nlist=20, nprobe=20)
    s, got = idx.search(q, 10, exclude=excluded)
    assert not np.isin(got, excluded).any()
    recall = np.mean([len(set(a) & set(rest[e])) / 10 for a, e in zip(got, want)])
    assert recall >= (1.0 if kind != "hnsw" else 0.95)
    if kind != "hnsw":
        np.testing.assert_allclose(s, want_s, atol=1e-5)
    # without exclusion each excluded query finds itself first
    assert (idx.search(q, 1)[1][:, 0] == excluded[:100]).all()


def test_exact_search_pads_when_exclusion_leaves_fewer_than_k():
    keys = np.eye(3, dtype=np.float32)
    s, i = LabelIndex("exact", keys).search(keys[:1], 3, exclude=np.array([0, 2]))
    assert i.tolist() == [[1, -1, -1]] and np.isneginf(s[0, 1:]).all()


def test_exact_topk_ties_and_padding_and_save_load(tmp_path):
    keys = np.array([[1.0, 0], [1.0, 0], [0, 1.0]], dtype=np.float32)
    s, i = exact_topk(np.array([[1.0, 0]], dtype=np.float32), keys, 5)
    assert i.tolist() == [[0, 1, 2, -1, -1]]
    assert np.isneginf(s[0, 3:]).all()
    for kind in ("exact", "hnsw"):
        idx = LabelIndex(kind, keys, m=8)
        idx.save(tmp_path / f"{kind}.index")
        s2, i2 = LabelIndex.load(tmp_path / f"{kind}.index", kind).search(np.array([[0, 1.0]], np.float32), 1)
        assert i2.tolist() == [[2]]


@pytest.mark.parametrize("precision", ["fp32", "bf16", "int8"])
@pytest.mark.parametrize("n_keys", [40, 4096])  # 4096: the grouped top-k's path (row_topk), 40: torch.topk's
def test_an_exact_tie_at_the_k_th_place_keeps_the_smallest_ids(precision, n_keys):
    rng = np.random.default_rng(0)
    dim = 16
    q = rng.standard_normal((3, dim)).astype(np.float32)
    q /= np.linalg.norm(q, axis=1, keepdims=True)
    keys = rng.standard_normal((n_keys, dim)).astype(np.float32) * 0.05  # far below the planted keys' scores
    keys[[11, 5]] = q[0] * [[0.9], [0.8]]  # the two best for query 0
    dup = np.sort(rng.choice(np.setdiff1d(np.arange(n_keys), [5, 11]), 9, replace=False))[::-1].copy()
    keys[dup] = q[0] * 0.7  # nine identical keys tied at places 3-11, written from the largest id down
    s, i = exact_topk(q, keys, 5, precision=precision)
    assert i[0].tolist() == [11, 5, *sorted(dup)[:3]]  # the three smallest of the nine tied ids
    assert s[0, 2] == s[0, 3] == s[0, 4] and s[0, 1] > s[0, 2]
    want = np.argsort(-(q[1:] @ keys.T), axis=1, kind="stable")[:, :5]  # no ties there: fp32's own order
    assert np.array_equal(i[1:], want)
    excl = exact_topk(q[:1], keys, 5, precision=precision, exclude=np.array(sorted(dup)[:2]))[1]
    assert excl[0].tolist() == [11, 5, *sorted(dup)[2:5]]  # excluded ids are never the tie's winners


def test_topk_from_scores_ties_by_label_id_and_padding():
    ids = np.array([[7, 3, 5, -1]])
    scores = np.array([[0.5, 0.5, 0.9, -np.inf]], dtype=np.float32)
    out_ids, out_s = topk_from_scores(ids, scores, 6)
    assert out_ids.tolist() == [[5, 3, 7, -1, -1, -1]]
    assert out_s[0, :3].tolist() == pytest.approx([0.9, 0.5, 0.5])


# ----------------------------------------------------------------------------------------- mixed precision

@pytest.mark.parametrize("amx, fp32_s, bf16_s, want", [(True, 1.0, 9.0, torch.bfloat16),  # AMX: not measured
                                                     (False, 1.0, 0.5, torch.bfloat16),  # 2x faster
                                                     (False, 1.0, 0.9, None),  # 1.1x: not worth it
                                                     (False, 1.0, 2.0, None)])  # slower (AVX-512-BF16 Xeon)
def test_auto_amp_on_cpu_is_bf16_only_where_it_pays(monkeypatch, amx, fp32_s, bf16_s, want):
    """On CPU ``auto`` autocasts to bf16 only with AMX or where bf16 products measure >= 1.2x faster; explicit
    settings are taken as given, and a bad one names the accepted values."""
    from xc_dagster import device

    monkeypatch.setattr(device, "cpu_has_amx", lambda: amx)
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True, raising=False)
    monkeypatch.setattr(device, "speedup", lambda slow, fast: fp32_s / bf16_s)
    device.cpu_bf16_pays.cache_clear()
    try:
        cpu = torch.device("cpu")
        assert device.amp_dtype(cpu, "auto") is want
        assert device.amp_dtype(cpu, "bf16") is torch.bfloat16 and device.amp_dtype(cpu, "off") is None
        with pytest.raises(XCConfigError, match="amp: expected auto|bf16|fp16|off"):
            device.amp_dtype(cpu, "fp8")
    finally:
        device.cpu_bf16_pays.cache_clear()


class _FakeClock:
    """A ``time`` stand-in for the probes: its clock moves only when a run ends, run ``r`` taking
    ``durations[r]`` seconds, so what a probe measures is known exactly."""

    def __init__(self, durations: list[float]):
        self.durations, self.now, self.runs = durations, 0.0, 0

    def perf_counter(self) -> float:
        return self.now

    def tick(self) -> None:
        self.now += self.durations[self.runs]
        self.runs += 1


def test_feed_forward_probe_runs_a_minilm_block_in_each_precision():
    """The bf16 probe's product is a MiniLM feed-forward pair ((2048 x 384) -> 1536 -> 384), in fp32 or under
    bf16 autocast, and computes that product."""
    from xc_dagster import device

    real_linear = torch.nn.functional.linear
    calls = []

    def linear(x, w):
        y = real_linear(x, w)
        calls.append((tuple(x.shape), tuple(w.shape), y.dtype))
        if len(calls) == 1:  # the product itself is right (first 64 rows; bf16 rounds to ~0.4% of |y| ~ 20)
            with torch.autocast("cpu", enabled=False):
                torch.testing.assert_close(y[:64].float(), x[:64] @ w.T, rtol=2e-2, atol=0.5)
        return y

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.nn.functional, "linear", linear)
        for dtype, out_dtype in ((None, torch.float32), (torch.bfloat16, torch.bfloat16)):
            calls.clear()
            device._feed_forward(dtype)()
            assert calls == [((2048, 384), (1536, 384), out_dtype), ((2048, 1536), (384, 1536), out_dtype)]


def test_speedup_interleaves_the_runs_drops_the_warm_ups_and_compares_the_fastest(monkeypatch):
    """``speedup`` runs slow, fast, slow, ... (a warm-up of each first, not counted) and returns the ratio of the
    fastest timed run of each: a run slowed by a busy machine (the 50 and 90 below) moves neither side, where a
    median of sequential runs would have (the clock is faked: the statistic is under test, not this CPU)."""
    from xc_dagster import device

    order = []
    # interleaved durations: slow warm-up, fast warm-up, then (slow, fast) pairs
    clock = _FakeClock([1000.0, 1000.0, 4.0, 90.0, 50.0, 1.0, 3.0, 2.0, 4.5, 50.0])
    monkeypatch.setattr(device, "time", clock)
    ratio = device.speedup(lambda: (order.append("s"), clock.tick()), lambda: (order.append("f"), clock.tick()),
                           reps=4)
    assert order == ["s", "f"] * 5
    assert ratio == 3.0  # fastest slow 3.0 / fastest fast 1.0
    # a second-long product: the runs stop once one of each was timed past max_seconds (the EPYC's int8 product)
    order.clear()
    clock = _FakeClock([1.0, 1.7, 0.09, 1.5, 0.09, 1.2, 0.09, 1.0])
    monkeypatch.setattr(device, "time", clock)
    ratio = device.speedup(lambda: (order.append("s"), clock.tick()), lambda: (order.append("f"), clock.tick()),
                           reps=31, max_seconds=1.0)
    assert order == ["s", "f"] * 2 and ratio == pytest.approx(0.09 / 1.5)


@pytest.mark.parametrize("fp32_s, bf16_s, pays", [(2.0, 1.0, True), (0.75, 0.625, True),  # exactly 1.2x
                                                  (0.74, 0.625, False), (1.0, 2.0, False)])
def test_bf16_probe_decides_from_the_fastest_runs_of_fp32_and_bf16(monkeypatch, fp32_s, bf16_s, pays):
    """Without AMX ``cpu_bf16_pays`` times fp32 and bf16 autocast feed-forward runs interleaved (a warm-up and 7
    timed runs each) and says bf16 pays exactly when fp32's fastest run is >= 1.2x bf16's, whatever the slower
    runs beside them; without bf16 support it probes nothing: False."""
    from xc_dagster import device

    dtypes = []

    def linear(x, w):  # no real product: the decision is under test here; a run is two products
        dtypes.append(torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None)
        if len(dtypes) % 2 == 0:
            clock.tick()
        return torch.zeros(x.shape[0], w.shape[0])

    monkeypatch.setattr(torch.nn.functional, "linear", linear)
    monkeypatch.setattr(device, "cpu_has_amx", lambda: False)
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True, raising=False)
    f, b = fp32_s, bf16_s  # warm-ups, then pairs; every other run is slowed, as a busy machine does
    clock = _FakeClock([1000 * f, 1000 * b] + [x for r in range(7) for x in ((f, b) if r % 2 else (9 * f, 50 * b))])
    monkeypatch.setattr(device, "time", clock)
    device.cpu_bf16_pays.cache_clear()
    try:
        assert device.cpu_bf16_pays() is pays
        assert dtypes == [None, None, torch.bfloat16, torch.bfloat16] * 8
        dtypes.clear()
        monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False, raising=False)
        device.cpu_bf16_pays.cache_clear()
        assert device.cpu_bf16_pays() is False and dtypes == []
    finally:
        device.cpu_bf16_pays.cache_clear()


def test_adamw_uses_the_fused_kernel_and_matches_the_default_update(monkeypatch):
    """``device.adamw``: the fused kernel on CPU (torch >= 2.4), the same weights as the default AdamW to float
    rounding, and the default implementation where torch refuses ``fused``."""
    from xc_dagster import device

    torch.manual_seed(0)
    start = [torch.randn(50, 8), torch.randn(8)]
    grads = [[torch.randn_like(p) for p in start] for _ in range(4)]

    def train(make):
        ps = [torch.nn.Parameter(p.clone()) for p in start]
        opt = make(ps)
        for g in grads:
            for p, gp in zip(ps, g):
                p.grad = gp.clone()
            opt.step()
        return opt, ps

    fused, w_fused = train(lambda ps: device.adamw(ps, 1e-2, 0.01))
    assert fused.param_groups[0]["fused"] is True
    _, w_ref = train(lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.01))
    for a, b, s0 in zip(w_fused, w_ref, start):
        assert torch.allclose(a, b, atol=1e-6)
        assert not torch.equal(a, s0)  # it did move

    real = torch.optim.AdamW

    def no_fused(params, **kw):
        if kw.get("fused"):
            raise RuntimeError("`fused=True` requires all the params to be on a supported device")
        return real(params, **kw)

    monkeypatch.setattr(torch.optim, "AdamW", no_fused)
    fallback, w_fb = train(lambda ps: device.adamw(ps, 1e-2, 0.01))
    assert not fallback.param_groups[0].get("fused")
    for a, b in zip(w_fb, w_ref):
        assert torch.equal(a, b)
