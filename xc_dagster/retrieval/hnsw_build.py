"""An HNSW graph (faiss ``IndexHNSWFlat``, inner product) built in chunks of vectors, each chunk's graph kept so that
a killed build goes on from the last chunk instead of from the start.

At the 1.3M shape one graph takes 27 to 56 minutes on 2 cores (1.3M labels, 2.25M training points): a kill, an OOM
of something beside it or a lost machine cost all of it, and faiss's single ``add`` call reported nothing until it
returned. With a ``GraphCheckpoint`` the vectors go in by ``CHUNK`` rows (``index.add`` extends the graph: each
chunk's points are linked into the graph of the ones before), the graph is kept after every chunk but the last,
and a resumed build loads it and adds the rest, after checking that its stored vectors are the first rows of
these vectors (docs/decisions.md#resumable-graphs). Without one the vectors go in by one ``add``, as before.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from xc_dagster.faiss_module import faiss

log = logging.getLogger("xc_dagster")
CHUNK = 1 << 18  # vectors per add when the build is kept as it goes: ~4-6 minutes of a memory-bound 2-core build


@dataclass
class GraphCheckpoint:
    """Where a graph under construction is kept: ``load()`` the kept partial graph (None: none, or unreadable),
    ``save(index)`` keep this one (whole or not at all)."""

    load: Callable[[], object | None]
    save: Callable[[object], None]


def build_hnsw(vectors: np.ndarray, m: int, ef_construction: int, checkpoint: GraphCheckpoint | None = None,
               progress: Callable[[int], None] | None = None):
    """A faiss ``IndexHNSWFlat`` over ``vectors`` (float32, C order); with ``checkpoint``, resumed from its kept
    partial graph when that is a prefix of these vectors, and kept after each ``CHUNK`` of vectors added.
    ``progress(rows)`` follows each chunk."""
    n, dim = vectors.shape
    index = _resumable(checkpoint.load(), vectors) if checkpoint is not None else None
    if index is None:
        index = faiss.IndexHNSWFlat(dim, m, faiss.METRIC_INNER_PRODUCT)
    else:
        log.info("HNSW build resumed from a kept graph of %d of %d vectors", index.ntotal, n)
        if progress is not None:
            progress(int(index.ntotal))
    index.hnsw.efConstruction = ef_construction
    step = CHUNK if checkpoint is not None else max(n, 1)
    for s in range(int(index.ntotal), n, step):
        e = min(n, s + step)
        index.add(vectors[s:e])
        if checkpoint is not None and e < n:
            checkpoint.save(index)
        if progress is not None:
            progress(e - s)
    return index


def _resumable(index, vectors: np.ndarray):
    """``index`` when it can be resumed over ``vectors``: a flat-storage HNSW graph of their width over at most as
    many vectors, whose first and last stored ones are these vectors' rows; else None."""
    if index is None:
        return None
    n, dim = vectors.shape
    try:
        # read_index returns the concrete class; a downcast_index wrapper would not own the index (freed with this one)
        flat = faiss.downcast_index(index.storage)
        done = int(index.ntotal)
        ok = isinstance(index, faiss.IndexHNSWFlat) and index.d == dim and 0 < done <= n
        if ok:
            stored = faiss.rev_swig_ptr(flat.get_xb(), done * dim).reshape(done, dim)
            ok = np.array_equal(stored[[0, done - 1]], vectors[[0, done - 1]])
    except (AttributeError, RuntimeError, TypeError):
        ok = False
    if not ok:
        log.warning("a kept partial HNSW graph does not match these %d vectors; building from the start", n)
        return None
    return index
