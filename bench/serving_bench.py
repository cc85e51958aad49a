"""Latency and throughput of the served model's inference path (``xc_dagster.serving``) on the CPU.

Two parts, timed separately, as ``predict_topk`` runs them:

* encoder: tokenize + encode short texts with MiniLM-L6 (the packaged default; untrained weights are as
  fast as trained ones), single query and batches;
* index + fusion (``serving.rank``): two faiss HNSW searches (over W and over the label embeddings), exact
  re-scoring of the union, fusion (alpha and NGAME's depth-7 tree), top-k.

Label sets:

* ``--labels 21k``: the embedded LF-WordNetNouns labels (21,523): label embeddings = MiniLM embeddings of
  the label titles, W = those plus noise (the classifier stage starts from the label embeddings), queries =
  MiniLM embeddings of test titles; or a real model with ``--model-uri models:/xc-<dataset>@champion``;
* ``--labels N`` (e.g. 1000000): N random unit vectors (dim 384) as label embeddings, W = them plus noise,
  queries = noisy copies of random labels. Uniform random vectors are HNSW's hard case (no cluster
  structure), so the recall figures are pessimistic.

For each ``--settings shortlist:efSearch`` it reports p50/p99 single-query latency, batch throughput and the
recall of the final top-10 against exhaustive alpha-fused scoring of every label.

  python bench/serving_bench.py --labels 21k --out bench/results/serving_21k.json
  python bench/serving_bench.py --labels 1000000 --cache /tmp/xc-serving-bench --encoder none \\
      --settings 100:200 100:100 50:64 --out bench/results/serving_1m.json
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import platform
import time
from pathlib import Path

import numpy as np
import torch

from xc_dagster import serving
from xc_dagster.ann import LabelIndex
from xc_dagster.fusion import AlphaFusion, TreeFusion
from xc_dagster.predict import ShortlistSources, topk_from_scores

DATA = Path(__file__).resolve().parents[1] / "xc_dagster" / "builtin_data" / "LF-WordNetNouns"


def _titles(name: str) -> list[str]:
    with gzip.open(DATA / name, "rt") as fh:
        return [json.loads(line)["title"] for line in fh]


def _unit(x: np.ndarray) -> np.ndarray:
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def set_threads(n: int) -> None:
    """torch intra-op threads and faiss OpenMP threads (1 = one query per core, as one server worker)."""
    import faiss

    torch.set_num_threads(n)
    faiss.omp_set_num_threads(n)


def _noise(rng: np.random.Generator, shape: tuple[int, int], norm: float) -> np.ndarray:
    """Gaussian noise whose rows have about the given L2 norm."""
    return (norm / np.sqrt(shape[1]) * rng.standard_normal(shape, dtype=np.float32)).astype(np.float32)


def _stats(times_s: list[float]) -> dict[str, float]:
    t = np.asarray(times_s) * 1000
    return {"p50_ms": float(np.percentile(t, 50)), "p99_ms": float(np.percentile(t, 99)),
            "mean_ms": float(t.mean()), "n": int(len(t))}


def single_latency(fn, items, warmup: int = 20) -> dict[str, float]:
    for x in items[:warmup]:
        fn(x)
    out = []
    for x in items:
        t0 = time.perf_counter()
        fn(x)
        out.append(time.perf_counter() - t0)
    return _stats(out)


def throughput(fn, batch, repeat: int = 3) -> dict[str, float]:
    fn(batch[: min(len(batch), 64)])  # warm-up
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn(batch)
        best = min(best, time.perf_counter() - t0)
    return {"batch": len(batch), "seconds": best, "per_s": len(batch) / best, "ms_per_query": 1000 * best / len(batch)}


def random_tree(num_labels: int, depth: int = 7, seed: int = 0) -> TreeFusion:
    """A full depth-7 tree on (embedding score, classifier score, inverse propensity), random thresholds:
    the same scoring work as a fitted one (a fitted tree is usually smaller)."""
    rng = np.random.default_rng(seed)
    n_inner, n = 2 ** depth - 1, 2 ** (depth + 1) - 1
    left = np.full(n, -1)
    right = np.full(n, -1)
    left[:n_inner], right[:n_inner] = 2 * np.arange(n_inner) + 1, 2 * np.arange(n_inner) + 2
    feature = np.full(n, -2)
    feature[:n_inner] = rng.integers(0, 3, n_inner)
    threshold = np.where(feature == 2, rng.uniform(1, 5, n), rng.uniform(-0.2, 0.6, n))
    threshold[n_inner:] = -2.0
    return TreeFusion(left, right, feature, threshold, rng.uniform(0, 1, n), depth, num_labels)


def build_index(vectors: np.ndarray, path: Path | None, m: int, efc: int) -> tuple[LabelIndex, float, bool]:
    """Build an HNSW index (or load it from ``path`` when a previous run saved it there)."""
    if path is not None and path.exists():
        return LabelIndex.load(path, "hnsw"), 0.0, True
    t0 = time.perf_counter()
    idx = LabelIndex("hnsw", vectors, m=m, ef_construction=efc)
    secs = time.perf_counter() - t0
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        idx.save(path)
    idx._vectors = None  # the faiss index holds its own copy
    return idx, secs, False


def exact_alpha_top(queries: np.ndarray, W: np.ndarray, E: np.ndarray, alpha: float, k: int) -> np.ndarray:
    """Exhaustive alpha-fused top-k over every label (the recall reference)."""
    out = []
    for s in range(0, len(queries), 64):
        q = torch.from_numpy(queries[s:s + 64])
        sc = alpha * (q @ torch.from_numpy(W).T) + (1 - alpha) * (q @ torch.from_numpy(E).T)
        out.append(torch.topk(sc, k, dim=1).indices.numpy())
    return np.concatenate(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--labels", default="21k", help="21k (LF-WordNetNouns label set) or a number of random labels")
    ap.add_argument("--model-uri", help="a registered model (models:/NAME@champion) instead of generated vectors")
    ap.add_argument("--tracking-uri", default=os.environ.get("MLFLOW_TRACKING_URI", ""))
    ap.add_argument("--dim", type=int, default=384)
    ap.add_argument("--hnsw-m", type=int, default=32)
    ap.add_argument("--efc", type=int, default=200)
    ap.add_argument("--settings", nargs="+", default=["100:200"], help="shortlist:efSearch pairs to time")
    ap.add_argument("--queries", type=int, default=1000, help="single queries timed")
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--k", type=int, default=10)
    ap.add_argument("--alpha", type=float, default=0.8)
    ap.add_argument("--encoder", default="minilm", help="encoder to time (none: skip the encoder part)")
    ap.add_argument("--amp", default="auto", help="encoder autocast: auto (bf16 where the CPU has it) | off")
    ap.add_argument("--cache", type=Path, help="folder to save/load the generated vectors and indexes")
    ap.add_argument("--single-threads", type=int, default=1, help="threads while timing single queries")
    ap.add_argument("--batch-threads", type=int, default=os.cpu_count(), help="threads while timing batches")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()

    from xc_dagster.device import amp_dtype
    from xc_dagster.encoder import load_encoder, load_tokenizer

    rng = np.random.default_rng(args.seed)
    dev = torch.device("cpu")
    report: dict = {"machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                                "torch_threads": torch.get_num_threads(), "python": platform.python_version(),
                                "torch": torch.__version__},
                    "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}}
    test_texts = _titles("tst.json.gz")
    qtexts = [test_texts[i] for i in rng.choice(len(test_texts), max(args.queries, args.batch), replace=False)]

    encoder = tokenizer = None
    dtype = amp_dtype(dev, args.amp)
    if args.encoder != "none" or (args.labels == "21k" and not args.model_uri):
        encoder = load_encoder(args.encoder if args.encoder != "none" else "minilm").eval()
        tokenizer = load_tokenizer(args.encoder if args.encoder != "none" else "minilm")

    cache = args.cache
    if args.model_uri:
        bundle = serving.load_served_bundle(args.model_uri, args.tracking_uri, "cpu")
        W, E = bundle.W, bundle.sources.label_repr
        queries = serving.encode_texts(qtexts, bundle)
        report["labels"] = {"source": args.model_uri, "n": bundle.num_labels}
    else:
        if args.labels == "21k":
            label_texts = _titles("lbl.json.gz")
            tmp = serving.ServingBundle(encoder=encoder, tokenizer=tokenizer, max_len=32,
                                        sources=None,
                                        fusion=None, inv_prop=None, label_texts=None, shortlist_size=0, device=dev,
                                        dtype=dtype, batch_size=256, default_k=args.k)
            path = cache / f"E_21k_{args.encoder}.npy" if cache else None
            if path is not None and path.exists():
                E = np.load(path)
            else:
                t0 = time.perf_counter()
                E = serving.encode_texts(label_texts, tmp)
                report["label_encoding_s"] = time.perf_counter() - t0
                if path is not None:
                    path.parent.mkdir(parents=True, exist_ok=True)
                    np.save(path, E)
            queries = serving.encode_texts(qtexts, tmp)
            noise = 0.3
        else:
            n = int(float(args.labels))
            label_texts = [f"label {i}" for i in range(n)]
            path = cache / f"E_{n}_{args.dim}_{args.seed}.npy" if cache else None
            if path is not None and path.exists():
                E = np.load(path, mmap_mode="r")  # file-backed pages: reclaimable under memory pressure
            else:
                E = np.empty((n, args.dim), dtype=np.float32)
                for s in range(0, n, 100_000):
                    E[s:s + 100_000] = _unit(rng.standard_normal((min(100_000, n - s), args.dim), dtype=np.float32))
                if path is not None:
                    path.parent.mkdir(parents=True, exist_ok=True)
                    np.save(path, E)
            pick = rng.integers(0, n, max(args.queries, args.batch))
            queries = _unit(E[pick] + _noise(rng, (len(pick), args.dim), 1.0))  # cosine ~0.7 to its label
            noise = 0.3
        L = len(E)
        w_path = cache / f"W_{args.labels}_{args.dim}_{args.seed}.npy" if cache else None
        if w_path is not None and w_path.exists():
            W = np.load(w_path, mmap_mode="r")
        else:
            W = np.empty(E.shape, dtype=np.float32)
            g = np.random.default_rng(args.seed + 1)
            for s in range(0, L, 100_000):
                blk = np.asarray(E[s:s + 100_000])
                W[s:s + 100_000] = _unit(blk + _noise(g, blk.shape, noise))  # cosine ~0.96 to the label embedding
            if w_path is not None:
                np.save(w_path, W)
        tag = f"{args.labels}_{args.dim}_M{args.hnsw_m}_efc{args.efc}_{args.seed}"
        w_index, w_s, w_loaded = build_index(W, cache / f"W_{tag}.index" if cache else None, args.hnsw_m, args.efc)
        e_index, e_s, e_loaded = build_index(E, cache / f"E_{tag}.index" if cache else None, args.hnsw_m, args.efc)
        report["labels"] = {"source": "LF-WordNetNouns label titles (MiniLM)" if args.labels == "21k"
                            else "random unit vectors", "n": L, "dim": int(E.shape[1])}
        report["index_build"] = {"hnsw_m": args.hnsw_m, "ef_construction": args.efc,
                                 "W_seconds": None if w_loaded else w_s, "label_emb_seconds": None if e_loaded else e_s,
                                 "loaded_from_cache": w_loaded and e_loaded}
        print(f"index build (M={args.hnsw_m}, efC={args.efc}) over {L} x {E.shape[1]}: "
              f"W {w_s:.1f}s, label_emb {e_s:.1f}s" + (" (cached)" if w_loaded and e_loaded else ""), flush=True)
        bundle = serving.ServingBundle(
            encoder, tokenizer, 32, ShortlistSources(W, E, {"W": w_index, "label": e_index}), AlphaFusion(args.alpha),
            rng.uniform(1.0, 5.0, L), np.array(label_texts, dtype=object), 100, dev, dtype, 256, args.k)

    single_q = [queries[i:i + 1] for i in range(args.queries)]
    batch_q = queries[:args.batch]
    exact = exact_alpha_top(queries[:200], W, E, args.alpha, args.k)
    results = []
    for setting in args.settings:
        sl_size, efs = (int(x) for x in setting.split(":"))
        bundle.shortlist_size = sl_size
        for idx in bundle.sources.indexes.values():
            idx.ef_search = efs
        for name, fz in (("alpha", AlphaFusion(args.alpha)), ("tree", random_tree(len(W)))):
            bundle.fusion = fz
            set_threads(args.single_threads)
            lat = single_latency(lambda q: serving.rank(q, bundle, args.k), single_q)
            set_threads(args.batch_threads)
            thr = throughput(lambda q: serving.rank(q, bundle, args.k), batch_q)
            row = {"shortlist": sl_size, "ef_search": efs, "fusion": name, "single": lat, "batch": thr}
            if name == "alpha":
                got, _ = serving.rank(queries[:200], bundle, args.k)
                row["recall_at_k_vs_exhaustive"] = float(np.mean([len(set(a) & set(b)) / args.k
                                                                  for a, b in zip(got, exact)]))
            results.append(row)
            print(f"index+fusion shortlist {sl_size} efSearch {efs} {name}: p50 {lat['p50_ms']:.3f} ms, "
                  f"p99 {lat['p99_ms']:.3f} ms, batch {thr['per_s']:.0f} q/s"
                  + (f", top-{args.k} recall {row['recall_at_k_vs_exhaustive']:.3f}" if "recall_at_k_vs_exhaustive"
                     in row else ""), flush=True)
    report["index_fusion"] = results

    if encoder is not None and args.encoder != "none":
        bundle.encoder, bundle.tokenizer = encoder, tokenizer
        set_threads(args.single_threads)
        enc_lat = single_latency(lambda t: serving.encode_texts([t], bundle), qtexts[:min(args.queries, 300)])
        set_threads(args.batch_threads)
        enc_thr = throughput(lambda ts: serving.encode_texts(ts, bundle), qtexts[:args.batch])
        bundle.shortlist_size = int(args.settings[0].split(":")[0])
        for idx in bundle.sources.indexes.values():
            idx.ef_search = int(args.settings[0].split(":")[1])
        bundle.fusion = AlphaFusion(args.alpha)
        set_threads(args.single_threads)
        e2e_lat = single_latency(lambda t: serving.predict_topk([t], bundle, args.k), qtexts[:min(args.queries, 300)])
        set_threads(args.batch_threads)
        e2e_thr = throughput(lambda ts: serving.predict_topk(ts, bundle, args.k), qtexts[:args.batch])
        report["encoder"] = {"name": args.encoder, "autocast": str(dtype), "single": enc_lat, "batch": enc_thr,
                             "mean_tokens": float(np.mean([len(tokenizer(t)["input_ids"]) for t in qtexts[:500]]))}
        report["predict_topk"] = {"setting": args.settings[0], "single": e2e_lat, "batch": e2e_thr}
        print(f"encoder {args.encoder} ({dtype}): single p50 {enc_lat['p50_ms']:.2f} ms, p99 {enc_lat['p99_ms']:.2f} ms;"
              f" batch {enc_thr['per_s']:.0f} texts/s", flush=True)
        print(f"predict_topk end to end: single p50 {e2e_lat['p50_ms']:.2f} ms, p99 {e2e_lat['p99_ms']:.2f} ms; "
              f"batch {e2e_thr['per_s']:.0f} texts/s", flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
