"""``xc-dagster compare NAME``: the dataset's evaluation runs from MLflow, best first, with the papers' published
numbers for it as reference rows."""

from __future__ import annotations

import argparse

from xc_dagster.errors import XCConfigError
from xc_dagster.evaluation.comparison import (
    COMPARE_METRICS,
    comparison_table,
    evaluation_runs,
    rank_runs,
    reference_rows,
)
from xc_dagster.home import Home


def run(args: argparse.Namespace, home: Home) -> int:
    """Print the evaluation runs of a dataset, best first, with reference rows from the registry."""
    if args.sort not in COMPARE_METRICS:
        raise XCConfigError(f"compare --sort {args.sort!r}: one of {', '.join(COMPARE_METRICS)}")
    runs = rank_runs(evaluation_runs(home.mlflow_uri, args.name), args.sort)[:args.limit]
    refs = reference_rows(args.name)
    if not runs:
        print(f"no finished evaluation runs for {args.name!r} in {home.mlflow_uri} "
              f"(materialize it with: xc-dagster materialize {args.name})")
    print(f"\n{args.name}: evaluation runs, best {args.sort} first (test split, %)\n")
    print(comparison_table(runs, refs))
    return 0
