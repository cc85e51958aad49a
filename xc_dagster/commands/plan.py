"""``xc-dagster plan NAME``: each stage's predicted seconds and peak memory on this machine, before a run
(docs/planning.md)."""

from __future__ import annotations

import argparse
import json

from xc_dagster.catalog import Catalog
from xc_dagster.config import parse_set_options
from xc_dagster.home import Home
from xc_dagster.planning import format_plan, plan_run


def run(args: argparse.Namespace, home: Home) -> int:
    """The plan of a run of NAME with ``--set`` (as ``materialize`` would resolve its config), the shape from the
    ingest/tokenize summaries or the shape options."""
    cfg = Catalog(home.catalog).get(args.name).config(parse_set_options(args.set or []))
    given = {"n_train": args.points, "n_test": args.test_points, "n_labels": args.labels,
             "labels_per_point": args.labels_per_point, "tokens": args.tokens}
    plan = plan_run(home.cache, home.artifacts, args.name, cfg, given, recalibrate=args.recalibrate)
    print(json.dumps(plan.to_dict(), indent=2) if args.json else format_plan(plan))
    return 0
