"""The click-log feed that triggers retraining, without Dagster (``assets/automation.py`` wraps it; see
``docs/AUTOMATION.md``).

**Click-log drops.** A *feed root* (a local folder or an fsspec URI: ``$XC_CLICKLOG_ROOT``, default
``$XC_HOME/clicklog-inbox``) holds one folder per dataset: every click-log file below ``<root>/<NAME>/``
(``.parquet``, ``.csv[.gz]``, ``.jsonl[.gz]``, any depth; names starting with ``.`` or ``_`` are skipped, as
upload temporaries) belongs to dataset ``NAME``. The files not seen before -- a new name, or a known name
whose size or modification stamp changed -- form a *drop*. :func:`pending_drops` finds them from a listing
and the record of the files already consumed (the sensor's cursor), so files arriving out of order are
never missed; :func:`build_drop` builds the dataset folder from them with
:func:`~xc_dagster.data.clicklog.build_click_dataset` (label ids continued from the dataset's current
``label_map.json``) into ``$XC_HOME/clicklogs/NAME/drop-<time>-<digest>/`` and points catalog entry NAME
at it (its other options are kept). A drop's digest (of its files' names, sizes and stamps) is unique per
drop: the same drop always gives the same folder and the same run key.

The file signatures here (:class:`FileSig`, :func:`local_path`, :func:`remote_sig`, :func:`url_fs`) also serve
:mod:`xc_dagster.serving.source_changes`, which tells whether a dataset's source changed since its last ingest.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit
from urllib.request import url2pathname

import fsspec

from xc_dagster.catalog import NAME_RE, Catalog, DatasetSpec
from xc_dagster.data.clicklog import build_click_dataset
from xc_dagster.data.clicklog_reader import log_format
from xc_dagster.errors import XCConfigError, XCError
from xc_dagster.home import Home

ENV_ROOT = "XC_CLICKLOG_ROOT"
INBOX = "clicklog-inbox"
HISTORY = ("drop", "all")  # build from the new files only, or from every file of the feed
CURSOR_VERSION = 1


# ------------------------------------------------------------------------------------------ listing

@dataclass(frozen=True)
class FileSig:
    """What identifies one version of a file: its size and a modification stamp (mtime, or an ETag)."""

    size: int
    stamp: str
    mtime: float | None = None  # seconds since the epoch, when the filesystem reports one

    def key(self) -> list[Any]:
        return [self.size, self.stamp]


@dataclass
class FeedListing:
    root: str
    feeds: dict[str, dict[str, FileSig]] = field(default_factory=dict)  # name -> relative path -> signature
    ignored: list[str] = field(default_factory=list)  # top-level folders that are not valid dataset names


def feed_root(home: Home, root: str = "") -> str:
    """The feed root: ``root`` if given, else ``$XC_CLICKLOG_ROOT``, else ``$XC_HOME/clicklog-inbox``."""
    return root or os.environ.get(ENV_ROOT) or str(home.root / INBOX)


def local_path(uri: str) -> Path | None:
    """The local path of a plain path or ``file://`` URI; None for any other scheme."""
    parts = urlsplit(uri)
    scheme = parts.scheme.lower()
    if scheme == "" or (len(scheme) == 1 and os.name == "nt"):
        return Path(uri).expanduser()
    if scheme == "file" and parts.netloc in ("", "localhost"):
        return Path(url2pathname(unquote(parts.path)))
    return None


def is_log_file(name: str) -> bool:
    """A click-log file name (:func:`~xc_dagster.data.clicklog_reader.log_format`) that is not hidden."""
    return not name.startswith((".", "_")) and log_format(Path(name)) is not None


def _hidden(rel: str) -> bool:
    return any(part.startswith((".", "_")) for part in rel.split("/"))


def _epoch(v: Any) -> float | None:
    if isinstance(v, (int, float)):
        return float(v)
    if isinstance(v, datetime):
        return (v if v.tzinfo else v.replace(tzinfo=timezone.utc)).timestamp()
    if isinstance(v, str):
        try:
            t = datetime.fromisoformat(v.replace("Z", "+00:00"))
        except ValueError:
            return None
        return (t if t.tzinfo else t.replace(tzinfo=timezone.utc)).timestamp()
    return None


def remote_sig(info: dict[str, Any]) -> FileSig:
    """Size and stamp from an fsspec ``info`` dict (keys differ by backend: local, S3, GCS, memory...)."""
    size = int(info.get("size") or 0)
    for k in ("mtime", "LastModified", "last_modified", "updated", "modified", "created"):
        t = _epoch(info.get(k))
        if t is not None:
            return FileSig(size, f"{t:.6f}", t)
    tag = info.get("ETag") or info.get("etag") or info.get("md5Hash") or info.get("checksum") or ""
    return FileSig(size, str(tag), None)


