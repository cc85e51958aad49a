"""The label sets ``bench/serving_bench.py`` times the served model's index + fusion over.

* ``LabelMixture``: a seeded hierarchical Gaussian mixture on the unit sphere shaped like MiniLM's LF-WordNetNouns
  label embeddings (docs/decisions.md#serving-bench-label-mixture), and iid uniform unit vectors;
* ``embedding_stats``: the shape statistics that compare a generated set with real label embeddings;
* ``classifier_vectors``: W = unit(E + noise), as the classifier stage starts from the label embeddings.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch


def _unit(x: np.ndarray) -> np.ndarray:
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


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


def generated_labels(args: argparse.Namespace, rng: np.random.Generator, report: dict
                     ) -> tuple[np.ndarray, np.ndarray, list[str], str]:
    """(label embeddings, query embeddings, label texts, cache name) of ``--labels`` generated labels."""
    cache, n = args.cache, int(float(args.labels))
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
    return E, queries, label_texts, gen


def classifier_vectors(E: np.ndarray, path: Path | None, seed: int, noise: float) -> np.ndarray:
    """W = unit(E + noise), cosine ~0.96 to the label embedding (the classifier stage starts from them)."""
    if path is not None and path.exists():
        return np.load(path)
    W = np.empty(E.shape, dtype=np.float32)
    g = np.random.default_rng(seed + 1)
    for s in range(0, len(E), 100_000):
        blk = np.asarray(E[s:s + 100_000])
        W[s:s + 100_000] = _unit(blk + _noise(g, blk.shape, noise))
    if path is not None:
        np.save(path, W)
    return W
