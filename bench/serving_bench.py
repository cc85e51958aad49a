"""Latency and throughput of the served model's inference path (``xc_dagster.serving``) on the CPU.

Two parts, timed separately, as ``predict_topk`` runs them:

* encoder: tokenize + encode short texts with MiniLM-L6 (the packaged default; untrained weights are as
  fast as trained ones), single query and batches;
* index + fusion (``serving_bundle.rank``): two faiss HNSW searches (over W and over the label embeddings), exact
  re-scoring of the union, fusion (alpha and NGAME's depth-7 tree), top-k.

Label sets:

* ``--labels 21k``: the embedded LF-WordNetNouns labels (21,523): label embeddings = MiniLM embeddings of
  the label titles, W = those plus noise (the classifier stage starts from the label embeddings), queries =
  MiniLM embeddings of test titles; or a real model with ``--model-uri models:/xc-<dataset>@champion``;
* ``--labels N`` (e.g. 1000000): N generated unit vectors (dim 384) as label embeddings, W = them plus
  noise (cosine ~0.96 to the label embedding), queries drawn from the same distribution.
  ``--structure clusters`` (the default; ``LabelMixture`` in ``bench/serving_labels.py``): a seeded
  hierarchical mixture on the unit sphere -- 1,000 topics, 20,000 subtopics of Zipf(0.6) popularity, a shared
  mean direction and a decaying spectrum -- shaped like MiniLM's LF-WordNetNouns label embeddings
  (docs/decisions.md#serving-bench-label-mixture); a query is a fresh draw from the subtopic of a random label.
  ``--structure uniform``: iid uniform unit vectors, queries = noisy copies of random labels (HNSW's hard case:
  no structure, so recall is pessimistic).

For each ``--settings shortlist:efSearch`` it reports p50/p99 single-query latency, batch throughput and the
recall of the final top-10 against exhaustive alpha-fused scoring of every label (``--recall-queries``).
Generated vectors and HNSW indexes are cached under ``--cache`` (names carry the generator, size, seed and
HNSW parameters; a cached index is checked against the vectors before use), so reruns skip the builds.

  python bench/serving_bench.py --labels 21k --out bench/results/serving_21k.json
  python bench/serving_bench.py --labels 1000000 --cache /tmp/xc-serving-bench --encoder none --hnsw-m 16 \\
      --efc 40 --settings 100:200 50:64 20:32 --out bench/results/serving_1m.json
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import platform
import sys
import time
from pathlib import Path

import faiss
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, for bench.serving_labels
from bench.serving_labels import classifier_vectors, embedding_stats, generated_labels  # noqa: E402
from xc_dagster.device import amp_dtype
from xc_dagster.encoders.loading import load_encoder
from xc_dagster.encoders.tokenizer import load_tokenizer
from xc_dagster.retrieval.ann import LabelIndex
from xc_dagster.retrieval.fusion import AlphaFusion, TreeFusion
from xc_dagster.retrieval.shortlist import ShortlistSources
from xc_dagster.serving import bundle as serving_bundle
from xc_dagster.serving import registry

DATA = Path(__file__).resolve().parents[1] / "xc_dagster" / "builtin_data" / "LF-WordNetNouns"


def _titles(name: str) -> list[str]:
    with gzip.open(DATA / name, "rt") as fh:
        return [json.loads(line)["title"] for line in fh]


def set_threads(n: int) -> None:
    """torch intra-op threads and faiss OpenMP threads (1 = one query per core, as one server worker)."""
    torch.set_num_threads(n)
    faiss.omp_set_num_threads(n)


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


def _matches(idx: LabelIndex, vectors: np.ndarray, probes: int = 16) -> bool:
    """Whether a cached index holds these vectors (its size, and a few rows reconstructed from it)."""
    if idx.size != len(vectors):
        return False
    rows = np.random.default_rng(0).integers(0, len(vectors), probes)
    return all(np.allclose(idx._index.reconstruct(int(r)), vectors[r], atol=1e-6) for r in rows)


def build_index(vectors: np.ndarray, path: Path | None, m: int, efc: int) -> tuple[LabelIndex, float, bool]:
    """Build an HNSW index (or load it from ``path`` when a previous run saved it there for these vectors)."""
    if path is not None and path.exists():
        idx = LabelIndex.load(path, "hnsw")
        if _matches(idx, vectors):
            return idx, 0.0, True
        print(f"{path} does not hold these vectors: rebuilding it", flush=True)
    t0 = time.perf_counter()
    idx = LabelIndex("hnsw", vectors, m=m, ef_construction=efc)
    secs = time.perf_counter() - t0
    if path is not None:  # written whole or not at all: an interrupted build leaves no file to trust
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".part")
        idx.save(tmp)
        os.replace(tmp, path)
    idx._vectors = None  # the faiss index holds its own copy
    return idx, secs, False


def exact_alpha_top(queries: np.ndarray, W: np.ndarray, E: np.ndarray, alpha: float, k: int,
                    block: int = 200_000) -> np.ndarray:
    """Exhaustive alpha-fused top-k over every label (the recall reference), in blocks of 64 queries x
    ``block`` labels so memory stays small at 1M labels."""
    out = []
    for s in range(0, len(queries), 64):
        q = torch.from_numpy(np.ascontiguousarray(queries[s:s + 64]))
        best_s = torch.full((len(q), k), -float("inf"))
        best_i = torch.zeros((len(q), k), dtype=torch.long)
        for b in range(0, len(W), block):
            sc = alpha * (q @ torch.from_numpy(np.asarray(W[b:b + block])).T) + \
                (1 - alpha) * (q @ torch.from_numpy(np.asarray(E[b:b + block])).T)
            top = torch.topk(sc, min(k, sc.shape[1]), dim=1)
            cat_s, cat_i = torch.cat([best_s, top.values], 1), torch.cat([best_i, top.indices + b], 1)
            pos = torch.topk(cat_s, k, dim=1).indices
            best_s, best_i = cat_s.gather(1, pos), cat_i.gather(1, pos)
        out.append(best_i.numpy())
    return np.concatenate(out)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--labels", default="21k", help="21k (LF-WordNetNouns label set) or a number of random labels")
    ap.add_argument("--model-uri", help="a registered model (models:/NAME@champion) instead of generated vectors")
    ap.add_argument("--tracking-uri", default=os.environ.get("MLFLOW_TRACKING_URI", ""))
    ap.add_argument("--dim", type=int, default=384)
    ap.add_argument("--structure", choices=("clusters", "uniform"), default="clusters",
                    help="generated labels: a clustered mixture shaped like text embeddings, or iid uniform")
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
    ap.add_argument("--build-threads", type=int, default=os.cpu_count(), help="threads while building indexes")
    ap.add_argument("--recall-queries", type=int, default=200, help="queries scored exhaustively for recall")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path)
    return ap.parse_args(argv)


def wordnet_labels(args: argparse.Namespace, probe: serving_bundle.ServingBundle, qtexts: list[str],
                   report: dict) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """(label embeddings, query embeddings, label texts) of the 21,523 LF-WordNetNouns labels, encoded by
    ``probe``'s encoder."""
    label_texts = _titles("lbl.json.gz")
    path = args.cache / f"E_21k_{args.encoder}.npy" if args.cache else None
    if path is not None and path.exists():
        E = np.load(path)
    else:
        t0 = time.perf_counter()
        E = serving_bundle.encode_texts(label_texts, probe)
        report["label_encoding_s"] = time.perf_counter() - t0
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            np.save(path, E)
    return E, serving_bundle.encode_texts(qtexts, probe), label_texts


