"""The source cache: one folder per fetched source, installed atomically, and SHA-256 checksums of sources.

A fetched file lands in a temp name, is checked and extracted into a temp folder, and that folder is fsynced and
renamed to ``cache_dir/<key>``: a cache entry that exists is complete, a crash included, and a partial or corrupt
download never becomes one. A failed install removes its temp names; those of a killed process (named with its
pid) are swept by the next install of the same key.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import socket
import uuid
from collections.abc import Callable
from pathlib import Path, PurePosixPath
from urllib.parse import unquote, urlsplit

from xc_dagster.checksums import file_sha256
from xc_dagster.data.archives import ARCHIVE_SUFFIXES, extract_archive, is_archive
from xc_dagster.durable import fsync_dir, fsync_tree
from xc_dagster.errors import XCConfigError, XCFormatError

# ----------------------------------------------------------------------------------------- checksums

def normalize_sha256(value: str | None) -> str | None:
    """A checksum as 64 lowercase hex digits (``sha256:`` prefix allowed), None when empty; else XCConfigError."""
    if value is None or not str(value).strip():
        return None
    v = str(value).strip().lower()
    v = v[len("sha256:"):] if v.startswith("sha256:") else v
    if not re.fullmatch(r"[0-9a-f]{64}", v):
        raise XCConfigError(f"sha256 must be 64 hexadecimal digits, got {value!r}")
    return v


def verify_sha256(path: Path, expected: str | None, label: str, delete: bool = False) -> None:
    """Raise :class:`XCFormatError` (naming ``label``, expected and got digests) unless ``path`` hashes to
    ``expected``; ``delete`` removes the bad file first. ``expected=None`` checks nothing."""
    if not expected:
        return
    got = file_sha256(path)
    if got != expected.lower():
        if delete:
            path.unlink(missing_ok=True)
        raise XCFormatError(label, None, f"a file with SHA-256 {expected.lower()}"
                            + (" (the corrupt download was deleted)" if delete else ""), got=got)


# ------------------------------------------------------------------------------------- cache entries

def cache_key(source: str, extra: str = "") -> str:
    """A readable, collision-safe cache folder name for a source."""
    stem = PurePosixPath(unquote(urlsplit(source).path)).name or "source"
    for suf in ARCHIVE_SUFFIXES:
        if stem.lower().endswith(suf):
            stem = stem[: -len(suf)]
            break
    stem = re.sub(r"[^A-Za-z0-9._-]+", "_", stem)[:60] or "source"
    digest = hashlib.sha256(f"{source}\0{extra}".encode()).hexdigest()[:12]
    return f"{stem}-{digest}"


def descend(folder: Path) -> Path:
    """The folder itself, or its only top-level sub-folder when that is all it holds."""
    entries = [p for p in folder.iterdir() if p.name != "__MACOSX"]
    if len(entries) == 1 and entries[0].is_dir() and not entries[0].is_symlink():
        return entries[0]
    return folder


def entry(target: Path, name: str) -> Path:
    """The dataset folder of the cache entry ``target`` of a file called ``name``."""
    return descend(target) if is_archive(name) else target


def commit(work: Path, target: Path) -> Path:
    """Rename a finished temp folder into place (another process may have won the race: keep theirs), its files
    and folders fsynced before and the cache folder's entries after, so a crash never leaves an entry whose
    files the disk has not got."""
    fsync_tree(work)
    try:
        os.rename(work, target)
    except OSError:
        if not target.is_dir():
            raise
        shutil.rmtree(work, ignore_errors=True)
        return target
    fsync_dir(target.parent)
    return target


def _host() -> str:
    """This machine's name as letters and digits (a part of temp names)."""
    return re.sub(r"[^A-Za-z0-9]", "", socket.gethostname())[:32] or "host"


def temp_path(cache_dir: Path, key: str, kind: str) -> Path:
    """A unique temp name of an install of ``key`` (kind ``tmp``: a folder, ``part``: a file); it carries the
    host and pid so that :func:`sweep_leftovers` can tell a live install's from a killed one's."""
    return cache_dir / f".{key}.{kind}-{_host()}-{os.getpid()}-{uuid.uuid4().hex[:12]}"


def _pid_alive(pid: int) -> bool:
    """Whether a process of this id runs on this machine (signal 0 checks without sending anything)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # exists, owned by another user
        return True
    return True


def sweep_leftovers(cache_dir: Path, key: str) -> None:
    """Remove the temp folders / files of installs of ``key`` whose process is gone (killed mid-extraction);
    only this host's: another host's pids cannot be checked from here (a cache shared over a network)."""
    if not cache_dir.is_dir():
        return
    pattern = re.compile(rf"^\.{re.escape(key)}\.(tmp|part)-{_host()}-(\d+)-[0-9a-f]+$")
    for p in cache_dir.iterdir():
        m = pattern.match(p.name)
        if m is None or _pid_alive(int(m.group(2))):
            continue
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)


def install_file(tmp_file: Path, name: str, target: Path, label: str) -> Path:
    """Turn a fetched file into the cached folder ``target``: extracted if an archive, else holding it."""
    sweep_leftovers(target.parent, target.name)
    work = temp_path(target.parent, target.name, "tmp")
    work.mkdir(parents=True)
    try:
        if is_archive(name):
            extract_archive(tmp_file, work, label)
        else:
            os.replace(tmp_file, work / (name or "download"))
        commit(work, target)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    return entry(target, name)


def fetch_to_cache(source: str, name: str, cache_dir: Path, key: str, fetch: Callable[[Path], None]) -> Path:
    """Fetch one file with ``fetch(dest_path)`` into a temp file, then install it as ``cache_dir/key``."""
    target = cache_dir / key
    if target.is_dir():
        return entry(target, name)
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp_file = temp_path(cache_dir, key, "part")
    try:
        fetch(tmp_file)
        return install_file(tmp_file, name, target, source)
    finally:
        tmp_file.unlink(missing_ok=True)


