"""Ingest benchmark: the project's streaming readers against the obvious pandas / sklearn readers.

Generates, into a temp folder, files of LF-AmazonTitles-1.3M's shape (default 2,248,619 points, 1,305,265
labels, 22.2 labels per point) as a split-sparse label file ``trn_X_Y.txt`` and as the LF layout
(``trn.json.gz``; ``lbl.json.gz`` with one title per label; a smaller ``tst.json.gz``), and a legacy BoW file
(default 500K rows x 100K features x 10 nnz, 1-5 labels per row out of 10K). Then every reader runs in a fresh
subprocess; its wall time (parse only, imports excluded) and peak RSS (``os.wait4`` rusage of that child, i.e.
what ``getrusage(RUSAGE_CHILDREN)`` reports for a single child) are printed as a Markdown table.

    python bench/ingest_bench.py                       # defaults (about 10 minutes on 2 cores)
    python bench/ingest_bench.py --points 200000 --bow-rows 50000 --keep /tmp/xc-bench
"""

from __future__ import annotations

import argparse
import gzip
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import scipy.sparse as sp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from xc_dagster.data.layouts import read_dataset  # noqa: E402
from xc_dagster.data.lf_raw import read_lf_points  # noqa: E402
from xc_dagster.data.streaming import read_bow_file, read_sparse_file  # noqa: E402

CHUNK = 200_000  # rows per generation chunk


# ------------------------------------------------------------------------------------- generation

def _label_rows(rng: np.random.Generator, n: int, L: int, avg: float) -> tuple[np.ndarray, np.ndarray]:
    """Row lengths (Poisson around ``avg``, at least 1) and sorted unique-ish label ids per row."""
    counts = np.maximum(1, rng.poisson(avg, n)).astype(np.int64)
    ids = rng.integers(0, L, int(counts.sum()))
    return counts, ids


def _joined(tokens, counts: np.ndarray, sep: str):
    """Arrow: per-row join of string tokens (``counts[r]`` tokens for row r)."""
    offsets = np.zeros(len(counts) + 1, dtype=np.int32)
    np.cumsum(counts, out=offsets[1:])
    return pc.binary_join(pa.ListArray.from_arrays(pa.array(offsets), tokens), sep)


def gen_split_sparse(path: Path, n: int, L: int, avg: float, seed: int) -> int:
    """``trn_X_Y.txt``: header ``n L`` then rows of ``id:1.0``; returns the nnz written."""
    rng = np.random.default_rng(seed)
    nnz = 0
    with open(path, "w", encoding="utf-8") as f:
        f.write(f"{n} {L}\n")
        for start in range(0, n, CHUNK):
            counts, ids = _label_rows(rng, min(CHUNK, n - start), L, avg)
            toks = pc.binary_join_element_wise(pc.cast(pa.array(ids), pa.string()), "1.0", ":")
            rows = _joined(toks, counts, " ").to_pylist()
            f.write("\n".join(rows) + "\n")
            nnz += len(ids)
    return nnz


