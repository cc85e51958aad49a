"""Safe extraction of dataset archives: ``.zip``, ``.tar.gz``, ``.tgz``, ``.tar`` and single-file ``X.gz``.

Every member is checked before anything is written: a member whose path or link target would land outside
the extraction folder (absolute path, ``..``, a link out) is rejected with :class:`XCFormatError` naming it.
"""

from __future__ import annotations

import gzip
import posixpath
import re
import shutil
import stat
import tarfile
import zipfile
import zlib
from pathlib import Path, PurePosixPath

from xc_dagster.errors import XCFormatError

ARCHIVE_SUFFIXES = (".zip", ".tar.gz", ".tgz", ".tar")
COPY_CHUNK = 1 << 20  # bytes per read / copy block
_UNSAFE_MSG = "archive members that stay inside the extraction folder (no absolute paths, '..', or links out)"


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


def _gunzip_single(archive: Path, dest: Path, label: str) -> None:
    """``X.gz`` holding one plain file: decompress it to ``dest/X`` (a gzipped tar goes to the tar path)."""
    name = Path(label).name
    out = dest / (name[:-3] if name.lower().endswith(".gz") else "data")
    check_member(dest, out.name, label)
    with gzip.open(archive, "rb") as src, open(out, "wb") as dst:
        shutil.copyfileobj(src, dst, COPY_CHUNK)


def _extract_zip(archive: Path, dest: Path, label: str) -> None:
    with zipfile.ZipFile(archive) as zf:
        infos = zf.infolist()
        for info in infos:  # check everything before writing anything
            check_member(dest, info.filename, label)
            if stat.S_ISLNK(info.external_attr >> 16):
                raise XCFormatError(label, None, _UNSAFE_MSG + " (symlinks are not allowed in zip archives)",
                                    got=info.filename)
        for info in infos:
            target = check_member(dest, info.filename, label)
            if info.is_dir():
                target.mkdir(parents=True, exist_ok=True)
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            with zf.open(info) as src, open(target, "wb") as out:
                shutil.copyfileobj(src, out, COPY_CHUNK)


def _extract_tar(archive: Path, dest: Path, label: str) -> None:
    with tarfile.open(archive, "r:*") as tf:
        members = tf.getmembers()
        for m in members:
            check_member(dest, m.name, label)
            if m.issym():
                _check_symlink_target(dest, m.name, m.linkname, label)
            elif m.islnk():
                check_member(dest, m.linkname, label)
            elif not (m.isfile() or m.isdir()):
                raise XCFormatError(label, None, "only regular files, folders and links in the archive",
                                    got=m.name)
        tf.extractall(dest, members=members, filter="data")


def _check_symlink_target(dest: Path, member: str, link: str, label: str) -> None:
    """A symlink's target, resolved from the member's folder, must stay inside ``dest``."""
    joined = posixpath.normpath(posixpath.join(posixpath.dirname(member), link))
    if joined.startswith("../") or joined == ".." or link.startswith("/"):
        raise XCFormatError(label, None, _UNSAFE_MSG, got=f"{member} -> {link}")
    check_member(dest, joined, label)


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
