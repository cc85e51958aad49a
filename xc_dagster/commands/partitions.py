"""The home's Dagster partitions (one per catalog dataset), added and removed by a child process that imports Dagster
(``resources.partitions``): the library does not import Dagster."""

from __future__ import annotations

import subprocess
import sys

from xc_dagster.errors import XCError
from xc_dagster.home import Home

PARTITIONS_CMD = ("import sys; from xc_dagster.project import project_import; "
                  "sys.exit(project_import('resources.partitions')[0].main(sys.argv[1:]))")


def dagster_partitions(home: Home, action: str, names: list[str]) -> None:
    """``add`` / ``remove`` dataset partitions in the home's Dagster instance, so the UI can launch a new dataset
    without a reload."""
    out = subprocess.run([sys.executable, "-c", PARTITIONS_CMD, action, *names], env=home.environ(), cwd=home.root,
                         capture_output=True, text=True)
    if out.returncode != 0:
        raise XCError(f"could not {action} the Dagster partition(s) {', '.join(names)} in the instance at "
                      f"{home.dagster_home} (exit {out.returncode}): {out.stderr.strip()[-2000:]}")
