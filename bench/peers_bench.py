"""Peer baselines on exactly the splits the pipeline uses: Omikuji, napkinXC and the untrained encoder.

  python bench/peers_bench.py --dataset wordnet-titles [--methods omikuji,napkinxc,zeroshot] \
      [--threads 2] [--out bench/results/peers_wordnet_titles.json]

Datasets: ``wordnet-titles`` (LF-WordNetNouns, point text = title), ``wordnet-full`` (title + content), both
from the embedded ``builtin:LF-WordNetNouns`` folder with label text = label title (the pipeline's default
``ingest.label_text``); ``lf-titles``: any LF raw-text folder given by ``--lf-dir PATH`` (point and label text
= title), e.g. a cut made by ``bench/make_subset.py``; ``features``: any BoW folder (``bow`` or ``bow-single``
layout, with or without its vocabulary) given by ``--features-dir PATH``; the Mulan BoW sets ``bibtex`` and
``delicious``, read from ``--bibtex-dir`` / ``--delicious-dir`` (default ``../shared/data/<Name>/xc_format`` next
to the repository). ``all`` runs wordnet-titles, wordnet-full, bibtex and delicious. Propensity A/B = 0.55/1.5 for all.

Each method trains on the whole train split and is evaluated on the test split, as the pipeline's evaluate
stage is (the pipeline additionally holds out up to 5% of train to fit its score fusion; the peers have no
fusion, so they train on all of it). The dataset's test filter pairs are removed from the top-100 predictions
before the top-k is taken (and ``evaluate`` is given them too); propensities from Y_train.

Methods (optional dependencies: ``pip install -e '.[bench]'``):

- ``omikuji``: Omikuji with its default hyper-parameters, which are Parabel's (3 trees, balanced 2-means,
  leaves of at most 100 labels, squared-hinge linear nodes, C = 1) on TF-IDF features: unigrams + bigrams of
  the point texts (sklearn ``TfidfVectorizer``, ``sublinear_tf``, ``min_df``), L2-normalised rows; for BoW
  datasets the shipped features through ``TfidfTransformer`` instead. Beam 10, top 100 per test point.
- ``napkinxc``: napkinXC's PLT (hierarchical 2-means tree, logistic nodes) on the same features, top 100.
- ``zeroshot``: the packaged all-MiniLM-L6-v2 (mean pooling, unit vectors) with no training: test and label
  texts tokenized as the pipeline does (max_len 32 titles / 128 full text), exact inner-product top 100.

Writes one JSON with every metric of ``xc_dagster.evaluation.metrics.evaluate`` and the timings, and prints a table.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import date
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from xc_dagster.catalog import builtin_path
from xc_dagster.data import XCDataset, read_dataset
from xc_dagster.evaluation.metrics import evaluate, inverse_propensity, remove_filtered

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, for bench.peer_features
from bench.peer_features import tfidf_features, write_xc_file  # noqa: E402

KS = (1, 3, 5)
TOPK = 100  # predictions kept per test point (--topk); metrics need max(KS) + filter pairs per row
SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"  # the data folder next to the repository


@dataclass(frozen=True)
class Bench:
    """One benchmark dataset: how to read it and the options the pipeline would use."""

    key: str
    name: str  # the catalog / registry name
    text_fields: tuple[str, ...]
    max_len: int
    propensity: tuple[float, float] = (0.55, 1.5)
    # "builtin" (embedded LF-WordNetNouns), "bow" (--<key>-dir), "lf-dir" (--lf-dir), "features-dir" (--features-dir)
    source: str = "builtin"


BENCHES = {
    "wordnet-titles": Bench("wordnet-titles", "LF-WordNetNounsTitles", ("title",), 32),
    "wordnet-full": Bench("wordnet-full", "LF-WordNetNouns", ("title", "content"), 128),
    "lf-titles": Bench("lf-titles", "", ("title",), 32, source="lf-dir"),  # named after the --lf-dir folder
    "features": Bench("features", "", ("title",), 128, source="features-dir"),  # named after --features-dir
    "bibtex": Bench("bibtex", "Bibtex", ("title",), 128, source="bow"),
    "delicious": Bench("delicious", "Delicious", ("title",), 128, source="bow"),
}
ALL = ("wordnet-titles", "wordnet-full", "bibtex", "delicious")  # --dataset all
METHODS = ("omikuji", "napkinxc", "zeroshot")


def load(bench: Bench, args: argparse.Namespace) -> tuple[XCDataset, str, Path]:
    """The dataset, its name in the report and the folder it was read from."""
    if bench.source == "bow":
        folder = getattr(args, f"{bench.key}_dir")
        return read_dataset(folder), bench.name, folder
    if bench.source == "features-dir":
        return read_dataset(args.features_dir), args.features_dir.name, args.features_dir
    folder, name = (args.lf_dir, args.lf_dir.name) if bench.source == "lf-dir" else \
        (builtin_path("LF-WordNetNouns"), bench.name)
    return read_dataset(folder, text_fields=bench.text_fields, label_text_fields=("title",)), name, folder


# ------------------------------------------------------------------------------------------ features

def pad_lists(preds: list[list[tuple[int, float]]], k: int) -> tuple[np.ndarray, np.ndarray]:
    """Lists of (label, score) -> (n, k) ids (-1 padded) and scores (-inf padded)."""
    ids = np.full((len(preds), k), -1, dtype=np.int64)
    sc = np.full((len(preds), k), -np.inf, dtype=np.float32)
    for i, row in enumerate(preds):
        row = row[:k]
        if row:
            ids[i, :len(row)] = [int(lab) for lab, _ in row]
            sc[i, :len(row)] = [float(s) for _, s in row]
    return ids, sc


# ------------------------------------------------------------------------------------------- methods

@contextlib.contextmanager
def stderr_to(path: Path) -> Iterator[None]:
    """Send file descriptor 2 (Omikuji's Rust progress bars) to ``path``; its tail is shown on failure."""
    sys.stderr.flush()
    saved = os.dup(2)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 2)
    os.close(fd)
    try:
        yield
    except BaseException:
        os.dup2(saved, 2)
        sys.stderr.write(path.read_text(errors="replace")[-3000:])
        raise
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def run_omikuji(Xtr, Ytr, Xte, threads: int, tmp: Path, topk: int = TOPK) -> tuple[np.ndarray, np.ndarray, dict]:
    import omikuji

    path = tmp / "omikuji_train.txt"
    t0 = time.perf_counter()
    write_xc_file(path, Xtr, Ytr)
    t_write = time.perf_counter() - t0
    hp = omikuji.Model.default_hyper_param()  # Parabel's settings
    t0 = time.perf_counter()
    with stderr_to(tmp / "omikuji_train.log"):
        model = omikuji.Model.train_on_data(str(path), hp, n_threads=threads)
    t_train = time.perf_counter() - t0
    model.init_prediction_thread_pool(threads)
    t0 = time.perf_counter()
    preds = []
    for i in range(Xte.shape[0]):
        s, e = Xte.indptr[i], Xte.indptr[i + 1]
        preds.append(model.predict(list(zip(Xte.indices[s:e].tolist(), Xte.data[s:e].tolist())),
                                   beam_size=10, top_k=topk))
    t_pred = time.perf_counter() - t0
    ids, sc = pad_lists(preds, topk)
    hp_d = {a: getattr(hp, a) for a in dir(hp) if not a.startswith("_")}
    return ids, sc, {"train_seconds": t_train, "predict_seconds": t_pred, "write_data_seconds": t_write,
                     "hyper_param": {k: (round(v, 6) if isinstance(v, float) else v) for k, v in hp_d.items()},
                     "beam_size": 10}