def build_indexes(args: argparse.Namespace, W: np.ndarray, E: np.ndarray, gen: str,
                  report: dict) -> tuple[LabelIndex, LabelIndex]:
    """The HNSW indexes over W and over the label embeddings (cached under ``--cache``), reported."""
    cache, L = args.cache, len(E)
    tag = f"{gen}_{args.dim}_M{args.hnsw_m}_efc{args.efc}_{args.seed}"
    set_threads(args.build_threads)
    w_index, w_s, w_loaded = build_index(W, cache / f"W_{tag}.index" if cache else None, args.hnsw_m, args.efc)
    print(f"W index: {w_s:.1f}s" + (" (cached)" if w_loaded else ""), flush=True)
    e_index, e_s, e_loaded = build_index(E, cache / f"E_{tag}.index" if cache else None, args.hnsw_m, args.efc)
    source = {"21k": "LF-WordNetNouns label titles (MiniLM)", "clusters": "generated: clustered mixture "
              "(LabelMixture)", "uniform": "generated: iid uniform unit vectors"}
    report["labels"] = {"source": source["21k" if args.labels == "21k" else args.structure], "n": L,
                        "dim": int(E.shape[1])}
    if args.labels != "21k":
        report["labels"]["stats"] = embedding_stats(E, args.seed)
    report["index_build"] = {"hnsw_m": args.hnsw_m, "ef_construction": args.efc,
                             "W_seconds": None if w_loaded else w_s, "label_emb_seconds": None if e_loaded else e_s,
                             "loaded_from_cache": w_loaded and e_loaded, "threads": args.build_threads}
    print(f"index build (M={args.hnsw_m}, efC={args.efc}) over {L} x {E.shape[1]}: "
          f"W {w_s:.1f}s, label_emb {e_s:.1f}s" + (" (cached)" if w_loaded and e_loaded else ""), flush=True)
    return w_index, e_index


