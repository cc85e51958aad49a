"""Requests to a model of feature rows: feature vectors as lines or mappings, summed, bounded and refused clearly."""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
from pathlib import Path
from types import SimpleNamespace

import mlflow
import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import scipy.sparse as sp

from tests.tinydata import write_tiny_encoder
from xc_dagster.errors import XCError
from xc_dagster.retrieval.lexical import LEXICAL_DIR, LexicalIndex
from xc_dagster.retrieval.shortlist import build_sources
from xc_dagster.retrieval.source_files import save_sources
from xc_dagster.serving import requests
from xc_dagster.serving.bundle import BUNDLE_FORMAT, SERVING_FILE, XCModel, load_bundle, predict_features
from xc_dagster.serving.limits import RequestLimits, XCRequestError
from xc_dagster.serving.requests import feature_lines, input_features, input_texts, param_k
from xc_dagster.storage import save_json

L, N, F = 40, 120, 30  # labels, training points, feature columns of the count model


@pytest.fixture(scope="module")
def count_dir(tmp_path_factory) -> Path:
    """A bundle of feature rows (no text) whose lexical TF-IDF was fitted on counts (sublinear tf)."""
    out = tmp_path_factory.mktemp("count_bundle")
    write_tiny_encoder(out / "encoder")
    rng = np.random.default_rng(0)
    W = rng.normal(size=(L, 32)).astype(np.float32)
    np.save(out / "W.npy", W)
    np.save(out / "label_emb.npy", W)
    save_sources(build_sources(("W", "label"), W, W, None, None, None, "text", "exact", 16, 40, 64), out, None)
    X = sp.random(N, F, density=0.15, random_state=0, format="csr", dtype=np.float32)
    X.data = np.ceil(X.data * 3)  # counts 1..3
    Y = sp.csr_matrix((np.ones(N), (np.arange(N), rng.integers(0, L, N))), shape=(N, L))
    LexicalIndex.fit(X, None, Y, 5).save(out / LEXICAL_DIR)
    save_json(out / "fusion.json", {"method": "alpha", "alpha": 0.5})
    np.save(out / "inv_prop.npy", np.ones(L))
    pq.write_table(pa.table({"text": [f"label {j}" for j in range(L)]}), out / "labels.parquet")
    save_json(out / SERVING_FILE, {
        "format": BUNDLE_FORMAT, "pooling": "mean", "max_len": 32, "amp": "off", "encode_batch_size": 256,
        "index_kind": "exact", "ef_search": 64, "sources": ["W", "label", "lexical"], "label_repr": "text",
        "knn_neighbours": 0, "shortlist_size": 10, "default_k": 5, "input": "features", "num_features": F})
    return out


@pytest.fixture(scope="module")
def count_bundle(count_dir):
    return load_bundle(count_dir, "cpu")


def test_lines_and_mappings_read_as_the_rows_they_name():
    X = input_features(pd.DataFrame({"features": ["0:1 3:0.5", "", "2:-2 2:0.5 4:1e3", None]}), 5)
    assert X.dtype == np.float32 and X.shape == (4, 5)
    np.testing.assert_array_equal(X.toarray(), [[1, 0, 0, 0.5, 0], [0] * 5, [0, 0, -1.5, 0, 1000], [0] * 5])
    M = input_features({"features": [{"3": 0.5, 0: 1}, {4: 2}]}, 5)
    np.testing.assert_array_equal(M.toarray(), [[1, 0, 0, 0.5, 0], [0, 0, 0, 0, 2]])
    assert input_features({1: 2.0}, 3).toarray().tolist() == [[0, 2, 0]]  # one mapping: one row
    assert input_features("1:2", 3).toarray().tolist() == [[0, 2, 0]]
    R = sp.random(6, 9, density=0.4, random_state=0, format="csr", dtype=np.float32)
    np.testing.assert_allclose(input_features(feature_lines(R), 9).toarray(), R.toarray(), rtol=1e-5)  # round trip


@pytest.mark.parametrize("value,match", [
    ("3", "row 1: token '3': expected id:value"),
    ("5:1", r"row 1: feature '5':'1': expected an id in \[0, 5\)"),
    ("-1:1", "row 1: feature '-1'"),
    ("a:1", "row 1: feature 'a'"),
    ("1:nan", "row 1: feature '1':'nan'"),
    ("1:inf", "row 1: feature '1':'inf'"),
    ("1:1e39", "finite float32"),
    ({1.5: 1}, "row 1: feature 1.5"),
    ({1: True}, "row 1: feature 1:True"),
    ({1: 10**400}, r"row 1: feature 1:1000000000000000000000000000000000000\.\.\.: expected"),  # past a float
    ("1:1" + "0" * 400, "row 1: feature '1':'10000"),
    ({10**400: 1}, r"row 1: feature 10000.*\.\.\.:1: expected an id in \[0, 5\)"),
    (b"\xff:1", "row 1: bytes that are not UTF-8"),
    ("1:3e38 1:3e38", "row 1: an id given twice sums past float32"),
])
def test_bad_features_are_refused_naming_the_row_and_token(value, match):
    with pytest.raises(XCRequestError, match=match):
        input_features(pd.Series(["0:1", value]), 5)


