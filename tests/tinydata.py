"""Small generated datasets and a tiny random transformer for fast, reproducible pipeline tests."""

from __future__ import annotations

import atexit
import contextlib
import gzip
import http.server
import json
import os
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from unittest import mock

import dagster as dg
import numpy as np

WORDS = ["apple", "river", "stone", "cloud", "music", "paper", "glass", "horse", "light", "metal",
         "ocean", "plant", "sugar", "tiger", "water", "wheel", "bread", "chair", "dream", "earth"]


def write_lf_dataset(folder: Path, n_train: int = 120, n_test: int = 40, n_labels: int = 20,
                     seed: int = 0) -> Path:
    """An LF raw-text dataset whose point titles name their labels' words (so it is learnable)."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    labels = [{"uid": f"L{j}", "title": WORDS[j % len(WORDS)] + (f" {j}" if j >= len(WORDS) else ""),
               "content": f"about {WORDS[j % len(WORDS)]}", "target_ind": [], "target_rel": []}
              for j in range(n_labels)]

    def rows(n: int, offset: int) -> list[dict]:
        out = []
        for i in range(n):
            k = int(rng.integers(1, 4))
            tgt = sorted(rng.choice(n_labels, size=k, replace=False).tolist())
            title = " ".join(WORDS[t % len(WORDS)] for t in tgt) + f" item{offset + i}"
            out.append({"uid": f"P{offset + i}", "title": title, "content": "a generated point",
                        "target_ind": tgt, "target_rel": [1.0] * k})
        return out

    for name, data in (("trn.json.gz", rows(n_train, 0)), ("tst.json.gz", rows(n_test, n_train)),
                       ("lbl.json.gz", labels)):
        with gzip.open(folder / name, "wt") as fh:
            for r in data:
                fh.write(json.dumps(r) + "\n")
    (folder / "filter_labels_test.txt").write_text("0 19\n3 18\n")
    (folder / "filter_labels_train.txt").write_text("1 17\n")
    return folder


def label_prior_metrics(Y_train, Y_test, filter_pairs=None, ks=(1, 5)) -> dict[str, float]:
    """The label-prior baseline a learned model must beat: every test point gets the same ranking, the labels by
    training frequency (ties: smaller id), scored as the evaluate stage scores predictions (filter pairs out)."""
    from xc_dagster.evaluation.metrics import evaluate  # noqa: PLC0415

    freq = np.asarray(Y_train.sum(axis=0)).ravel()
    order = np.lexsort((np.arange(len(freq)), -freq))
    return evaluate(np.tile(order, (Y_test.shape[0], 1)), Y_test, ks=ks, filter_pairs=filter_pairs)


def label_word_texts():
    """24 points naming one or two of 8 label words, tokenized with MiniLM's tokenizer (max_len 8): (point
    tokens, label tokens, Y)."""
    import scipy.sparse as sp  # noqa: PLC0415  (test helper: keeps tinydata importable without scipy)

    from xc_dagster.encoders.tokenizer import load_tokenizer  # noqa: PLC0415

    tok = load_tokenizer("minilm")
    rng = np.random.default_rng(0)
    labels = [rng.choice(8, size=int(rng.integers(1, 3)), replace=False) for _ in range(24)]
    r = np.repeat(np.arange(24), [len(lab) for lab in labels])
    Y = sp.csr_matrix((np.ones(len(r), dtype=np.float32), (r, np.concatenate(labels))), shape=(24, 8))

    def tokens(t: list[str]) -> tuple[np.ndarray, np.ndarray]:
        enc = tok(t, padding="max_length", truncation=True, max_length=8, return_tensors="np")
        return enc["input_ids"].astype(np.int32), enc["attention_mask"].sum(1).astype(np.int32)

    pt = tokens([" ".join(WORDS[j] for j in lab) + f" item {i}" for i, lab in enumerate(labels)])
    return pt, tokens(WORDS[:8]), Y


def write_tiny_encoder(folder: Path, seed: int = 0) -> Path:
    """A 2-layer, 32-wide random BERT with the packaged MiniLM tokenizer, saved as an HF folder."""
    import torch
    from transformers import AutoTokenizer, BertConfig, BertModel

    from xc_dagster.encoders.names import resolve_encoder_path

    if (folder / "config.json").exists():
        return folder
    torch.manual_seed(seed)
    tok = AutoTokenizer.from_pretrained(resolve_encoder_path("minilm"))
    cfg = BertConfig(vocab_size=tok.vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=64, max_position_embeddings=128)
    BertModel(cfg).save_pretrained(folder, safe_serialization=True)
    tok.save_pretrained(folder)
    return folder


def tiny_lf_home(tmp_path: Path, monkeypatch, overrides: dict, encoder: Path | None = None,
                 name: str = "TinyTitles", instance: bool = False):
    """A fresh XC home under ``tmp_path`` (MLflow local; with ``instance`` its Dagster instance too) whose catalog
    holds ``name``: the tiny LF dataset with ``overrides`` and the tiny random encoder (or ``encoder``)."""
    from xc_dagster.catalog import Catalog, DatasetSpec

    monkeypatch.setenv("XC_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    home = ready_home(tmp_path / "home", instance)
    encoder = encoder or write_tiny_encoder(tmp_path / "tiny-bert")
    src = write_lf_dataset(tmp_path / "src" / name)
    Catalog(home.catalog).add(DatasetSpec(name, str(src), overrides={**overrides, "tokenize.encoder": str(encoder)}))
    return home


# each test process's homes made once, without and with the Dagster instance, copied for every fresh home
_TEMPLATE_HOMES: dict[bool, Path] = {}
# variables that change what a home's first use makes: unset while a template home is made
_HOME_VARIABLES = ("XC_HOME", "DAGSTER_HOME", "MLFLOW_TRACKING_URI", "XC_DAGSTER_POSTGRES_URL",
                   "XC_TRAINING_CONCURRENCY")


def _template_home(instance: bool) -> Path:
    """A home whose first use (``Home.ensure``) ran once in this process, in a temporary folder removed at exit."""
    from xc_dagster.home import Home

    if instance not in _TEMPLATE_HOMES:
        base = Path(tempfile.mkdtemp(prefix="xc-template-home-")).resolve()
        atexit.register(shutil.rmtree, base, True)
        root = base / "home"
        if instance:  # the Dagster instance migrated in a copy of the home without it: one MLflow store made
            shutil.copytree(_template_home(False), root)
            _repoint(_template_home(False), root)
        with mock.patch.dict(os.environ):
            for var in _HOME_VARIABLES:
                os.environ.pop(var, None)
            Home(root).ensure(instance=instance)
        _TEMPLATE_HOMES[instance] = root
    return _TEMPLATE_HOMES[instance]


def _repoint(template: Path, root: Path) -> None:
    """The absolute paths of a copied home made to name the copy: the first-use marker's MLflow store and the
    MLflow experiments' artifact locations."""
    from xc_dagster.home import READY

    marker = root / READY
    marker.write_text(marker.read_text().replace(str(template), str(root)))
    with contextlib.closing(sqlite3.connect(root / "mlflow.db")) as db, db:
        db.execute("UPDATE experiments SET artifact_location = replace(artifact_location, ?, ?)",
                   (str(template), str(root)))


