"""Serving is bounded: k clamped to the shortlist, texts cut before tokenizing, no labels for texts without a
visible character, bytes decoded as UTF-8, requests capped (HTTP 400 from MLflow's scoring server).

The bundle is written by hand (tiny random encoder, 2,000 labels, exact indexes over W and the label embeddings,
alpha fusion, shortlist 50 per source): no pipeline run. Memory bounds are checked in a child process under
``RLIMIT_AS``."""

from __future__ import annotations

import io
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import mlflow
import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import uvicorn
from mlflow.models import infer_signature
from mlflow.pyfunc import scoring_server

from tests.tinydata import WORDS, write_tiny_encoder
from xc_dagster.encoders.encode import encode_tokens
from xc_dagster.encoders.loading import load_encoder
from xc_dagster.encoders.tokenizer import load_tokenizer, tokenize_texts
from xc_dagster.errors import XCConfigError, XCError
from xc_dagster.retrieval.shortlist import build_sources
from xc_dagster.retrieval.source_files import save_sources
from xc_dagster.serving import bundle as serving_bundle
from xc_dagster.serving.bundle_files import MANIFEST_FILE, VERIFY_ENV, write_manifest
from xc_dagster.serving.limits import MAX_TEXTS_ENV, RequestLimits, cut_text, text_char_limit
from xc_dagster.serving.registry import MODEL_CODE
from xc_dagster.serving.warm_start import resolve_warm_start
from xc_dagster.storage import save_json

ROOT = Path(__file__).resolve().parents[1]
L, SHORTLIST, MAX_LEN = 2000, 50, 32
WIDTH = 2 * SHORTLIST  # two sources (W, label): the most labels a row can get


def _label_texts() -> list[str]:
    return [f"{WORDS[j % len(WORDS)]} {WORDS[(j // len(WORDS)) % len(WORDS)]} {j}" for j in range(L)]


@pytest.fixture(scope="module")
def bundle_dir(tmp_path_factory) -> Path:
    """A serving bundle folder of the tiny encoder over L generated labels."""
    out = tmp_path_factory.mktemp("bundle")
    enc_dir = write_tiny_encoder(out / "encoder")
    encoder, tok = load_encoder(str(enc_dir), "mean").eval(), load_tokenizer(str(enc_dir))
    texts = _label_texts()
    label_emb = encode_tokens(encoder, *tokenize_texts(tok, texts, MAX_LEN), torch.device("cpu"), None, 256)
    W = label_emb + np.random.default_rng(0).normal(0, 0.05, label_emb.shape).astype(np.float32)
    np.save(out / "W.npy", W)
    np.save(out / "label_emb.npy", label_emb)
    save_sources(build_sources(("W", "label"), W, label_emb, None, None, None, "text", "exact", 16, 40, 64),
                 out, None)
    save_json(out / "fusion.json", {"method": "alpha", "alpha": 0.5})
    np.save(out / "inv_prop.npy", np.ones(L))
    pq.write_table(pa.table({"text": texts}), out / "labels.parquet")
    save_json(out / serving_bundle.SERVING_FILE, {
        "format": serving_bundle.BUNDLE_FORMAT, "pooling": "mean", "max_len": MAX_LEN, "amp": "off",
        "encode_batch_size": 256, "index_kind": "exact", "ef_search": 64, "sources": ["W", "label"],
        "label_repr": "text", "knn_neighbours": 0, "shortlist_size": SHORTLIST, "default_k": 10,
        "manifest": MANIFEST_FILE})
    write_manifest(out)  # last, as write_bundle does
    return out


@pytest.fixture(scope="module")
def bundle(bundle_dir) -> serving_bundle.ServingBundle:
    return serving_bundle.load_bundle(bundle_dir, "cpu")


def _model(bundle, limits: RequestLimits | None = None) -> serving_bundle.XCModel:
    model = serving_bundle.XCModel()
    model.bundle, model.limits = bundle, limits or RequestLimits()
    return model


