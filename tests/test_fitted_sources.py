"""What the fusion stage chooses of the sources: the lexical classifiers kept or dropped on the fused objective
(``fusion.try_without_lexical_classifiers``, ``xc_dagster.retrieval.fitted_sources``)."""

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
from xc_dagster.pipeline import fusion as fusion_stage
from xc_dagster.retrieval.files import LEXICAL_DIR
from xc_dagster.retrieval.fitted_sources import Choice, as_fitted, choices, fitted_choice, without_lexical_classifiers
from xc_dagster.retrieval.lexical import LexicalIndex
from xc_dagster.retrieval.lexical_classifier import ClassifierSettings
from xc_dagster.retrieval.shortlist import ShortlistSources
from xc_dagster.retrieval.source_files import CLASSIFIER_FILES, link_lexical
from xc_dagster.serving import bundle as serving_bundle
from xc_dagster.storage import ArtifactStore, load_json

LEXICAL = {**TINY, "pretrain.epochs": 1, "classifier.epochs": 1, "index.sources": "W,label,knn,lexical"}


def _texts(seed: int = 0):
    rng = np.random.default_rng(seed)
    words = [f"w{i}" for i in range(30)]
    texts = [" ".join(rng.choice(words, size=5)) for _ in range(80)]
    Y = csr_matrix((rng.random((80, 8)) < 0.3).astype(np.float32))
    return texts, [" ".join(rng.choice(words, size=2)) for _ in range(8)], Y


def test_without_the_classifiers_the_lexical_source_scores_as_one_fitted_without_them():
    texts, labels, Y = _texts()
    rows = np.arange(60)
    settings = ClassifierSettings(epochs=2, hard_negatives=3, random_negatives=3, candidates=8)
    full = LexicalIndex.fit(texts, labels, Y, 5, 1, fit_on=rows, classifier=settings)
    plain = LexicalIndex.fit(texts, labels, Y, 5, 1, fit_on=rows)
    assert full.classifier is not None
    src = ShortlistSources(np.eye(8, 4, dtype=np.float32), np.eye(8, 4, dtype=np.float32), {}, lexical=full)
    got = without_lexical_classifiers(src)
    q = full.transform(texts[60:])
    np.testing.assert_allclose(got.lexical.scores(q).toarray(), plain.scores(q).toarray(), rtol=1e-6)
    assert not np.allclose(full.scores(q).toarray(), plain.scores(q).toarray())  # the classifiers do score
    assert full.classifier is not None and got.lexical.points is full.points  # the original untouched, shared
    assert without_lexical_classifiers(got) is got
    assert as_fitted(src, {"lexical_classifiers": False}).lexical.classifier is None
    assert as_fitted(src, {"method": "alpha"}).lexical is full  # a fusion file of before: as the index built it


def test_choices_are_ordered_and_read_back_from_the_fusion_file():
    assert choices([None], True) == [Choice(None, True), Choice(None, False)]
    assert choices([(10, 2.0), (5, 1.0)], False) == [Choice((10, 2.0)), Choice((5, 1.0))]
    assert Choice((10, 2.0), False).record() == {"votes": {"neighbours": 10, "power": 2.0},
                                                 "lexical_classifiers": False}
    assert Choice().record() == {}
    assert fitted_choice({"votes": {"neighbours": 3, "power": 1}, "lexical_classifiers": False}) == Choice((3, 1.0),
                                                                                                          False)
    with pytest.raises(XCConfigError, match="'lexical_classifiers' should be true or false, got 'no'"):
        fitted_choice({"lexical_classifiers": "no"})


def test_the_fusion_keeps_the_lexical_classifiers_only_where_validation_prefers_them(tmp_path, monkeypatch):
    """The fusion is fitted with and without the lexical classifiers; each objective is that of a fusion fitted on
    an index built with or without them, and the better is deployed."""
    home = tiny_lf_home(tmp_path, monkeypatch, LEXICAL)
    spec = Catalog(home.catalog).get("TinyTitles")
    ctx = StageContext(ArtifactStore(home.artifacts), spec, spec.config(), home.cache)
    out = run_all(ctx)
    grid = out["fusion"]["lexical_classifier_grid"]
    assert [g[0] for g in grid] == [True, False]
    keep = grid[1][1] <= grid[0][1]  # ties: kept
    assert out["fusion"]["objective_value"] == max(g[1] for g in grid)
    fitted = json.loads((ctx.dir("fusion") / "fusion.json").read_text())
    assert fitted.get("lexical_classifiers", True) is keep
    assert (ctx.read.deployed_sources(ctx.cfg.index.hnsw_ef_search).lexical.classifier is not None) is keep
    for with_them, value in grid:  # the same model indexed with / without them, fitted once
        direct = StageContext(ctx.store, spec, spec.config({"index.lexical_classifier": with_them,
                                                            "fusion.try_without_lexical_classifiers": False}),
                              home.cache)
        again = run_all(direct, ("index", "fusion"))
        assert "lexical_classifier_grid" not in again["fusion"]
        assert again["fusion"]["objective_value"] == pytest.approx(value, abs=1e-9)


