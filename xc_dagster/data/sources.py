"""Resolve a dataset source URI (local path, ``file://``, ``http(s)://``, any fsspec scheme) to a local folder.

Remote sources are fetched into ``cache_dir`` (:mod:`~xc_dagster.data.cache`) and reused when present;
``http(s)://`` downloads resume an interrupted ``.part`` file of the same version only (``If-Range``,
:mod:`~xc_dagster.data.download`), and every single-file source (archive or file) is checked against its SHA-256
when one is given: a partial or corrupt download never becomes a cache entry. Archives are extracted safely
(:mod:`~xc_dagster.data.archives`).
"""

from __future__ import annotations

import os
import posixpath
import shutil
from pathlib import Path, PurePosixPath
from urllib.parse import unquote, urlsplit
from urllib.request import url2pathname

import fsspec

from xc_dagster.data.archives import check_member, is_archive
from xc_dagster.data.cache import (
    cache_key,
    commit,
    entry,
    fetch_to_cache,
    install_file,
    normalize_sha256,
    sweep_leftovers,
    temp_path,
    verify_sha256,
)
from xc_dagster.data.download import discard, download
from xc_dagster.errors import XCConfigError, XCDatasetNotFound, XCError
from xc_dagster.storage import file_lock


def _no_folder_digest(source: str, sha256: str | None) -> None:
    if sha256:
        raise XCConfigError(f"dataset source {source} is a folder: a sha256 checksum applies to a single file "
                            "or archive source; remove the checksum or point the source at the archive")


def _resolve_local(path: Path, cache_dir: Path, sha256: str | None = None) -> Path:
    if not path.exists():
        raise XCDatasetNotFound(f"dataset source {path} does not exist")
    if path.is_dir():
        _no_folder_digest(str(path), sha256)
        return path
    if is_archive(path.name):
        st = path.stat()
        key = cache_key(str(path.resolve()), f"{st.st_size}:{st.st_mtime_ns}:{sha256 or ''}")
        target = cache_dir / key
        if target.is_dir():
            return entry(target, path.name)
        verify_sha256(path, sha256, str(path))  # the user's own file: reported, never deleted
        cache_dir.mkdir(parents=True, exist_ok=True)
        return install_file(path, path.name, target, str(path))  # extracts straight from the archive
    verify_sha256(path, sha256, str(path))
    return path.parent


def _resolve_http(url: str, cache_dir: Path, sha256: str | None = None) -> Path:
    """Resumable download into ``cache_dir/.KEY.part`` (+ its validator), SHA-256 check, extraction, then the
    cache entry.

    The cache entry ``cache_dir/KEY`` appears only once all three succeeded; a failed check or extraction
    deletes the download so the next call starts afresh.
    """
    name = PurePosixPath(unquote(urlsplit(url).path)).name or "download"
    key = cache_key(url, sha256 or "")
    target = cache_dir / key
    if target.is_dir():
        return entry(target, name)
    cache_dir.mkdir(parents=True, exist_ok=True)
    part = cache_dir / f".{key}.part"
    with file_lock(cache_dir / f".{key}.lock"):
        if target.is_dir():  # another process finished it while we waited
            return entry(target, name)
        download(url, part)
        try:
            verify_sha256(part, sha256, url, delete=True)
            return install_file(part, name, target, url)
        except BaseException:
            discard(part)
            raise
        finally:
            if target.is_dir():
                discard(part)


def _copy_fsspec_folder(fs: fsspec.AbstractFileSystem, path: str, source: str, cache_dir: Path, key: str) -> Path:
    """Copy a remote folder file by file into a temp folder, then rename it to ``cache_dir/key``."""
    target = cache_dir / key
    if target.is_dir():
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    sweep_leftovers(cache_dir, key)
    work = temp_path(cache_dir, key, "tmp")
    work.mkdir()
    try:
        root = path.rstrip("/")
        for f in fs.find(path):
            rel = posixpath.relpath(f, root)
            dest = check_member(work, rel, source)
            dest.parent.mkdir(parents=True, exist_ok=True)
            fs.get_file(f, str(dest))
        commit(work, target)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    return target


def _resolve_fsspec(source: str, cache_dir: Path, sha256: str | None = None) -> Path:
    try:
        fs, path = fsspec.core.url_to_fs(source)
    except (ValueError, ImportError) as e:
        raise XCError(f"unsupported dataset source {source!r}: {e}") from e
    try:
        exists = fs.exists(path)
    except Exception as e:  # backends raise their own types (auth, network)
        raise XCError(f"could not reach dataset source {source!r}: {e}") from e
    if not exists:
        raise XCDatasetNotFound(f"dataset source {source} does not exist")
    key = cache_key(source, sha256 or "")
    if not fs.isdir(path):
        name = posixpath.basename(path.rstrip("/"))

        def fetch(dest: Path) -> None:
            fs.get_file(path, str(dest))
            verify_sha256(dest, sha256, source, delete=True)

        return fetch_to_cache(source, name, cache_dir, key, fetch)
    _no_folder_digest(source, sha256)
    return _copy_fsspec_folder(fs, path, source, cache_dir, key)


def resolve_source(source: str, cache_dir: Path, sha256: str | None = None) -> Path:
    """A local folder holding the dataset named by ``source``.

    Local path / ``file://``: a folder as is, a file's parent folder, an archive extracted into the cache.
    ``http(s)://``: resumable streamed download into ``cache_dir``; other schemes: fsspec copy into
    ``cache_dir``. Archives are extracted safely and a lone top-level folder is descended into.
    ``sha256`` (hex digest of the source file or archive) is verified before anything is cached: a mismatch
    raises :class:`XCFormatError` with both digests (a downloaded copy is deleted); folders take no digest.
    """
    sha256 = normalize_sha256(sha256)
    cache_dir = Path(cache_dir)
    source = str(source)
    parts = urlsplit(source)
    scheme = parts.scheme.lower()
    if scheme == "" or (len(scheme) == 1 and os.name == "nt"):  # plain path (or a Windows drive letter)
        return _resolve_local(Path(source).expanduser(), cache_dir, sha256)
    if scheme == "file":
        if parts.netloc not in ("", "localhost"):
            raise XCError(f"file:// source with a remote host is not supported: {source}")
        return _resolve_local(Path(url2pathname(unquote(parts.path))), cache_dir, sha256)
    if scheme in ("http", "https"):
        return _resolve_http(source, cache_dir, sha256)
    return _resolve_fsspec(source, cache_dir, sha256)
