"""``xc-dagster retrain check``: changed dataset sources and click-log feeds (docs/AUTOMATION.md)."""

from __future__ import annotations

import argparse

from xc_dagster.home import Home
from xc_dagster.serving.retraining import feed_root, list_feeds
from xc_dagster.serving.source_changes import changed_datasets


def run(args: argparse.Namespace, home: Home) -> int:
    """What the retraining automation would do now: changed catalog sources (retrain_schedule) and
    click-log files not yet consumed (click_log_sensor, from a fresh cursor: every file counts as new)."""
    changes = changed_datasets(home)
    if not changes:
        print(f"no datasets in {home.catalog}")
    for c in changes:
        print(f"{c.name}: {'CHANGED' if c.changed else 'unchanged'} ({c.reason})")
    root = feed_root(home)
    listing = list_feeds(root)
    print(f"\nclick-log feed root {root}: " + (", ".join(f"{n} ({len(f)} file(s))" for n, f in
                                                          sorted(listing.feeds.items())) or "no dataset folders"))
    for name in listing.ignored:
        print(f"  folder {name!r} ignored: not a valid dataset name")
    return 0
