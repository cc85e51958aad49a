"""Durable local writes: fsync of a file or a folder's entries, and a file replaced whole by temp + fsync + rename.

One concept below the artifact store (``xc_dagster.storage``) and the remote root (``xc_dagster.remote_store``),
which both write local files a crash must not leave half-done.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path


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