# a child process: load the bundle, warm up, then cap its address space at what it maps + 2 GiB and run one case
_CHILD = r'''
import json, resource, sys, time
from xc_dagster.serving import bundle as sb
b = sb.load_bundle(sys.argv[1], "cpu")
sb.predict_topk(["apple river"], b, 10)
vm = next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmSize:"))
if sys.argv[2] == "k":
    texts = [f"apple river {i}" for i in range(3000)]
else:
    texts = ["apple river stone cloud " * (50_000_000 // 24), "apple river stone cloud " * 400]
resource.setrlimit(resource.RLIMIT_AS, (vm + (2 << 30), vm + (2 << 30)))
t = time.perf_counter()
ids, scores = sb.predict_topk(texts, b, 10**6 if sys.argv[2] == "k" else 10)
out = {"seconds": time.perf_counter() - t, "shape": list(ids.shape), "labels": (ids >= 0).sum(1).tolist()[:5]}
if sys.argv[2] == "k":
    top10, _ = sb.predict_topk(texts[:50], b, 10)
    out["prefix_equal"] = bool((ids[:50, :10] == top10).all())
else:
    out["same_as_cut"] = bool((ids[0] == ids[1]).all() and (scores[0] == scores[1]).all())
print("RESULT " + json.dumps(out))
'''


def _child(bundle_dir: Path, case: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
           "RAYON_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "MALLOC_ARENA_MAX": "2"}
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(bundle_dir), case], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"rc {proc.returncode}\n{proc.stderr[-3000:]}"
    return json.loads(lines[-1][len("RESULT "):])


def test_huge_k_is_clamped_to_the_shortlist_in_bounded_memory(bundle_dir, bundle):
    """k = 10^6 on 3,000 texts: at most the shortlist's width per row, within 2 GiB more address space."""
    got = _child(bundle_dir, "k")
    assert got["shape"] == [3000, WIDTH] and all(0 < n <= WIDTH for n in got["labels"])
    assert bundle.max_k == WIDTH
    assert got["prefix_equal"]  # the first 10 of the clamped answer are the top-10
    out = _model(bundle).predict(None, pd.DataFrame({"text": ["apple river", "stone"]}), params={"k": 10**6})
    assert all(0 < len(x) <= WIDTH for x in out["label_ids"])


def test_50mb_text_is_cut_before_tokenizing(bundle_dir):
    """A 50 MB text is answered in seconds within 2 GiB more address space, as its first max_len * 32 chars."""
    got = _child(bundle_dir, "long")
    assert got["same_as_cut"] and got["shape"] == [2, 10] and got["seconds"] < 10


def test_tokenizer_and_lexical_input_see_at_most_the_char_bound(bundle, monkeypatch):
    seen = []
    real = serving_bundle.tokenize_texts

    def spy(tok, texts, max_len):
        seen.extend(len(t) for t in texts)
        return real(tok, texts, max_len)

    monkeypatch.setattr(serving_bundle, "tokenize_texts", spy)
    long = "stone cloud " * 100_000
    ids, _ = serving_bundle.predict_topk([long, "apple"], bundle, 5)
    assert seen == [text_char_limit(MAX_LEN), 5] and text_char_limit(MAX_LEN) == MAX_LEN * 32
    assert (ids >= 0).all()


def test_whitespace_is_collapsed_before_the_cut(bundle):
    """Whitespace runs of a text over the cut are collapsed first: they never push its words out of it."""
    limit = text_char_limit(MAX_LEN)
    padded = ["\n" * 1100 + "apple river", "apple" + " " * 1100 + "river", " \t" * 600 + "apple \n river  " * 2]
    ids, scores = serving_bundle.predict_topk(padded, bundle, 10)
    ref, ref_scores = serving_bundle.predict_topk(["apple river", "apple river", "apple river apple river"], bundle, 10)
    np.testing.assert_array_equal(ids, ref)
    np.testing.assert_allclose(scores, ref_scores, rtol=1e-5)
    assert cut_text("apple  river", limit) == "apple  river"  # within the cut: read as it is, as evaluated
    assert cut_text(" " * 10_000_000 + "apple", limit) == "apple"  # slices of the cut's size, not a copy
    words = "stone  cloud\t" * 1000
    assert cut_text(words, limit) == " ".join(words.split())[:limit] and len(cut_text(words, limit)) == limit
    assert cut_text("ab" + " " * limit + "cd", 3) == "ab " and cut_text("a" * 5 + " b", 3) == "aaa"


