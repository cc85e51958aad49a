"""Resolve a dataset source URI (local path, ``file://``, ``http(s)://``, any fsspec scheme) to a local folder.

Remote sources are fetched into ``cache_dir`` atomically (temp name, then rename) and reused when present;
``http(s)://`` downloads resume an interrupted ``.part`` file with a Range request, and every single-file
source (archive or file) is checked against its SHA-256 when one is given: a partial or corrupt download
never becomes a cache entry. Archives (``.zip``, ``.tar.gz``, ``.tgz``, ``.tar``) are extracted safely: a member whose path or link target
would land outside the extraction folder is rejected with :class:`XCFormatError` naming it.
"""

from __future__ import annotations

import contextlib
import hashlib
import http.client
import os
import posixpath
import re
import shutil
import stat
import tarfile
import urllib.error
import urllib.request
import uuid
import zipfile
import zlib
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from urllib.parse import unquote, urlsplit
from urllib.request import url2pathname

from xc_dagster.errors import XCConfigError, XCDatasetNotFound, XCError, XCFormatError

ARCHIVE_SUFFIXES = (".zip", ".tar.gz", ".tgz", ".tar")
_CHUNK = 1 << 20
_UNSAFE_MSG = "archive members that stay inside the extraction folder (no absolute paths, '..', or links out)"


def is_archive(name: str) -> bool:
    """Whether a file name has one of the supported archive suffixes, or is a single gzipped file
    (``X.gz``, decompressed to ``X``) other than the LF layout's own ``*.json.gz`` tables."""
    low = name.lower()
    return low.endswith(ARCHIVE_SUFFIXES) or (low.endswith(".gz") and not low.endswith(".json.gz"))


def _gunzip_single(archive: Path, dest: Path, label: str) -> None:
    """``X.gz`` holding one plain file: decompress it to ``dest/X`` (a gzipped tar goes to the tar path)."""
    import gzip

    name = Path(label).name
    out = dest / (name[:-3] if name.lower().endswith(".gz") else "data")
    _check_member(dest, out.name, label)
    with gzip.open(archive, "rb") as src, open(out, "wb") as dst:
        shutil.copyfileobj(src, dst, _CHUNK)


def _cache_key(source: str, extra: str = "") -> str:
    """A readable, collision-safe cache folder name for a source."""
    stem = PurePosixPath(unquote(urlsplit(source).path)).name or "source"
    for suf in ARCHIVE_SUFFIXES:
        if stem.lower().endswith(suf):
            stem = stem[: -len(suf)]
            break
    stem = re.sub(r"[^A-Za-z0-9._-]+", "_", stem)[:60] or "source"
    digest = hashlib.sha256(f"{source}\0{extra}".encode()).hexdigest()[:12]
    return f"{stem}-{digest}"


def _descend(folder: Path) -> Path:
    """The folder itself, or its only top-level sub-folder when that is all it holds."""
    entries = [p for p in folder.iterdir() if p.name != "__MACOSX"]
    if len(entries) == 1 and entries[0].is_dir() and not entries[0].is_symlink():
        return entries[0]
    return folder


# ----------------------------------------------------------------------------------- safe extraction

def _check_member(dest: Path, name: str, label: str) -> Path:
    """The destination of member ``name``; raises unless it stays inside ``dest``."""
    if (not name or name.startswith(("/", "\\")) or re.match(r"^[A-Za-z]:", name)
            or ".." in PurePosixPath(name.replace("\\", "/")).parts):
        raise XCFormatError(label, None, _UNSAFE_MSG, got=name)
    target = (dest / name).resolve()
    if not target.is_relative_to(dest.resolve()):
        raise XCFormatError(label, None, _UNSAFE_MSG, got=name)
    return target


def _extract_zip(archive: Path, dest: Path, label: str) -> None:
    with zipfile.ZipFile(archive) as zf:
        infos = zf.infolist()
        for info in infos:  # check everything before writing anything
            _check_member(dest, info.filename, label)
            if stat.S_ISLNK(info.external_attr >> 16):
                raise XCFormatError(label, None, _UNSAFE_MSG + " (symlinks are not allowed in zip archives)",
                                    got=info.filename)
        for info in infos:
            target = _check_member(dest, info.filename, label)
            if info.is_dir():
                target.mkdir(parents=True, exist_ok=True)
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            with zf.open(info) as src, open(target, "wb") as out:
                shutil.copyfileobj(src, out, _CHUNK)


def _extract_tar(archive: Path, dest: Path, label: str) -> None:
    with tarfile.open(archive, "r:*") as tf:
        members = tf.getmembers()
        for m in members:
            _check_member(dest, m.name, label)
            if m.issym():
                _check_symlink_target(dest, m.name, m.linkname, label)
            elif m.islnk():
                _check_member(dest, m.linkname, label)
            elif not (m.isfile() or m.isdir()):
                raise XCFormatError(label, None, "only regular files, folders and links in the archive",
                                    got=m.name)
        tf.extractall(dest, members=members, filter="data")


