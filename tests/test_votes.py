"""The kNN votes chosen on validation (``fusion.vote_grid``, ``xc_dagster.retrieval.votes``)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from scipy.sparse import csr_matrix

from tests.test_pipeline import TINY
from tests.tinydata import tiny_lf_home
from xc_dagster.catalog import Catalog
from xc_dagster.data import load_dataset
from xc_dagster.errors import XCConfigError
from xc_dagster.evaluation.metrics import remove_filtered
from xc_dagster.pipeline import StageContext, run_all
from xc_dagster.pipeline.fusion import vote_candidates
from xc_dagster.retrieval.lexical import LexicalIndex
from xc_dagster.retrieval.shortlist import ShortlistSources
from xc_dagster.retrieval.votes import fitted_votes, parse_vote_grid, with_votes
from xc_dagster.serving import bundle as serving_bundle
from xc_dagster.storage import ArtifactStore
from xc_dagster.strategies import STRATEGIES


def test_vote_grid_items_are_parsed_in_order_without_repeats():
    assert parse_vote_grid(["10:2", "25:4", "10:2.0", " 5:1.5"]) == [(10, 2.0), (25, 4.0), (5, 1.5)]
    assert parse_vote_grid(()) == []


@pytest.mark.parametrize("item", ["10", "0:2", "-3:2", "10:0", "10:-1", "a:2", "10:nan", "10:inf", "1.5:2", ":2",
                                  "10:", "10:2:3"])
def test_a_bad_vote_grid_item_is_named(item):
    with pytest.raises(XCConfigError, match=r"fusion\.vote_grid: expected items K:p.*" + repr(item).replace("'", "")):
        parse_vote_grid(["10:2", item])


def test_fitted_votes_read_back_or_are_refused():
    assert fitted_votes({"method": "alpha"}) is None
    assert fitted_votes({"votes": {"neighbours": 25, "power": 4}}) == (25, 4.0)
    with pytest.raises(XCConfigError, match="neighbours and power"):
        fitted_votes({"votes": [25, 4]})
    with pytest.raises(XCConfigError, match="votes.power"):
        fitted_votes({"votes": {"neighbours": 25, "power": -1}})


def test_with_votes_scores_as_an_index_built_with_them():
    """A lexical index given (K, p) by with_votes scores every query as one fitted with K and p; the original
    keeps its own votes and the copy shares its matrices."""
    rng = np.random.default_rng(0)
    words = [f"w{i}" for i in range(30)]
    texts = [" ".join(rng.choice(words, size=5)) for _ in range(60)]
    Y = (rng.random((60, 8)) < 0.3).astype(np.float32)
    labels = [" ".join(rng.choice(words, size=2)) for _ in range(8)]
    base = LexicalIndex.fit(texts, labels, csr_matrix(Y), 10, 1, power=2.0)
    want = LexicalIndex.fit(texts, labels, csr_matrix(Y), 4, 1, power=3.0)
    src = ShortlistSources(np.eye(8, 4, dtype=np.float32), np.eye(8, 4, dtype=np.float32), {}, lexical=base)
    got = with_votes(src, (4, 3.0))
    q = base.transform(texts[:20])
    np.testing.assert_allclose(got.lexical.scores(q).toarray(), want.scores(q).toarray(), rtol=1e-6)
    assert (base.neighbours, base.power) == (10, 2.0) and got.lexical.points is base.points
    assert with_votes(src, None) is src and got.knn_neighbours == src.knn_neighbours  # no dense kNN: untouched


def test_vote_grid_picks_the_candidate_validation_prefers_and_deploys_it(tmp_path, monkeypatch):
    """fusion.vote_grid: the fusion is fitted once per (K, p); each candidate's objective is that of a fusion
    fitted on an index built with those votes, the best is written to fusion.json, and evaluation and the serving
    bundle predict with it (the bundle's predictions equal the evaluation's)."""
    home = tiny_lf_home(tmp_path, monkeypatch, {**TINY, "pretrain.epochs": 1, "classifier.epochs": 1,
                                                "index.sources": "W,label,knn,lexical",
                                                "fusion.vote_grid": "2:1,6:3",
                                                "fusion.try_without_lexical_classifiers": False})
    spec = Catalog(home.catalog).get("TinyTitles")
    ctx = StageContext(ArtifactStore(home.artifacts), spec, spec.config(), home.cache)
    out = run_all(ctx)
    grid = out["fusion"]["vote_grid"]
    assert [g[:2] for g in grid] == [[2, 1.0], [6, 3.0]]
    best = max(range(2), key=lambda i: (grid[i][2], -i))
    k, p = grid[best][:2]
    fitted = json.loads((ctx.dir("fusion") / "fusion.json").read_text())
    assert fitted["votes"] == {"neighbours": k, "power": p} == out["fusion"]["votes"]
    assert out["fusion"]["objective_value"] == grid[best][2]
    predictions = np.load(ctx.dir("evaluate") / "predictions.npz")["ids"]
    m = ctx.read.deployed_sources(ctx.cfg.index.hnsw_ef_search)
    assert (m.knn_neighbours, m.knn_power, m.lexical.neighbours, m.lexical.power) == (k, p, k, p)

    # the same model indexed with each candidate's votes and no grid: the same objective, and for the chosen one
    # the same predictions
    for i, (kc, pc, value) in enumerate(grid):
        direct = spec.config({"index.knn_neighbours": kc, "index.knn_power": pc, "index.lexical_neighbours": kc,
                              "index.lexical_power": pc, "fusion.vote_grid": ""})
        dctx = StageContext(ctx.store, spec, direct, home.cache)
        again = run_all(dctx, ("index", "fusion", "evaluate"))
        assert "votes" not in again["fusion"] and again["fusion"]["objective_value"] == pytest.approx(value, abs=1e-9)
        if i == best:
            np.testing.assert_array_equal(np.load(dctx.dir("evaluate") / "predictions.npz")["ids"], predictions)
    assert vote_candidates(dctx) == [None]  # votes set by the user and no grid: the index's votes

    run_all(ctx, ("index", "fusion", "evaluate"))
    serving_bundle.write_bundle(ctx, tmp_path / "bundle")
    bundle = serving_bundle.load_bundle(tmp_path / "bundle", "cpu")
    assert bundle.info["votes"] == {"neighbours": k, "power": p} and bundle.info["knn_neighbours"] == k
    assert (bundle.sources.knn_neighbours, bundle.sources.lexical.neighbours, bundle.sources.lexical.power) == (k, k, p)
    ds = load_dataset(ctx.dir("ingest") / "dataset", features=False)
    ids, scores = serving_bundle.predict_topk(ds.test_texts, bundle, 10)
    filtered, _ = remove_filtered(ids, scores, ds.filter_test)
    np.testing.assert_array_equal(filtered, np.load(ctx.dir("evaluate") / "predictions.npz")["ids"])


def test_the_vote_grid_yields_to_votes_the_user_set(tmp_path, monkeypatch):
    """A strategy's grid is skipped when the user set the votes (index.knn_neighbours, ...) but not the grid; a
    bad grid fails the fusion stage before any work. (ngame searched 10:2 and 50:4 before its co-occurrence
    source; a strategy with a grid is made here as it was.)"""
    monkeypatch.setitem(STRATEGIES["ngame"].overrides, "fusion.vote_grid", ("10:2", "50:4"))
    home = tiny_lf_home(tmp_path, monkeypatch, TINY)
    spec = Catalog(home.catalog).get("TinyTitles")
    store = ArtifactStore(home.artifacts)
    ctx = StageContext(store, spec, spec.config(), home.cache)
    assert spec.strategy == "ngame" and "fusion.vote_grid" not in ctx.cfg.explicit
    run_all(ctx, ("ingest", "tokenize", "pretrain", "mining", "classifier", "index"))
    assert vote_candidates(ctx) == [(10, 2.0), (50, 4.0)]  # ngame's grid
    for key in ("index.knn_neighbours", "index.lexical_power"):
        mine = StageContext(store, spec, spec.config({key: 3}), home.cache)
        assert vote_candidates(mine) == [None]
    both = StageContext(store, spec, spec.config({"index.knn_neighbours": 3, "fusion.vote_grid": "3:1"}), home.cache)
    assert vote_candidates(both) == [(3, 1.0)]
    only_w = StageContext(store, spec, spec.config({"index.sources": "W,label"}), home.cache)
    run_all(only_w, ("index",))
    assert vote_candidates(only_w) == [None]  # neither a kNN nor a lexical source: nothing to vote
    bad = StageContext(store, spec, spec.config({"fusion.vote_grid": "10:2,25"}), home.cache)
    with pytest.raises(XCConfigError, match="fusion.vote_grid"):
        run_all(bad, ("fusion",))
    assert not any((home.artifacts / "TinyTitles").glob("*fusion*"))  # nothing half-written