def test_past_the_budget_the_fusion_fits_the_index_sources_alone_unless_the_candidates_were_set(tmp_path,
                                                                                                 monkeypatch):
    """Under a budget the earlier stages have used up (0.001 minutes: 60 ms), the fusion fits its first candidate
    (the index's sources whole, the lexical classifiers scored) and not the second: the same objective as the
    grid's first, one candidate skipped. Without a budget, or with the candidates set by the user, both."""
    home = tiny_lf_home(tmp_path, monkeypatch, LEXICAL)
    spec = Catalog(home.catalog).get("TinyTitles")
    ctx = StageContext(ArtifactStore(home.artifacts), spec, spec.config(), home.cache)
    grid = run_all(ctx)["fusion"]["lexical_classifier_grid"]
    assert [g[0] for g in grid] == [True, False]
    assert ctx.read.spent_before("fusion") > 0.06
    tight = StageContext(ctx.store, spec, spec.config({"train.budget_minutes": 0.001}), home.cache)
    out = run_all(tight, ("fusion",))["fusion"]
    assert out["candidates_skipped_at_deadline"] == 1 and "lexical_classifier_grid" not in out
    assert out["objective_value"] == pytest.approx(grid[0][1], abs=1e-9)
    assert json.loads((tight.dir("fusion") / "fusion.json").read_text()).get("lexical_classifiers", True)
    told = StageContext(ctx.store, spec, spec.config({"train.budget_minutes": 0.001,
                                                      "fusion.try_without_lexical_classifiers": True}), home.cache)
    both = run_all(told, ("fusion",))["fusion"]
    assert both["lexical_classifier_grid"] == grid and "candidates_skipped_at_deadline" not in both


def test_a_fusion_fitted_without_the_lexical_classifiers_is_evaluated_and_served_without_them(tmp_path, monkeypatch):
    """Chosen without them (here the only candidate), evaluation predicts as a model indexed without them and the
    serving bundle as the evaluation."""
    home = tiny_lf_home(tmp_path, monkeypatch, LEXICAL)
    spec = Catalog(home.catalog).get("TinyTitles")
    store = ArtifactStore(home.artifacts)
    plain = StageContext(store, spec, spec.config({"index.lexical_classifier": False}), home.cache)
    run_all(plain)
    want = np.load(plain.dir("evaluate") / "predictions.npz")["ids"]
    monkeypatch.setattr(fusion_stage, "choices", lambda votes, without: [Choice(v, False) for v in votes])
    ctx = StageContext(store, spec, spec.config(), home.cache)
    out = run_all(ctx, ("index", "fusion", "evaluate"))
    assert ctx.read.summary("index")["lexical"]["classifier_weights"] > 0  # trained, then not scored
    assert out["fusion"]["lexical_classifiers"] is False
    np.testing.assert_array_equal(np.load(ctx.dir("evaluate") / "predictions.npz")["ids"], want)
    serving_bundle.write_bundle(ctx, tmp_path / "bundle")
    bundle = serving_bundle.load_bundle(tmp_path / "bundle", "cpu")
    assert bundle.info["lexical_classifiers"] is False and bundle.sources.lexical.classifier is None
    # the bundle carries none of their weights, nor names them (the index stage's folder keeps them)
    index_lex, bundle_lex = ctx.dir("index") / LEXICAL_DIR, tmp_path / "bundle" / LEXICAL_DIR
    assert all((index_lex / f).is_file() for f in CLASSIFIER_FILES)
    assert not any((bundle_lex / f).exists() for f in CLASSIFIER_FILES)
    assert "classifier" not in load_json(bundle_lex / "lexical.json")
    assert not any(f in load_json(tmp_path / "bundle" / "manifest.json")["files"] for f in
                   [f"{LEXICAL_DIR}/{name}" for name in CLASSIFIER_FILES])
    assert {f.name for f in bundle_lex.iterdir()} == {f.name for f in index_lex.iterdir()} - set(CLASSIFIER_FILES)
    link_lexical(index_lex, tmp_path / "kept", classifiers=True)  # a fusion that scores them: the folder as it is
    assert LexicalIndex.load(tmp_path / "kept").classifier is not None
    assert {f.name for f in (tmp_path / "kept").iterdir()} == {f.name for f in index_lex.iterdir()}
    ds = load_dataset(ctx.dir("ingest") / "dataset", features=False)
    ids, scores = serving_bundle.predict_topk(ds.test_texts, bundle, 10)
    np.testing.assert_array_equal(remove_filtered(ids, scores, ds.filter_test)[0], want)


def test_a_tie_keeps_the_lexical_classifiers_whatever_the_grid_order(monkeypatch):
    """Equal objectives: the candidate with the classifiers is deployed, also against a later vote candidate's."""
    from types import SimpleNamespace

    class Fit:
        def __init__(self, value):
            self.value = value

        def summary(self):
            return {"objective_value": self.value}

        def to_dict(self):
            return {"method": "alpha"}

    cands = [Choice((2, 1.0)), Choice((2, 1.0), False), Choice((6, 3.0)), Choice((6, 3.0), False)]
    monkeypatch.setattr(fusion_stage, "source_choices", lambda ctx, how: cands)
    monkeypatch.setattr(fusion_stage, "_fits", lambda ctx, how, c, *a: [(Fit(v), {}) for v in (1.0, 2.0, 2.0, 1.5)])
    fit, summary = fusion_stage._fit(SimpleNamespace(), "validation")
    assert "lexical_classifiers" not in fit and fit["votes"] == {"neighbours": 6, "power": 3.0}
    assert summary["lexical_classifier_grid"] == [[True, 2.0], [False, 1.5]]
    assert summary["vote_grid"] == [[2, 1.0, 1.0], [6, 3.0, 2.0]]