def test_invisible_characters_are_dropped_before_the_cut(bundle):
    """Zero-width and other format / control characters of a text over the cut are dropped first (the tokenizer
    drops them too): padding of them never pushes its words out of the cut."""
    limit = text_char_limit(MAX_LEN)
    padded = ["\u200b" * 5000 + "apple river", "apple\u00ad" * 2 + "\u200d" * limit + " river",
              "\x07" * limit + "apple river"]
    ids, scores = serving_bundle.predict_topk(padded, bundle, 10)
    ref, ref_scores = serving_bundle.predict_topk(["apple river", "appleapple river", "apple river"], bundle, 10)
    np.testing.assert_array_equal(ids, ref)
    np.testing.assert_allclose(scores, ref_scores, rtol=1e-5)
    assert cut_text("\u200b" * limit + "apple", limit) == "apple" and cut_text("\u200b" * (limit + 1), limit) == ""
    assert cut_text("ab\u200b" + "\u200b" * limit + " cd", limit) == "ab cd"  # the space after the run is kept
    assert cut_text("apple\u200b river", limit) == "apple\u200b river"  # within the cut: read as it is


def test_texts_without_a_visible_character_get_no_labels(bundle):
    texts = ["", "   ", "\t\n\r", "\u200b\u00a0\u3000", "apple river", "x"]
    ids, scores = serving_bundle.predict_topk(texts, bundle, 10)
    assert ids.shape == (6, 10)
    assert (ids[:4] == -1).all() and np.isneginf(scores[:4]).all()
    assert (ids[4:] >= 0).all()
    ref, _ = serving_bundle.predict_topk(["apple river"], bundle, 10)
    np.testing.assert_array_equal(ids[4], ref[0])  # the others are unchanged by their empty neighbours
    out = _model(bundle).predict(None, pd.DataFrame({"text": ["  ", None, float("nan"), "apple"]}))
    assert list(out["label_ids"][:3]) == [[], [], []] and list(out["labels"][:3]) == [[], [], []]
    assert len(out["label_ids"][3]) == 10
    ids, _ = serving_bundle.predict_topk([" ", ""], bundle, 3)  # all empty: nothing encoded
    assert ids.shape == (2, 3) and (ids == -1).all()


def test_bytes_are_decoded_as_utf8(bundle):
    texts = ["café river", "stone cloud ünïcode"]
    model = _model(bundle)
    as_str = model.predict(None, pd.DataFrame({"text": texts}))
    for given in (pd.DataFrame({"text": [t.encode() for t in texts]}), [t.encode() for t in texts],
                  {"text": [t.encode() for t in texts]}):
        got = model.predict(None, given)
        assert list(got["label_ids"]) == list(as_str["label_ids"]) and list(got["scores"]) == list(as_str["scores"])
    with pytest.raises(mlflow.exceptions.MlflowException, match="row 1: bytes that are not UTF-8") as ei:
        model.predict(None, pd.DataFrame({"text": [b"ok", b"\xff\xfe bad"]}))
    assert ei.value.get_http_status_code() == 400
    with pytest.raises(mlflow.exceptions.MlflowException, match="row 0: expected a text"):
        model.predict(None, pd.DataFrame({"text": [{"a": 1}]}))
    # a JSON escape of half a surrogate pair ("caf\ud83d") reaches the model as a str no tokenizer reads (it raised a
    # TypeError in the tokenizer: a server error); a whole pair is text like any other
    with pytest.raises(mlflow.exceptions.MlflowException, match=r"row 1: a lone surrogate '\\ud83d' at character 4") \
            as ei:
        model.predict(None, {"text": np.array(["ok", "caf\ud83d"])})
    assert ei.value.get_http_status_code() == 400
    assert list(model.predict(None, {"text": ["caf\U0001f600 river"]})["label_ids"])[0] is not None


def test_request_caps(bundle, monkeypatch):
    model = _model(bundle, RequestLimits(max_texts=3, max_chars=100))
    assert len(model.predict(None, pd.DataFrame({"text": ["apple"] * 3}))) == 3
    for texts, what in ((["apple"] * 4, "4 texts: at most 3"), (["a" * 60, "b" * 41], "101 characters: at most 100")):
        with pytest.raises(mlflow.exceptions.MlflowException, match=what) as ei:
            model.predict(None, pd.DataFrame({"text": texts}))
        assert ei.value.get_http_status_code() == 400
    monkeypatch.setenv(MAX_TEXTS_ENV, "7")
    assert RequestLimits.from_env().max_texts == 7
    for bad in ("0", "many"):
        monkeypatch.setenv(MAX_TEXTS_ENV, bad)
        with pytest.raises(XCConfigError, match=MAX_TEXTS_ENV):
            RequestLimits.from_env()


