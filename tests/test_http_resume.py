"""HTTP resume never splices two versions of a source: a download cut off (a dropped connection, a SIGKILLed
process), then resumed after the server's file changed, ends as the new version exactly.

A real local HTTP server in a thread serves one of two versions, with a validator (strong ETag, Last-Modified, or
none), honours ``Range`` and ``If-Range`` as RFC 9110 says (or, switched, ignores ``If-Range`` as a broken server
would), and can cut an answer short or send it slowly."""

from __future__ import annotations

import email.utils
import http.server
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from tests.tinydata import serve_http
from xc_dagster.data.cache import cache_key
from xc_dagster.data.download import validator_path
from xc_dagster.data.sources import resolve_source
from xc_dagster.errors import XCError

ROOT = Path(__file__).resolve().parents[1]
SIZE = 300_000


def _version(seed: int, size: int = SIZE) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()


V1, V2 = _version(1), _version(2)


class _Server:
    """What the test server serves (``data``, version ``number``), how, and the (Range, If-Range) it was sent."""

    def __init__(self, data: bytes, validator: str = "etag"):
        self.data, self.number, self.validator = data, 1, validator  # validator: etag | last-modified | none
        self.if_range = True  # False: honours Range but ignores If-Range (and still names its current ETag)
        self.cut: int | None = None  # the next answer sends only this many body bytes, then drops the connection
        self.slow = False  # answers trickle out in 64 KiB pieces (time to SIGKILL a client mid-download)
        self.sent_some = threading.Event()
        self.requests: list[tuple[str | None, str | None]] = []
        self.statuses: list[int] = []

    def switch(self, data: bytes) -> None:
        """The file changed on the server: a new version with a new validator."""
        self.data, self.number = data, self.number + 1

    def current(self) -> str | None:
        if self.validator == "etag":
            return f'"v{self.number}"'
        if self.validator == "last-modified":  # an hour per version, long before the answer's Date: strong
            return email.utils.formatdate(1_600_000_000 + 3600 * self.number, usegmt=True)
        return None


def _handler(state: _Server) -> type[http.server.BaseHTTPRequestHandler]:
    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:  # quiet
            pass

        def _head(self, status: int, length: int, content_range: str | None = None) -> None:
            state.statuses.append(status)
            self.send_response(status)
            if content_range:
                self.send_header("Content-Range", content_range)
            if state.current():
                self.send_header("ETag" if state.validator == "etag" else "Last-Modified", state.current())
            self.send_header("Content-Length", str(length))
            self.end_headers()

        def do_GET(self) -> None:
            rng, if_range = self.headers.get("Range"), self.headers.get("If-Range")
            state.requests.append((rng, if_range))
            data, start = state.data, 0
            m = re.fullmatch(r"bytes=(\d+)-", rng or "")
            if m and (if_range is None or not state.if_range or if_range == state.current()):
                start = int(m.group(1))
                if start >= len(data):
                    self._head(416, 0, f"bytes */{len(data)}")
                    return
                self._head(206, len(data) - start, f"bytes {start}-{len(data) - 1}/{len(data)}")
            else:  # no range asked, or If-Range names another version: the whole current one
                self._head(200, len(data))
            body, cut, state.cut = data[start:], state.cut, None
            if cut is not None:
                body = body[:cut]  # then the connection drops
                self.close_connection = True
            step = 65536 if state.slow else len(body) or 1
            for i in range(0, len(body), step):
                self.wfile.write(body[i:i + step])
                self.wfile.flush()
                state.sent_some.set()
                if state.slow:
                    time.sleep(0.02)

    return Handler


def _serve(state: _Server):
    return serve_http(_handler(state), "data.bin")


def _cut_then(state: _Server, url: str, cache: Path, cut: int) -> None:
    """A first download that the server cuts off after ``cut`` bytes (the ``.part`` file stays)."""
    state.cut = cut
    with pytest.raises(XCError, match="connection ended after"):
        resolve_source(url, cache)


def _part(cache: Path, url: str) -> Path:
    return cache / f".{cache_key(url)}.part"


