"""The project's own top-level packages (``assets``, ``resources``), imported from where they were installed.

Python puts the working directory first on ``sys.path`` for ``python -m`` and ``dagster ... -m``: run from a
folder that has its own ``assets/`` or ``resources/`` package, a plain ``import assets`` would load that one and the
code location would fail. :func:`project_import` imports ours from the folder that holds ``xc_dagster`` (the repo
root of an editable install, ``site-packages`` of a wheel).
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

from xc_dagster.errors import XCError

ROOT = Path(__file__).resolve().parents[1]  # the folder holding xc_dagster/, assets/ and resources/


def _is_ours(module: ModuleType) -> bool:
    paths = list(getattr(module, "__path__", [])) or [getattr(module, "__file__", None) or ""]
    return any(Path(p).resolve().parent == ROOT for p in paths if p)


def project_import(*names: str) -> list[ModuleType]:
    """Import the project's modules ``names`` (e.g. ``"assets"``, ``"resources.partitions"``) with :data:`ROOT`
    first on the path for the duration; a same-named package imported earlier from elsewhere is an error."""
    out = []
    sys.path.insert(0, str(ROOT))
    try:
        for name in names:
            top = name.split(".")[0]
            loaded = sys.modules.get(top)
            if loaded is not None and not _is_ours(loaded):
                raise XCError(f"a package named {top!r} from {getattr(loaded, '__file__', '?')} is already imported; "
                              f"xc-dagster needs its own {top!r} from {ROOT}: run from another folder")
            out.append(importlib.import_module(name))
    finally:
        sys.path.remove(str(ROOT))
    return out
