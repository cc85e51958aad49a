"""Changed sources: a dataset source's fingerprint, and whether it changed since its last ingest, without Dagster
(``assets/automation.py``'s retrain schedule wraps it; see ``docs/AUTOMATION.md``).

:func:`data_changed` tells whether a catalog dataset's source changed since its last ingest: never ingested; the
``source_fingerprint`` the ingest summary recorded (when it records one) differs from the source's current one;
the catalog points to another local folder than the one ingested; or a file of the source was modified after the
ingest summary was written.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from xc_dagster.catalog import BUILTIN_PREFIX, Catalog, DatasetSpec
from xc_dagster.errors import XCError
from xc_dagster.home import Home
from xc_dagster.serving.retraining import FileSig, local_path, remote_sig, url_fs


@dataclass(frozen=True)
class Fingerprint:
    digest: str
    newest: float | None  # the latest modification time among the source's files
    newest_file: str
    files: int


@dataclass(frozen=True)
class SourceChange:
    name: str
    changed: bool
    reason: str
    fingerprint: str | None = None

    @property
    def run_key(self) -> str:
        return f"retrain:{self.name}:{(self.fingerprint or 'none')[:16]}"


def _fingerprint(entries: dict[str, FileSig]) -> Fingerprint:
    body = json.dumps(sorted([rel, *sig.key()] for rel, sig in entries.items()), separators=(",", ":"))
    dated = [(sig.mtime, rel) for rel, sig in entries.items() if sig.mtime is not None]
    newest, newest_file = max(dated) if dated else (None, "")
    return Fingerprint(hashlib.sha256(body.encode()).hexdigest(), newest, newest_file, len(entries))


def source_fingerprint(source: str) -> Fingerprint | None:
    """Names, sizes and modification stamps of a dataset source's files (a folder: every file below it that
    is not hidden; a file: that file), hashed. None for a packaged (``builtin:``) source, which never
    changes. Remote sources are listed through fsspec (``http(s)://`` with a HEAD request)."""
    if source.startswith(BUILTIN_PREFIX):
        return None
    local = local_path(source)
    entries: dict[str, FileSig] = {}
    if local is not None:
        if not local.exists():
            raise XCError(f"dataset source {local} does not exist")
        if local.is_file():
            st = local.stat()
            entries[local.name] = FileSig(st.st_size, str(st.st_mtime_ns), st.st_mtime)
        else:
            for dirpath, dirnames, filenames in os.walk(local):
                dirnames[:] = [n for n in dirnames if not n.startswith(".")]
                for fn in filenames:
                    if fn.startswith("."):
                        continue
                    p = Path(dirpath) / fn
                    st = p.stat()
                    entries[p.relative_to(local).as_posix()] = FileSig(st.st_size, str(st.st_mtime_ns), st.st_mtime)
        return _fingerprint(entries)
    fs, path = url_fs(source)
    try:
        if fs.isdir(path):
            for p, info in fs.find(path, detail=True).items():
                entries[p[len(path):].lstrip("/")] = remote_sig(info)
        else:
            entries[path.rsplit("/", 1)[-1]] = remote_sig(fs.info(path))
    except Exception as e:
        raise XCError(f"dataset source {source}: cannot list it ({type(e).__name__}: {e})") from e
    return _fingerprint(entries)


def _utc(t: float) -> str:
    return datetime.fromtimestamp(t, tz=timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def data_changed(home: Home, spec: DatasetSpec) -> SourceChange:
    """Whether ``spec``'s source changed since its last ingest (``artifacts/<name>/ingest/summary.json``)."""
    summary_path = home.artifacts / spec.name / "ingest" / "summary.json"
    try:
        fp = source_fingerprint(spec.source)
    except XCError as e:
        return SourceChange(spec.name, False, f"not checked: {e}")
    digest = None if fp is None else fp.digest
    if not summary_path.is_file():
        return SourceChange(spec.name, True, "never ingested", digest or "builtin")
    if fp is None:
        return SourceChange(spec.name, False, f"packaged source {spec.source} (never changes)")
    try:
        summary = json.loads(summary_path.read_text())
    except ValueError:
        return SourceChange(spec.name, True, f"unreadable ingest summary {summary_path}", digest)
    recorded = summary.get("source_fingerprint")
    if recorded:
        if recorded != digest:
            return SourceChange(spec.name, True, "the source's fingerprint differs from the one ingested", digest)
        return SourceChange(spec.name, False, "unchanged (same fingerprint as ingested)", digest)
    local = local_path(spec.source)
    ingested_from = summary.get("source")
    if local is not None and local.is_dir() and ingested_from and \
            Path(ingested_from).resolve() != local.resolve():
        return SourceChange(spec.name, True, f"the catalog source moved from {ingested_from} to {local}", digest)
    ingested_at = summary_path.stat().st_mtime
    if fp.newest is not None and fp.newest > ingested_at:
        return SourceChange(spec.name, True, f"{fp.newest_file or spec.source} modified at {_utc(fp.newest)}, "
                                             f"after the last ingest at {_utc(ingested_at)}", digest)
    return SourceChange(spec.name, False, f"unchanged since the last ingest at {_utc(ingested_at)}", digest)


def changed_datasets(home: Home, names: list[str] | None = None) -> list[SourceChange]:
    """:func:`data_changed` for every catalog dataset (or those of ``names`` that are in the catalog)."""
    specs = Catalog(home.catalog).load()
    return [data_changed(home, specs[n]) for n in sorted(specs) if names is None or n in names]