@pytest.mark.parametrize("validator", ["etag", "last-modified"])
def test_resume_after_the_file_changed_fetches_the_new_version_whole(tmp_path, validator):
    state = _Server(V1, validator)
    cache = tmp_path / "cache"
    with _serve(state) as url:
        _cut_then(state, url, cache, SIZE // 3)
        v1_validator = state.current()
        state.switch(V2)
        got = resolve_source(url, cache)
    assert (got / "data.bin").read_bytes() == V2  # never V1[:SIZE // 3] + V2[SIZE // 3:]
    assert state.requests == [(None, None), (f"bytes={SIZE // 3}-", v1_validator)]
    assert state.statuses == [200, 200]  # If-Range named the old version: the server sent the new one whole
    assert not [p.name for p in cache.iterdir() if ".part" in p.name]


@pytest.mark.parametrize("validator", ["etag", "last-modified"])
def test_resume_of_the_same_version_asks_only_for_the_rest(tmp_path, validator):
    state = _Server(V1, validator)
    cache = tmp_path / "cache"
    with _serve(state) as url:
        _cut_then(state, url, cache, SIZE // 3)
        got = resolve_source(url, cache)
    assert (got / "data.bin").read_bytes() == V1
    assert state.requests[1] == (f"bytes={SIZE // 3}-", state.current()) and state.statuses == [200, 206]


def test_server_that_ignores_if_range_is_caught_by_its_etag(tmp_path):
    """A 206 naming another ETag than the partial file's is another version's bytes: restart from zero."""
    state = _Server(V1)
    state.if_range = False
    cache = tmp_path / "cache"
    with _serve(state) as url:
        _cut_then(state, url, cache, SIZE // 3)
        state.switch(_version(2, SIZE + 1000))  # a longer new version
        got = resolve_source(url, cache)
    assert (got / "data.bin").read_bytes() == _version(2, SIZE + 1000)
    assert state.statuses == [200, 206, 200] and state.requests[2] == (None, None)


def test_no_validator_no_resume(tmp_path):
    """A server naming neither ETag nor Last-Modified: a cut-off download restarts from zero."""
    state = _Server(V1, "none")
    cache = tmp_path / "cache"
    with _serve(state) as url:
        state.cut = SIZE // 3
        with pytest.raises(XCError, match="next call starts over"):
            resolve_source(url, cache)
        assert not _part(cache, url).exists()  # nothing kept that could be spliced
        state.switch(V2)
        got = resolve_source(url, cache)
    assert (got / "data.bin").read_bytes() == V2
    assert state.requests == [(None, None), (None, None)]


def test_complete_part_of_an_old_version_is_not_installed(tmp_path):
    """A download that finished but was never installed (killed in between), of a version since replaced by
    one of the same size: If-Range gets the new version, not a 416 that would keep the old one."""
    state = _Server(V1)
    cache = tmp_path / "cache"
    with _serve(state) as url:
        cache.mkdir()
        part = _part(cache, url)
        part.write_bytes(V1)
        validator_path(part).write_text(state.current() + "\n")
        state.switch(V2)
        got = resolve_source(url, cache)
    assert (got / "data.bin").read_bytes() == V2
    assert state.requests == [(f"bytes={SIZE}-", '"v1"')] and state.statuses == [200]


def test_sigkilled_download_resumed_after_the_file_changed(tmp_path):
    """A child process downloading is SIGKILLed mid-transfer; the file then changes on the server; the next
    fetch ends with the new version exactly."""
    big1, big2 = _version(1, 6 << 20), _version(2, 6 << 20)  # several of the client's 1 MiB copy blocks
    state = _Server(big1)
    state.slow = True
    cache = tmp_path / "cache"
    with _serve(state) as url:
        code = "import sys; from pathlib import Path; from xc_dagster.data.sources import resolve_source; " \
               "resolve_source(sys.argv[1], Path(sys.argv[2]))"
        child = subprocess.Popen([sys.executable, "-c", code, url, str(cache)], cwd=ROOT,
                                 env={**os.environ, "PYTHONPATH": str(ROOT)})
        part = _part(cache, url)
        deadline = time.monotonic() + 60
        while not (part.exists() and part.stat().st_size > 0):  # a first block written
            assert child.poll() is None and time.monotonic() < deadline, "the child never got going"
            time.sleep(0.01)
        os.kill(child.pid, signal.SIGKILL)
        assert child.wait(30) == -signal.SIGKILL
        have = part.stat().st_size
        assert 0 < have < len(big1)
        state.slow = False
        state.switch(big2)
        got = resolve_source(url, cache)
    assert (got / "data.bin").read_bytes() == big2
    assert state.requests[-1] == (f"bytes={have}-", '"v1"') and state.statuses[-1] == 200