def ready_home(root: Path, instance: bool = False):
    """``Home(root).ensure(instance)`` for a fresh ``root`` from a copy of a home made once per test process: the
    first use's MLflow schema migrations and ``dagster instance migrate`` take seconds in child processes.
    ``ensure`` still runs on the copy, so what this process's environment wants beyond the template is made."""
    from xc_dagster.home import READY, Home

    root = Path(root).resolve()
    if not (root / READY).exists():
        template = _template_home(instance)
        shutil.copytree(template, root, dirs_exist_ok=True)
        _repoint(template, root)
    return Home(root).ensure(instance=instance)


def _default_stop_signals() -> None:
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)


def start_server(cmd: list[str], log: Path, **kw) -> subprocess.Popen:
    """``cmd`` in a process group of its own (for :func:`stop_process_group`), its output in ``log``, with SIGINT's
    and SIGTERM's default actions: pytest started by a non-interactive shell (CI) ignores SIGINT, Dagster maps
    SIGTERM to SIGINT's handler (in its own processes, and in this one when a test runs Dagster in process), and a
    child inherits ignored signals, so the server would ignore the stop signal until SIGKILL."""
    with open(log, "wb") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=_default_stop_signals, **kw)


def stop_process_group(proc, timeout: float = 30.0) -> None:
    """SIGTERM a server started with ``start_new_session=True`` and its children; SIGKILL if it lingers."""
    import subprocess

    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=timeout)
    except ProcessLookupError:
        pass
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