def gen_lf(folder: Path, n: int, n_test: int, L: int, avg: float, seed: int) -> None:
    """``trn.json.gz``, ``tst.json.gz``, ``lbl.json.gz`` (gzip level 1) with short random titles."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)

    def titles(m: int):
        w = rng.integers(0, 50_000, (m, 3))
        return pc.binary_join_element_wise(*(pc.cast(pa.array(w[:, j]), pa.string()) for j in range(3)), " w")

    with gzip.open(folder / "lbl.json.gz", "wt", encoding="utf-8", compresslevel=1) as f:
        for start in range(0, L, CHUNK):
            m = min(CHUNK, L - start)
            uid = pc.cast(pa.array(np.arange(start, start + m)), pa.string())
            lines = pc.binary_join_element_wise('{"uid": "L', uid, '", "title": "w', titles(m), '", "content": ""}',
                                                "")
            f.write("\n".join(lines.to_pylist()) + "\n")
    for name, rows in (("trn.json.gz", n), ("tst.json.gz", n_test)):
        with gzip.open(folder / name, "wt", encoding="utf-8", compresslevel=1) as f:
            for start in range(0, rows, CHUNK):
                m = min(CHUNK, rows - start)
                counts, ids = _label_rows(rng, m, L, avg)
                ind = _joined(pc.cast(pa.array(ids), pa.string()), counts, ", ")
                rel = _joined(pa.array(np.full(len(ids), "1.0", dtype=object), pa.string()), counts, ", ")
                uid = pc.cast(pa.array(np.arange(start, start + m)), pa.string())
                lines = pc.binary_join_element_wise(
                    '{"uid": "P', uid, '", "title": "w', titles(m), '", "content": "", "target_ind": [', ind,
                    '], "target_rel": [', rel, "]}", "")
                f.write("\n".join(lines.to_pylist()) + "\n")


def gen_bow(path: Path, n: int, D: int, nnz: int, L: int, seed: int) -> None:
    """Legacy BoW ``N D L`` file; every row has 1-5 labels and ``nnz`` distinct sorted features (as sklearn needs)."""
    rng = np.random.default_rng(seed)
    with open(path, "w", encoding="utf-8") as f:
        f.write(f"{n} {D} {L}\n")
        for start in range(0, n, CHUNK):
            m = min(CHUNK, n - start)
            lc = rng.integers(1, 6, m)
            labs = _joined(pc.cast(pa.array(rng.integers(0, L, int(lc.sum()))), pa.string()), lc, ",")
            start_f = rng.integers(0, D, (m, 1))
            step = rng.integers(1, max(2, D // nnz), (m, 1))
            feats = np.sort((start_f + step * np.arange(nnz)) % D, axis=1).ravel()  # sorted, unique per row
            vals = np.round(rng.random(m * nnz), 4)
            toks = pc.binary_join_element_wise(pc.cast(pa.array(feats), pa.string()),
                                               pc.cast(pa.array(vals), pa.string()), ":")
            rows = pc.binary_join_element_wise(labs, _joined(toks, np.full(m, nnz), " "), " ")
            f.write("\n".join(rows.to_pylist()) + "\n")


# ---------------------------------------------------------------------------------------- workers

def _csr_from_lists(lists, L: int) -> sp.csr_matrix:
    counts = np.fromiter((len(x) for x in lists), dtype=np.int64, count=len(lists))
    indptr = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(counts, out=indptr[1:])
    ids = np.fromiter((i for x in lists for i in x), dtype=np.int64, count=int(indptr[-1]))
    return sp.csr_matrix((np.ones(len(ids), np.float32), ids, indptr), shape=(len(lists), L))


# Each reader returns (rows, parse seconds): the clock starts after its imports and stops while its results are
# still alive. The baselines import pandas / sklearn inside their function so that only their own child
# process pays those imports' time and memory.

def _ours_split_sparse(p: Path, extra: list[str]) -> tuple[int, float]:
    t = time.perf_counter()
    m = read_sparse_file(p)
    return m.shape[0], time.perf_counter() - t


def _pandas_split_sparse(p: Path, extra: list[str]) -> tuple[int, float]:
    import pandas as pd

    t = time.perf_counter()
    with open(p, encoding="utf-8") as f:
        n_rows, n_cols = map(int, f.readline().split())
    df = pd.read_csv(p, skiprows=1, header=None, names=["row"], sep="\t", dtype=str, skip_blank_lines=False,
                     keep_default_na=False)
    toks = df["row"].str.split()
    counts = toks.str.len().to_numpy()
    pairs = toks.explode().dropna().str.split(":", expand=True)
    ids = pairs[0].astype(np.int64).to_numpy()
    vals = pairs[1].astype(np.float32).to_numpy()
    indptr = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(counts, out=indptr[1:])
    m = sp.csr_matrix((vals, ids, indptr), shape=(n_rows, n_cols))
    return m.shape[0], time.perf_counter() - t


def _pandas_split_sparse_chunked(p: Path, extra: list[str]) -> tuple[int, float]:
    import pandas as pd

    t = time.perf_counter()
    with open(p, encoding="utf-8") as f:
        n_rows, n_cols = map(int, f.readline().split())
    parts_c, parts_i, parts_v = [], [], []
    for df in pd.read_csv(p, skiprows=1, header=None, names=["row"], sep="\t", dtype=str,
                          skip_blank_lines=False, keep_default_na=False, chunksize=65_536):
        toks = df["row"].str.split()
        parts_c.append(toks.str.len().to_numpy())
        pairs = toks.explode().dropna().str.split(":", expand=True)
        parts_i.append(pairs[0].astype(np.int32).to_numpy())
        parts_v.append(pairs[1].astype(np.float32).to_numpy())
    counts = np.concatenate(parts_c)
    indptr = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(counts, out=indptr[1:])
    m = sp.csr_matrix((np.concatenate(parts_v), np.concatenate(parts_i), indptr), shape=(n_rows, n_cols))
    return m.shape[0], time.perf_counter() - t


def _ours_lf(p: Path, extra: list[str]) -> tuple[int, float]:
    L = int(extra[0])
    t = time.perf_counter()
    _texts, m = read_lf_points(p, L, ("title",))
    return m.shape[0], time.perf_counter() - t


def _ours_lf_linewise(p: Path, extra: list[str]) -> tuple[int, float]:
    L = int(extra[0])
    t = time.perf_counter()
    _texts, m = read_lf_points(p, L, ("title",), fast=False)
    return m.shape[0], time.perf_counter() - t


def _pandas_lf(p: Path, extra: list[str]) -> tuple[int, float]:
    import pandas as pd

    L = int(extra[0])
    t = time.perf_counter()
    df = pd.read_json(p, lines=True, compression="gzip")
    _texts = df["title"].tolist()
    m = _csr_from_lists(df["target_ind"].tolist(), L)
    return m.shape[0], time.perf_counter() - t


def _ours_lf_dataset(p: Path, extra: list[str]) -> tuple[int, float]:
    t = time.perf_counter()
    ds = read_dataset(p)
    return ds.num_train + ds.num_test + ds.num_labels, time.perf_counter() - t


def _ours_bow(p: Path, extra: list[str]) -> tuple[int, float]:
    t = time.perf_counter()
    X, Y = read_bow_file(p)
    return X.shape[0], time.perf_counter() - t


def _sklearn_bow(p: Path, extra: list[str]) -> tuple[int, float]:
    from sklearn.datasets import load_svmlight_file

    D = int(extra[0])
    t = time.perf_counter()
    # offset=1: seek past byte 0, then skip to the next newline, i.e. past the 'N D L' header line
    X, y = load_svmlight_file(str(p), n_features=D, multilabel=True, zero_based=True, offset=1,
                              dtype=np.float32)
    return X.shape[0], time.perf_counter() - t


WORKERS: dict[str, Callable[[Path, list[str]], tuple[int, float]]] = {
    "ours-split-sparse": _ours_split_sparse,
    "pandas-split-sparse": _pandas_split_sparse,
    "pandas-split-sparse-chunked": _pandas_split_sparse_chunked,
    "ours-lf": _ours_lf,
    "ours-lf-linewise": _ours_lf_linewise,
    "pandas-lf": _pandas_lf,
    "ours-lf-dataset": _ours_lf_dataset,
    "ours-bow": _ours_bow,
    "sklearn-bow": _sklearn_bow,
}


def worker(name: str, path: str, extra: list[str]) -> None:
    """Run one reader; print ``rows seconds`` (parse time only)."""
    if name not in WORKERS:
        raise SystemExit(f"unknown worker {name}")
    rows, seconds = WORKERS[name](Path(path), extra)
    print(rows, seconds)


def run_worker(name: str, path: Path, *extra: str, cap_gb: float | None = None) -> dict:
    """Run ``worker`` in a fresh interpreter; returns rows, seconds, peak RSS (GiB) or the failure."""
    cmd = [sys.executable, __file__, "--worker", name, str(path), *extra]

    def limit() -> None:
        if cap_gb:
            b = int(cap_gb * 2**30)
            resource.setrlimit(resource.RLIMIT_AS, (b, b))

    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=limit)
    out = p.stdout.read().decode()  # type: ignore[union-attr]
    err = p.stderr.read().decode()  # type: ignore[union-attr]
    _, status, ru = os.wait4(p.pid, 0)
    rss = ru.ru_maxrss / 2**20  # KiB -> GiB (Linux)
    if os.waitstatus_to_exitcode(status) != 0:
        return {"name": name, "error": (err.strip().splitlines() or ["?"])[-1][:120], "rss": rss}
    rows, secs = out.split()
    return {"name": name, "rows": int(rows), "secs": float(secs), "rss": rss}


# ------------------------------------------------------------------------------------------- main

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--points", type=int, default=2_248_619)
    ap.add_argument("--labels", type=int, default=1_305_265)
    ap.add_argument("--avg", type=float, default=22.2, help="average labels per point")
    ap.add_argument("--test-points", type=int, default=100_000, help="rows of tst.json.gz (full-layout run)")
    ap.add_argument("--bow-rows", type=int, default=500_000)
    ap.add_argument("--bow-features", type=int, default=100_000)
    ap.add_argument("--bow-nnz", type=int, default=10)
    ap.add_argument("--bow-labels", type=int, default=10_000)
    ap.add_argument("--baseline-cap-gb", type=float, default=20.0, help="address-space cap of baseline children")
    ap.add_argument("--skip", default="", help="comma-separated layouts to skip: split-sparse,lf,bow")
    ap.add_argument("--linewise", action="store_true", help="also time the line-by-line LF reader")
    ap.add_argument("--keep", type=Path, default=None, help="generate into (or reuse) this folder and keep it")
    ap.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        worker(a.worker[0], a.worker[1], a.worker[2:])
        return
    skip = set(filter(None, a.skip.split(",")))
    tmp = a.keep or Path(tempfile.mkdtemp(prefix="xc-ingest-bench-"))
    tmp.mkdir(parents=True, exist_ok=True)
    results: list[tuple[str, str, dict, float]] = []
    try:
        if "split-sparse" not in skip:
            f = tmp / "split" / "trn_X_Y.txt"
            if not f.is_file():
                f.parent.mkdir(parents=True, exist_ok=True)
                t = time.time()
                gen_split_sparse(f, a.points, a.labels, a.avg, 0)
                print(f"generated {f} ({f.stat().st_size / 1e6:.0f} MB) in {time.time() - t:.0f}s", flush=True)
            mb = f.stat().st_size / 1e6
            for w in ("ours-split-sparse", "pandas-split-sparse-chunked", "pandas-split-sparse"):
                r = run_worker(w, f, cap_gb=None if w.startswith("ours") else a.baseline_cap_gb)
                results.append(("split-sparse `trn_X_Y.txt`", w, r, mb))
                print(r, flush=True)
        if "lf" not in skip:
            d = tmp / "lf"
            if not (d / "trn.json.gz").is_file():
                t = time.time()
                gen_lf(d, a.points, a.test_points, a.labels, a.avg, 1)
                print(f"generated {d} in {time.time() - t:.0f}s", flush=True)
            f = d / "trn.json.gz"
            mb = f.stat().st_size / 1e6
            names = ["ours-lf"] + (["ours-lf-linewise"] if a.linewise else []) + ["pandas-lf"]
            for w in names:
                r = run_worker(w, f, str(a.labels), cap_gb=None if w.startswith("ours") else a.baseline_cap_gb)
                results.append(("LF `trn.json.gz`", w, r, mb))
                print(r, flush=True)
            r = run_worker("ours-lf-dataset", d)
            results.append(("LF layout, whole folder (`read_dataset`)", "ours-lf-dataset", r,
                            sum(p.stat().st_size for p in d.iterdir()) / 1e6))
            print(r, flush=True)
        if "bow" not in skip:
            f = tmp / "bow" / "bench_train.txt"
            if not f.is_file():
                f.parent.mkdir(parents=True, exist_ok=True)
                t = time.time()
                gen_bow(f, a.bow_rows, a.bow_features, a.bow_nnz, a.bow_labels, 2)
                print(f"generated {f} ({f.stat().st_size / 1e6:.0f} MB) in {time.time() - t:.0f}s", flush=True)
            mb = f.stat().st_size / 1e6
            for w in ("ours-bow", "sklearn-bow"):
                r = run_worker(w, f, str(a.bow_features),
                               cap_gb=None if w.startswith("ours") else a.baseline_cap_gb)
                results.append(("BoW `*_train.txt`", w, r, mb))
                print(r, flush=True)
    finally:
        if a.keep is None:
            shutil.rmtree(tmp, ignore_errors=True)
    print("\n| layout (file) | reader | file MB | rows | seconds | rows/s | peak RSS GiB |")
    print("|---|---|---|---|---|---|---|")
    for layout, w, r, mb in results:
        if "error" in r:
            print(f"| {layout} | {w} | {mb:.0f} | failed: {r['error']} | | | {r['rss']:.2f} |")
        else:
            print(f"| {layout} | {w} | {mb:.0f} | {r['rows']:,} | {r['secs']:.1f} | {r['rows'] / r['secs']:,.0f} "
                  f"| {r['rss']:.2f} |")


if __name__ == "__main__":
    main()
