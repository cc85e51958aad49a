"""What a layout reader is: the options it is given and the protocol every layout's reader class implements.

A new layout is one class with ``detect`` and ``read`` in its own module, plus its entry in
:data:`xc_dagster.data.layouts.READERS` (and its place in the detection order there).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from xc_dagster.data.canonical import XCDataset
from xc_dagster.data.textio import DEFAULT_CHUNK_LINES


@dataclass(frozen=True)
class ReadOptions:
    """What :func:`~xc_dagster.data.layouts.read_dataset` passes on to a layout reader (already validated)."""

    text_fields: tuple[str, ...] = ("title",)  # fields composing a point text (lf-raw)
    label_text_fields: tuple[str, ...] = ("title",)  # fields composing a label text (lf-raw)
    split: int = 0  # column of the split tables (bow-single)
    chunk_lines: int = DEFAULT_CHUNK_LINES  # chunk size of the streaming parsers, in lines


class LayoutReader(Protocol):
    """One XC repository layout: whether a folder holds it, and how to read it into an :class:`XCDataset`."""

    def detect(self, folder: Path, names: Sequence[str]) -> bool:
        """Whether ``folder`` (whose entry names are ``names``, sorted) holds this layout."""
        ...

    def read(self, folder: Path, opts: ReadOptions) -> XCDataset:
        """The dataset of ``folder``; every problem in a file raises ``XCFormatError`` naming file and line."""
        ...
