"""What checking a serving bundle against its manifest adds to ``load_bundle`` (docs/decisions.md#bundle-manifest).

Writes a bundle of ``--labels`` generated labels (the packaged MiniLM encoder, W and label embeddings of width
384, exact indexes over both, the files ``write_bundle`` writes, then its manifest), and times
``load_bundle`` with ``XC_SERVING_VERIFY`` = off, size and sha256, ``--repeats`` times each in that order after
one untimed load (the files then in the page cache; a cold read adds the disk's time to every mode alike), and the
manifest check alone. Reports the bundle's bytes, each mode's median seconds and the hashing rate.

  python bench/bundle_verify.py --labels 131072 --out bench/results/xeon_bundle_verify.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from xc_dagster.encoders.names import resolve_encoder_path
from xc_dagster.retrieval.shortlist import build_sources
from xc_dagster.retrieval.source_files import save_sources
from xc_dagster.serving import bundle as serving_bundle
from xc_dagster.serving.bundle_files import MANIFEST_FILE, VERIFY_ENV, verify_bundle, write_manifest
from xc_dagster.storage import save_json


def write_generated_bundle(out: Path, n_labels: int, dim: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    label_emb = rng.standard_normal((n_labels, dim), dtype=np.float32)
    label_emb /= np.linalg.norm(label_emb, axis=1, keepdims=True)
    W = label_emb + rng.normal(0, 0.05, label_emb.shape).astype(np.float32)
    shutil.copytree(resolve_encoder_path("minilm"), out / "encoder")
    np.save(out / "W.npy", W)
    np.save(out / "label_emb.npy", label_emb)
    save_sources(build_sources(("W", "label"), W, label_emb, None, None, None, "text", "exact", 16, 40, 64), out,
                 None)
    save_json(out / "fusion.json", {"method": "alpha", "alpha": 0.5})
    np.save(out / "inv_prop.npy", np.ones(n_labels))
    pq.write_table(pa.table({"text": [f"label {i}" for i in range(n_labels)]}), out / "labels.parquet")
    save_json(out / serving_bundle.SERVING_FILE, {
        "format": serving_bundle.BUNDLE_FORMAT, "pooling": "mean", "max_len": 32, "amp": "off",
        "encode_batch_size": 256, "index_kind": "exact", "ef_search": 64, "sources": ["W", "label"],
        "label_repr": "text", "knn_neighbours": 0, "shortlist_size": 100, "default_k": 10, "manifest": MANIFEST_FILE})
    write_manifest(out)


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--labels", type=int, default=131072)
    ap.add_argument("--dim", type=int, default=384)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, help="JSON file for the result")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="xc-bundle-verify-") as tmp:
        folder = Path(tmp) / "bundle"
        write_generated_bundle(folder, args.labels, args.dim, args.seed)
        size = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
        seconds: dict[str, float] = {}
        os.environ[VERIFY_ENV] = "off"
        serving_bundle.load_bundle(folder, "cpu")  # untimed: imports and the page cache, for every mode alike
        for mode in ("off", "size", "sha256"):
            os.environ[VERIFY_ENV] = mode
            runs = [_timed(lambda: serving_bundle.load_bundle(folder, "cpu")) for _ in range(args.repeats)]
            seconds[mode] = statistics.median(runs)
        alone = statistics.median(_timed(lambda: verify_bundle(folder, True, "sha256")) for _ in range(args.repeats))
    extra = seconds["sha256"] - seconds["off"]
    result = {"labels": args.labels, "dim": args.dim, "bundle_bytes": size, "load_seconds_median": seconds,
              "sha256_extra_seconds": round(extra, 3), "verify_sha256_alone_seconds": round(alone, 3),
              "sha256_gb_per_s_alone": round(size / 1e9 / alone, 2),
              "repeats": args.repeats, "machine": platform.processor() or platform.machine(),
              "cpus": os.cpu_count(),
              "command": f"python bench/bundle_verify.py --labels {args.labels} --repeats {args.repeats}"}
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
