"""Dataset sources: resumable http(s) downloads, SHA-256 verification, nothing cached from a bad download."""

from __future__ import annotations

import gzip
import hashlib
import http.server
import io
import os
import re
import tarfile
import zipfile
from pathlib import Path

import fsspec
import pytest

from tests.tinydata import serve_http, write_lf_dataset
from xc_dagster.data import read_dataset
from xc_dagster.data.archives import is_archive
from xc_dagster.data.cache import cache_key, file_sha256, install_file
from xc_dagster.data.download import validator_path
from xc_dagster.data.sources import resolve_source
from xc_dagster.errors import XCConfigError, XCError, XCFormatError


def _zip_of(folder: Path) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for f in sorted(folder.iterdir()):
            zf.write(f, f"ds/{f.name}")
    return buf.getvalue()


class _State:
    """What the test server serves and what it saw."""

    def __init__(self, payload: bytes, cut_first: int | None = None, honor_range: bool = True):
        self.payload, self.cut_first, self.honor_range = payload, cut_first, honor_range
        self.ranges: list[str | None] = []


def _handler(state: _State) -> type[http.server.BaseHTTPRequestHandler]:
    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:  # quiet
            pass

        def do_GET(self) -> None:
            rng = self.headers.get("Range")
            state.ranges.append(rng)
            if self.path != "/ds.zip":
                self.send_error(404)
                return
            data, start = state.payload, 0
            etag = f'"{hashlib.sha256(data).hexdigest()[:16]}"'  # the version's validator: resumes need one
            m = re.fullmatch(r"bytes=(\d+)-", rng or "")
            if m and state.honor_range:
                start = int(m.group(1))
                if start >= len(data):
                    self.send_response(416)
                    self.send_header("Content-Range", f"bytes */{len(data)}")
                    self.send_header("Content-Length", "0")
                    self.send_header("ETag", etag)
                    self.end_headers()
                    return
                self.send_response(206)
                self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
            else:
                self.send_response(200)
            self.send_header("ETag", etag)
            body = data[start:]
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if state.cut_first is not None and len(state.ranges) == 1:
                self.wfile.write(body[:state.cut_first])  # then the connection drops
                self.wfile.flush()
                self.close_connection = True
                return
            self.wfile.write(body)

    return Handler


def _serve(state: _State):
    return serve_http(_handler(state), "ds.zip")


@pytest.fixture(scope="module")
def payload(tmp_path_factory) -> bytes:
    return _zip_of(write_lf_dataset(tmp_path_factory.mktemp("src") / "ds", n_train=30, n_test=10, n_labels=20))


def _entries(cache: Path) -> list[str]:
    return sorted(p.name for p in cache.iterdir()) if cache.exists() else []


