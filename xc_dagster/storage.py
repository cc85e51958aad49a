"""Artifacts on disk: one folder per (dataset, stage), published atomically for writers and readers alike.

The stage's path ``root/<dataset>/<stage>`` is a relative symlink to a version folder ``.<stage>.v-<id>`` beside it.
A write fills a new version folder, fsyncs it, and switches the link with one ``os.replace`` of a new symlink, so a
reader opening a file by the stage path finds it in the complete old or the complete new version, never in a
half-written or missing folder; the replaced version is removed after the switch. A failed or killed run never
changes what the link names. Writers hold a shared lock on ``.<stage>.lock`` while they write; a write that finds no
other writer (the exclusive lock is free) first sweeps what killed writers left: version folders the link does not
name, temporary links, and the ``.tmp-*`` / ``.old-*`` folders of the earlier rename-away scheme. A store's write
sweeps every stage of its dataset so (docs/decisions.md#stage-versions-behind-a-symlink).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import uuid
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from xc_dagster.errors import XCError

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: no advisory locks, the lock is a no-op (as data/cache.py's)
    fcntl = None  # type: ignore[assignment]

VERSION, LINK = "v-", "link-"  # name parts of a stage's version folders and of its not yet switched links
LEFTOVER_PARTS = (VERSION, LINK, "tmp-", "old-")  # tmp- / old-: folders of the earlier rename-away scheme
LEFTOVER_RE = re.compile(r"^\.(?P<stage>.+)\.(?:v|link|tmp|old)-[0-9a-f]+$")  # the stage a leftover belongs to


class MissingArtifact(XCError, FileNotFoundError):
    """An upstream stage has not been materialized for this dataset."""


@contextlib.contextmanager
def file_lock(path: Path, shared: bool = False, blocking: bool = True) -> Iterator[bool]:
    """Hold an ``flock`` on ``path`` (created if missing) for the block; yields whether it was taken (always True
    when ``blocking``). The kernel releases it when the process dies, SIGKILL included."""
    if fcntl is None:  # pragma: no cover - Windows
        yield True
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | (0 if blocking else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        os.close(fd)  # closing the last descriptor releases the lock


def fsync_file(path: Path) -> None:
    """Flush a written file's data, or a folder's entries (a rename or a new file in it), to the disk (any
    descriptor of it will do)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(folder: Path) -> None:
    """Make a folder's entries (a rename or a new file in it) durable."""
    if os.name != "nt":  # Windows cannot open a folder to fsync it
        fsync_file(folder)


def fsync_tree(folder: Path) -> None:
    """fsync every file and folder under ``folder`` (the folder included), so a published link never names data
    the disk has not got."""
    for dirpath, _, filenames in os.walk(folder):
        for name in filenames:
            fsync_file(Path(dirpath) / name)
        fsync_dir(Path(dirpath))


def stage_leftovers(final: Path) -> list[Path]:
    """What interrupted writers left beside ``final``: its version folders the link does not name, temporary
    links, and the earlier scheme's ``.tmp-*`` / ``.old-*`` folders. A live writer's folder is listed too: remove
    them only holding the stage lock exclusively (:func:`sweep_stage`)."""
    final = Path(final)
    if not final.parent.is_dir():
        return []
    current = os.readlink(final) if final.is_symlink() else None
    prefix = f".{final.name}."
    return sorted(p for p in final.parent.iterdir()
                  if p.name.startswith(prefix) and p.name != current
                  and p.name[len(prefix):].startswith(LEFTOVER_PARTS))


def _remove(path: Path) -> None:
    if path.is_symlink() or not path.is_dir():
        path.unlink(missing_ok=True)
    else:
        shutil.rmtree(path, ignore_errors=True)


def _lock_path(final: Path) -> Path:
    return final.parent / f".{final.name}.lock"