def run_napkinxc(Xtr, Ytr, Xte, threads: int, tmp: Path, topk: int = TOPK) -> tuple[np.ndarray, np.ndarray, dict]:
    from napkinxc.models import PLT

    Y_lists = [Ytr.indices[Ytr.indptr[i]:Ytr.indptr[i + 1]].tolist() for i in range(Ytr.shape[0])]
    model = PLT(str(tmp / "napkinxc_plt"), threads=threads, seed=0)
    t0 = time.perf_counter()
    model.fit(Xtr, Y_lists)
    t_train = time.perf_counter() - t0
    t0 = time.perf_counter()
    preds = model.predict_proba(Xte, top_k=topk)
    t_pred = time.perf_counter() - t0
    ids, sc = pad_lists(preds, topk)
    return ids, sc, {"train_seconds": t_train, "predict_seconds": t_pred,
                     "params": "PLT defaults: hierarchicalKmeans arity 2, max_leaves 100, loss log, liblinear "
                               "C 10, weights_threshold 0.1, exact tree search; seed 0"}


def run_zeroshot(ds: XCDataset, max_len: int, threads: int, tmp: Path,
                 topk: int = TOPK) -> tuple[np.ndarray, np.ndarray, dict]:
    import torch

    from xc_dagster.device import amp_dtype
    from xc_dagster.encoders.encode import encode_tokens
    from xc_dagster.encoders.loading import load_encoder
    from xc_dagster.encoders.tokenizer import load_tokenizer, load_tokens, tokenize_to_npy
    from xc_dagster.retrieval.ann import exact_topk

    device = torch.device("cpu")
    dtype = amp_dtype(device, "auto")  # as the pipeline: bf16 on CPUs with bf16 units
    tok = load_tokenizer("minilm")
    encoder = load_encoder("minilm")
    t0 = time.perf_counter()
    lens = {}
    for split, texts in (("test", ds.test_texts), ("label", ds.label_texts)):
        lens[split] = tokenize_to_npy(tok, texts, max_len, tmp / f"{split}_ids.npy", tmp / f"{split}_len.npy")
    t_tok = time.perf_counter() - t0
    t0 = time.perf_counter()
    label_emb = encode_tokens(encoder, *load_tokens(tmp / "label_ids.npy", tmp / "label_len.npy"), device, dtype)
    t_label = time.perf_counter() - t0
    t0 = time.perf_counter()
    test_emb = encode_tokens(encoder, *load_tokens(tmp / "test_ids.npy", tmp / "test_len.npy"), device, dtype)
    t_test = time.perf_counter() - t0
    t0 = time.perf_counter()
    sc, ids = exact_topk(test_emb, label_emb, topk, device=device)
    t_search = time.perf_counter() - t0
    return ids, sc, {"train_seconds": 0.0, "label_encode_seconds": t_label, "tokenize_seconds": t_tok,
                     "test_encode_seconds": t_test, "search_seconds": t_search,
                     "predict_seconds": t_test + t_search, "amp": str(dtype), "max_len": max_len,
                     "token_stats": lens, "torch_threads": torch.get_num_threads()}