def url_fs(uri: str):
    try:
        return fsspec.core.url_to_fs(uri)
    except (ImportError, ValueError) as e:
        raise XCConfigError(f"click-log feed root {uri}: no fsspec filesystem for it ({e})") from e


def list_feeds(root: str) -> FeedListing:
    """Every click-log file under ``root/<NAME>/``, by dataset name and path relative to ``root/<NAME>``.

    A missing local root is an empty listing. Top-level folders that are not valid dataset names are listed
    in ``ignored``; top-level files, hidden names (``.``/``_``) and files of other types are skipped.
    """
    out = FeedListing(root)
    local = local_path(root)
    if local is not None:
        if not local.is_dir():
            return out
        for d in sorted(local.iterdir()):
            if not d.is_dir() or d.name.startswith((".", "_")):
                continue
            if not NAME_RE.fullmatch(d.name):
                out.ignored.append(d.name)
                continue
            files: dict[str, FileSig] = {}
            for dirpath, dirnames, filenames in os.walk(d):
                dirnames[:] = sorted(n for n in dirnames if not n.startswith((".", "_")))
                for fn in sorted(filenames):
                    if is_log_file(fn):
                        p = Path(dirpath) / fn
                        st = p.stat()
                        files[p.relative_to(d).as_posix()] = FileSig(st.st_size, str(st.st_mtime_ns), st.st_mtime)
            out.feeds[d.name] = files
        return out
    fs, base = url_fs(root)
    base = base.rstrip("/")
    try:
        infos = fs.find(base, detail=True, withdirs=True) if fs.exists(base) else {}
    except Exception as e:  # backends raise their own types (auth, network)
        raise XCError(f"click-log feed root {root}: cannot list it ({type(e).__name__}: {e})") from e
    for path, info in sorted(infos.items()):
        rel = path[len(base):].lstrip("/") if path.startswith(base) else path
        name, _, inner = rel.partition("/")
        if not name or name.startswith((".", "_")):
            continue
        if not NAME_RE.fullmatch(name):
            if name not in out.ignored:
                out.ignored.append(name)
            continue
        if info.get("type") == "directory":
            out.feeds.setdefault(name, {})
            continue
        if inner and not _hidden(inner) and is_log_file(inner.rsplit("/", 1)[-1]):
            out.feeds.setdefault(name, {})[inner] = remote_sig(info)
    return out


def feed_names(root: str) -> list[str]:
    """The dataset names of the feed root's folders (the partitions the sensor can request)."""
    return sorted(list_feeds(root).feeds)


# ------------------------------------------------------------------------------------------- cursor

def decode_cursor(text: str | None) -> dict[str, dict[str, list[Any]]]:
    """The consumed files (``{name: {relative path: [size, stamp]}}``) from a sensor cursor (None = none)."""
    if not text:
        return {}
    try:
        raw = json.loads(text)
    except ValueError as e:
        raise XCConfigError(f"click-log sensor cursor is not JSON ({e}); reset it in the sensor's page") from e
    if not isinstance(raw, dict) or raw.get("version") != CURSOR_VERSION or not isinstance(raw.get("seen"), dict):
        raise XCConfigError(f"click-log sensor cursor: expected {{'version': {CURSOR_VERSION}, 'seen': {{...}}}}, "
                            f"got {text[:120]!r}; reset it in the sensor's page")
    return raw["seen"]


def encode_cursor(seen: dict[str, dict[str, list[Any]]]) -> str:
    return json.dumps({"version": CURSOR_VERSION, "seen": seen}, sort_keys=True, separators=(",", ":"))


# -------------------------------------------------------------------------------------------- drops

@dataclass
class Drop:
    """The new or changed files of one dataset's feed, and the files its dataset is built from."""

    name: str
    new: dict[str, FileSig]
    files: dict[str, FileSig]
    digest: str
    newest: float | None

    @property
    def run_key(self) -> str:
        return f"clicklogs:{self.name}:{self.digest}"

    @property
    def folder_name(self) -> str:
        if self.newest is None:
            return f"drop-{self.digest}"
        t = datetime.fromtimestamp(self.newest, tz=timezone.utc).strftime("%Y%m%dT%H%M%SZ")
        return f"drop-{t}-{self.digest}"

    def consumed(self) -> dict[str, list[Any]]:
        """The cursor entries of this drop's new files."""
        return {rel: sig.key() for rel, sig in self.new.items()}


def drop_digest(name: str, files: dict[str, FileSig]) -> str:
    body = json.dumps([name, sorted([rel, *sig.key()] for rel, sig in files.items())], separators=(",", ":"))
    return hashlib.sha256(body.encode()).hexdigest()[:16]


