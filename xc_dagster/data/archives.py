"""Safe extraction of dataset archives: ``.zip``, ``.tar.gz``, ``.tgz``, ``.tar`` and single-file ``X.gz``.

Every member is checked before anything is written: a member whose path or link target would land outside
the extraction folder (absolute path, ``..``, a link out) is rejected with :class:`XCFormatError` naming it.
What an archive unpacks to is capped (:class:`~xc_dagster.data.limits.Expansion`: the members' declared sizes
before writing, the bytes written while writing), so a decompression bomb fails before it fills the disk.
On Pythons whose ``tarfile`` has no ``data_filter`` (before 3.10.12 / 3.11.4) members are written here, and
symlinks are refused, since nothing re-checks a path at the moment it is written there.
"""

from __future__ import annotations

import gzip
import os
import posixpath
import re
import shutil
import stat
import tarfile
import zipfile
import zlib
from pathlib import Path, PurePosixPath
from typing import IO

from xc_dagster.data.limits import Expansion
from xc_dagster.errors import XCFormatError

ARCHIVE_SUFFIXES = (".zip", ".tar.gz", ".tgz", ".tar")
COPY_CHUNK = 1 << 20  # bytes per read / copy block
MAX_MEMBERS = 100_000  # members per archive: an XC dataset has a few dozen files, the list is held in memory
_UNSAFE_MSG = "archive members that stay inside the extraction folder (no absolute paths, '..', or links out)"
_FILTER_ERRORS = tuple(e for e in (getattr(tarfile, "FilterError", None),) if e is not None)  # 3.10.12+ only


def is_archive(name: str) -> bool:
    """Whether a file name has one of the supported archive suffixes, or is a single gzipped file
    (``X.gz``, decompressed to ``X``) other than the LF layout's own ``*.json.gz`` tables."""
    low = name.lower()
    return low.endswith(ARCHIVE_SUFFIXES) or (low.endswith(".gz") and not low.endswith(".json.gz"))


def check_member(dest: Path, name: str, label: str) -> Path:
    """The destination of member ``name``; raises unless it stays inside ``dest``."""
    if (not name or name.startswith(("/", "\\")) or re.match(r"^[A-Za-z]:", name)
            or ".." in PurePosixPath(name.replace("\\", "/")).parts):
        raise XCFormatError(label, None, _UNSAFE_MSG, got=name)
    target = (dest / name).resolve()
    if not target.is_relative_to(dest.resolve()):
        raise XCFormatError(label, None, _UNSAFE_MSG, got=name)
    return target


def _copy(src: IO[bytes], dst: IO[bytes], grown: Expansion) -> None:
    """Copy a stream, counting every block against the archive's expansion cap before it is written."""
    while block := src.read(COPY_CHUNK):
        grown.add(len(block))
        dst.write(block)


def _gunzip_single(archive: Path, dest: Path, label: str, grown: Expansion) -> None:
    """``X.gz`` holding one plain file: decompress it to ``dest/X`` (a gzipped tar goes to the tar path)."""
    name = Path(label).name
    out = dest / (name[:-3] if name.lower().endswith(".gz") else "data")
    check_member(dest, out.name, label)
    with gzip.open(archive, "rb") as src, open(out, "wb") as dst:
        _copy(src, dst, grown)


def _too_many(label: str, n: int) -> None:
    if n > MAX_MEMBERS:
        raise XCFormatError(label, None, f"an archive of at most {MAX_MEMBERS:,} members", got=f"{n:,} or more")


def _extract_zip(archive: Path, dest: Path, label: str, grown: Expansion) -> None:
    with zipfile.ZipFile(archive) as zf:
        infos = zf.infolist()
        _too_many(label, len(infos))
        for info in infos:  # check everything before writing anything
            check_member(dest, info.filename, label)
            if stat.S_ISLNK(info.external_attr >> 16):
                raise XCFormatError(label, None, _UNSAFE_MSG + " (symlinks are not allowed in zip archives)",
                                    got=info.filename)
        if sum(info.file_size for info in infos) > grown.cap:  # declared sizes: refused before writing
            raise grown.error()
        for info in infos:
            target = check_member(dest, info.filename, label)
            if info.is_dir():
                target.mkdir(parents=True, exist_ok=True)
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            with zf.open(info) as src, open(target, "wb") as out:
                _copy(src, out, grown)