def generated_bundle(args: argparse.Namespace, rng: np.random.Generator, encoder, tokenizer, dtype,
                     qtexts: list[str], report: dict) -> tuple[serving_bundle.ServingBundle, np.ndarray, np.ndarray]:
    """(bundle, W, query embeddings) over the 21k label set or ``--labels`` generated labels, alpha fusion."""
    dev = torch.device("cpu")
    if args.labels == "21k":
        probe = serving_bundle.ServingBundle(encoder=encoder, tokenizer=tokenizer, max_len=32, sources=None,
                                             fusion=None, inv_prop=None, label_texts=None, shortlist_size=0,
                                             device=dev, dtype=dtype, batch_size=256, default_k=args.k)
        E, queries, label_texts = wordnet_labels(args, probe, qtexts, report)
        gen = "21k"
    else:
        E, queries, label_texts, gen = generated_labels(args, rng, report)
    w_path = args.cache / f"W_{gen}_{args.dim}_{args.seed}.npy" if args.cache else None
    W = classifier_vectors(E, w_path, args.seed, 0.3)
    w_index, e_index = build_indexes(args, W, E, gen, report)
    bundle = serving_bundle.ServingBundle(
        encoder, tokenizer, 32, ShortlistSources(W, E, {"W": w_index, "label": e_index}), AlphaFusion(args.alpha),
        rng.uniform(1.0, 5.0, len(E)), np.array(label_texts, dtype=object), 100, dev, dtype, 256, args.k)
    return bundle, W, queries


def _use_setting(bundle: serving_bundle.ServingBundle, setting: str) -> tuple[int, int]:
    """Shortlist size and efSearch of a ``shortlist:efSearch`` setting, applied to the bundle."""
    sl_size, efs = (int(x) for x in setting.split(":"))
    bundle.shortlist_size = sl_size
    for idx in bundle.sources.indexes.values():
        idx.ef_search = efs
    return sl_size, efs


def time_index_fusion(args: argparse.Namespace, bundle: serving_bundle.ServingBundle, queries: np.ndarray,
                      W: np.ndarray, E: np.ndarray) -> list[dict]:
    """Single-query latency, batch throughput and top-k recall (alpha) of ``rank`` at each setting, both fusions."""
    single_q = [queries[i:i + 1] for i in range(args.queries)]
    batch_q = queries[:args.batch]
    n_rec = min(args.recall_queries, len(queries))
    set_threads(args.batch_threads)
    exact = exact_alpha_top(queries[:n_rec], W, E, args.alpha, args.k)
    results = []
    for setting in args.settings:
        sl_size, efs = _use_setting(bundle, setting)
        for name, fz in (("alpha", AlphaFusion(args.alpha)), ("tree", random_tree(len(W)))):
            bundle.fusion = fz
            set_threads(args.single_threads)
            lat = single_latency(lambda q: serving_bundle.rank(q, bundle, args.k), single_q)
            set_threads(args.batch_threads)
            thr = throughput(lambda q: serving_bundle.rank(q, bundle, args.k), batch_q)
            row = {"shortlist": sl_size, "ef_search": efs, "fusion": name, "single": lat, "batch": thr}
            if name == "alpha":
                got, _ = serving_bundle.rank(queries[:n_rec], bundle, args.k)
                row["recall_at_k_vs_exhaustive"] = float(np.mean([len(set(a) & set(b)) / args.k
                                                                  for a, b in zip(got, exact)]))
            results.append(row)
            print(f"index+fusion shortlist {sl_size} efSearch {efs} {name}: p50 {lat['p50_ms']:.3f} ms, "
                  f"p99 {lat['p99_ms']:.3f} ms, batch {thr['per_s']:.0f} q/s"
                  + (f", top-{args.k} recall {row['recall_at_k_vs_exhaustive']:.3f}" if "recall_at_k_vs_exhaustive"
                     in row else ""), flush=True)
    return results