def pending_drops(listing: FeedListing, seen: dict[str, dict[str, list[Any]]], *, now: float,
                  settle_seconds: float = 0.0, history: str = "drop") -> tuple[list[Drop], dict[str, str]]:
    """The drops to build now, and the feeds that wait (a new file modified less than ``settle_seconds``
    ago may still be being written; the whole drop waits for it)."""
    if history not in HISTORY:
        raise XCConfigError(f"click-log feed history {history!r}: one of {HISTORY}")
    drops, waiting = [], {}
    for name, files in sorted(listing.feeds.items()):
        done = seen.get(name, {})
        new = {rel: sig for rel, sig in files.items() if done.get(rel) != sig.key()}
        if not new:
            continue
        young = [rel for rel, sig in new.items() if sig.mtime is not None and now - sig.mtime < settle_seconds]
        if young:
            waiting[name] = (f"{len(young)} new file(s) modified less than {settle_seconds:g} s ago "
                             f"(e.g. {young[0]}); waiting for them to settle")
            continue
        times = [sig.mtime for sig in new.values() if sig.mtime is not None]
        drops.append(Drop(name, new, dict(files) if history == "all" else new, drop_digest(name, new),
                          max(times) if times else None))
    return drops, waiting


def previous_label_map(catalog: Catalog, name: str) -> Path | None:
    """The ``label_map.json`` of the folder catalog entry ``name`` points to (a click dataset), if any."""
    spec = catalog.load().get(name)
    if spec is None:
        return None
    local = local_path(spec.source)
    if local is not None and (local / "label_map.json").is_file():
        return local / "label_map.json"
    return None


def register_click_dataset(catalog: Catalog, name: str, folder: Path) -> tuple[DatasetSpec, bool]:
    """Point catalog entry ``name`` at a click dataset folder (layout ``lf-raw``, text ``title``); an existing
    entry keeps its other options (strategy, preset, overrides). Retrains warm-start from the dataset's
    champion (``pretrain.warm_start=champion``, a cold start while there is none) unless the entry sets
    ``pretrain.warm_start`` itself. Returns the entry and whether it existed."""
    existed = []

    def change(old: DatasetSpec | None) -> DatasetSpec:  # read and written under the catalog's lock
        existed.append(old is not None)
        overrides = dict(old.overrides) if old is not None else {}
        overrides.setdefault("pretrain.warm_start", "champion")
        changes: dict[str, Any] = {"source": str(folder), "layout": "lf-raw", "text": "title", "sha256": None,
                                   "overrides": overrides}
        return dataclasses.replace(old, **changes) if old is not None else DatasetSpec(name=name, **changes)

    spec = catalog.update(name, change)
    return spec, existed[-1]


def _local_files(home: Home, root: str, drop: Drop) -> list[Path]:
    """Local paths of the drop's files: as they are for a local root, else copied into the cache."""
    local = local_path(root)
    if local is not None:
        return [local / drop.name / rel for rel in sorted(drop.files)]
    fs, base = url_fs(root)
    cache = home.cache / "clicklog-feeds" / drop.name / drop.digest
    paths = []
    for rel in sorted(drop.files):
        dst = cache / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        tmp = dst.with_name(f".{dst.name}.part")
        try:
            # get_file copies the one path as named; get() would expand a name like day[1].csv as a glob
            fs.get_file(f"{base.rstrip('/')}/{drop.name}/{rel}", str(tmp))
        except Exception as e:
            raise XCError(f"click-log feed {root}: cannot copy {drop.name}/{rel} ({type(e).__name__}: {e})") from e
        os.replace(tmp, dst)
        paths.append(dst)
    return paths


def build_drop(home: Home, root: str, drop: Drop, *, min_clicks: int = 1,
               test_fraction: float = 0.2) -> dict[str, Any]:
    """Build the drop's dataset folder and register it in the catalog; returns the build summary plus
    ``folder``, ``previous`` (the label map continued, or None) and ``registered`` (added/updated)."""
    catalog = Catalog(home.catalog)
    previous = previous_label_map(catalog, drop.name)
    out = home.root / "clicklogs" / drop.name / drop.folder_name
    paths = _local_files(home, root, drop)
    try:
        summary = build_click_dataset(paths, out, label_map=previous, test_fraction=test_fraction,
                                      min_clicks=min_clicks, literal_paths=True)  # file names, not patterns
    finally:
        if local_path(root) is None:
            shutil.rmtree(home.cache / "clicklog-feeds" / drop.name / drop.digest, ignore_errors=True)
    _, existed = register_click_dataset(catalog, drop.name, out)
    return {**summary, "folder": str(out), "previous": None if previous is None else str(previous),
            "registered": "updated" if existed else "added"}