def _check_symlink_target(dest: Path, member: str, link: str, label: str) -> None:
    """A symlink's target, resolved from the member's folder, must stay inside ``dest``."""
    joined = posixpath.normpath(posixpath.join(posixpath.dirname(member), link))
    if joined.startswith("../") or joined == ".." or link.startswith("/"):
        raise XCFormatError(label, None, _UNSAFE_MSG, got=f"{member} -> {link}")
    _check_member(dest, joined, label)


def extract_archive(archive: Path, dest: Path, label: str | None = None) -> None:
    """Extract a zip/tar archive into ``dest`` after checking every member stays inside it."""
    label = label or str(archive)
    name = label.lower()
    try:
        if name.endswith(".zip") or (not is_archive(name) and zipfile.is_zipfile(archive)):
            _extract_zip(archive, dest, label)
        elif name.endswith(".gz") and not name.endswith((".tar.gz", ".tgz")) and not tarfile.is_tarfile(archive):
            _gunzip_single(archive, dest, label)
        else:
            _extract_tar(archive, dest, label)
    except XCFormatError:
        raise
    except tarfile.FilterError as e:
        raise XCFormatError(label, None, _UNSAFE_MSG, got=f"{getattr(e, 'tarinfo', None) and e.tarinfo.name}") from e
    except (tarfile.TarError, zipfile.BadZipFile, zlib.error, EOFError, OSError) as e:
        raise XCFormatError(label, None, "a readable zip or tar archive", got=f"{type(e).__name__}: {e}") from e


# ------------------------------------------------------------------------------------ cache install

def _commit(work: Path, target: Path) -> Path:
    """Rename a finished temp folder into place (another process may have won the race: keep theirs)."""
    try:
        os.rename(work, target)
    except OSError:
        if not target.is_dir():
            raise
        shutil.rmtree(work, ignore_errors=True)
    return target


def _install_file(tmp_file: Path, name: str, target: Path, label: str) -> Path:
    """Turn a fetched file into the cached folder ``target``: extracted if an archive, else holding it."""
    work = target.parent / f".{target.name}.tmp-{uuid.uuid4().hex[:12]}"
    work.mkdir(parents=True)
    try:
        if is_archive(name):
            extract_archive(tmp_file, work, label)
        else:
            os.replace(tmp_file, work / (name or "download"))
        _commit(work, target)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    return _descend(target) if is_archive(name) else target


def _fetch_to_cache(source: str, name: str, cache_dir: Path, key: str, fetch) -> Path:
    """Fetch one file with ``fetch(dest_path)`` into a temp file, then install it as ``cache_dir/key``."""
    target = cache_dir / key
    if target.is_dir():
        return _descend(target) if is_archive(name) else target
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp_file = cache_dir / f".{key}.part-{uuid.uuid4().hex[:12]}"
    try:
        fetch(tmp_file)
        return _install_file(tmp_file, name, target, source)
    finally:
        tmp_file.unlink(missing_ok=True)


# ------------------------------------------------------------------------------------------ schemes

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
        key = _cache_key(str(path.resolve()), f"{st.st_size}:{st.st_mtime_ns}:{sha256 or ''}")
        target = cache_dir / key
        if target.is_dir():
            return _descend(target)
        verify_sha256(path, sha256, str(path))  # the user's own file: reported, never deleted
        cache_dir.mkdir(parents=True, exist_ok=True)
        return _install_file(path, path.name, target, str(path))  # extracts straight from the archive
    verify_sha256(path, sha256, str(path))
    return path.parent


def _http_error(url: str, e: Exception) -> XCError:
    if isinstance(e, urllib.error.HTTPError):
        if e.code == 404:
            return XCDatasetNotFound(f"dataset source {url} not found (HTTP 404)")
        return XCError(f"could not download {url}: HTTP {e.code} {e.reason}")
    return XCError(f"could not download {url}: {e}; the partial download is kept and the next call resumes it")


def _content_range_total(value: str | None) -> int | None:
    """Total size from a ``Content-Range: bytes a-b/total`` (or ``bytes */total``) header."""
    m = re.match(r"^\s*bytes\s+(?:\d+-\d+|\*)/(\d+)\s*$", value or "")
    return int(m.group(1)) if m else None