def test_a_request_past_its_limits_is_refused_before_it_is_parsed(monkeypatch):
    with pytest.raises(XCRequestError, match="request of 3 feature rows: at most 2"):
        input_features(["0:1", "bad", "bad"], 5, RequestLimits(max_texts=2))
    with pytest.raises(XCRequestError, match="characters: at most 10 per request .* send shorter feature rows"):
        input_features(["0:1 1:1 2:1", "3:1 4:1"], 5, RequestLimits(max_chars=10))
    monkeypatch.setattr(requests, "_pairs", lambda *a: pytest.fail("a row was parsed before the cap was checked"))
    with pytest.raises(XCRequestError, match="request of 1203 characters: at most 1000"):  # not the bad token
        input_features(["0:1 " * 300, "bad"], 5, RequestLimits(max_chars=1000))
    with pytest.raises(XCRequestError, match="request of 12 characters: at most 10"):  # a mapping as id:value
        input_features([{"1": 1, 2: 2.5}, {3: 1}], 5, RequestLimits(max_chars=10))
    with pytest.raises(Exception, match="expected a column 'features'"):
        input_features(pd.DataFrame({"text": ["a"], "other": ["b"]}), 5)


def test_the_pyfunc_refuses_a_bad_feature_request_as_a_client_error():
    model = XCModel()
    model.bundle = SimpleNamespace(input="features", num_features=5, default_k=10, counts=False)
    with pytest.raises(mlflow.exceptions.MlflowException, match="row 0: feature '9'") as e:
        model.predict(None, pd.DataFrame({"features": ["9:1"]}))
    assert e.value.error_code == "INVALID_PARAMETER_VALUE"


def test_a_duplicated_input_column_is_refused():
    with pytest.raises(XCRequestError, match="column 'text' given 2 times"):
        input_texts(pd.DataFrame([["apple river", "stone"]], columns=["text", "text"]))
    with pytest.raises(XCRequestError, match="column 'features' given 2 times"):
        input_features(pd.DataFrame([["0:1", "1:1"]], columns=["features", "features"]), 5)
    with pytest.raises(mlflow.exceptions.MlflowException, match="column 'features' given 2 times"):
        XCModel.predict(SimpleNamespace(bundle=SimpleNamespace(input="features", num_features=5, default_k=10,
                                                               counts=False), limits=None),
                        None, pd.DataFrame([["0:1", "1:1"]], columns=["features", "features"]))


@pytest.mark.parametrize("k, want", [(3, 3), (5.0, 5), ("7", 7), ("5.0", 5), (np.int64(2), 2), (10**400, 10**400)])
def test_param_k_reads_integers(k, want):
    assert param_k({"k": k}, 10) == want and param_k(None, 4) == 4


@pytest.mark.parametrize("k", [math.inf, -math.inf, math.nan, 1.9, 0.5, 0, -3, True, False, "abc", "1.5", None,
                               [1], "9" * 5000, "5_0", " 5", "+5", "0.0"])
def test_param_k_refuses_what_is_not_an_integer_from_one(k):
    with pytest.raises(XCRequestError, match="param k: expected an integer >= 1, got"):
        param_k({"k": k}, 10)


@pytest.mark.parametrize("params", [[("k", 5)], "k=5", 5])
def test_params_that_are_no_mapping_are_refused(params):
    with pytest.raises(XCRequestError, match="params: expected a mapping such as"):
        param_k(params, 10)


def test_one_text_as_an_array_of_no_dimension_reads_as_one_text():
    assert input_texts(np.array("café")) == ["café"]


def test_a_count_model_refuses_values_that_are_not_counts(count_bundle):
    b = count_bundle
    assert b.counts and b.num_features == F
    model = XCModel()
    model.bundle = b
    lines = ["3:2 0:1", "5:1 5:2 7:3", "", "3:0 4:1", "2:2.0"]
    got = model.predict(None, pd.DataFrame({"features": lines}), params={"k": 5})
    ids, _ = predict_features(input_features(lines, F), b, 5)  # as before: the rows unchecked
    assert list(got["label_ids"]) == [[int(i) for i in r if i >= 0] for r in ids]
    assert all(len(x) for j, x in enumerate(got["label_ids"]) if j != 2)
    for line, token in (("3:0.3", "'3':'0.3'"), ("3:-1", "'3':'-1'"), ("3:1.5", "'3':'1.5'")):
        with pytest.raises(mlflow.exceptions.MlflowException, match=f"row 1: feature {token}: .* fitted on counts"):
            model.predict(None, pd.DataFrame({"features": ["0:1", line]}))
    with pytest.raises(XCRequestError, match="row 0: feature 3:0.3: .* fitted on counts"):
        input_features([{3: 0.3}], F, counts=True)
    with pytest.raises(XCRequestError, match="feature row 1: value 0.5: .* fitted on counts"):
        predict_features(sp.csr_matrix(np.array([[1] + [0] * (F - 1), [0.5] + [0] * (F - 1)])), b, 5)


def test_a_real_valued_model_takes_any_finite_value(count_bundle):
    values = LexicalIndex.fit(sp.csr_matrix(np.full((4, F), 0.25, np.float32)), None,
                              sp.csr_matrix(np.eye(4, L)), 2)  # not counts: values L2-normalised only
    b = dataclasses.replace(count_bundle, sources=dataclasses.replace(count_bundle.sources, lexical=values))
    assert not b.counts
    model = XCModel()
    model.bundle = b
    got = model.predict(None, pd.DataFrame({"features": ["3:0.3 4:-1"]}), params={"k": 3})
    assert len(got["label_ids"][0]) > 0


def test_num_features_disagreeing_with_the_lexical_index_fails_at_load(count_dir, tmp_path):
    bad = Path(shutil.copytree(count_dir, tmp_path / "b"))
    info = json.loads((bad / SERVING_FILE).read_text())
    (bad / SERVING_FILE).write_text(json.dumps({**info, "num_features": F + 10}))
    with pytest.raises(XCError, match=f"serving.json: 'num_features' {F + 10}: expected the lexical index's {F}"):
        load_bundle(bad, "cpu")
