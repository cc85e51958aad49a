"""Cut a small LF raw-text dataset out of a bigger one (default: the embedded LF-WordNetNouns).

  python bench/make_subset.py [--source DIR] [--n-train 9200] [--n-labels N] [--seed 0] \
      [--out /work/data/LF-WordNetNounsTitles-9K] [--force]

- A seeded random sample (numpy ``default_rng(seed)``) of ``--n-train`` training points and the same fraction
  of the test points (rounded), each kept in its source order.
- With ``--n-labels N``, first a seeded sample of N labels drawn without replacement with probability
  proportional to their training points (so a cut with few labels keeps the head and the torso, as a small
  dataset of its own would have them); the points are sampled among those carrying at least one of them, and
  their other labels dropped.
- Only the labels that occur in the sampled training points are kept, renumbered 0..L'-1 in their source
  order (their ``uid``, ``title`` and ``content`` are kept); points left without a label are dropped (only test
  points can be: every label of a sampled training point is kept).
- ``target_ind`` is remapped to the new label ids (``target_rel`` follows); every other field of a record is
  written unchanged. ``filter_labels_train.txt`` / ``filter_labels_test.txt`` ("row label", 0-based) are remapped
  to the new row and label ids; pairs whose row or label is gone are dropped.
- Written into a temporary folder next to ``--out``, read back with ``xc_dagster.data.read_dataset`` and then
  renamed to ``--out`` (an existing ``--out`` is refused unless ``--force``): the folder appears complete or
  not at all. ``subset.json`` records the source, its SHA-256 checksums, the seed and the counts; the
  source's ``PROVENANCE.md`` (with its license notice), when it has one, is copied as ``SOURCE_PROVENANCE.md``.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from xc_dagster.catalog import builtin_path
from xc_dagster.data import read_dataset
from xc_dagster.data.cache import file_sha256
from xc_dagster.data.companions import read_filters

DEFAULT_OUT = Path("/work/data/LF-WordNetNounsTitles-9K")
POINT_FILES = {"train": "trn.json.gz", "test": "tst.json.gz"}
FILTER_FILES = {"train": "filter_labels_train.txt", "test": "filter_labels_test.txt"}


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(s) for s in f if s.strip()]


def write_jsonl(path: Path, records: list[dict[str, Any]]) -> None:
    """Gzipped JSON lines with a fixed gzip header time, so the same cut gives the same bytes."""
    with open(path, "wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) as gz:
        for rec in records:
            gz.write((json.dumps(rec, ensure_ascii=False) + "\n").encode("utf-8"))


def sample_rows(rng: np.random.Generator, n_total: int, n: int) -> np.ndarray:
    return np.sort(rng.choice(n_total, size=min(n, n_total), replace=False))


def remap_points(records: list[dict[str, Any]], rows: np.ndarray,
                 label_map: dict[int, int]) -> tuple[list[dict[str, Any]], dict[int, int]]:
    """The sampled records with their targets renumbered (unknown labels dropped), label-less ones dropped;
    and old row id -> new row id of the kept ones."""
    out, row_map = [], {}
    for r in rows.tolist():
        rec = records[r]
        ind = rec.get("target_ind") or []
        rel = rec.get("target_rel")
        keep = [j for j, lab in enumerate(ind) if lab in label_map]
        if not keep:
            continue
        new = dict(rec)
        new["target_ind"] = [label_map[ind[j]] for j in keep]
        if rel is not None:
            new["target_rel"] = [rel[j] for j in keep]
        row_map[r] = len(out)
        out.append(new)
    return out, row_map


def remap_pairs(pairs: np.ndarray, row_map: dict[int, int], label_map: dict[int, int]) -> list[tuple[int, int]]:
    return [(row_map[r], label_map[c]) for r, c in pairs.tolist() if r in row_map and c in label_map]


def label_sample(rng: np.random.Generator, train: list[dict[str, Any]], num_labels: int, n: int) -> np.ndarray:
    """(num_labels,) bool: n labels drawn without replacement, each with probability proportional to its
    training points (labels without any are never drawn)."""
    ind = [r.get("target_ind") or [] for r in train]
    freq = np.bincount(np.fromiter((lab for t in ind for lab in t), dtype=np.int64), minlength=num_labels)
    keep = np.zeros(num_labels, dtype=bool)
    keep[rng.choice(num_labels, size=min(n, int((freq > 0).sum())), replace=False, p=freq / freq.sum())] = True
    return keep


def carrying(records: list[dict[str, Any]], keep: np.ndarray) -> np.ndarray:
    """Rows of ``records`` with at least one label in ``keep``."""
    return np.array([i for i, r in enumerate(records) if any(keep[lab] for lab in r.get("target_ind") or [])],
                    dtype=np.int64)


def cut(source: Path, n_train: int, seed: int, n_labels: int | None = None
        ) -> tuple[dict[str, list], dict[str, list], list, dict[str, Any]]:
    """Point records per split, filter pairs per split, label records and the counts of the subset."""
    points = {s: read_jsonl(source / name) for s, name in POINT_FILES.items()}
    labels = read_jsonl(source / "lbl.json.gz")
    filters = dict(zip(FILTER_FILES, read_filters(source, len(points["train"]), len(points["test"]), len(labels))))
    rng = np.random.default_rng(seed)
    # the rows sampled from: every point, or those carrying a drawn label
    keep = None if n_labels is None else label_sample(rng, points["train"], len(labels), n_labels)
    pool = {s: np.arange(len(points[s])) if keep is None else carrying(points[s], keep) for s in POINT_FILES}
    frac = min(n_train, len(pool["train"])) / max(len(pool["train"]), 1)
    rows = {"train": pool["train"][sample_rows(rng, len(pool["train"]), n_train)]}
    rows["test"] = pool["test"][sample_rows(rng, len(pool["test"]), round(frac * len(pool["test"])))]
    kept_ids = sorted({lab for r in rows["train"].tolist() for lab in points["train"][r].get("target_ind") or []
                       if keep is None or keep[lab]})
    label_map = {old: new for new, old in enumerate(kept_ids)}
    out_points, out_pairs, counts = {}, {}, {"fraction": frac}
    for s in POINT_FILES:
        out_points[s], row_map = remap_points(points[s], rows[s], label_map)
        out_pairs[s] = remap_pairs(filters[s], row_map, label_map)
        n_lab = sum(len(p["target_ind"]) for p in out_points[s])
        counts[s] = {"source_points": len(points[s]), "sampled": len(rows[s]), "kept": len(out_points[s]),
                     "dropped_without_labels": len(rows[s]) - len(out_points[s]),
                     "labels_per_point": round(n_lab / max(len(out_points[s]), 1), 4),
                     "filter_pairs": len(out_pairs[s]), "source_filter_pairs": len(filters[s])}
    counts["labels"] = {"source": len(labels), "kept": len(kept_ids)}
    return out_points, out_pairs, [labels[i] for i in kept_ids], counts


def write_subset(source: Path, out: Path, n_train: int, seed: int, force: bool = False,
                 n_labels: int | None = None) -> dict[str, Any]:
    """Cut ``source`` and install the result at ``out`` atomically; returns the provenance record."""
    out = Path(out)
    if out.exists() and not force:
        raise FileExistsError(f"{out} exists (use --force to replace it)")
    points, pairs, labels, counts = cut(source, n_train, seed, n_labels)
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        work.chmod(0o755)  # mkdtemp's 0700 would make the dataset private
        for s, name in POINT_FILES.items():
            write_jsonl(work / name, points[s])
            (work / FILTER_FILES[s]).write_text("".join(f"{r} {c}\n" for r, c in pairs[s]))
        write_jsonl(work / "lbl.json.gz", labels)
        files = [*POINT_FILES.values(), "lbl.json.gz", *FILTER_FILES.values()]
        prov = {"made_by": "bench/make_subset.py", "source": str(source), "seed": seed, "n_train_requested": n_train,
                "n_labels_requested": n_labels,
                "sampling": ("numpy default_rng(seed).choice without replacement: " + (
                    "" if n_labels is None else "labels (probability proportional to their training points), ")
                    + "train rows, then test rows" + ("" if n_labels is None else " (of those carrying a label)")),
                "source_sha256": {n: file_sha256(source / n) for n in files if (source / n).is_file()},
                "counts": counts, "sha256": {n: file_sha256(work / n) for n in files}}
        (work / "subset.json").write_text(json.dumps(prov, indent=2) + "\n")
        if (source / "PROVENANCE.md").is_file():  # the source's description and license notice travel along
            shutil.copyfile(source / "PROVENANCE.md", work / "SOURCE_PROVENANCE.md")
        ds = read_dataset(work, text_fields=("title",), label_text_fields=("title",))
        assert (ds.num_train, ds.num_test, ds.num_labels) == (
            counts["train"]["kept"], counts["test"]["kept"], counts["labels"]["kept"]), "read-back counts differ"
        old = None
        if out.exists():
            old = out.with_name(f".{out.name}.old-{os.getpid()}")
            out.rename(old)
        work.rename(out)
        if old is not None:
            shutil.rmtree(old)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    return prov


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--source", type=Path, default=None, help="LF raw-text folder (default: the embedded "
                    "LF-WordNetNouns)")
    ap.add_argument("--n-train", type=int, default=9200, help="training points to sample")
    ap.add_argument("--n-labels", type=int, default=None, help="labels to sample first, each in proportion to "
                    "its training points (default: every label of the sampled points)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--force", action="store_true", help="replace an existing --out")
    args = ap.parse_args()
    if args.n_train < 1:
        ap.error("--n-train must be >= 1")
    if args.n_labels is not None and args.n_labels < 1:
        ap.error("--n-labels must be >= 1")
    if args.out.exists() and not args.force:
        ap.error(f"{args.out} exists (use --force to replace it)")
    source = args.source or builtin_path("LF-WordNetNouns")
    prov = write_subset(source, args.out, args.n_train, args.seed, args.force, args.n_labels)
    c = prov["counts"]
    print(f"wrote {args.out}: {c['train']['kept']} train / {c['test']['kept']} test / {c['labels']['kept']} labels; "
          f"labels per point {c['train']['labels_per_point']} train, {c['test']['labels_per_point']} test; "
          f"filter pairs {c['train']['filter_pairs']} train, {c['test']['filter_pairs']} test; "
          f"{c['test']['dropped_without_labels']} sampled test points dropped without labels")


if __name__ == "__main__":
    main()