def test_interrupted_download_resumes_with_range(tmp_path, payload):
    state = _State(payload, cut_first=len(payload) // 3)
    digest = hashlib.sha256(payload).hexdigest()
    cache = tmp_path / "cache"
    with _serve(state) as url:
        with pytest.raises(XCError, match="connection ended after"):
            resolve_source(url, cache, sha256=digest)
        parts = [p for p in cache.iterdir() if p.name.endswith(".part")]
        assert len(parts) == 1 and parts[0].stat().st_size == len(payload) // 3
        assert not [n for n in _entries(cache) if not n.startswith(".")]  # no cache entry from a partial file
        got = resolve_source(url, cache, sha256=digest)
        assert state.ranges == [None, f"bytes={len(payload) // 3}-"]
        assert resolve_source(url, cache, sha256=digest) == got  # cached: no third request
        assert len(state.ranges) == 2
    ds = read_dataset(got)
    assert (ds.num_train, ds.num_test, ds.num_labels) == (30, 10, 20)
    assert not [p for p in cache.iterdir() if p.name.endswith(".part")]


def test_resume_falls_back_to_full_download_when_range_is_ignored(tmp_path, payload):
    state = _State(payload, cut_first=1000, honor_range=False)
    cache = tmp_path / "cache"
    with _serve(state) as url:
        with pytest.raises(XCError):
            resolve_source(url, cache)
        got = resolve_source(url, cache)
    assert state.ranges == [None, "bytes=1000-"]  # asked to resume, got a 200: restarted from zero
    assert read_dataset(got).num_train == 30


def test_complete_part_file_is_finished_after_416(tmp_path, payload):
    """A download that finished but was never extracted (killed in between) is not fetched again."""
    state = _State(payload)
    cache = tmp_path / "cache"
    with _serve(state) as url:
        cache.mkdir()
        part = cache / f".{cache_key(url)}.part"
        part.write_bytes(payload)
        validator_path(part).write_text(f'"{hashlib.sha256(payload).hexdigest()[:16]}"\n')  # recorded with it
        got = resolve_source(url, cache)
    assert state.ranges == [f"bytes={len(payload)}-"]
    assert read_dataset(got).num_labels == 20


def test_checksum_mismatch_is_rejected_and_leaves_nothing(tmp_path, payload):
    cache = tmp_path / "cache"
    wrong = "0" * 64
    with _serve(_State(payload)) as url:
        with pytest.raises(XCFormatError) as ei:
            resolve_source(url, cache, sha256=wrong)
        msg = str(ei.value)
        assert url in msg and wrong in msg and hashlib.sha256(payload).hexdigest() in msg
        assert _entries(cache) == [n for n in _entries(cache) if n.endswith(".lock")]  # no entry, no .part
        # the right checksum then works (fresh download)
        got = resolve_source(url, cache, sha256=hashlib.sha256(payload).hexdigest().upper())
    assert read_dataset(got).num_test == 10


def test_corrupt_archive_download_is_not_cached(tmp_path, payload):
    cache = tmp_path / "cache"
    with _serve(_State(payload[: len(payload) // 2] + b"\0" * 50)) as url:
        with pytest.raises(XCFormatError, match="readable zip"):
            resolve_source(url, cache)
    assert all(n.endswith(".lock") for n in _entries(cache))


def test_bad_checksum_values_and_folders(tmp_path, payload):
    archive = tmp_path / "ds.zip"
    archive.write_bytes(payload)
    with pytest.raises(XCConfigError, match="64 hexadecimal"):
        resolve_source(str(archive), tmp_path / "cache", sha256="abc")
    with pytest.raises(XCFormatError, match="SHA-256"):
        resolve_source(str(archive), tmp_path / "cache", sha256="1" * 64)
    assert archive.exists() and not _entries(tmp_path / "cache")  # the user's own file is never deleted
    got = resolve_source(f"file://{archive}", tmp_path / "cache", sha256=f"sha256:{file_sha256(archive)}")
    assert read_dataset(got).num_train == 30
    with pytest.raises(XCConfigError, match="folder"):
        resolve_source(str(tmp_path), tmp_path / "cache", sha256=file_sha256(archive))


def test_fsspec_memory_file_with_checksum(tmp_path, payload):
    fs = fsspec.filesystem("memory")
    fs.pipe("/xc-test-sources/ds.zip", payload)
    try:
        with pytest.raises(XCFormatError, match="SHA-256"):
            resolve_source("memory:///xc-test-sources/ds.zip", tmp_path / "cache", sha256="2" * 64)
        assert not _entries(tmp_path / "cache")
        got = resolve_source("memory:///xc-test-sources/ds.zip", tmp_path / "cache",
                             sha256=hashlib.sha256(payload).hexdigest())
        assert read_dataset(got).num_labels == 20
    finally:
        fs.rm("/xc-test-sources", recursive=True)


def test_single_gz_sources_are_decompressed(tmp_path):
    """``X.gz`` of one plain file becomes ``X`` in the cache; a gzipped tar named ``.gz`` is extracted;
    the LF layout's own ``*.json.gz`` files are not archives."""
    assert is_archive("Y.txt.gz") and is_archive("ds.tar.gz") and not is_archive("trn.json.gz")
    single = tmp_path / "Y.txt.gz"
    single.write_bytes(gzip.compress(b"label a\nlabel b\n"))
    got = resolve_source(str(single), tmp_path / "cache")
    assert (got / "Y.txt").read_bytes() == b"label a\nlabel b\n"
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        data = b"hello\n"
        info = tarfile.TarInfo("DS/Y.txt")
        info.size = len(data)
        tf.addfile(info, io.BytesIO(data))
    (tmp_path / "ds.gz").write_bytes(gzip.compress(buf.getvalue()))
    got = resolve_source(str(tmp_path / "ds.gz"), tmp_path / "cache")
    assert got.name == "DS" and (got / "Y.txt").read_text() == "hello\n"
    bad = tmp_path / "broken.gz"
    bad.write_bytes(gzip.compress(b"x" * 1000)[:20])
    with pytest.raises(XCFormatError, match="broken.gz"):
        resolve_source(str(bad), tmp_path / "cache")
    assert not [p for p in (tmp_path / "cache").iterdir() if p.name.startswith("broken")]


def test_a_cache_entry_is_fsynced_before_it_is_renamed_into_place(tmp_path, monkeypatch):
    """Every file and folder of an extracted entry reaches the disk before the rename names it, and the cache
    folder's entries after: a crash never leaves an entry that exists but is not complete."""
    arc = tmp_path / "ds.tar.gz"
    with tarfile.open(arc, "w:gz") as t:
        for name, body in (("ds/train.txt", b"1 2\n" * 100), ("ds/test.txt", b"3 4\n" * 50)):
            info = tarfile.TarInfo(name)
            info.size = len(body)
            t.addfile(info, io.BytesIO(body))
    calls, real_fsync, real_rename = [], os.fsync, os.rename
    monkeypatch.setattr(os, "fsync", lambda fd: (calls.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"))),
                                                 real_fsync(fd))[1])
    monkeypatch.setattr(os, "rename", lambda a, b: (calls.append(("rename", str(a))), real_rename(a, b))[1])
    cache = tmp_path / "cache"
    out = install_file(arc, arc.name, cache / "ds-abc", str(arc))
    assert sorted(p.name for p in out.iterdir()) == ["test.txt", "train.txt"]
    (work,) = [path for op, path in calls if op == "rename"]
    renamed = calls.index(("rename", work))
    synced_before = {path for op, path in calls[:renamed] if op == "fsync"}
    assert {work, f"{work}/ds", f"{work}/ds/train.txt", f"{work}/ds/test.txt"} <= synced_before
    assert ("fsync", str(cache)) in calls[renamed:]
