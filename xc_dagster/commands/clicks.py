"""``xc-dagster clicks build NAME --logs PATH``: click logs of a time window -> a dataset (docs/CLICKLOGS.md)."""

from __future__ import annotations

import argparse

from xc_dagster.catalog import NAME_RE, Catalog
from xc_dagster.commands.partitions import dagster_partitions
from xc_dagster.data.clicklog import build_click_dataset, parse_time, window_id
from xc_dagster.errors import XCConfigError
from xc_dagster.home import Home
from xc_dagster.serving.retraining import register_click_dataset


def run(args: argparse.Namespace, home: Home) -> int:
    """Click logs over a window -> ``$XC_HOME/clicklogs/NAME/<window-id>/`` (LF raw text); ``--register``
    points catalog entry NAME at it (other options of an existing entry are kept)."""
    if not NAME_RE.fullmatch(args.name):
        raise XCConfigError(f"clicks build: dataset name {args.name!r} must match {NAME_RE.pattern}")
    start = parse_time(args.start) if args.start else None
    end = parse_time(args.end) if args.end else None
    out = home.root / "clicklogs" / args.name / window_id(start, end)
    s = build_click_dataset(args.logs, out, start=start, end=end, label_map=args.previous,
                            test_fraction=args.test_fraction, min_clicks=args.min_clicks)
    print(f"click dataset {args.name!r} window {s['window']['id']}: {s['rows_in_window']} of {s['rows_read']} "
          f"rows, {s['n_train']} train / {s['n_test']} test queries, {s['n_labels']} labels "
          f"({s['n_new_labels']} new) -> {out}")
    print(f"next window's --previous: {out / 'label_map.json'}")
    if args.register:
        _, existed = register_click_dataset(Catalog(home.catalog), args.name, out)
        dagster_partitions(home, "add", [args.name])
        print(f"{'updated' if existed else 'registered'} dataset {args.name!r} in {home.catalog}; "
              f"materialize it with: xc-dagster materialize {args.name}")
    return 0