# ------------------------------------------------------------------------------------------ driver

def score(ds: XCDataset, ids: np.ndarray, sc: np.ndarray, inv_prop: np.ndarray) -> dict[str, float]:
    ids, sc = remove_filtered(ids, sc, ds.filter_test)  # filter pairs out before the top-k
    return evaluate(ids, ds.Y_test, ks=KS, inv_prop=inv_prop, filter_pairs=ds.filter_test, scores=sc)


def run_bench(bench: Bench, methods: list[str], args: argparse.Namespace) -> dict[str, Any]:
    t0 = time.perf_counter()
    ds, name, folder = load(bench, args)
    out: dict[str, Any] = {"dataset": name, "key": bench.key, "folder": str(folder),
                           "read_seconds": time.perf_counter() - t0,
                           "stats": {"n_train": ds.num_train, "n_test": ds.num_test, "n_labels": ds.num_labels,
                                     "filter_test_pairs": len(ds.filter_test), "layout": ds.layout},
                           "propensity": list(bench.propensity), "methods": {}}
    inv_prop = inverse_propensity(ds.Y_train, *bench.propensity)
    print(f"== {name}: {ds.num_train} train / {ds.num_test} test / {ds.num_labels} labels, "
          f"{len(ds.filter_test)} test filter pairs", flush=True)
    feats = None
    for m in methods:
        with tempfile.TemporaryDirectory() as tmpd:
            tmp = Path(tmpd)
            info: dict[str, Any] = {"started": time.strftime("%Y-%m-%dT%H:%M:%S")}
            cpu0, wall0 = time.process_time(), time.perf_counter()
            if m in ("omikuji", "napkinxc"):
                if feats is None:
                    t1 = time.perf_counter()
                    feats = tfidf_features(ds, args.min_df)
                    feats[2]["seconds"] = time.perf_counter() - t1
                Xtr, Xte, finfo = feats
                info["features"] = finfo
                runner: Callable = run_omikuji if m == "omikuji" else run_napkinxc
                try:
                    ids, sc, rinfo = runner(Xtr, ds.Y_train, Xte, args.threads, tmp, args.topk)
                except ImportError as exc:
                    print(f"  {m}: not installed ({exc}); pip install -e '.[bench]'")
                    out["methods"][m] = {"error": f"not installed: {exc}"}
                    continue
                if args.repeats > 1:  # tree building is randomised (Omikuji takes no seed): re-train, report spread
                    runs = [{"metrics": score(ds, ids, sc, inv_prop), "train_seconds": rinfo["train_seconds"],
                             "predict_seconds": rinfo["predict_seconds"]}]
                    for _ in range(args.repeats - 1):
                        i2, s2, r2 = runner(Xtr, ds.Y_train, Xte, args.threads, tmp, args.topk)
                        runs.append({"metrics": score(ds, i2, s2, inv_prop), "train_seconds": r2["train_seconds"],
                                     "predict_seconds": r2["predict_seconds"]})
                    info["repeats"] = runs
                    info["repeat_spread"] = {
                        k: {"mean": float(np.mean([r["metrics"][k] for r in runs])),
                            "std": float(np.std([r["metrics"][k] for r in runs], ddof=1)),
                            "min": float(min(r["metrics"][k] for r in runs)),
                            "max": float(max(r["metrics"][k] for r in runs))}
                        for k in ("precision_at_1", "precision_at_5", "psprecision_at_1", "psprecision_at_5")}
            else:
                ids, sc, rinfo = run_zeroshot(ds, bench.max_len, args.threads, tmp, args.topk)
            info.update(rinfo)
            # process CPU seconds (all threads) next to wall seconds: on a shared machine the ratio shows how
            # much of the wall time the method actually had the CPU (about `threads` x wall when alone)
            info["method_wall_seconds"] = time.perf_counter() - wall0
            info["method_cpu_seconds"] = time.process_time() - cpu0
            t1 = time.perf_counter()
            info["metrics"] = score(ds, ids, sc, inv_prop)
            info["evaluate_seconds"] = time.perf_counter() - t1
            info["ms_per_query"] = 1000.0 * info["predict_seconds"] / max(ds.num_test, 1)
            out["methods"][m] = info
            mt = info["metrics"]
            print(f"  {m:9s} P@1 {100 * mt['precision_at_1']:.2f}  P@5 {100 * mt['precision_at_5']:.2f}  "
                  f"PSP@1 {100 * mt['psprecision_at_1']:.2f}  train {info['train_seconds']:.1f}s  "
                  f"predict {info['predict_seconds']:.1f}s  (cpu {info['method_cpu_seconds']:.0f}s over "
                  f"{info['method_wall_seconds']:.0f}s wall)", flush=True)
            if "repeat_spread" in info:
                print("            over " + str(len(info["repeats"])) + " trainings: " + "  ".join(
                    f"{k} {100 * v['mean']:.2f} +- {100 * v['std']:.2f} [{100 * v['min']:.2f}, {100 * v['max']:.2f}]"
                    for k, v in info["repeat_spread"].items()), flush=True)
    return out


