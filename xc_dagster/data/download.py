"""Resumable HTTP(S) download of a dataset source into a ``.part`` file.

An interrupted download is resumed with a ``Range`` request; a server that ignores the range restarts it from
zero. A connection that ends before the announced length raises :class:`XCError` and keeps the ``.part`` file.
"""

from __future__ import annotations

import http.client
import re
import shutil
import urllib.error
import urllib.request
from pathlib import Path

from xc_dagster.data.archives import COPY_CHUNK
from xc_dagster.errors import XCDatasetNotFound, XCError


def _http_error(url: str, e: Exception) -> XCError:
    if isinstance(e, urllib.error.HTTPError):
        if e.code == 404:
            return XCDatasetNotFound(f"dataset source {url} not found (HTTP 404)")
        return XCError(f"could not download {url}: HTTP {e.code} {e.reason}")
    return XCError(f"could not download {url}: {e}; the partial download is kept and the next call resumes it")


def _content_range_total(value: str | None) -> int | None:
    """Total size from a ``Content-Range: bytes a-b/total`` (or ``bytes */total``) header."""
    m = re.match(r"^\s*bytes\s+(?:\d+-\d+|\*)/(\d+)\s*$", value or "")
    return int(m.group(1)) if m else None


def download(url: str, part: Path) -> None:
    """Download ``url`` into ``part``, resuming a previous partial ``part`` with an HTTP Range request.

    A 206 answer whose range starts at the current size is appended; any other success answer (the server
    ignored Range) restarts from zero. A connection that ends before the announced length raises
    :class:`XCError` and keeps ``part``, so the next call resumes.
    """
    have = part.stat().st_size if part.exists() else 0
    req = urllib.request.Request(url, headers={"Range": f"bytes={have}-"} if have else {})
    try:
        resp = urllib.request.urlopen(req, timeout=60)
    except urllib.error.HTTPError as e:
        if e.code == 416 and have:  # nothing left past ``have``: complete if the total matches, else restart
            total = _content_range_total(e.headers.get("Content-Range"))
            e.close()
            if total == have:
                return
            part.unlink(missing_ok=True)
            return download(url, part)
        raise _http_error(url, e) from e
    except (urllib.error.URLError, OSError) as e:
        raise _http_error(url, e) from e
    with resp:
        status = getattr(resp, "status", 200)
        start = have if status == 206 else 0
        if status == 206:
            m = re.match(r"^\s*bytes\s+(\d+)-", resp.headers.get("Content-Range") or "")
            if not m or int(m.group(1)) != have:  # a range we did not ask for: start over
                resp.close()
                part.unlink(missing_ok=True)
                return download(url, part)
        length = resp.headers.get("Content-Length")
        expected = start + int(length) if length and length.isdigit() else None
        try:
            with open(part, "ab" if start else "wb") as out:
                shutil.copyfileobj(resp, out, COPY_CHUNK)
        except (OSError, http.client.HTTPException) as e:
            raise _http_error(url, e) from e
    got = part.stat().st_size
    if expected is not None and got != expected:
        raise XCError(f"could not download {url}: the connection ended after {got} of {expected} bytes; "
                      "the partial download is kept and the next call resumes it")
