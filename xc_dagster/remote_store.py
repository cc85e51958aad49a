"""Stage folders published to an artifact root on any fsspec URI (``XC_ARTIFACT_ROOT=s3://bucket/prefix``).

The local ``$XC_HOME/artifacts`` stays the working copy; :class:`RemoteStore` owns the remote side only:

- ``<root>/<dataset>/<stage>/versions/<version>/<path>``: the files of one published version, written once;
- ``<root>/<dataset>/<stage>/MANIFEST.json``: the current version (its id, when it was published, and every
  file's size and sha256).

:meth:`RemoteStore.publish` uploads a complete local folder under a fresh version key and only then writes the
manifest in one PUT: the new version becomes visible at once, and a publish that fails or is killed leaves the
manifest naming the previous version, whose files are untouched. :meth:`RemoteStore.download` copies the
manifest's version into a folder, checking every file's size and sha256 against it. Old versions (and the
partial versions of killed publishes) are never deleted: a deletion could remove the version a concurrent
publisher is about to name, or a reader is fetching.

Credentials and endpoints come from fsspec's own configuration: for S3 the standard AWS variables
(``AWS_ACCESS_KEY_ID``, ``AWS_ENDPOINT_URL``, ...), ``FSSPEC_S3_<kwarg>`` variables (``FSSPEC_S3_ENDPOINT_URL``)
or files under ``~/.config/fsspec``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import socket
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, Callable, Iterator, Mapping

import fsspec
from fsspec.implementations.local import LocalFileSystem

from xc_dagster.durable import atomic_write_text
from xc_dagster.errors import XCConfigError, XCError

ROOT_ENV = "XC_ARTIFACT_ROOT"  # the remote artifact root; unset or empty: artifacts stay local
MANIFEST = "MANIFEST.json"
VERSIONS = "versions"
FORMAT = 1
CHUNK = 8 << 20  # bytes per read while hashing, uploading, downloading
VERSION_RE = re.compile(r"^[0-9A-Za-z][0-9A-Za-z._-]{0,127}$")
SHA256_RE = re.compile(r"^[0-9a-f]{64}$")


class RemoteArtifactError(XCError):
    """A remote stage could not be published or fetched, or what was fetched is not what its manifest names."""


@dataclass(frozen=True)
class Manifest:
    """One published version of a stage: ``files`` maps each relative POSIX path to ``{"size", "sha256"}``;
    ``dirs`` lists the folders with no file in them (kept so a fetched copy has the same tree); ``created_ns``:
    when it was published (ns since the epoch; 0 in a manifest written before the field, read as older than any
    local write)."""

    dataset: str
    stage: str
    version: str
    files: dict[str, dict[str, Any]]
    dirs: tuple[str, ...] = ()
    created: str = ""
    created_ns: int = 0
    uri: str = field(default="", compare=False)  # where it was read from (error messages)

    def to_json(self) -> str:
        return json.dumps({"format": FORMAT, "dataset": self.dataset, "stage": self.stage, "version": self.version,
                           "created": self.created, "created_ns": self.created_ns, "host": socket.gethostname(),
                           "files": self.files, "dirs": list(self.dirs)}, indent=1, sort_keys=True) + "\n"


def _bad(uri: str, what: str) -> RemoteArtifactError:
    return RemoteArtifactError(f"{uri}: {what}; publish the stage again (re-materialize it)")


def _check_relpath(uri: str, rel: Any) -> str:
    """A manifest path must stay inside its version: relative, POSIX, no '.', '..' or empty parts."""
    parts = rel.split("/") if isinstance(rel, str) else []
    if not parts or any(p in ("", ".", "..") or "\\" in p for p in parts):
        raise _bad(uri, f"field 'files'/'dirs': expected relative paths inside the version, got {rel!r}")
    return rel


@contextlib.contextmanager
def _failing(what: str) -> Iterator[None]:
    """Name what failed on the remote side: the storage's own errors (botocore's credential and endpoint errors
    are not OSErrors) become a :class:`RemoteArtifactError`; ours pass."""
    try:
        yield
    except XCError:
        raise
    except Exception as exc:
        raise RemoteArtifactError(f"{what} ({type(exc).__name__}: {exc}); check the root's permissions, "
                                  f"credentials and endpoint (AWS_*, FSSPEC_S3_* variables)") from exc


def parse_manifest(raw: bytes, uri: str, dataset: str, stage: str) -> Manifest:
    """A manifest's JSON, checked field by field (it is read from shared storage: untrusted)."""
    try:
        obj = json.loads(raw)
    except ValueError as exc:
        raise _bad(uri, f"not valid JSON ({exc})") from None
    if not isinstance(obj, dict) or obj.get("format") != FORMAT:
        raise _bad(uri, f"expected a JSON object with 'format': {FORMAT}")
    for name, want in (("dataset", dataset), ("stage", stage)):
        if obj.get(name) != want:
            raise _bad(uri, f"field {name!r}: expected {want!r}, got {obj.get(name)!r}")
    version, files, dirs = obj.get("version"), obj.get("files"), obj.get("dirs", [])
    created_ns = obj.get("created_ns", 0)
    if type(created_ns) is not int or created_ns < 0:
        raise _bad(uri, f"field 'created_ns': expected an integer >= 0 (ns since the epoch), got {created_ns!r}")
    if not isinstance(version, str) or not VERSION_RE.match(version):
        raise _bad(uri, f"field 'version': expected a version id ([0-9A-Za-z._-]), got {version!r}")
    if not isinstance(files, dict) or not isinstance(dirs, list):
        raise _bad(uri, "fields 'files' (an object) and 'dirs' (a list) expected")
    for rel, meta in files.items():
        _check_relpath(uri, rel)
        if not (isinstance(meta, dict) and isinstance(meta.get("size"), int) and meta["size"] >= 0
                and isinstance(meta.get("sha256"), str) and SHA256_RE.match(meta["sha256"])):
            raise _bad(uri, f"field 'files'[{rel!r}]: expected {{'size': int >= 0, 'sha256': 64 hex digits}}, "
                            f"got {meta!r}")
    return Manifest(dataset, stage, version,
                    {k: {"size": v["size"], "sha256": v["sha256"]} for k, v in files.items()},
                    tuple(_check_relpath(uri, d) for d in dirs), str(obj.get("created", "")), created_ns, uri)


