"""Resumable HTTP(S) download of a dataset source into a ``.part`` file, never splicing two versions.

The validator of the version being downloaded (its strong ``ETag``, else a strong ``Last-Modified``) is kept beside
the ``.part`` file (``<part>.validator``). An interrupted download is resumed with ``Range`` and ``If-Range:
<validator>`` only: a server whose file changed answers 200 with the whole new version, which restarts the download
from zero; one that answers 206 must start at the partial size and, when it names a validator, the same one. A
partial download without a validator is never resumed. See docs/decisions.md#http-resume-if-range.
A connection that ends before the announced length raises :class:`XCError` and keeps the ``.part`` file (with its
validator) for the next call.
"""

from __future__ import annotations

import email.utils
import http.client
import os
import re
import shutil
import urllib.error
import urllib.request
from email.message import Message
from pathlib import Path

from xc_dagster.data.archives import COPY_CHUNK
from xc_dagster.errors import XCDatasetNotFound, XCError

VALIDATOR_SUFFIX = ".validator"
TIMEOUT_S = 60


def validator_path(part: Path) -> Path:
    """The file beside ``part`` that holds the validator of the version it is a prefix of."""
    return part.with_name(part.name + VALIDATOR_SUFFIX)


def discard(part: Path) -> None:
    """Remove a partial download and its validator."""
    part.unlink(missing_ok=True)
    validator_path(part).unlink(missing_ok=True)


def _http_date(value: str | None) -> float | None:
    """Seconds since the epoch of an HTTP date header, None when absent or unreadable."""
    try:
        return email.utils.parsedate_to_datetime(value).timestamp() if value else None
    except (TypeError, ValueError, IndexError):
        return None


def response_validator(headers: Message) -> str | None:
    """The strong validator of a response: its ETag unless weak (``W/``), else its Last-Modified when strong
    (the response's Date at least one second later, RFC 9110 8.8.2.2), else None."""
    etag = (headers.get("ETag") or "").strip()
    if etag and not etag.startswith("W/"):
        return etag
    modified = (headers.get("Last-Modified") or "").strip()
    lm, date = _http_date(modified), _http_date(headers.get("Date"))
    if lm is not None and date is not None and date - lm >= 1:
        return modified
    return None


def _read_validator(part: Path) -> str | None:
    try:
        return validator_path(part).read_text(encoding="utf-8").strip() or None
    except (OSError, UnicodeDecodeError):
        return None


def _write_validator(part: Path, validator: str | None) -> None:
    """Record (or, given None, remove) the validator of ``part``, by temp file + rename (never half-written)."""
    path = validator_path(part)
    if validator is None:
        path.unlink(missing_ok=True)
        return
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    tmp.write_text(validator + "\n", encoding="utf-8")
    os.replace(tmp, path)


# what the next call does with a partial download, by whether it can be resumed (a validator is recorded)
_NEXT = {True: "the partial download is kept and the next call resumes it",
         False: "the server names no ETag / Last-Modified to resume against, so the next call starts over"}


def _http_error(url: str, e: Exception, resumable: bool = True) -> XCError:
    if isinstance(e, urllib.error.HTTPError):
        if e.code == 404:
            return XCDatasetNotFound(f"dataset source {url} not found (HTTP 404)")
        return XCError(f"could not download {url}: HTTP {e.code} {e.reason}")
    return XCError(f"could not download {url}: {e}; {_NEXT[resumable]}")


def _content_range(value: str | None) -> tuple[int | None, int | None]:
    """(first byte, total size) of a ``Content-Range: bytes a-b/total`` (``bytes */total``, ``/*``) header."""
    m = re.match(r"^\s*bytes\s+(?:(\d+)-\d+|\*)/(\d+|\*)\s*$", value or "")
    if not m:
        return None, None
    return (int(m.group(1)) if m.group(1) else None), (int(m.group(2)) if m.group(2) != "*" else None)


def _open(url: str, have: int, validator: str | None):
    """The response to a GET of ``url``, asking for the bytes past ``have`` of version ``validator`` when
    ``have``; an HTTP 416 comes back as the HTTPError itself (the caller decides), other errors raise XCError."""
    headers = {"Range": f"bytes={have}-", "If-Range": validator} if have else {}
    try:
        return urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=TIMEOUT_S)
    except urllib.error.HTTPError as e:
        if e.code == 416 and have:
            return e
        raise _http_error(url, e) from e
    except (urllib.error.URLError, OSError) as e:
        raise _http_error(url, e) from e


def download(url: str, part: Path) -> None:
    """Download ``url`` into ``part``, resuming a previous partial ``part`` of the same version.

    A partial ``part`` is resumed only when its validator was recorded (``Range`` + ``If-Range``); a 206 answer
    must start at the partial size and carry the same validator when it carries one, else the download restarts
    from zero, as it does on a 200 answer (the file changed, or the server ignores ranges). A connection that ends
    before the announced length raises :class:`XCError` and keeps ``part`` (when it can be resumed).
    """
    have = part.stat().st_size if part.exists() else 0
    validator = _read_validator(part) if have else None
    if have and validator is None:  # nothing to tell this version from a changed one: never resume
        discard(part)
        have = 0
    resp = _open(url, have, validator)
    if isinstance(resp, urllib.error.HTTPError):  # 416: nothing past ``have``; complete only if the same version
        _, total = _content_range(resp.headers.get("Content-Range"))
        other = response_validator(resp.headers)
        resp.close()
        if total == have and other in (None, validator):
            return
        discard(part)
        return download(url, part)
    with resp:
        status = getattr(resp, "status", 200)
        if status == 206:
            start, total = _content_range(resp.headers.get("Content-Range"))
            other = response_validator(resp.headers)
            if not have:
                raise XCError(f"could not download {url}: the server answered a plain request with a part "
                              f"(HTTP 206, Content-Range {resp.headers.get('Content-Range')!r})")
            if start != have or other not in (None, validator):  # another range, or another version: restart
                resp.close()
                discard(part)
                return download(url, part)
            length = resp.headers.get("Content-Length")
            _copy(url, resp, part, have, total if total is not None else
                  (have + int(length) if length and length.isdigit() else None))
            return
        with open(part, "wb"):  # truncate first: a part file is never longer than its recorded version's prefix
            pass
        _write_validator(part, response_validator(resp.headers))
        length = resp.headers.get("Content-Length")
        _copy(url, resp, part, 0, int(length) if length and length.isdigit() else None)


def _copy(url: str, resp, part: Path, start: int, expected: int | None) -> None:
    """Stream ``resp`` into ``part`` from byte ``start``; raise XCError when it ends before ``expected`` bytes
    (dropping the part when it cannot be resumed: no validator)."""
    resumable = validator_path(part).exists()
    try:
        with open(part, "r+b" if start else "wb") as out:
            out.seek(start)
            out.truncate()
            shutil.copyfileobj(resp, out, COPY_CHUNK)
    except (OSError, http.client.HTTPException) as e:
        if not resumable:
            discard(part)
        raise _http_error(url, e, resumable) from e
    got = part.stat().st_size
    if expected is not None and got != expected:
        if not resumable:
            discard(part)
        raise XCError(f"could not download {url}: the connection ended after {got} of {expected} bytes; "
                      f"{_NEXT[resumable]}")
