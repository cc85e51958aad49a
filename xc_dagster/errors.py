"""Errors a user can cause, each naming what was wrong and where."""

from __future__ import annotations

from pathlib import Path


class XCError(Exception):
    """Base class of every error the library raises on user input or configuration."""


class XCFormatError(XCError, ValueError):
    """A data file does not follow its layout: names the file, the 1-based line and what was expected."""

    def __init__(self, path: str | Path, line: int | None, expected: str, got: str | None = None):
        self.path = str(path)
        self.line = line
        self.expected = expected
        self.got = got
        where = f"{self.path}:{line}" if line is not None else self.path
        msg = f"{where}: expected {expected}"
        if got is not None:
            msg += f", got {got!r}" if len(str(got)) <= 80 else f", got {str(got)[:77]!r}..."
        super().__init__(msg)


class XCConfigError(XCError, ValueError):
    """A configuration value (catalog entry, preset, override) is invalid: names the field."""


class XCDatasetNotFound(XCError, KeyError):
    """A dataset name is not in the catalog, or its source does not exist."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0]) if self.args else "dataset not found"
