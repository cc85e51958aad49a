"""Input limits of ingest: the longest line, how far a compressed source may expand, unused header columns.

Hostile or corrupt input fails with :class:`XCFormatError` naming the file (and line) before it can exhaust
memory or disk: nothing is allocated from a header's counts alone. Each limit is a field of
:class:`InputLimits`, set by the environment variable ``XC_INGEST_<FIELD>`` (e.g.
``XC_INGEST_MAX_LINE_BYTES=67108864``); the defaults and why: docs/decisions.md#ingest-input-limits.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from xc_dagster.config.env import env_positive
from xc_dagster.errors import XCFormatError

ENV_PREFIX = "XC_INGEST_"
MAX_DIM = 2**31 - 1  # largest count a header may give: every row / column id then fits an int32


@dataclass(frozen=True)
class InputLimits:
    """The bounds ingest enforces on untrusted input (docs/datasets.md#input-limits)."""

    max_line_bytes: int = 32 << 20  # one line of any text file, with its line end
    max_expansion: float = 100.0  # unpacked bytes per compressed byte of an archive, .gz or streamed .json.gz
    expansion_floor_bytes: int = 64 << 20  # unpacking up to this many bytes is never refused for its ratio
    max_unpacked_bytes: int = 256 << 30  # absolute cap on what one compressed source unpacks to
    max_unused_columns: int = 1 << 20  # header columns no row uses, when no names/vocabulary file lists them

    def expansion_cap(self, packed_bytes: int) -> int:
        """How many bytes ``packed_bytes`` of compressed input may unpack to."""
        by_ratio = max(self.expansion_floor_bytes, int(self.max_expansion * max(packed_bytes, 0)))
        return min(self.max_unpacked_bytes, by_ratio)


def env_name(field: str) -> str:
    """The environment variable that sets the limit ``field``."""
    return ENV_PREFIX + field.upper()


def current_limits() -> InputLimits:
    """The defaults, with every field whose ``XC_INGEST_<FIELD>`` variable is set replaced by its value."""
    values = {}
    for f in dataclasses.fields(InputLimits):
        v = env_positive(env_name(f.name), None, float if f.type == "float" else int)
        if v is None:
            continue
        values[f.name] = v
    return InputLimits(**values)


class Expansion:
    """Counts the bytes one compressed input unpacks to; raises once they pass :meth:`InputLimits.expansion_cap`."""

    def __init__(self, label: str | Path, packed_bytes: int, limits: InputLimits | None = None):
        self.label, self.packed = str(label), int(packed_bytes)
        self.limits = limits or current_limits()
        self.cap = self.limits.expansion_cap(self.packed)
        self.total = 0

    def add(self, n: int, line: int | None = None) -> None:
        """Count ``n`` more unpacked bytes (read up to 1-based ``line``, when known)."""
        self.total += n
        if self.total > self.cap:
            raise self.error(line)

    def error(self, line: int | None = None) -> XCFormatError:
        """The error of a source that unpacks past the cap."""
        lim = self.limits
        return XCFormatError(
            self.label, line,
            f"compressed input that unpacks to at most {self.cap:,} bytes (the larger of {lim.max_expansion:g} x "
            f"its {self.packed:,} compressed bytes and {lim.expansion_floor_bytes:,}, capped at "
            f"{lim.max_unpacked_bytes:,}; raise {env_name('max_expansion')} or "
            f"{env_name('max_unpacked_bytes')} if the data is real)",
            got="more (a decompression bomb, or a limit too low)")


def line_too_long(path: str | Path, line: int, limits: InputLimits) -> XCFormatError:
    """The error of a line longer than ``limits.max_line_bytes``."""
    return XCFormatError(path, line, f"lines of at most {limits.max_line_bytes:,} bytes (raise "
                                     f"{env_name('max_line_bytes')} if the data is real)", got="a longer line")


def check_header_rows(path: Path, field: str, rows: int, bytes_left: int) -> None:
    """A header's row count against what the rest of the file can hold: every row takes at least one byte."""
    if rows > bytes_left:
        raise XCFormatError(path, 1, f"'{field}' at most the {bytes_left:,} bytes after the header (one or more "
                                     "per row)", got=f"{field} = {rows:,}")


def check_used_columns(path: Path, field: str, n_cols: int, indices: Sequence[np.ndarray],
                       limits: InputLimits | None = None) -> None:
    """A header's column count against the columns the rows use: at most ``max_unused_columns`` may be unused.

    For a count no other file corroborates (no label names, no vocabulary): L placeholder names, per-label
    arrays and classifier rows would otherwise be allocated from the header alone.
    """
    lim = limits or current_limits()
    if n_cols <= lim.max_unused_columns:
        return
    nnz = sum(len(ix) for ix in indices)
    if n_cols - nnz > lim.max_unused_columns:  # too few entries to use enough columns: no need to count
        used = nnz
    else:  # the bitmap is bounded by entries actually read (n_cols <= max_unused + nnz)
        seen = np.zeros(n_cols, dtype=bool)
        for ix in indices:
            seen[ix] = True
        used = int(seen.sum())
        if n_cols - used <= lim.max_unused_columns:
            return
    raise XCFormatError(path, 1, f"'{field}' at most {lim.max_unused_columns:,} more than the distinct columns "
                                 f"the rows use (raise {env_name('max_unused_columns')}, or ship a file naming "
                                 "every column, if the data is real)",
                        got=f"{field} = {n_cols:,} with at most {used:,} used")
