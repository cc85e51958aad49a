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
  ``--structure clusters`` (the default; :class:`LabelMixture`): a seeded hierarchical mixture on the unit
  sphere -- 1,000 topics, 20,000 subtopics of Zipf(0.6) popularity, a shared mean direction and a decaying
  spectrum -- whose parameters were chosen so that a 21,523-label sample has the statistics of MiniLM's
  LF-WordNetNouns label embeddings (norm of the mean, random-pair cosine, nearest-neighbour cosines; see
  ``bench/SERVING.md``); a query is a fresh draw from the subtopic of a random label. ``--structure
  uniform``: iid uniform unit vectors, queries = noisy copies of random labels (HNSW's hard case: no
  structure, so recall is pessimistic).

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
import time
from pathlib import Path

import numpy as np
import torch

from xc_dagster.retrieval.ann import LabelIndex
from xc_dagster.retrieval.fusion import AlphaFusion, TreeFusion
from xc_dagster.retrieval.shortlist import ShortlistSources
from xc_dagster.serving import bundle as serving_bundle
from xc_dagster.serving import registry

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


class LabelMixture:
    """A seeded hierarchical Gaussian mixture on the unit sphere, shaped like text-encoder label embeddings.

    x = unit(a * mean + topic_t + sub_s + noise): ``topics`` topic centres, ``subtopics`` subtopic centres
    (each offset from a random topic; popularity Zipf(``zipf``) in a random order), a shared direction
    ``mean`` of weight ``a`` (encoders' anisotropy), and every Gaussian term shaped by a spectrum decaying as
    (i + 1) ** -beta over the dimensions (a lower effective dimension than isotropic noise).
    """

    def __init__(self, dim: int = 384, seed: int = 0, topics: int = 1000, subtopics: int = 20000,
                 beta: float = 0.3, a: float = 0.6, sub_spread: float = 0.8, label_spread: float = 0.8,
                 zipf: float = 0.6) -> None:
        rng = np.random.default_rng(seed)
        scale = (np.arange(dim) + 1.0) ** -beta
        self.scale = (scale / np.sqrt((scale ** 2).sum())).astype(np.float32)  # Gaussian rows of norm ~1
        self.dim, self.label_spread = dim, label_spread
        self.mean = a * _unit(rng.standard_normal((1, dim)))[0]
        centres = rng.standard_normal((topics, dim)).astype(np.float32) * self.scale
        parent = rng.integers(0, topics, subtopics)
        self.sub = (centres[parent] + sub_spread * rng.standard_normal((subtopics, dim)).astype(np.float32)
                    * self.scale + self.mean).astype(np.float32)
        p = 1.0 / (np.arange(subtopics) + 1.0) ** zipf
        self.p = (p / p.sum())[rng.permutation(subtopics)]
        self.params = {"topics": topics, "subtopics": subtopics, "beta": beta, "a": a, "sub_spread": sub_spread,
                       "label_spread": label_spread, "zipf": zipf, "seed": seed}

    def subtopics_of(self, n: int, rng: np.random.Generator) -> np.ndarray:
        return rng.choice(len(self.sub), n, p=self.p)

    def draw(self, sub_ids: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """One unit vector per subtopic id."""
        noise = rng.standard_normal((len(sub_ids), self.dim), dtype=np.float32) * self.scale
        return _unit(self.sub[sub_ids] + self.label_spread * noise)


def generate_labels(n: int, dim: int, structure: str, seed: int) -> tuple[np.ndarray, np.ndarray | None]:
    """(n, dim) float32 unit label embeddings, and their subtopic ids (None for ``uniform``); 100k rows at a
    time so the only large allocation is the result."""
    rng = np.random.default_rng(seed)
    E = np.empty((n, dim), dtype=np.float32)
    if structure == "uniform":
        for s in range(0, n, 100_000):
            E[s:s + 100_000] = _unit(rng.standard_normal((min(100_000, n - s), dim), dtype=np.float32))
        return E, None
    mix = LabelMixture(dim, seed)
    subs = mix.subtopics_of(n, rng)
    for s in range(0, n, 100_000):
        E[s:s + 100_000] = mix.draw(subs[s:s + 100_000], rng)
    return E, subs


def embedding_stats(E: np.ndarray, seed: int = 0, sample: int = 300) -> dict[str, float]:
    """Shape of a label set: norm of the mean, random-pair cosine, mean cosine of the 1st/10th nearest label."""
    rng = np.random.default_rng(seed)
    mu = np.zeros(E.shape[1], dtype=np.float64)
    for s in range(0, len(E), 100_000):
        mu += np.asarray(E[s:s + 100_000], dtype=np.float64).sum(0)
    i, j = rng.integers(0, len(E), 5000), rng.integers(0, len(E), 5000)
    pair = (np.asarray(E[i]) * np.asarray(E[j])).sum(1)
    pick = np.sort(rng.choice(len(E), min(sample, len(E)), replace=False))
    q = torch.from_numpy(np.asarray(E[pick]))
    best = torch.full((len(pick), 11), -2.0)
    for s in range(0, len(E), 100_000):
        sc = q @ torch.from_numpy(np.asarray(E[s:s + 100_000])).T
        best = torch.topk(torch.cat([best, sc], 1), 11, dim=1).values
    nn = best[:, 1:].numpy()  # the first is the label itself
    return {"mean_norm": float(np.linalg.norm(mu / len(E))), "pair_cos_mean": float(pair.mean()),
            "pair_cos_sd": float(pair.std()), "nn1_cos": float(nn[:, 0].mean()), "nn10_cos": float(nn[:, 9].mean()),
            "n_sampled": int(len(pick))}


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


def main() -> None:
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
    args = ap.parse_args()

    from xc_dagster.device import amp_dtype
    from xc_dagster.encoders.loading import load_encoder
    from xc_dagster.encoders.tokenizer import load_tokenizer

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

    cache = args.cache
    if args.model_uri:
        bundle = registry.load_served_bundle(args.model_uri, args.tracking_uri, "cpu")
        W, E = bundle.W, bundle.sources.label_repr
        queries = serving_bundle.encode_texts(qtexts, bundle)
        report["labels"] = {"source": args.model_uri, "n": bundle.num_labels}
    else:
        if args.labels == "21k":
            label_texts = _titles("lbl.json.gz")
            tmp = serving_bundle.ServingBundle(encoder=encoder, tokenizer=tokenizer, max_len=32,
                                        sources=None,
                                        fusion=None, inv_prop=None, label_texts=None, shortlist_size=0, device=dev,
                                        dtype=dtype, batch_size=256, default_k=args.k)
            path = cache / f"E_21k_{args.encoder}.npy" if cache else None
            if path is not None and path.exists():
                E = np.load(path)
            else:
                t0 = time.perf_counter()
                E = serving_bundle.encode_texts(label_texts, tmp)
                report["label_encoding_s"] = time.perf_counter() - t0
                if path is not None:
                    path.parent.mkdir(parents=True, exist_ok=True)
                    np.save(path, E)
            queries = serving_bundle.encode_texts(qtexts, tmp)
            noise = 0.3
        else:
            n = int(float(args.labels))
            label_texts = [f"label {i}" for i in range(n)]
            gen = f"{n}_{args.structure}" if args.structure != "uniform" else str(n)
            path = cache / f"E_{gen}_{args.dim}_{args.seed}.npy" if cache else None
            s_path = cache / f"S_{gen}_{args.dim}_{args.seed}.npy" if cache else None
            if path is not None and path.exists() and (args.structure == "uniform" or s_path.exists()):
                E = np.load(path)  # in memory: timings without page faults (1.5 GB at 1M x 384)
                subs = np.load(s_path) if args.structure != "uniform" else None
            else:
                t0 = time.perf_counter()
                E, subs = generate_labels(n, args.dim, args.structure, args.seed)
                report["label_generation_s"] = time.perf_counter() - t0
                if path is not None:
                    path.parent.mkdir(parents=True, exist_ok=True)
                    np.save(path, E)
                    if subs is not None:
                        np.save(s_path, subs)
            pick = rng.integers(0, n, max(args.queries, args.batch, args.recall_queries))
            if args.structure == "uniform":
                queries = _unit(E[pick] + _noise(rng, (len(pick), args.dim), 1.0))  # cosine ~0.7 to its label
            else:  # a fresh draw from the subtopic of a random label
                mix = LabelMixture(args.dim, args.seed)
                queries = mix.draw(subs[pick], rng)
                report["generator"] = mix.params
            noise = 0.3
        L = len(E)
        gen = "21k" if args.labels == "21k" else gen
        w_path = cache / f"W_{gen}_{args.dim}_{args.seed}.npy" if cache else None
        if w_path is not None and w_path.exists():
            W = np.load(w_path)
        else:
            W = np.empty(E.shape, dtype=np.float32)
            g = np.random.default_rng(args.seed + 1)
            for s in range(0, L, 100_000):
                blk = np.asarray(E[s:s + 100_000])
                W[s:s + 100_000] = _unit(blk + _noise(g, blk.shape, noise))  # cosine ~0.96 to the label embedding
            if w_path is not None:
                np.save(w_path, W)
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
        bundle = serving_bundle.ServingBundle(
            encoder, tokenizer, 32, ShortlistSources(W, E, {"W": w_index, "label": e_index}), AlphaFusion(args.alpha),
            rng.uniform(1.0, 5.0, L), np.array(label_texts, dtype=object), 100, dev, dtype, 256, args.k)

    single_q = [queries[i:i + 1] for i in range(args.queries)]
    batch_q = queries[:args.batch]
    n_rec = min(args.recall_queries, len(queries))
    set_threads(args.batch_threads)
    exact = exact_alpha_top(queries[:n_rec], W, E, args.alpha, args.k)
    results = []
    for setting in args.settings:
        sl_size, efs = (int(x) for x in setting.split(":"))
        bundle.shortlist_size = sl_size
        for idx in bundle.sources.indexes.values():
            idx.ef_search = efs
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
    report["index_fusion"] = results

    if encoder is not None and args.encoder != "none":
        bundle.encoder, bundle.tokenizer = encoder, tokenizer
        set_threads(args.single_threads)
        enc_lat = single_latency(lambda t: serving_bundle.encode_texts([t], bundle), qtexts[:min(args.queries, 300)])
        set_threads(args.batch_threads)
        enc_thr = throughput(lambda ts: serving_bundle.encode_texts(ts, bundle), qtexts[:args.batch])
        bundle.shortlist_size = int(args.settings[0].split(":")[0])
        for idx in bundle.sources.indexes.values():
            idx.ef_search = int(args.settings[0].split(":")[1])
        bundle.fusion = AlphaFusion(args.alpha)
        set_threads(args.single_threads)
        e2e_lat = single_latency(lambda t: serving_bundle.predict_topk([t], bundle, args.k), qtexts[:min(args.queries, 300)])
        set_threads(args.batch_threads)
        e2e_thr = throughput(lambda ts: serving_bundle.predict_topk(ts, bundle, args.k), qtexts[:args.batch])
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
