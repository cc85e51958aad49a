"""A serving bundle's files: an exact index served as an HNSW graph is built here, and every file is listed with its
size and SHA-256 in ``manifest.json``, written last by ``xc_dagster.serving.bundle.write_bundle`` (which links the
others in: ``xc_dagster.storage.link``).

``load_bundle`` and a warm start from a bundle folder (``xc_dagster.serving.warm_start``) check the files against
the manifest before reading any, so a bundle damaged in a copy, an upload or on disk fails to load naming the
file -- a flipped byte in ``W.npy`` or a faiss graph otherwise loads silently and serves wrong labels, a truncated
file fails only where it is read. How much is checked: ``$XC_SERVING_VERIFY`` -- ``sha256`` (the default: every
file read once, hashed side by side: 2.2 GB/s on 2 cores, bench/bundle_verify.py), ``size`` (sizes only, for a large
bundle on storage you trust) or ``off``. A bundle written before manifests existed (its ``serving.json`` names none)
loads unchecked, with a warning.
"""

from __future__ import annotations

import json
import logging
import os
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from xc_dagster.checksums import file_sha256
from xc_dagster.durable import atomic_write_text
from xc_dagster.errors import XCConfigError, XCError
from xc_dagster.retrieval.ann import LabelIndex, saved_kind

if TYPE_CHECKING:  # pragma: no cover
    from xc_dagster.pipeline import StageContext

MANIFEST_FILE = "manifest.json"
MANIFEST_FORMAT = 1
VERIFY_ENV = "XC_SERVING_VERIFY"
VERIFY_MODES = ("sha256", "size", "off")
_HEX64 = re.compile(r"[0-9a-f]{64}")
log = logging.getLogger(__name__)


def graph_copy(src: Path, dst: Path, graph_above: int, ctx: "StageContext") -> bool:
    """Write to ``dst`` an HNSW graph (``index.hnsw_m`` / ``hnsw_ef_construction``) of the exact index ``src`` when it
    holds more than ``graph_above`` vectors (0: never), for single-query latency: exact search reads every vector
    per query (8 ms at 131K, docs/decisions.md#exact-bf16), the graph a few hundred. True when it did."""
    if graph_above <= 0 or saved_kind(src) != "exact":
        return False
    vectors = np.load(src, mmap_mode="r", allow_pickle=False)
    if len(vectors) <= graph_above:
        return False
    p = ctx.cfg.index
    LabelIndex("hnsw", np.asarray(vectors), m=p.hnsw_m, ef_construction=p.hnsw_ef_construction).save(dst)
    return True


def write_manifest(folder: Path) -> dict[str, dict[str, Any]]:
    """Write ``folder``'s ``manifest.json``: every file under it (relative POSIX path -> size and SHA-256)."""
    folder = Path(folder)
    rels = [f.relative_to(folder).as_posix() for f in sorted(folder.rglob("*"))
            if f.is_file() and f != folder / MANIFEST_FILE]
    files = {rel: {"size": (folder / rel).stat().st_size, "sha256": digest}
             for rel, digest in zip(rels, _digests(folder, rels))}
    atomic_write_text(folder / MANIFEST_FILE, json.dumps({"format": MANIFEST_FORMAT, "files": files}, indent=1,
                                                         sort_keys=True) + "\n")
    return files


def verify_mode(value: str | None = None) -> str:
    """``value`` or ``$XC_SERVING_VERIFY`` (unset or empty: ``sha256``), checked."""
    mode = (value if value is not None else os.environ.get(VERIFY_ENV, "")).strip().lower() or "sha256"
    if mode not in VERIFY_MODES:
        raise XCConfigError(f"${VERIFY_ENV}: expected one of {', '.join(VERIFY_MODES)}, got {mode!r}")
    return mode


def _entries(path: Path) -> dict[str, dict[str, Any]]:
    """The manifest's file entries, each checked (a path inside the bundle, a size, 64 hex digits)."""
    try:
        obj = json.loads(path.read_bytes())
    except (OSError, ValueError) as e:
        raise XCError(f"serving bundle file {path}: cannot be read ({type(e).__name__}: {e})") from e
    files = obj.get("files") if isinstance(obj, dict) and obj.get("format") == MANIFEST_FORMAT else None
    if not isinstance(files, dict):
        raise XCError(f"serving bundle file {path}: expected a JSON object with 'format': {MANIFEST_FORMAT} and "
                      "'files'; write the bundle again (write_bundle)")
    for rel, meta in files.items():
        parts = rel.split("/")
        ok_path = not rel.startswith("/") and all(p not in ("", ".", "..") and "\\" not in p for p in parts)
        ok_meta = isinstance(meta, dict) and type(meta.get("size")) is int and meta["size"] >= 0 \
            and isinstance(meta.get("sha256"), str) and _HEX64.fullmatch(meta["sha256"])
        if not (ok_path and ok_meta):
            raise XCError(f"serving bundle file {path}: entry {rel!r}: expected a relative path inside the bundle "
                          f"with {{'size': int >= 0, 'sha256': 64 hex digits}}, got {meta!r}")
    return files


def verify_bundle(folder: Path, required: bool, mode: str | None = None) -> int:
    """Check the files of the bundle ``folder`` against its manifest (``mode``: see the module docstring); the
    number of files checked. ``required``: the bundle's ``serving.json`` says it was written with a manifest, so
    a missing one is damage. Raises :class:`XCError` naming the first file that differs."""
    folder, mode = Path(folder), verify_mode(mode)
    path = folder / MANIFEST_FILE
    if mode == "off":
        return 0
    if not path.exists():
        if required:
            raise XCError(f"serving bundle {folder}: {MANIFEST_FILE} is missing, though serving.json says the bundle "
                          "was written with one; copy the whole bundle again")
        log.warning("serving bundle %s has no %s (written before manifests): its files are not checked", folder,
                    MANIFEST_FILE)
        return 0
    files = _entries(path)
    for rel, want in sorted(files.items()):  # presence and sizes first: cheap, and they name a truncated file
        f = folder / rel
        if not f.is_file():
            raise XCError(f"serving bundle file {f}: missing, though {MANIFEST_FILE} lists it; copy the whole "
                          "bundle again")
        if (size := f.stat().st_size) != want["size"]:
            _differs(f, {"size": size}, want)
    if mode == "sha256":  # reported in path order
        rels = sorted(files)
        for rel, digest in zip(rels, _digests(folder, rels)):
            if digest != files[rel]["sha256"]:
                _differs(folder / rel, {"size": files[rel]["size"], "sha256": digest}, files[rel])
    return len(files)


def _digests(folder: Path, rels: list[str]) -> list[str]:
    """The SHA-256 of each file ``rels`` under ``folder``, hashed side by side (hashlib releases the GIL)."""
    with ThreadPoolExecutor(max_workers=max(1, min(4, os.cpu_count() or 1))) as pool:
        return list(pool.map(lambda rel: file_sha256(folder / rel), rels))


def _differs(f: Path, got: dict[str, Any], want: dict[str, Any]) -> None:
    said = ", ".join(f"{k} {want[k]}" for k in got)
    raise XCError(f"serving bundle file {f}: {', '.join(f'{k} {v}' for k, v in got.items())}, but {MANIFEST_FILE} "
                  f"says {said}: damaged or changed after write_bundle wrote it; copy the bundle again or write it "
                  "again")