def _set_info(**changes):
    def change(folder: Path) -> None:
        info = json.loads((folder / serving_bundle.SERVING_FILE).read_text())
        info.update(changes)
        (folder / serving_bundle.SERVING_FILE).write_text(json.dumps({k: v for k, v in info.items() if v is not None}))
    return change


def _npy(array: np.ndarray) -> bytes:
    """``array`` as a .npy file's bytes (np.save would add .npy to a name such as W.index)."""
    buf = io.BytesIO()
    np.save(buf, array)
    return buf.getvalue()


def _truncate(name: str):
    def change(folder: Path) -> None:
        with open(folder / name, "r+b") as fh:
            fh.truncate(1000)
    return change


@pytest.mark.parametrize("damage, match", [
    (lambda d: np.save(d / "inv_prop.npy", np.ones(5)), r"inv_prop.npy: shape \(5,\), expected \(2000,\)"),
    (lambda d: np.save(d / "label_emb.npy", np.load(d / "label_emb.npy")[:100]),
     r"label_emb.npy: shape \(100, 32\), expected \(2000, 32\)"),
    (lambda d: np.save(d / "W.npy", np.ones((L, 7), np.float32)), r"W.npy: shape \(2000, 7\), expected \(2000, 32\)"),
    (lambda d: (d / "W.index").write_bytes(_npy(np.ones((L, 7), np.float32))),
     r"W.index: shape \(2000, 7\), expected \(2000, 32\)"),
    (_set_info(shortlist_size=0), "serving.json: 'shortlist_size': expected int >= 1, got 0"),
    (_set_info(pooling=None), "serving.json: 'pooling': expected str, got None \\(missing\\)"),
    (_truncate("label_emb.npy"), "label_emb.npy: cannot be read"),
    (lambda d: (d / "fusion.json").unlink(), "fusion.json: missing"),
    (lambda d: (d / "labels.parquet").write_text("not parquet"), "labels.parquet: cannot be read"),
])
def test_a_damaged_bundle_fails_at_load_naming_the_file_or_field(bundle_dir, tmp_path, damage, match):
    bad = Path(shutil.copytree(bundle_dir, tmp_path / "bundle"))
    damage(bad)
    write_manifest(bad)  # a bundle written inconsistent (not changed after): the parts' checks name it
    with pytest.raises(XCError, match=match):
        serving_bundle.load_bundle(bad, "cpu")


def _flip_last_byte(name: str):
    def change(folder: Path) -> None:  # same size, still a valid file: numpy reads it without complaint
        data = bytearray((folder / name).read_bytes())
        data[-1] ^= 0xFF
        (folder / name).write_bytes(bytes(data))
    return change


def _manifest_entry(rel: str):
    def change(folder: Path) -> None:
        m = json.loads((folder / MANIFEST_FILE).read_text())
        m["files"][rel] = {"size": 1, "sha256": "0" * 64}
        (folder / MANIFEST_FILE).write_text(json.dumps(m))
    return change