def time_encoder(args: argparse.Namespace, bundle: serving_bundle.ServingBundle, encoder, tokenizer, dtype,
                 qtexts: list[str], report: dict) -> None:
    """The encoder alone and ``predict_topk`` end to end (first setting, alpha fusion), into ``report``."""
    bundle.encoder, bundle.tokenizer = encoder, tokenizer
    set_threads(args.single_threads)
    enc_lat = single_latency(lambda t: serving_bundle.encode_texts([t], bundle), qtexts[:min(args.queries, 300)])
    set_threads(args.batch_threads)
    enc_thr = throughput(lambda ts: serving_bundle.encode_texts(ts, bundle), qtexts[:args.batch])
    _use_setting(bundle, args.settings[0])
    bundle.fusion = AlphaFusion(args.alpha)
    set_threads(args.single_threads)
    e2e_lat = single_latency(lambda t: serving_bundle.predict_topk([t], bundle, args.k),
                             qtexts[:min(args.queries, 300)])
    set_threads(args.batch_threads)
    e2e_thr = throughput(lambda ts: serving_bundle.predict_topk(ts, bundle, args.k), qtexts[:args.batch])
    report["encoder"] = {"name": args.encoder, "autocast": str(dtype), "single": enc_lat, "batch": enc_thr,
                         "mean_tokens": float(np.mean([len(tokenizer(t)["input_ids"]) for t in qtexts[:500]]))}
    report["predict_topk"] = {"setting": args.settings[0], "single": e2e_lat, "batch": e2e_thr}
    print(f"encoder {args.encoder} ({dtype}): single p50 {enc_lat['p50_ms']:.2f} ms, p99 {enc_lat['p99_ms']:.2f} ms;"
          f" batch {enc_thr['per_s']:.0f} texts/s", flush=True)
    print(f"predict_topk end to end: single p50 {e2e_lat['p50_ms']:.2f} ms, p99 {e2e_lat['p99_ms']:.2f} ms; "
          f"batch {e2e_thr['per_s']:.0f} texts/s", flush=True)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    rng = np.random.default_rng(args.seed)
    dev = torch.device("cpu")
    report: dict = {"machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                                "torch_threads": torch.get_num_threads(), "python": platform.python_version(),
                                "torch": torch.__version__,
                                "load_avg_1_5_15": list(os.getloadavg())},  # other work on the machine
                    "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}}
    test_texts = _titles("tst.json.gz")
    qtexts = [test_texts[i] for i in rng.choice(len(test_texts), max(args.queries, args.batch), replace=False)]
    encoder = tokenizer = None
    dtype = amp_dtype(dev, args.amp)
    if args.encoder != "none" or (args.labels == "21k" and not args.model_uri):
        encoder = load_encoder(args.encoder if args.encoder != "none" else "minilm").eval()
        tokenizer = load_tokenizer(args.encoder if args.encoder != "none" else "minilm")
    if args.model_uri:
        bundle = registry.load_served_bundle(args.model_uri, args.tracking_uri, "cpu")
        W, E = bundle.W, bundle.sources.label_repr
        queries = serving_bundle.encode_texts(qtexts, bundle)
        report["labels"] = {"source": args.model_uri, "n": bundle.num_labels}
    else:
        bundle, W, queries = generated_bundle(args, rng, encoder, tokenizer, dtype, qtexts, report)
        E = bundle.sources.label_repr
    report["index_fusion"] = time_index_fusion(args, bundle, queries, W, E)
    if encoder is not None and args.encoder != "none":
        time_encoder(args, bundle, encoder, tokenizer, dtype, qtexts, report)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
