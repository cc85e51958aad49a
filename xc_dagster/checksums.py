"""SHA-256 of files, streamed in blocks (bounded memory at any size): the one digest every integrity check of the
project uses -- a download against its catalog checksum (``xc_dagster.data.cache``), a training checkpoint against
the hash its save recorded (``xc_dagster.training.checkpoint``), a serving bundle against its manifest
(``xc_dagster.serving.bundle_files``)."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import BinaryIO


def read_sha256(f: BinaryIO) -> str:
    """Hex SHA-256 of what is left to read in the open binary file ``f`` (the standard library's reader: one
    reused buffer, the hash computed without the GIL)."""
    return hashlib.file_digest(f, "sha256").hexdigest()


def file_sha256(path: Path) -> str:
    """Hex SHA-256 of the file at ``path``."""
    with open(path, "rb") as f:
        return read_sha256(f)
