"""Each test file's seconds from a JUnit report of the suite, into ``tests/file_seconds.json`` (the order in which
``tests/conftest.py`` deals test files to the workers: longest first).

  .venv/bin/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --junitxml=/tmp/suite.xml
  .venv/bin/python -m tests.file_seconds /tmp/suite.xml
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

OUT = Path(__file__).with_name("file_seconds.json")


def file_seconds(report: Path) -> dict[str, float]:
    """Seconds per test file (``tests/test_x.py``), summed over its test cases, longest first."""
    totals: dict[str, float] = defaultdict(float)
    for case in ET.parse(report).getroot().iter("testcase"):
        module = case.get("classname", "").split(".")
        while module and not module[-1].startswith("test_"):  # a class inside the module
            module.pop()
        if module:
            totals["/".join(module) + ".py"] += float(case.get("time", 0.0))
    return {name: round(sec, 1) for name, sec in sorted(totals.items(), key=lambda kv: -kv[1])}


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    OUT.write_text(json.dumps(file_seconds(Path(sys.argv[1])), indent=0) + "\n")
    print(f"wrote {OUT}")
