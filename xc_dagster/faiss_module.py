"""The one faiss module: faiss-cpu (the ``cpu`` extra) or the CUDA build (the ``gpu`` extra), never both -- the two
distributions install the same module ``faiss``, and the second one's files overwrite the first's.

``faiss`` is imported from here, so a machine without either gets an error that says what to install, and one with
both gets a warning naming them.
"""

from __future__ import annotations

import importlib.metadata
import logging

log = logging.getLogger(__name__)

CPU_DIST = "faiss-cpu"
GPU_DISTS = ("faiss-gpu-cu12", "faiss-gpu")
INSTALL_HINT = ("pip install 'xc-dagster[cpu]' (faiss-cpu) or, on a machine with CUDA 12, 'xc-dagster[gpu]' "
                "(faiss-gpu-cu12): one of the two, not both (they install the same module)")

try:
    import faiss
except ImportError as exc:  # a plain `pip install xc-dagster`: faiss comes with the extra that picks its build
    raise ImportError(f"faiss is not installed: {INSTALL_HINT}") from exc


def installed_faiss() -> list[str]:
    """The faiss distributions installed in this environment (more than one: a broken module)."""
    out = []
    for dist in (CPU_DIST, *GPU_DISTS):
        try:
            importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
        out.append(dist)
    return out


def has_gpu_build() -> bool:
    """Whether the imported faiss can put indexes on a GPU."""
    return hasattr(faiss, "StandardGpuResources")


if len(installed_faiss()) > 1:
    log.warning("both %s are installed: they write the same module faiss; uninstall one "
                "(pip uninstall faiss-cpu keeps the GPU build)", " and ".join(installed_faiss()))

__all__ = ["faiss", "has_gpu_build", "installed_faiss"]
