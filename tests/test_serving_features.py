"""Requests to a model of feature rows: feature vectors as lines or mappings, summed, bounded and refused clearly."""

from __future__ import annotations

from types import SimpleNamespace

import mlflow
import numpy as np
import pandas as pd
import pytest
import scipy.sparse as sp

from xc_dagster.serving.bundle import XCModel
from xc_dagster.serving.limits import RequestLimits, XCRequestError
from xc_dagster.serving.requests import feature_lines, input_features


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
    (b"\xff:1", "row 1: bytes that are not UTF-8"),
    ("1:3e38 1:3e38", "row 1: an id given twice sums past float32"),
])
def test_bad_features_are_refused_naming_the_row_and_token(value, match):
    with pytest.raises(XCRequestError, match=match):
        input_features(pd.Series(["0:1", value]), 5)


def test_a_request_past_its_limits_is_refused_before_it_is_parsed():
    with pytest.raises(XCRequestError, match="request of 3 feature rows: at most 2"):
        input_features(["0:1", "bad", "bad"], 5, RequestLimits(max_texts=2))
    with pytest.raises(XCRequestError, match="characters: at most 10 per request .* send shorter feature rows"):
        input_features(["0:1 1:1 2:1", "3:1 4:1"], 5, RequestLimits(max_chars=10))
    with pytest.raises(Exception, match="expected a column 'features'"):
        input_features(pd.DataFrame({"text": ["a"], "other": ["b"]}), 5)


def test_the_pyfunc_refuses_a_bad_feature_request_as_a_client_error():
    model = XCModel()
    model.bundle = SimpleNamespace(input="features", num_features=5, default_k=10)
    with pytest.raises(mlflow.exceptions.MlflowException, match="row 0: feature '9'") as e:
        model.predict(None, pd.DataFrame({"features": ["9:1"]}))
    assert e.value.error_code == "INVALID_PARAMETER_VALUE"
