"""Artifacts on disk: one folder per (dataset, stage), published atomically for writers and readers alike.

The stage's path ``root/<dataset>/<stage>`` is a relative symlink to a version folder ``.<stage>.v-<id>`` beside it.
A write fills a new version folder, fsyncs it, and switches the link with one ``os.replace`` of a new symlink, so a
reader opening a file by the stage path finds it in the complete old or the complete new version, never in a
half-written or missing folder; the replaced version is removed after the switch. A failed or killed run never
changes what the link names. Writers hold a shared lock on ``.<stage>.lock`` while they write; a write that finds no
other writer (the exclusive lock is free) first sweeps what killed writers left: version folders the link does not
name, temporary links, and the ``.tmp-*`` / ``.old-*`` folders of the earlier rename-away scheme. A store's write
sweeps every stage of its dataset so (docs/decisions.md#stage-versions-behind-a-symlink).

With a remote artifact root (``XC_ARTIFACT_ROOT``, :mod:`xc_dagster.remote_store`) these folders are the local cache
of the published stages: :meth:`ArtifactStore.publish` uploads a written stage, and :meth:`ArtifactStore.sync`
(which ``require`` runs) replaces a stage whose local copy is not the remote manifest's version by that version,
downloaded and verified into a new version folder switched in as a write is. A local write not yet published and
newer than the manifest is kept, so a run between its write and its publish publishes its own data
(docs/decisions.md#remote-artifact-manifest).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Iterator, Literal

import numpy as np

from xc_dagster.durable import atomic_write_text, fsync_dir, fsync_tree
from xc_dagster.errors import XCError
from xc_dagster.remote_store import Manifest, RemoteArtifactError, RemoteStore

log = logging.getLogger("xc_dagster")

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: no advisory locks, the lock is a no-op (as data/cache.py's)
    fcntl = None  # type: ignore[assignment]

VERSION, LINK = "v-", "link-"  # name parts of a stage's version folders and of its not yet switched links
LEFTOVER_PARTS = (VERSION, LINK, "tmp-", "old-")  # tmp- / old-: folders of the earlier rename-away scheme
LEFTOVER_RE = re.compile(r"^\.(?P<stage>.+)\.(?:v|link|tmp|old)-[0-9a-f]+$")  # the stage a leftover belongs to
# the replaced version is removed this long after the switch: a reader descheduled between reading the link and
# opening a file of its version (1 missing and 1 partial read in 28,577 under a loaded 2-core machine) still finds it
RETIRE_GRACE_S = 0.02
REMOTE_DIR = "_remote"  # <root>/<dataset>/_remote/<stage>.json: which local versions are copies, which unpublished


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
        time.sleep(RETIRE_GRACE_S)  # a reader that resolved the link just before the switch still finds its files
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


class ArtifactStore:
    """Paths of every stage's artifacts under ``root/<dataset>/<stage>`` (see the module docstring).

    ``remote``: the published stages this local tree caches; ``"env"`` (default) reads ``XC_ARTIFACT_ROOT``,
    None keeps every artifact local. A stage is checked against the remote manifest once per store object.
    """

    def __init__(self, root: Path, remote: RemoteStore | None | Literal["env"] = "env"):
        self.root = Path(root)
        self.remote = RemoteStore.from_env() if remote == "env" else remote
        self._checked: set[tuple[str, str]] = set()
        self._written: dict[tuple[str, str], str] = {}  # (dataset, stage) -> the version folder it wrote last

    def stage_dir(self, dataset: str, stage: str) -> Path:
        return self.root / dataset / stage

    def require(self, dataset: str, stage: str) -> Path:
        self.sync(dataset, stage)
        d = self.stage_dir(dataset, stage)
        if not d.is_dir():
            where = f" nor under {self.remote.uri(self.remote.stage_key(dataset, stage))}" if self.remote else ""
            raise MissingArtifact(
                f"dataset {dataset!r}: stage {stage!r} has no artifacts at {d}{where}; materialize it first")
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
        so a killed write of a stage that is not rewritten soon is reclaimed too. With a remote root the version is
        recorded as a write of this home not yet published, with its time, before it is switched in (:meth:`_stale`)."""
        with self._writing(dataset, stage, self._record_write if self.remote is not None else None) as tmp:
            yield tmp

    @contextlib.contextmanager
    def _writing(self, dataset: str, stage: str, record: Callable[[str, str, str], None] | None) -> Iterator[Path]:
        self.sweep(dataset)
        with atomic_dir(self.stage_dir(dataset, stage)) as tmp:
            yield tmp
            if record is not None:
                record(dataset, stage, tmp.name)  # before the switch: never current without its record
        self._written[(dataset, stage)] = tmp.name  # what this store's publish sends, not what the link names then

    # ---- the remote root: publish after a write, fetch before a read
    def _marker(self, dataset: str, stage: str) -> Path:
        return self.root / dataset / REMOTE_DIR / f"{stage}.json"

    def _marker_lock(self, dataset: str, stage: str) -> contextlib.AbstractContextManager[bool]:
        """Held to change the marker, and by a fetch throughout (one fetch of a stage at a time on this tree)."""
        return file_lock(self._marker(dataset, stage).with_suffix(".lock"))

    def _marks(self, dataset: str, stage: str) -> tuple[dict[str, str], dict[str, Any]]:
        """What the marker of this remote root says of local version folders (by name): those that are copies of a
        remote version (fetched or published), and those written here and not published yet, each with the remote
        version current when it was written (``{"base": version, "" for none}``; a record of before: its write time
        in ns since the epoch). A marker of another root (or none) names neither; one of the earliest layout names
        one copy, one of the previous layout copies only."""
        try:
            mark = load_json(self._marker(dataset, stage))
        except (OSError, ValueError):
            return {}, {}
        if not isinstance(mark, dict) or mark.get("root") != self.remote.root:
            return {}, {}
        local, version, pending = mark.get("local"), mark.get("version"), mark.get("pending")
        if isinstance(local, str):  # the earliest layout: {"root", "version", "local": one name}
            copies = {local: version} if isinstance(version, str) else {}
        else:
            copies = {k: v for k, v in local.items() if isinstance(v, str)} if isinstance(local, dict) else {}
        written = ({k: v for k, v in pending.items() if type(v) is int or (isinstance(v, dict) and isinstance(
            v.get("base"), str))} if isinstance(pending, dict) else {})
        return copies, written

    def _record(self, dataset: str, stage: str, name: str, version: str | None = None,
                written: dict[str, Any] | int | None = None) -> None:
        """Record local version ``name`` as a copy of remote ``version``, or else as a write of this home not
        published yet (``written``: the remote version it was written over); entries of version folders removed
        since are dropped. The caller holds :meth:`_marker_lock`."""
        copies, pending = self._marks(dataset, stage)
        copies.pop(name, None)
        pending.pop(name, None)
        if version is not None:
            copies[name] = version
        else:
            pending[name] = written
        there = {n for n in {*copies, *pending} if (self.root / dataset / n).is_dir()}
        atomic_write_text(self._marker(dataset, stage), json.dumps(
            {"root": self.remote.root, "local": {n: v for n, v in copies.items() if n in there},
             "pending": {n: t for n, t in pending.items() if n in there}}) + "\n")

    def _record_write(self, dataset: str, stage: str, name: str) -> None:
        """Record a write with the remote version current now, which a later fetch compares with the manifest's:
        no clock of this host or another's is read (docs/decisions.md#remote-artifact-manifest)."""
        try:
            manifest = self.remote.manifest(dataset, stage)
            written: dict[str, Any] | int = {"base": "" if manifest is None else manifest.version}
        except RemoteArtifactError as e:  # the write stands; its record falls back to this host's clock
            log.warning("%s / %s: the remote manifest could not be read (%s); the write is recorded by its time",
                         dataset, stage, e)
            written = time.time_ns()
        with self._marker_lock(dataset, stage):
            self._record(dataset, stage, name, written=written)

    def _stale(self, dataset: str, stage: str, manifest: Manifest) -> bool:
        """Whether sync replaces the local stage by ``manifest``'s version. Kept: a copy of that version, and a write
        of this home not published yet, made while the manifest named the version it names now (its run publishes
        it next; replacing it would have the run publish the older data). Replaced: a missing stage, a copy of
        another version, a write older than the manifest (another home published after it: its own publish
        failed, or has not come yet), a version without a record
        (written before the remote root was set, or recorded for another root) and a real folder of before
        versions: a stage built on them would be published on inputs the remote does not have."""
        d = self.stage_dir(dataset, stage)
        if not d.is_dir():
            return True
        try:
            here = os.readlink(d)
        except OSError:  # a real folder of the layout before versions
            return True
        copies, pending = self._marks(dataset, stage)
        if here in copies:
            return copies[here] != manifest.version
        written = pending.get(here)
        if isinstance(written, dict):  # replaced once another version was published after it was written
            return written["base"] != manifest.version
        return written is None or written <= manifest.created_ns  # a record of before: by the clocks

    def sync(self, dataset: str, stage: str) -> bool:
        """Bring the local copy of a stage to the remote manifest's version unless it is that version or a newer
        write not published yet (see :meth:`_stale`): downloaded, checked against the manifest, switched in like a
        write. Returns whether the stage is materialized locally now. Without a remote root, or already checked by
        this store, only the latter."""
        d = self.stage_dir(dataset, stage)
        if self.remote is None or (dataset, stage) in self._checked:
            return d.is_dir()
        manifest = self.remote.manifest(dataset, stage)
        if manifest is not None and self._stale(dataset, stage, manifest):
            with self._marker_lock(dataset, stage):  # the next fetch of the stage on this tree finds it fresh
                if self._stale(dataset, stage, manifest):
                    self._fetch(dataset, stage, manifest)
        self._checked.add((dataset, stage))
        return d.is_dir()

    def _fetch(self, dataset: str, stage: str, manifest: Manifest) -> None:
        """Download ``manifest``'s version into a new version, recorded as its copy before the switch (a kill on
        either side of it leaves the current version known). The caller holds :meth:`_marker_lock`."""
        with self._writing(dataset, stage, lambda ds, st, name: self._record(ds, st, name, manifest.version)) as tmp:
            self.remote.download(manifest, tmp)

    def publish(self, dataset: str, stage: str) -> Manifest | None:
        """Upload the stage's complete local folder as the remote's new current version (None: no remote root):
        the version this store wrote last, else the one the link names. When the link no longer names it (a
        concurrent local rewrite or fetch replaced it) the upload fails rather than send another run's data or a
        removed folder's remains; the manifest then still names the previous version."""
        if self.remote is None:
            return None
        d = self.require_local(dataset, stage)
        local = self._written.get((dataset, stage), os.readlink(d))

        def still_current() -> None:
            if os.readlink(d) != local:
                raise RemoteArtifactError(
                    f"dataset {dataset!r}: stage {stage!r}: its local version {local} was replaced by "
                    f"{os.readlink(d)} (a concurrent write or fetch) before it was published; the remote manifest "
                    f"still names its previous version; materialize the stage again")

        still_current()
        manifest = self.remote.publish(dataset, stage, self.root / dataset / local, check=still_current)
        with self._marker_lock(dataset, stage):
            self._record(dataset, stage, local, manifest.version)  # a write published: a copy of its version now
        self._checked.add((dataset, stage))
        return manifest

    def require_local(self, dataset: str, stage: str) -> Path:
        """The stage's local folder, written by this tree's versioned writes (a symlink), without a remote check."""
        d = self.stage_dir(dataset, stage)
        if not d.is_symlink() or not d.is_dir():
            raise MissingArtifact(f"dataset {dataset!r}: stage {stage!r} has no local artifacts to publish at {d} "
                                  f"(a versioned stage folder, written by ArtifactStore.writing, expected)")
        return d


def link_or_copy(src: str | Path, dst: str | Path) -> None:
    """``dst`` as a hard link of the file ``src``: no second copy of a multi-GB index (a copy across file systems)."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def link(src: Path, dst: Path) -> None:
    """``dst`` as a hard link of the file ``src`` (a copy across file systems), or a folder of such links."""
    if src.is_dir():
        shutil.copytree(src, dst, copy_function=link_or_copy)
    else:
        link_or_copy(src, dst)


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