def _download(url: str, part: Path) -> None:
    """Download ``url`` into ``part``, resuming a previous partial ``part`` with an HTTP Range request.

    A 206 answer whose range starts at the current size is appended; any other success answer (the server
    ignored Range) restarts from zero. A connection that ends before the announced length raises
    :class:`XCError` and keeps ``part``, so the next call resumes.
    """
    have = part.stat().st_size if part.exists() else 0
    req = urllib.request.Request(url, headers={"Range": f"bytes={have}-"} if have else {})
    try:
        resp = urllib.request.urlopen(req, timeout=60)
    except urllib.error.HTTPError as e:
        if e.code == 416 and have:  # nothing left past ``have``: complete if the total matches, else restart
            total = _content_range_total(e.headers.get("Content-Range"))
            e.close()
            if total == have:
                return
            part.unlink(missing_ok=True)
            return _download(url, part)
        raise _http_error(url, e) from e
    except (urllib.error.URLError, OSError) as e:
        raise _http_error(url, e) from e
    with resp:
        status = getattr(resp, "status", 200)
        start = have if status == 206 else 0
        if status == 206:
            m = re.match(r"^\s*bytes\s+(\d+)-", resp.headers.get("Content-Range") or "")
            if not m or int(m.group(1)) != have:  # a range we did not ask for: start over
                resp.close()
                part.unlink(missing_ok=True)
                return _download(url, part)
        length = resp.headers.get("Content-Length")
        expected = start + int(length) if length and length.isdigit() else None
        try:
            with open(part, "ab" if start else "wb") as out:
                shutil.copyfileobj(resp, out, _CHUNK)
        except (OSError, http.client.HTTPException) as e:
            raise _http_error(url, e) from e
    got = part.stat().st_size
    if expected is not None and got != expected:
        raise XCError(f"could not download {url}: the connection ended after {got} of {expected} bytes; "
                      "the partial download is kept and the next call resumes it")


def normalize_sha256(value: str | None) -> str | None:
    """A checksum as 64 lowercase hex digits (``sha256:`` prefix allowed), None when empty; else XCConfigError."""
    if value is None or not str(value).strip():
        return None
    v = str(value).strip().lower()
    v = v[len("sha256:"):] if v.startswith("sha256:") else v
    if not re.fullmatch(r"[0-9a-f]{64}", v):
        raise XCConfigError(f"sha256 must be 64 hexadecimal digits, got {value!r}")
    return v


def file_sha256(path: Path) -> str:
    """Hex SHA-256 of a file, streamed."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(_CHUNK), b""):
            h.update(block)
    return h.hexdigest()


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


@contextlib.contextmanager
def _locked(lock_path: Path) -> Iterator[None]:
    """An exclusive advisory lock on ``lock_path`` (POSIX; a no-op elsewhere)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows
        yield
        return
    with open(lock_path, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _resolve_http(url: str, cache_dir: Path, sha256: str | None = None) -> Path:
    """Resumable download into ``cache_dir/.KEY.part``, SHA-256 check, extraction, then the cache entry.

    The cache entry ``cache_dir/KEY`` appears only once all three succeeded; a failed check or extraction
    deletes the download so the next call starts afresh.
    """
    name = PurePosixPath(unquote(urlsplit(url).path)).name or "download"
    key = _cache_key(url, sha256 or "")
    target = cache_dir / key
    if target.is_dir():
        return _descend(target) if is_archive(name) else target
    cache_dir.mkdir(parents=True, exist_ok=True)
    part = cache_dir / f".{key}.part"
    with _locked(cache_dir / f".{key}.lock"):
        if target.is_dir():  # another process finished it while we waited
            return _descend(target) if is_archive(name) else target
        _download(url, part)
        verify_sha256(part, sha256, url, delete=True)
        try:
            return _install_file(part, name, target, url)
        except BaseException:
            part.unlink(missing_ok=True)
            raise
        finally:
            if target.is_dir():
                part.unlink(missing_ok=True)


def _resolve_fsspec(source: str, cache_dir: Path, sha256: str | None = None) -> Path:
    import fsspec

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
    key = _cache_key(source, sha256 or "")
    if not fs.isdir(path):
        name = posixpath.basename(path.rstrip("/"))

        def fetch(dest: Path) -> None:
            fs.get_file(path, str(dest))
            verify_sha256(dest, sha256, source, delete=True)

        return _fetch_to_cache(source, name, cache_dir, key, fetch)
    _no_folder_digest(source, sha256)
    target = cache_dir / key
    if target.is_dir():
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    work = cache_dir / f".{key}.tmp-{uuid.uuid4().hex[:12]}"
    work.mkdir()
    try:
        root = path.rstrip("/")
        for f in fs.find(path):
            rel = posixpath.relpath(f, root)
            dest = _check_member(work, rel, source)
            dest.parent.mkdir(parents=True, exist_ok=True)
            fs.get_file(f, str(dest))
        _commit(work, target)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    return target


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