def sweep_stage(final: Path) -> list[Path]:
    """Remove ``final``'s leftovers if no writer of it is alive (its lock is free); returns what was removed."""
    final = Path(final)
    with file_lock(_lock_path(final), blocking=False) as alone:
        if not alone:
            return []
        gone = stage_leftovers(final)
        for p in gone:
            _remove(p)
        return gone


def _switch(final: Path, version: Path) -> None:
    """Point ``final`` at ``version`` with one atomic rename of a new symlink; remove the version it replaces."""
    link = final.parent / f".{final.name}.{LINK}{uuid.uuid4().hex[:8]}"
    os.symlink(version.name, link)  # relative: the home may move or be copied
    old = None
    if final.is_symlink():
        old = final.parent / os.readlink(final)
    elif final.exists():  # a real folder from before versions: moved aside once (a reader's one gap)
        old = final.parent / f".{final.name}.{VERSION}{uuid.uuid4().hex[:8]}"
        with contextlib.suppress(FileNotFoundError):  # a concurrent writer moved it first
            os.replace(final, old)
    os.replace(link, final)
    fsync_dir(final.parent)
    if old is not None and old.parent == final.parent and old.name.startswith(f".{final.name}.{VERSION}"):
        _remove(old)  # only a version of ours: a hand-made link to elsewhere is not ours to delete


@contextlib.contextmanager
def atomic_dir(final: Path) -> Iterator[Path]:
    """Yield a new version folder; on success ``final`` names it (the old version removed), on error it is deleted.

    The first writer to find the stage free of writers sweeps the leftovers of killed ones (:func:`sweep_stage`).
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    sweep_stage(final)
    with file_lock(_lock_path(final), shared=True):  # marks this writer alive for other writers' sweeps
        version = final.parent / f".{final.name}.{VERSION}{uuid.uuid4().hex[:8]}"
        version.mkdir()
        try:
            yield version
            fsync_tree(version)
        except BaseException:
            shutil.rmtree(version, ignore_errors=True)
            raise
        _switch(final, version)  # a failure in it leaves a leftover for the next sweep, never a current version


def atomic_write_text(path: Path, text: str) -> None:
    """Write a file by temp + fsync + rename: a reader or a crash sees the old or the new content, whole."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


class ArtifactStore:
    """Paths of every stage's artifacts under ``root/<dataset>/<stage>`` (see the module docstring)."""

    def __init__(self, root: Path):
        self.root = Path(root)

    def stage_dir(self, dataset: str, stage: str) -> Path:
        return self.root / dataset / stage

    def require(self, dataset: str, stage: str) -> Path:
        d = self.stage_dir(dataset, stage)
        if not d.is_dir():
            raise MissingArtifact(
                f"dataset {dataset!r}: stage {stage!r} has no artifacts at {d}; materialize it first")
        return d

    def sweep(self, dataset: str) -> list[Path]:
        """Remove what killed writers left in any stage of ``dataset`` that no live writer holds; returns it."""
        folder = self.root / dataset
        stages = {m["stage"] for p in (folder.iterdir() if folder.is_dir() else ())
                  if (m := LEFTOVER_RE.match(p.name))}
        return [p for stage in sorted(stages) for p in sweep_stage(folder / stage)]

    @contextlib.contextmanager
    def writing(self, dataset: str, stage: str) -> Iterator[Path]:
        """A new version folder of the stage (see :func:`atomic_dir`); every stage of the dataset is swept first,
        so a killed write of a stage that is not rewritten soon is reclaimed too."""
        self.sweep(dataset)
        with atomic_dir(self.stage_dir(dataset, stage)) as tmp:
            yield tmp


def save_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True, default=_jsonable))


def load_json(path: Path) -> Any:
    return json.loads(Path(path).read_text())


def _jsonable(o: Any) -> Any:
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    if isinstance(o, np.ndarray):
        return o.tolist()
    if isinstance(o, Path):
        return str(o)
    if isinstance(o, tuple):
        return list(o)
    raise TypeError(f"not JSON serialisable: {type(o)}")