class QuietHTTPServer(http.server.ThreadingHTTPServer):
    """A threaded test server that does not print the errors of clients killed mid-answer (expected here)."""

    daemon_threads = True

    def handle_error(self, request, client_address) -> None:
        pass


@contextlib.contextmanager
def serve_http(handler, path: str):
    """Serve ``handler`` on a free local port in a thread; yields the URL of ``path``."""
    server = QuietHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/{path}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def kill_at_marker(proc, marker: str) -> None:
    """SIGKILL ``proc`` once it prints the line ``marker`` (its stdout a text pipe): a kill at a known point."""
    try:
        assert proc.stdout.readline().strip() == marker
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL


def dagster_instance(*datasets: str) -> dg.DagsterInstance:
    """An ephemeral Dagster instance whose dataset partitions (dynamic) are ``datasets``."""
    from resources.partitions import register

    instance = dg.DagsterInstance.ephemeral()
    register(instance, datasets)
    return instance


# a child's start: say ready (argv[1]), wait for the start signal (argv[2]); argv[3] is its index
WAIT_FOR_GO = textwrap.dedent("""
    import sys, time
    from pathlib import Path

    ready, go, i = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
    ready.touch()
    deadline = time.monotonic() + 120
    while not go.exists():
        if time.monotonic() > deadline:
            sys.exit("no start signal")
        time.sleep(0.002)
""")


def release_together(imports: str, body: str, n: int, tmp: Path, env: dict[str, str],
                     args=lambda i: []) -> list[subprocess.CompletedProcess]:
    """Start ``n`` children running ``imports + WAIT_FOR_GO + body`` (extra arguments ``args(i)``), wait until each
    has imported and is waiting, then release them at once; their completed processes."""
    go = tmp / "go"
    ready = [tmp / f"ready-{i}" for i in range(n)]
    procs = [subprocess.Popen([sys.executable, "-c", imports + WAIT_FOR_GO + body, str(r), str(go), str(i), *args(i)],
                              env=env, cwd=tmp, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i, r in enumerate(ready)]
    deadline = time.monotonic() + 120
    while not all(r.exists() for r in ready) and time.monotonic() < deadline and all(p.poll() is None for p in procs):
        time.sleep(0.01)
    go.touch()
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=180)
        out.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr))
    return out


def free_port() -> int:
    """A TCP port of 127.0.0.1 free now (for a server a test starts)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def graphql(port: int, query: str, variables: dict | None = None) -> dict:
    """The ``data`` of a GraphQL request to the Dagster webserver on ``port`` (errors fail the test)."""
    req = urllib.request.Request(f"http://127.0.0.1:{port}/graphql", method="POST",
                                 data=json.dumps({"query": query, "variables": variables or {}}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        body = json.loads(r.read())
    assert "errors" not in body, body["errors"]
    return body["data"]


def wait_for(what: str, fn, timeout: float, log: Path, proc: subprocess.Popen):
    """Poll ``fn`` until it returns something true (a server not answering yet counts as not yet), while ``proc``
    (the server, writing ``log``) runs; fails naming ``what`` and the log's tail."""
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, f"server exited ({proc.returncode})\n" + log.read_text()[-4000:]
        try:
            value = fn()
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            value = None
        if value:
            return value
        assert time.monotonic() < deadline, f"{what}: not within {timeout:.0f} s\n" + log.read_text()[-4000:]
        time.sleep(0.5)
