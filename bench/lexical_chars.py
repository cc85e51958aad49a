"""The lexical source's cost with and without its char n-gram block (``index.lexical_char_weight``), at a dataset's
shape: fit seconds (TF-IDF and classifiers), peak RSS, stored entries, and scoring seconds per test query.

  python bench/lexical_chars.py --folder /data/syn131k --weights 0 0.5 [--queries 20000] [--json results.jsonl]

Each weight is fitted in its own process (so that each peak RSS is its own) as the index stage fits it: the TF-IDF
on the training points and label texts (postings capped above ``index.lexical_exact_points``), the lexical
classifiers with the index stage's settings (no budget deadline), a seeded 5% of the training points judging their
passes. See docs/decisions.md#lexical-char-ngrams.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, for bench.rows
from bench.rows import emit  # noqa: E402


def one(folder: Path, weight: float, queries: int, seed: int) -> dict:
    """Fit and score with char weight ``weight``; the measurements."""
    from xc_dagster.config.params import IndexParams
    from xc_dagster.data.layouts import read_dataset
    from xc_dagster.pipeline.index import classifier_settings
    from xc_dagster.retrieval.lexical import LexicalIndex

    ds = read_dataset(folder)
    n = len(ds.train_texts)
    rng = np.random.default_rng(seed)
    fit_on = np.sort(rng.permutation(n)[: int(0.95 * n)])
    t0 = time.perf_counter()
    p = IndexParams()  # the defaults, postings capped above lexical_exact_points as the index stage caps them
    lex = LexicalIndex.fit(ds.train_texts, ds.label_texts, ds.Y_train, p.lexical_neighbours, p.lexical_min_df, fit_on,
                           max_postings=p.lexical_max_postings if n > p.lexical_exact_points else 0,
                           classifier=classifier_settings(p, seed), char_weight=weight)
    fit_s = time.perf_counter() - t0
    texts = ds.test_texts[:queries]
    t0 = time.perf_counter()
    S = lex.scores(lex.transform(texts))
    score_s = time.perf_counter() - t0
    top = np.asarray(S.argmax(axis=1)).ravel()
    hits = np.asarray(ds.Y_test[np.arange(len(texts)), top]).ravel() > 0
    return {"weight": weight, "points": n, "max_postings": lex.max_postings, "labels": ds.num_labels,
            "terms": int(lex.points.shape[1]),
            "point_entries": int(lex.points.nnz), "classifier_weights": int(len(lex.classifier.keys)),
            "fit_s": round(fit_s, 1), "queries": len(texts), "ms_per_query": round(1000 * score_s / len(texts), 3),
            "lexical_p_at_1": round(100 * float(hits.mean()), 2),
            "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--folder", required=True, type=Path, help="a dataset folder (any layout ingest reads, with text)")
    p.add_argument("--weights", nargs="+", type=float, default=[0.0, 0.5])
    p.add_argument("--queries", type=int, default=20_000, help="test queries scored (the first ones)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--one", type=float, default=None, help=argparse.SUPPRESS)  # a child process: one weight
    a = p.parse_args(argv)
    if a.one is not None:
        print(json.dumps(one(a.folder, a.one, a.queries, a.seed)))
        return 0
    for w in a.weights:
        out = subprocess.run([sys.executable, __file__, "--folder", str(a.folder), "--queries", str(a.queries),
                              "--seed", str(a.seed), "--one", str(w)], check=True, capture_output=True, text=True)
        emit({"folder": str(a.folder), **json.loads(out.stdout.strip().splitlines()[-1])}, a.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