@pytest.mark.parametrize("damage, mode, match", [
    (_flip_last_byte("W.npy"), "sha256", r"W.npy: size \d+, sha256 [0-9a-f]{64}, but manifest.json says size \d+, "
                                         r"sha256 [0-9a-f]{64}: damaged or changed after write_bundle"),
    (_flip_last_byte("encoder/model.safetensors"), "", r"encoder/model.safetensors: size \d+, sha256"),
    (_truncate("label_emb.npy"), "size", r"label_emb.npy: size 1000, but manifest.json says size \d+:"),
    (lambda d: (d / "W.index").unlink(), "size", r"W.index: missing, though manifest.json lists it"),
    (lambda d: (d / MANIFEST_FILE).unlink(), "sha256", r"manifest.json is missing, though serving.json says"),
    (lambda d: (d / MANIFEST_FILE).write_text("{"), "sha256", r"manifest.json: cannot be read"),
    (_manifest_entry("../outside.npy"), "sha256", r"entry '../outside.npy': expected a relative path inside"),
])
def test_a_bundle_changed_after_it_was_written_fails_against_its_manifest(bundle_dir, tmp_path, monkeypatch, damage,
                                                                         mode, match):
    bad = Path(shutil.copytree(bundle_dir, tmp_path / "bundle"))
    damage(bad)
    monkeypatch.setenv(VERIFY_ENV, mode)
    with pytest.raises(XCError, match=match):
        serving_bundle.load_bundle(bad, "cpu")
    with pytest.raises(XCError, match=match):  # a warm start reads the same encoder, W and label texts
        resolve_warm_start(str(bad), "TinyTitles", None, tmp_path / "champion")


def test_manifest_checks_as_much_as_xc_serving_verify_asks(bundle_dir, tmp_path, monkeypatch, caplog):
    flipped = Path(shutil.copytree(bundle_dir, tmp_path / "flipped"))
    _flip_last_byte("W.npy")(flipped)
    monkeypatch.setenv(VERIFY_ENV, "size")  # a same-size change passes the sizes; the parts then load
    assert serving_bundle.load_bundle(flipped, "cpu").num_labels == L
    monkeypatch.setenv(VERIFY_ENV, "off")
    (flipped / MANIFEST_FILE).unlink()
    serving_bundle.load_bundle(flipped, "cpu")
    monkeypatch.setenv(VERIFY_ENV, "md5")
    with pytest.raises(XCConfigError, match=r"\$XC_SERVING_VERIFY: expected one of sha256, size, off, got 'md5'"):
        serving_bundle.load_bundle(bundle_dir, "cpu")
    monkeypatch.delenv(VERIFY_ENV)
    old = Path(shutil.copytree(bundle_dir, tmp_path / "old"))  # written before manifests: no key, no file
    (old / MANIFEST_FILE).unlink()
    _set_info(manifest=None)(old)
    with caplog.at_level("WARNING", logger="xc_dagster"):
        assert serving_bundle.load_bundle(old, "cpu").num_labels == L
    assert "has no manifest.json (written before manifests)" in caplog.text


# ------------------------------------------------------------- MLflow's scoring server, over real HTTP

def _post(url: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.fixture
def scoring_url(bundle_dir, bundle, tmp_path, monkeypatch):
    """The app ``mlflow models serve`` runs (``scoring_server.init``) over this bundle's pyfunc, under uvicorn in a
    thread, with at most 3 texts per request."""
    monkeypatch.setenv(MAX_TEXTS_ENV, "3")
    code = tmp_path / "xc_model.py"
    code.write_text(MODEL_CODE)
    inp = pd.DataFrame({"text": ["apple river"]})
    out = serving_bundle.predictions_frame(*serving_bundle.predict_topk(["apple river"], bundle, 10), bundle)
    mlflow.pyfunc.save_model(tmp_path / "model", python_model=str(code), artifacts={"bundle": str(bundle_dir)},
                             signature=infer_signature(inp, out, params={"k": 10}), input_example=inp,
                             pip_requirements=["mlflow"])
    app = scoring_server.init(mlflow.pyfunc.load_model(str(tmp_path / "model")))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "scoring server did not start"
        time.sleep(0.05)
    yield SimpleNamespace(url=f"http://127.0.0.1:{port}/invocations")
    server.should_exit = True
    thread.join(10)


def test_scoring_server_bounds_requests_over_http(scoring_url):
    def body(texts, k=10):
        return {"dataframe_split": {"columns": ["text"], "data": [[t] for t in texts]}, "params": {"k": k}}

    status, answer = _post(scoring_url.url, body(["apple river", "   ", "stone"], 10**6))
    assert status == 200
    labels = [len(p["label_ids"]) for p in answer["predictions"]]
    assert labels[1] == 0 and 0 < labels[0] <= WIDTH and 0 < labels[2] <= WIDTH
    status, answer = _post(scoring_url.url, body(["apple"] * 4))
    assert status == 400 and "4 texts: at most 3" in answer["message"]
    assert answer["error_code"] == "INVALID_PARAMETER_VALUE"