def pkg_version(name: str) -> str | None:
    try:
        return version(name)
    except PackageNotFoundError:
        return None


def table(results: list[dict[str, Any]]) -> str:
    cols = [("P@1", "precision_at_1"), ("P@3", "precision_at_3"), ("P@5", "precision_at_5"),
            ("PSP@1", "psprecision_at_1"), ("PSP@3", "psprecision_at_3"), ("PSP@5", "psprecision_at_5"),
            ("nDCG@5", "ndcg_at_5"), ("cov@5", "coverage_at_5")]
    head = "| dataset | method | " + " | ".join(c for c, _ in cols) + " | train s | predict s | ms/query |"
    lines = [head, "|" + "---|" * (len(cols) + 5)]
    for r in results:
        for m, info in r["methods"].items():
            if "metrics" not in info:
                lines.append(f"| {r['dataset']} | {m} | {info.get('error', '')} |")
                continue
            mt = info["metrics"]
            vals = " | ".join(f"{100 * mt[k]:.2f}" if k in mt else "-" for _, k in cols)
            lines.append(f"| {r['dataset']} | {m} | {vals} | {info['train_seconds']:.1f} | "
                         f"{info['predict_seconds']:.1f} | {info['ms_per_query']:.2f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dataset", choices=[*BENCHES, "all"], default="wordnet-titles",
                    help=f"'all' = {', '.join(ALL)}")
    ap.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated subset of {','.join(METHODS)}")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--min-df", type=int, default=2, help="TfidfVectorizer min_df for the text datasets")
    ap.add_argument("--topk", type=int, default=TOPK, help="predictions per test point (napkinXC's PLT "
                    "search time grows with it)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="train omikuji/napkinxc this many times (first run is the table's; spread in the JSON)")
    for b in BENCHES.values():
        if b.source == "bow":
            ap.add_argument(f"--{b.key}-dir", type=Path, default=SHARED_DATA / b.name / "xc_format",
                            help=f"the {b.name} BoW folder (default: %(default)s)")
    ap.add_argument("--lf-dir", type=Path, help="LF raw-text folder of --dataset lf-titles")
    ap.add_argument("--features-dir", type=Path, help="BoW folder of --dataset features")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    bad = [m for m in methods if m not in METHODS]
    if bad:
        ap.error(f"unknown methods {bad}; choose from {METHODS}")
    if args.dataset == "lf-titles" and args.lf_dir is None:
        ap.error("--dataset lf-titles needs --lf-dir PATH")
    if args.dataset == "features" and args.features_dir is None:
        ap.error("--dataset features needs --features-dir PATH")
    import torch

    torch.set_num_threads(args.threads)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    keys = list(ALL) if args.dataset == "all" else [args.dataset]
    t0 = time.perf_counter()
    results = []
    for key in keys:
        ms = [m for m in methods if not (BENCHES[key].source in ("bow", "features-dir") and m == "zeroshot")]
        if len(ms) < len(methods):
            print(f"zeroshot skipped on {key}: its text is rebuilt from a vocabulary, labels are tags")
        results.append(run_bench(BENCHES[key], ms, args))
    report = {
        "date": date.today().isoformat(), "command_args": vars(args),  # paths: json's default=str
        "machine": {"platform": platform.platform(), "processor": platform.processor(),
                    "cpu_count": os.cpu_count(), "threads": args.threads},
        "versions": {p: pkg_version(p) for p in ("omikuji", "napkinxc", "scikit-learn", "torch", "numpy")},
        "protocol": {"train": "whole train split", "test": "test split", "filters": "test filter pairs removed",
                     "topk_predicted": args.topk, "ks": list(KS)},
        "total_seconds": time.perf_counter() - t0,
        "results": results,
    }
    print()
    print(table(results))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2, default=str))
        print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