def _tar_members(tf: tarfile.TarFile, dest: Path, label: str, grown: Expansion) -> list[tarfile.TarInfo]:
    """Every member, checked as its header is read: the scan stops at the first one past the caps, before
    the stream is decompressed any further."""
    members = []
    for m in tf:
        _too_many(label, len(members) + 1)
        check_member(dest, m.name, label)
        if m.issym():
            if not hasattr(tarfile, "data_filter"):
                raise XCFormatError(label, None, "no symlinks in tar archives on this Python (tarfile's data "
                                                 "filter needs 3.10.12 / 3.11.4 or later)", got=m.name)
            _check_symlink_target(dest, m.name, m.linkname, label)
        elif m.islnk():
            check_member(dest, m.linkname, label)
        elif m.issparse() or not (m.isfile() or m.isdir()):
            raise XCFormatError(label, None, "only regular files, folders and links in the archive",
                                got=m.name)
        if m.isfile():
            grown.add(m.size)  # tarfile writes exactly the declared size
        members.append(m)
    return members


def _extract_tar(archive: Path, dest: Path, label: str, grown: Expansion) -> None:
    with tarfile.open(archive, "r:*") as tf:
        members = _tar_members(tf, dest, label, grown)
        if hasattr(tarfile, "data_filter"):
            tf.extractall(dest, members=members, filter="data")
            return
        for m in members:  # older Pythons: no symlinks (refused above); paths and link targets checked
            target = check_member(dest, m.name, label)
            if m.isdir():
                target.mkdir(parents=True, exist_ok=True)
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            if m.islnk():
                os.link(check_member(dest, m.linkname, label), target)
                continue
            src = tf.extractfile(m)
            assert src is not None  # a regular file
            with src, open(target, "wb") as out:
                shutil.copyfileobj(src, out, COPY_CHUNK)


def _check_symlink_target(dest: Path, member: str, link: str, label: str) -> None:
    """A symlink's target, resolved from the member's folder, must stay inside ``dest``."""
    joined = posixpath.normpath(posixpath.join(posixpath.dirname(member), link))
    if joined.startswith("../") or joined == ".." or link.startswith("/"):
        raise XCFormatError(label, None, _UNSAFE_MSG, got=f"{member} -> {link}")
    check_member(dest, joined, label)


def extract_archive(archive: Path, dest: Path, label: str | None = None) -> None:
    """Extract a zip/tar archive into ``dest`` after checking every member stays inside it; what it unpacks to
    is capped (:class:`~xc_dagster.data.limits.Expansion` of the archive's size)."""
    label = label or str(archive)
    name = label.lower()
    grown = Expansion(label, archive.stat().st_size)
    try:
        if name.endswith(".zip") or (not is_archive(name) and zipfile.is_zipfile(archive)):
            _extract_zip(archive, dest, label, grown)
        elif name.endswith(".gz") and not name.endswith((".tar.gz", ".tgz")) and not tarfile.is_tarfile(archive):
            _gunzip_single(archive, dest, label, grown)
        else:
            _extract_tar(archive, dest, label, grown)
    except XCFormatError:
        raise
    except _FILTER_ERRORS as e:
        raise XCFormatError(label, None, _UNSAFE_MSG, got=f"{getattr(e, 'tarinfo', None) and e.tarinfo.name}") from e
    except (tarfile.TarError, zipfile.BadZipFile, zlib.error, EOFError, OSError) as e:
        raise XCFormatError(label, None, "a readable zip or tar archive", got=f"{type(e).__name__}: {e}") from e
