"""The bounds of a serving request: what a text may be, how long it is read, how many a request may hold.

A served model reads untrusted input; each bound keeps one request's time and memory proportional to what the
model can use (docs/serving-and-retraining.md, "Input limits"; docs/decisions.md#serving-input-bounds):

- a text is cut to ``max_len * MAX_CHARS_PER_TOKEN`` characters before it is tokenized (the encoder reads at most
  ``max_len`` tokens of it anyway), and the lexical source reads the same cut text; a longer text has its
  whitespace runs collapsed to one space (and stripped) and its invisible control and format characters (zero-width
  spaces, soft hyphens, which the tokenizer drops) removed first, so neither pushes its words out of the cut;
- a text with no visible character (empty, whitespace, control or format characters only) gets no labels;
- ``bytes`` are decoded as UTF-8 (strict: invalid bytes are refused, naming the row), never ``str(bytes)``;
- a request holds at most ``$XC_SERVING_MAX_TEXTS`` texts and ``$XC_SERVING_MAX_REQUEST_CHARS`` characters;
- ``k`` is clamped to what the shortlist holds (``ServingBundle.max_k``), in ``bundle.rank``.
"""

from __future__ import annotations

import functools
import math
import sys
import unicodedata
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import pandas as pd

from xc_dagster.config.env import env_positive
from xc_dagster.errors import XCError

# characters read per token of max_len: no WordPiece / BPE token of natural text is this long, so the cut text
# tokenizes to the same first max_len tokens as the whole one (docs/decisions.md#serving-input-bounds)
MAX_CHARS_PER_TOKEN = 32
MAX_TEXTS_ENV = "XC_SERVING_MAX_TEXTS"  # texts per request (default DEFAULT_MAX_TEXTS)
MAX_CHARS_ENV = "XC_SERVING_MAX_REQUEST_CHARS"  # characters of all texts of a request, before the cut
DEFAULT_MAX_TEXTS = 4096
DEFAULT_MAX_REQUEST_CHARS = 64 << 20


class XCRequestError(XCError, ValueError):
    """A serving request the model refuses (too large, or a text that is not text): HTTP 400 when served."""


def text_char_limit(max_len: int) -> int:
    """The characters of a text that are read, for a model that reads ``max_len`` tokens."""
    return max(1, int(max_len)) * MAX_CHARS_PER_TOKEN


def cut_text(text: str, limit: int) -> str:
    """``text`` when it holds at most ``limit`` characters; else its words (whitespace runs collapsed to one space,
    stripped; control and format characters dropped) cut to ``limit`` characters. Read in slices of ``limit``
    characters until the words fill it, so a text of mostly whitespace costs one pass over it and ``limit``-sized
    pieces, never a copy or a word list of all of it (a word cut by a slice's end is joined again: no space is put
    between slices without one)."""
    if len(text) <= limit:  # read as the tokenize stage reads training and test texts
        return text
    out, chars, space = [], 0, False  # space: the previous slice ended in whitespace
    for start in range(0, len(text), limit):
        part = text[start:start + limit].translate(_invisible())  # what the tokenizer drops too: never in the cut
        words = part.split()
        if words:
            piece = " ".join(words)
            out.append(" " + piece if out and (space or part[0].isspace()) else piece)
            chars += len(out[-1])
            if chars >= limit:
                break
        if part:  # a slice of invisible characters only: the one before it says whether a space comes
            space = part[-1].isspace()
    return "".join(out)[:limit]


@functools.cache
def _invisible() -> dict[int, None]:
    """``str.translate``'s table dropping the control and format characters that are not whitespace (Unicode Cc,
    Cf: zero-width spaces and joiners, soft hyphens, bidi marks), as the tokenizer's normaliser drops them: a text
    over the cut padded with them keeps its words in it. Built on first use (0.13 s)."""
    return {c: None for c in range(sys.maxunicode + 1)
            if unicodedata.category(chr(c)) in ("Cc", "Cf") and not chr(c).isspace()}


def cut_texts(texts: Sequence[str], max_len: int) -> list[str]:
    """Each text cut to :func:`text_char_limit` characters by :func:`cut_text` (a shorter text is returned as it
    is)."""
    limit = text_char_limit(max_len)
    return [cut_text(t, limit) for t in texts]


def has_content(text: str) -> bool:
    """Whether ``text`` holds a visible character: a letter, digit, mark, punctuation or symbol (Unicode
    categories other than C* control/format and Z* separators); stops at the first one."""
    return any(unicodedata.category(c)[0] not in "CZ" for c in text)


def as_text(value: Any, row: int) -> str:
    """One input value as text: str as is, bytes decoded as UTF-8, None / NaN as "", numbers as written;
    anything else (bytes that are not UTF-8, a str holding a lone surrogate: a JSON escape of half a pair, which no
    tokenizer reads) raises :class:`XCRequestError` naming the 0-based ``row``."""
    if isinstance(value, str):
        if not value.isascii():
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as e:
                raise XCRequestError(f"model input row {row}: a lone surrogate {value[e.start]!r} at character "
                                     f"{e.start + 1}; send text that is UTF-8 encodable (whole surrogate pairs)") \
                    from None
        return value
    if value is None or value is pd.NA or (isinstance(value, float) and math.isnan(value)):
        return ""
    if isinstance(value, (bytes, bytearray, memoryview)):
        try:
            return bytes(value).decode("utf-8")
        except UnicodeDecodeError as e:
            raise XCRequestError(f"model input row {row}: bytes that are not UTF-8 ({e}); send text, or UTF-8 "
                                 "encoded bytes") from None
    if isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, (bool, np.bool_)):
        return str(value)
    raise XCRequestError(f"model input row {row}: expected a text (str, or UTF-8 bytes), got "
                         f"{type(value).__name__}")


@dataclass(frozen=True)
class RequestLimits:
    """How much one request to a served model may hold."""

    max_texts: int = DEFAULT_MAX_TEXTS
    max_chars: int = DEFAULT_MAX_REQUEST_CHARS  # all texts together, as received (before the per-text cut)

    @classmethod
    def from_env(cls) -> "RequestLimits":
        """``$XC_SERVING_MAX_TEXTS`` / ``$XC_SERVING_MAX_REQUEST_CHARS``, or the defaults when unset."""
        return cls(env_positive(MAX_TEXTS_ENV, DEFAULT_MAX_TEXTS),
                   env_positive(MAX_CHARS_ENV, DEFAULT_MAX_REQUEST_CHARS))

    def check_count(self, n: int, unit: str = "texts") -> None:
        """Raise :class:`XCRequestError` when a request holds more than ``max_texts`` texts (or feature rows:
        ``unit`` names them)."""
        if n > self.max_texts:
            raise XCRequestError(f"request of {n} {unit}: at most {self.max_texts} per request "
                                 f"(${MAX_TEXTS_ENV}); split it")

    def check_chars(self, texts: Sequence[str], unit: str = "texts") -> None:
        """Raise :class:`XCRequestError` when ``texts`` hold more than ``max_chars`` characters together."""
        self.check_total(sum(len(t) for t in texts), unit)

    def check_total(self, chars: int, unit: str = "texts") -> None:
        """Raise :class:`XCRequestError` when a request of ``chars`` characters is over ``max_chars``."""
        if chars > self.max_chars:
            raise XCRequestError(f"request of {chars} characters: at most {self.max_chars} per request "
                                 f"(${MAX_CHARS_ENV}); split it or send shorter {unit}")
