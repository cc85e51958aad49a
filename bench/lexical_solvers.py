"""The lexical classifiers' trainers compared on a BoW dataset: each setting's classifiers alone, and the lexical
score with them, on the test split (P@1 / P@5 in percent, every label scored).

  python bench/lexical_solvers.py --folder ../shared/data/Bibtex/xc_format \
      --settings '{"solver": "sgd"}' '{"solver": "liblinear", "c": 0.25}' [--json results.jsonl]

The lexical source is fitted as the index stage fits it (``LexicalIndex.fit``, 10 neighbours) on a seeded 95% of
the training points, the other 5% judging the passes (or the margins' scale); each ``--settings`` is a JSON object of
``ClassifierSettings`` fields. See docs/decisions.md#lexical-classifier-exact.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from xc_dagster.data.bow import read_bow
from xc_dagster.retrieval.lexical import LexicalIndex
from xc_dagster.retrieval.lexical_classifier import ClassifierSettings

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, for bench.rows
from bench.rows import emit  # noqa: E402


def precision(S: np.ndarray, Y: np.ndarray, k: int) -> float:
    top = np.argsort(-S, axis=1, kind="stable")[:, :k]
    return round(100 * float(np.take_along_axis(Y, top, 1).mean()), 2)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--folder", required=True, type=Path, help="a BoW dataset folder (*train*.txt, *test*.txt)")
    p.add_argument("--settings", nargs="+", default=['{"solver": "sgd"}', '{"solver": "liblinear"}'])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args(argv)
    ds = read_bow(a.folder)
    n = ds.X_train.shape[0]
    fit = np.sort(np.random.default_rng(a.seed).permutation(n)[:int(0.95 * n)])
    Y_test = (ds.Y_test.toarray() > 0).astype(np.float32)
    num_labels = ds.Y_train.shape[1]
    for spec in a.settings:
        started = time.perf_counter()
        index = LexicalIndex.fit(ds.X_train, None, ds.Y_train, 10, fit_on=fit,
                                 classifier=ClassifierSettings(**json.loads(spec)))
        seconds = time.perf_counter() - started
        Q = index.transform(ds.X_test)
        rows, labels = np.repeat(np.arange(Q.shape[0]), num_labels), np.tile(np.arange(num_labels), Q.shape[0])
        alone = index.classifier.pair_scores(Q, rows, labels).reshape(-1, num_labels)
        lexical = index.scores(Q).toarray()
        emit({"folder": str(a.folder), "settings": json.loads(spec), "solver": index.classifier.solver,
              "fit_seconds": round(seconds, 1), "history": index.classifier.history,
              "classifiers_p1": precision(alone, Y_test, 1), "classifiers_p5": precision(alone, Y_test, 5),
              "lexical_p1": precision(lexical, Y_test, 1), "lexical_p5": precision(lexical, Y_test, 5)}, a.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