def _raise(exc: OSError) -> None:
    """os.walk's error: a folder of the version being published cannot be listed (removed meanwhile)."""
    raise RemoteArtifactError(f"{exc.filename}: cannot be listed ({exc.strerror}) while it is published: the folder "
                              f"changed (a concurrent rewrite removed it); nothing was made current") from exc


def new_version_id() -> str:
    """``<UTC time>-<random>``: sorts by creation time, unique across machines."""
    return f"{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{uuid.uuid4().hex[:12]}"


class RemoteStore:
    """The published stages under one fsspec root (see the module docstring)."""

    def __init__(self, root: str, storage_options: Mapping[str, Any] | None = None):
        root = str(root).strip().rstrip("/")
        if not root:
            raise XCConfigError(f"{ROOT_ENV}: expected a folder or fsspec URI (s3://bucket/prefix), got ''")
        try:
            self.fs, self.path = fsspec.core.url_to_fs(root, **dict(storage_options or {}))
        except (ImportError, ValueError) as exc:  # unknown protocol, or its package (s3fs, gcsfs) not installed
            raise XCConfigError(f"{ROOT_ENV}={root!r}: cannot open it with fsspec ({exc}); install the "
                                f"protocol's package (pip install 'xc-dagster[s3]' for s3://)") from None
        self.path = self.path.rstrip("/")
        self.root = root
        self.local = isinstance(self.fs, LocalFileSystem)  # a mounted file system: folders made, renames atomic

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> "RemoteStore | None":
        """The store of ``XC_ARTIFACT_ROOT``, or None when it is unset or empty."""
        root = environ.get(ROOT_ENV, "").strip()
        return cls(root) if root else None

    def __repr__(self) -> str:
        return f"RemoteStore({self.root!r})"

    def uri(self, key: str) -> str:
        """The full URI of a key of this store (for messages)."""
        return f"{self.root}/{key}" if key else self.root

    def _key(self, key: str) -> str:
        return f"{self.path}/{key}"

    @staticmethod
    def stage_key(dataset: str, stage: str) -> str:
        return f"{dataset}/{stage}"

    def manifest_key(self, dataset: str, stage: str) -> str:
        return f"{self.stage_key(dataset, stage)}/{MANIFEST}"

    def version_key(self, dataset: str, stage: str, version: str) -> str:
        return f"{self.stage_key(dataset, stage)}/{VERSIONS}/{version}"

    def manifest(self, dataset: str, stage: str) -> Manifest | None:
        """The stage's current manifest, or None when the stage was never published."""
        key = self.manifest_key(dataset, stage)
        with _failing(f"{self.uri(key)}: cannot read the manifest"):
            try:
                self.fs.invalidate_cache(self._key(key))  # this process's cached listings may predate another's PUT
                raw = self.fs.cat_file(self._key(key))
            except FileNotFoundError:
                return None
        return parse_manifest(raw, self.uri(key), dataset, stage)

    def publish(self, dataset: str, stage: str, folder: Path, check: Callable[[], None] | None = None) -> Manifest:
        """Upload ``folder`` (complete, not changing) as a new version, then point the manifest at it. A folder or
        file that cannot be read (removed meanwhile) fails the upload, as does ``check`` (called after the last
        upload, before the manifest is written: e.g. that ``folder`` is still the current one)."""
        folder = Path(folder)
        version = new_version_id()
        base = self.version_key(dataset, stage, version)
        files: dict[str, dict[str, Any]] = {}
        dirs = []
        with _failing(f"publishing {folder} to {self.uri(base)} failed; the manifest "
                      f"{self.uri(self.manifest_key(dataset, stage))} still names the previous version"):
            for dirpath, dirnames, filenames in os.walk(folder, onerror=_raise):  # no folder skipped silently
                dirnames.sort()
                rel_dir = PurePosixPath(Path(dirpath).relative_to(folder).as_posix())
                if not filenames and not dirnames and str(rel_dir) != ".":
                    dirs.append(str(rel_dir))
                for name in sorted(filenames):
                    rel = str(rel_dir / name) if str(rel_dir) != "." else name
                    files[rel] = self._upload(Path(dirpath) / name, f"{base}/{rel}")
            if check is not None:
                check()
            now = time.time_ns()  # compared with local writes' times by ArtifactStore.sync
            manifest = Manifest(dataset, stage, version, files, tuple(dirs),
                                time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now // 10**9)), now,
                                self.uri(self.manifest_key(dataset, stage)))
            self._put_manifest(self.manifest_key(dataset, stage), manifest.to_json().encode())
        return manifest

    def _upload(self, src: Path, key: str) -> dict[str, Any]:
        """Copy one file to ``key``, hashing the bytes sent; returns its manifest entry."""
        digest, size = hashlib.sha256(), 0
        with open(src, "rb") as f, self._open_out(key) as out:
            while chunk := f.read(CHUNK):
                digest.update(chunk)
                size += len(chunk)
                out.write(chunk)
            self._flush(out)
        return {"size": size, "sha256": digest.hexdigest()}

    def _open_out(self, key: str) -> Any:
        """A new object (written whole at close on object stores), or a file of a local root (its folder made)."""
        if not self.local:
            return self.fs.open(self._key(key), "wb")
        Path(self._key(key)).parent.mkdir(parents=True, exist_ok=True)
        return open(self._key(key), "wb")

    def _flush(self, out: Any) -> None:
        """On a local root, make a written file durable before a manifest may name it."""
        if self.local:
            out.flush()
            os.fsync(out.fileno())

    def _put_manifest(self, key: str, data: bytes) -> None:
        """One whole-object write: a PUT on object stores; a temporary file, fsync and rename on a local root."""
        if not self.local:
            self.fs.pipe_file(self._key(key), data)
            return
        atomic_write_text(Path(self._key(key)), data.decode("utf-8"))

    def download(self, manifest: Manifest, dest: Path) -> None:
        """Copy ``manifest``'s version into the empty folder ``dest``, checking each file's size and sha256;
        a missing or different object raises naming its key (``dest`` is then the caller's to remove)."""
        dest = Path(dest)
        base = self.version_key(manifest.dataset, manifest.stage, manifest.version)
        for rel in manifest.dirs:
            (dest / rel).mkdir(parents=True, exist_ok=True)
        for rel, want in sorted(manifest.files.items()):
            key = f"{base}/{rel}"
            target = dest / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            with _failing(f"{self.uri(key)}: download failed"):
                try:
                    got = self._download(key, target, want["size"])
                except FileNotFoundError:
                    raise RemoteArtifactError(f"{self.uri(key)}: missing, though the manifest {manifest.uri} "
                                              f"names it (version {manifest.version}); re-materialize the "
                                              f"stage") from None
            if got != want:
                raise RemoteArtifactError(
                    f"{self.uri(key)}: size {got['size']} sha256 {got['sha256']}, but the manifest {manifest.uri} "
                    f"says size {want['size']} sha256 {want['sha256']}: the object was changed or damaged after it "
                    f"was published; nothing of it was kept in the local cache; re-materialize the stage")

    def _download(self, key: str, target: Path, limit: int) -> dict[str, Any]:
        """Copy one object to ``target``, hashing it; stops past ``limit`` bytes (an object grown since)."""
        digest, size = hashlib.sha256(), 0
        with self.fs.open(self._key(key), "rb") as f, open(target, "wb") as out:
            while chunk := f.read(CHUNK):
                digest.update(chunk)
                size += len(chunk)
                if size > limit:
                    return {"size": f"over {limit}", "sha256": "(not read to its end)"}
                out.write(chunk)
        return {"size": size, "sha256": digest.hexdigest()}
