"""Durable local writes: fsync of a file or a folder's entries, and a file replaced whole by temp + fsync + rename.

One concept below the artifact store (``xc_dagster.storage``) and the remote root (``xc_dagster.remote_store``),
which both write local files a crash must not leave half-done.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path


def fsync_file(path: Path, flags: int = os.O_RDONLY) -> None:
    """Flush a written file's data, or a folder's entries (a rename or a new file in it), to the disk (any
    descriptor of it will do on POSIX; Windows flushes a file only through a writable one: ``os.O_RDWR``)."""
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(folder: Path) -> None:
    """Make a folder's entries (a rename or a new file in it) durable."""
    if os.name != "nt":  # Windows cannot open a folder to fsync it
        fsync_file(folder)


def fsync_tree(folder: Path) -> None:
    """fsync every file and folder under ``folder`` (the folder included), so a rename or link that publishes it
    never names data the disk has not got."""
    for dirpath, _, filenames in os.walk(folder):
        for name in filenames:
            # a link's entry is its folder's (fsynced below); its target may be gone, or outside the tree
            if not os.path.islink(path := Path(dirpath) / name):
                fsync_file(path)
        fsync_dir(Path(dirpath))


def _fsync_written(path: Path) -> None:
    fsync_file(path, os.O_RDWR)  # writable: as the writing handle's fsync was, on Windows too


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def atomic_write(path: Path, write: Callable[[Path], None], tmp: Path | None = None,
                 sync: Callable[[Path], None] = _fsync_written) -> None:
    """Replace ``path`` whole by what ``write(tmp)`` writes: a reader or a crash sees the old or the new content.

    ``tmp`` is a temporary name in ``path``'s folder, ``.<name>.tmp-<8 hex>`` unless given (a fixed name's
    leftover of a killed write is removed first); ``sync(tmp)`` puts it on the disk before the rename (a folder
    ``write`` makes needs a ``sync`` of its whole tree), and the folder's entries are synced after. When anything
    before the rename raises, the temporary file is removed and the exception propagates; ``path`` is untouched.
    """
    path = Path(path)
    if tmp is None:
        tmp = path.parent / f".{path.name}.tmp-{uuid.uuid4().hex[:8]}"
    else:
        tmp = Path(tmp)
        _remove(tmp)  # a killed write's leftover under the fixed name
    try:
        write(tmp)
        sync(tmp)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):  # the write's own exception is the one to see
            _remove(tmp)
        raise
    fsync_dir(path.parent)


def atomic_write_text(path: Path, text: str) -> None:
    """Write a text file by temp + fsync + rename: a reader or a crash sees the old or the new content, whole."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)

    def write(tmp: Path) -> None:
        with open(tmp, "w") as f:
            f.write(text)

    atomic_write(path, write)
