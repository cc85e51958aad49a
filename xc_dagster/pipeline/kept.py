"""Work a long stage finished before it was killed, kept on disk so that the next run does not do it again: the
row blocks of mining's and evaluation's shortlists, and the index stage's finished indexes.

At the 1.3M shape the evaluation searches three indexes for 970,237 test queries (about an hour on 2 cores), mining
searches for 2,248,619 training points and the index stage builds graphs over 2.25M and 1.3M vectors (more than an
hour): a kill at 90% cost the whole stage again. Each block's arrays go to one ``.npz`` file, each finished
artifact to its own name, written to a temporary name, fsynced and renamed, under the stage's checkpoint folder
with a key file: the fingerprint of the stage's settings, of the versions of the upstream artifacts it reads and
(evaluation) of its queries. A folder holding another key's work is cleared, a block file that does not read back
whole is done again, and the stage clears the folder once its artifacts are written
(docs/decisions.md#kept-work).
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from xc_dagster.durable import atomic_write, atomic_write_text, fsync_file
from xc_dagster.faiss_module import faiss
from xc_dagster.retrieval.hnsw_build import GraphCheckpoint
from xc_dagster.storage import file_lock, fsync_tree, link

log = logging.getLogger("xc_dagster")
KEY = "key.txt"
PARTIAL = "partial-"  # an HNSW graph under construction: the chunks added so far (KeptWork.graph)
# what np.load raises on a truncated or damaged .npz
DAMAGED = (zipfile.BadZipFile, OSError, ValueError, EOFError, KeyError)


class KeptWork:
    """The finished work of one stage in ``folder`` (None: nothing kept), valid for ``key``; a context manager.

    One run at a time keeps work in a folder: it holds an exclusive ``flock`` on ``<folder>.lock`` until ``close``
    (the kernel releases it if the process dies). A run of the same stage started meanwhile keeps nothing and says
    so, rather than clearing or overwriting the first one's blocks."""

    def __init__(self, folder: Path | None, key: str):
        self.folder = None if folder is None else Path(folder)
        self.key = key
        self.resumed = self.resumed_rows = 0  # blocks (and their rows) read back instead of computed, in this run
        self._lock = contextlib.ExitStack()
        if self.folder is None:
            return
        if not self._lock.enter_context(file_lock(self.folder.with_name(f"{self.folder.name}.lock"), blocking=False)):
            log.warning("%s: another run of this stage is keeping its work there; this run keeps none", self.folder)
            self.folder = None
            return
        try:
            if self.folder.is_dir() and self._stored_key() != key:
                shutil.rmtree(self.folder)  # another configuration's or other inputs' blocks: never mixed in
            self.folder.mkdir(parents=True, exist_ok=True)
            if self._stored_key() != key:
                atomic_write_text(self.folder / KEY, key)
        except BaseException:
            self._lock.close()
            raise

    def _stored_key(self) -> str | None:
        try:
            return (self.folder / KEY).read_text()
        except OSError:
            return None

    def _path(self, start: int) -> Path:
        return self.folder / f"rows_{start:012d}.npz"

    def load(self, start: int) -> dict[str, np.ndarray] | None:
        """The arrays of the block starting at row ``start``, or None when it is not (whole) on disk."""
        path = None if self.folder is None else self._path(start)
        if path is None or not path.exists():
            return None
        try:
            with np.load(path, allow_pickle=False) as z:
                return {name: z[name] for name in z.files}
        except DAMAGED as exc:
            log.warning("row block %s does not read back (%s: %s); it is done again", path, type(exc).__name__, exc)
            path.unlink(missing_ok=True)
            return None

    def save(self, start: int, arrays: dict[str, np.ndarray]) -> None:
        """Keep the block starting at ``start`` (durable once it returns)."""
        if self.folder is None:
            return

        def write(path: Path) -> None:
            with open(path, "wb") as fh:  # a handle: np.savez would append ".npz" to the temporary name
                np.savez(fh, **arrays)

        self.keep(self._path(start).name, write)

    def blocks(self, n: int, rows: int, compute: Callable[[int, int], dict[str, np.ndarray]],
               skipped: Callable[[int], None] | None = None) -> Iterator[tuple[int, int, dict[str, np.ndarray]]]:
        """(start, end, arrays) of each block of ``rows`` rows of ``n``: read back when kept, else ``compute(start,
        end)`` and kept. ``skipped(count)``: told the rows of each block read back (a progress bar)."""
        for s in range(0, n, rows):
            e = min(n, s + rows)
            got = self.load(s)
            if got is not None and any(len(a) != e - s for a in got.values()):
                got = None  # kept with another block size: done again
            if got is not None:
                self.resumed += 1
                self.resumed_rows += e - s
                if skipped is not None:
                    skipped(e - s)
            else:
                got = compute(s, e)
                self.save(s, got)
            yield s, e, got

    def path(self, name: str) -> Path | None:
        """The kept artifact ``name`` (a file or a folder), None when a killed run did not finish it."""
        kept = None if self.folder is None else self.folder / name
        return kept if kept is not None and kept.exists() else None

    def keep(self, name: str, write: Callable[[Path], None]) -> Path | None:
        """Keep what ``write(path)`` writes (a file or a folder) as ``name``, whole or not at all; returns where
        (None: nothing is kept, no folder)."""
        if self.folder is None:
            return None
        # one fixed temporary name: a killed write's leftover is removed, not piled up beside multi-GB indexes
        atomic_write(self.folder / name, write, tmp=self.folder / f".{name}.tmp", sync=_sync)
        return self.folder / name

    def artifact(self, name: str, build: Callable[[Path], None], dest: Path) -> bool:
        """``dest`` (a file or a folder) as ``build(path)`` writes it: linked from the kept copy when a killed run
        finished it, else built, kept, then linked. Returns whether the kept copy was used."""
        if self.folder is None:
            build(dest)
            return False
        kept = self.path(name)
        used = kept is not None
        link(kept if used else self.keep(name, build), dest)
        return used

    def graph(self, name: str) -> GraphCheckpoint | None:
        """Where an HNSW build of the index ``name`` keeps its partial graph as it goes (``partial-<name>``; None:
        nothing is kept), for ``hnsw_build.build_hnsw``; ``drop(name)`` once the whole index is kept."""
        if self.folder is None:
            return None

        def load():
            path = self.path(PARTIAL + name)
            try:
                return None if path is None else faiss.read_index(str(path))
            except RuntimeError as exc:  # a damaged file: the build starts again
                log.warning("partial graph %s does not read back (%s); building from the start", path, exc)
                return None

        return GraphCheckpoint(load, lambda index: self.keep(PARTIAL + name,
                                                             lambda path: faiss.write_index(index, str(path))))

    def drop(self, name: str) -> None:
        """Remove the partial graph of ``name`` (its whole index is kept or written)."""
        if self.folder is not None:
            _remove(self.folder / (PARTIAL + name))

    def __enter__(self) -> KeptWork:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Let another run keep work in the folder (what is kept stays)."""
        self._lock.close()

    def clear(self) -> None:
        if self.folder is not None and self.folder.exists():
            shutil.rmtree(self.folder, ignore_errors=True)


def _sync(path: Path) -> None:
    fsync_tree(path) if path.is_dir() else fsync_file(path)  # a kept folder: every file and folder in it


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


