"""Line and chunk input shared by every text reader of the XC layouts, and their integer headers.

Bad UTF-8, a truncated or corrupt gzip stream, a header that is not the expected non-negative integers, a line
longer than ``max_line_bytes`` and a gzip stream that unpacks past its expansion cap raise :class:`XCFormatError`
naming the file, the 1-based line and what was expected (limits: :mod:`xc_dagster.data.limits`).
"""

from __future__ import annotations

import contextlib
import gzip
import zlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import IO, Any, Callable

from xc_dagster.data.limits import MAX_DIM, Expansion, InputLimits, current_limits, line_too_long
from xc_dagster.errors import XCFormatError

DEFAULT_CHUNK_LINES = 65_536
CHUNK_BYTES = 32 << 20  # a chunk also ends once it holds this many bytes: its memory is bounded, not only its lines


class FastPathFailed(Exception):
    """A chunk (a whole file for LF JSON lines) the vectorised parser does not take; it is re-parsed line by line."""


def optional_file(path: Path) -> bool:
    """Whether the optional companion ``path`` is there (absent: False); a folder or other non-file by its name is
    an error, not an absent file (a folder named ``filter_labels_test.txt`` read as "no filter" and changed every
    metric without a word)."""
    if path.is_file():
        return True
    if path.exists():
        raise XCFormatError(path, None, "a file, or nothing by that name (an optional file of the layout)",
                            got="a folder" if path.is_dir() else "not a regular file")
    return False


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


def read_line(f: IO[bytes], path: Path, lineno: int, limits: InputLimits) -> bytes:
    """The next raw line (b"" at the end), read with a bounded buffer: a longer line raises naming it."""
    raw = f.readline(limits.max_line_bytes + 1)
    if len(raw) > limits.max_line_bytes:
        raise line_too_long(path, lineno, limits)
    return raw


def read_header(f: IO[bytes], path: Path) -> str | None:
    """The first line as text (BOM and line end stripped), None for an empty file; bytes that are no UTF-8 raise
    naming line 1 (a UTF-16 file by its byte-order mark: the layouts are UTF-8)."""
    raw = read_line(f, path, 1, current_limits())
    if not raw:
        return None
    try:
        s = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        got = "a UTF-16 byte-order mark" if raw[:2] in (b"\xff\xfe", b"\xfe\xff") else \
            f"undecodable bytes at column {e.start + 1}"
        raise XCFormatError(path, 1, "UTF-8 text", got=got) from e
    return s.lstrip("\ufeff").rstrip("\r\n")


def first_line(path: Path) -> str | None:
    """:func:`read_header` of the file at ``path``, None when it cannot be opened."""
    try:
        f = open(path, "rb")
    except OSError:
        return None
    with f:
        return read_header(f, path)


def parse_header(path: Path, line: str | None, names: Sequence[str]) -> list[int]:
    """Parse a header of ``len(names)`` non-negative integers (line 1), e.g. ``rows cols`` or ``N D L``; each at
    most 2**31 - 1, so that ids fit an int32 and never wrap."""
    expected = f"a header '{' '.join(names)}' of {len(names)} non-negative integers"
    parts = (line or "").split()
    if len(parts) != len(names):
        raise XCFormatError(path, 1, expected, got=line if line is not None else "an empty file")
    try:
        vals = [int(p) for p in parts]
    except ValueError:
        raise XCFormatError(path, 1, expected, got=line) from None
    for name, v in zip(names, vals):
        if not 0 <= v <= MAX_DIM:
            raise XCFormatError(path, 1, f"{expected}, '{name}' at most {MAX_DIM:,}", got=f"{name} = {v:,}")
    return vals


def _expansion(path: Path, gz: bool) -> Expansion | None:
    """The expansion counter of a gzip file read as a stream (None for a plain file)."""
    return Expansion(path, path.stat().st_size) if gz else None


def iter_chunks(f: IO[bytes], path: Path, chunk_lines: int, first_lineno: int,
                gz: bool = False) -> Iterator[tuple[int, bytes, int]]:
    """Yield ``(1-based number of the chunk's first line, bytes, number of lines)``; every line ends in ``\\n``.

    A chunk holds at most ``chunk_lines`` lines and ends early once past :data:`CHUNK_BYTES`; every line is
    read with a bounded buffer (``max_line_bytes``)."""
    if chunk_lines < 1:
        raise ValueError("chunk_lines must be >= 1")
    limits = current_limits()
    grown = _expansion(path, gz)
    lineno = first_lineno
    with gzip_errors(path, gz):
        while True:
            lines: list[bytes] = []
            size = 0
            while len(lines) < chunk_lines and size < CHUNK_BYTES:
                raw = read_line(f, path, lineno + len(lines), limits)
                if not raw:
                    break
                lines.append(raw)
                size += len(raw)
            if not lines:
                return
            if grown is not None:
                grown.add(size, lineno + len(lines) - 1)
            if not lines[-1].endswith(b"\n"):
                lines[-1] += b"\n"
            yield lineno, b"".join(lines), len(lines)
            lineno += len(lines)


def iter_lines(path: Path, *, gz: bool = False) -> Iterator[tuple[int, str]]:
    """Yield ``(1-based line number, decoded line without terminator)``; bad UTF-8 / gzip, a line longer than
    ``max_line_bytes`` or a gzip file unpacking past its expansion cap -> XCFormatError."""
    opener: Callable[..., Any] = gzip.open if gz else open
    limits = current_limits()
    grown = _expansion(path, gz)
    lineno = 0
    with gzip_errors(path, gz):
        with opener(path, "rb") as f:
            while raw := read_line(f, path, lineno + 1, limits):
                lineno += 1
                if grown is not None:
                    grown.add(len(raw), lineno)
                try:
                    s = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise XCFormatError(path, lineno, "UTF-8 text",
                                        got=f"undecodable bytes at column {e.start + 1}") from e
                if lineno == 1 and s.startswith("\ufeff"):
                    s = s[1:]
                yield lineno, s.rstrip("\r\n")


def read_text_lines(path: Path, expected: int, what: str) -> list[str]:
    """All lines of a one-text-per-line file, which must hold exactly ``expected`` lines (reading stops at the
    first line past them)."""
    lines: list[str] = []
    for lineno, s in iter_lines(path):
        if lineno > expected:
            raise XCFormatError(path, lineno, f"{expected} lines (one {what} per line)", got="more lines")
        lines.append(s)
    if len(lines) != expected:
        raise XCFormatError(path, len(lines) + 1, f"{expected} lines (one {what} per line)",
                            got=f"{len(lines)} lines")
    return lines
