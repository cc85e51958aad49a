"""Line and chunk input shared by every text reader of the XC layouts, and their integer headers.

Bad UTF-8, a truncated or corrupt gzip stream and a header that is not the expected non-negative integers raise
:class:`XCFormatError` naming the file, the 1-based line and what was expected.
"""

from __future__ import annotations

import contextlib
import gzip
import zlib
from collections.abc import Iterator, Sequence
from itertools import islice
from pathlib import Path
from typing import IO, Any, Callable

from xc_dagster.errors import XCFormatError

DEFAULT_CHUNK_LINES = 65_536
MAX_DIM = 2**40  # sanity bound on header sizes (guards against corrupted headers)


class FastPathFailed(Exception):
    """A chunk (a whole file for LF JSON lines) the vectorised parser does not take; it is re-parsed line by line."""


def open_binary(path: Path, gz: bool = False) -> IO[bytes]:
    """Open a (possibly gzipped) file for binary line reading."""
    return gzip.open(path, "rb") if gz else open(path, "rb")  # type: ignore[return-value]


@contextlib.contextmanager
def gzip_errors(path: Path, gz: bool) -> Iterator[None]:
    """Turn a truncated or corrupt gzip stream (and read errors of one) into XCFormatError naming the file."""
    try:
        yield
    except (EOFError, zlib.error, gzip.BadGzipFile) as e:
        raise XCFormatError(path, None, "a complete, valid gzip file", got=f"{type(e).__name__}: {e}") from e
    except OSError as e:
        if gz:
            raise XCFormatError(path, None, "a complete, valid gzip file", got=f"{type(e).__name__}: {e}") from e
        raise


def decode_line(raw: bytes, path: Path, lineno: int) -> str:
    """One raw line as text without its line end; bad UTF-8 raises naming the line and column."""
    try:
        return raw.decode("utf-8").rstrip("\r\n")
    except UnicodeDecodeError as e:
        raise XCFormatError(path, lineno, "UTF-8 text", got=f"undecodable bytes at column {e.start + 1}") from e


def read_header(f: IO[bytes], path: Path) -> str | None:
    """The first line as text (BOM and line end stripped), None for an empty file; bad UTF-8 raises."""
    raw = f.readline()
    if not raw:
        return None
    try:
        s = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise XCFormatError(path, 1, "UTF-8 text", got=f"undecodable bytes at column {e.start + 1}") from e
    return s.lstrip("\ufeff").rstrip("\r\n")


def first_line(path: Path) -> str | None:
    """The first line of a file, or None when unreadable as UTF-8."""
    try:
        with open(path, "rb") as f:
            raw = f.readline(4096)
        if not raw:
            return None
        return raw.decode("utf-8").lstrip("\ufeff").rstrip("\r\n")
    except (OSError, UnicodeDecodeError):
        return None


def parse_header(path: Path, line: str | None, names: Sequence[str]) -> list[int]:
    """Parse a header of ``len(names)`` non-negative integers (line 1), e.g. ``rows cols`` or ``N D L``."""
    expected = f"a header '{' '.join(names)}' of {len(names)} non-negative integers"
    parts = (line or "").split()
    if len(parts) != len(names):
        raise XCFormatError(path, 1, expected, got=line if line is not None else "an empty file")
    try:
        vals = [int(p) for p in parts]
    except ValueError:
        raise XCFormatError(path, 1, expected, got=line) from None
    if any(not 0 <= v < MAX_DIM for v in vals):
        raise XCFormatError(path, 1, expected + " below 2**40", got=line)
    return vals


def iter_chunks(f: IO[bytes], path: Path, chunk_lines: int, first_lineno: int,
                gz: bool = False) -> Iterator[tuple[int, bytes, int]]:
    """Yield ``(1-based number of the chunk's first line, bytes, number of lines)``; every line ends in ``\\n``."""
    if chunk_lines < 1:
        raise ValueError("chunk_lines must be >= 1")
    lineno = first_lineno
    with gzip_errors(path, gz):
        while True:
            lines = list(islice(f, chunk_lines))
            if not lines:
                return
            if not lines[-1].endswith(b"\n"):
                lines[-1] += b"\n"
            yield lineno, b"".join(lines), len(lines)
            lineno += len(lines)


def iter_lines(path: Path, *, gz: bool = False) -> Iterator[tuple[int, str]]:
    """Yield ``(1-based line number, decoded line without terminator)``; bad UTF-8 / gzip -> XCFormatError."""
    opener: Callable[..., Any] = gzip.open if gz else open
    lineno = 0
    with gzip_errors(path, gz):
        with opener(path, "rb") as f:
            for raw in f:
                lineno += 1
                try:
                    s = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise XCFormatError(path, lineno, "UTF-8 text",
                                        got=f"undecodable bytes at column {e.start + 1}") from e
                if lineno == 1 and s.startswith("\ufeff"):
                    s = s[1:]
                yield lineno, s.rstrip("\r\n")


def read_text_lines(path: Path, expected: int, what: str) -> list[str]:
    """All lines of a one-text-per-line file, which must hold exactly ``expected`` lines."""
    lines = [s for _, s in iter_lines(path)]
    if len(lines) != expected:
        line = len(lines) + 1 if len(lines) < expected else expected + 1
        raise XCFormatError(path, line, f"{expected} lines (one {what} per line)", got=f"{len(lines)} lines")
    return lines
