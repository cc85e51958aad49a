"""Generated XC datasets with planted structure, written in the ``lf-raw`` layout that ingest reads.

  python -m xc_dagster.data.synthetic --shape 131k|1.3m|N_TRAIN,N_TEST,L,LPP --out DIR [--scale F] [--seed S]
      [--content-words W] [--force]

- **Labels** have power-law frequencies: the label of rank r is drawn with probability proportional to
  ``(r + zipf_offset) ** -zipf_exponent`` (10 and 0.95: the 131k shape gets a median training frequency of 2
  and a top label with a few thousand points); when N_train >= L, evenly spaced "cover" points give every label
  one training point first. Labels fall into clusters (mean size ``max(cluster_size, 2 x LPP)``) that share a
  word. A label has 2-3 title words and ``hidden_words`` more from a shared pool of made-up words
  (:mod:`~xc_dagster.data.synthetic_text`); its title is its cluster's word and its title words.
- **Points** get a geometric number of labels (mean LPP): the first by the frequency law, each further one
  from the first one's cluster with probability ``cluster_share`` (else by the law), duplicates dropped. A title
  is 5-12 words in random order: 1-2 words (title or hidden) of each of its first ``mention`` labels, each kept
  with probability ``word_keep`` (else a noise word), the first label's cluster word with probability 1/2,
  and noise words (Zipf over ``noise_words`` words) to fill it.
- ``filter_rate`` of the points draw one filter pair: a label of their first label's cluster they do not have
  (the draw is dropped when they have it).
- ``content_words`` > 0 adds long texts (``content``) of at least that many words to points and labels.
- Seeded: the randomness of each block of ``BLOCK_POINTS`` points comes from ``(seed, file, block)``, so a
  seed gives byte-identical files, a block's lines do not depend on N, and memory is bounded by a block plus
  the O(L) label model, whatever N. ``synthetic.json`` records the parameters and the statistics.

Why these values, with the measurements: docs/decisions.md#synthetic-xc-shapes. The named shapes (seed 0,
training label frequencies):

| shape | train / test / labels | labels per point | max | median | mean | labels <= 2 |
|---|---|---|---|---|---|---|
| 131k | 294,805 / 134,835 / 131,073 | 2.28 | 2,907 | 2 | 5.1 | 50.6% |
| 1.3m | 2,248,619 / 970,237 / 1,305,265 | 22.20 | 166,011 | 15 | 38.2 | 0.1% |
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import json
import math
import os
import shutil
import sys
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from xc_dagster.data.synthetic_text import WordBuffer, compose, make_vocabulary
from xc_dagster.errors import XCConfigError

# the named shapes: (train points, test points, labels, labels per point) as the XC repository publishes them
SHAPES = {"131k": (294_805, 134_835, 131_073, 2.29), "1.3m": (2_248_619, 970_237, 1_305_265, 22.20)}
BLOCK_POINTS = 1 << 15  # points per random stream and per vectorised step: the memory bound
OVERSAMPLE = 3  # draws per wanted label after the first, so that dropping duplicates rarely leaves a row short
GZIP_LEVEL = 1  # 3.8x faster than level 6 on these lines, files about 10% larger
PARTS = {"train": 1, "test": 2, "labels": 3}


@dataclass(frozen=True)
class SyntheticSpec:
    """What to generate; every field is recorded in ``synthetic.json``."""

    n_train: int
    n_test: int
    n_labels: int
    labels_per_point: float
    seed: int = 0
    zipf_exponent: float = 0.95
    zipf_offset: float = 10.0
    cluster_size: float = 16.0  # mean labels per cluster (at least 2 x labels_per_point)
    cluster_share: float = 0.6  # chance that a further label of a point comes from its first label's cluster
    word_pool: float = 1.0  # size of the pool that label words are drawn from, per label
    hidden_words: int = 3  # words of a label that its points use and its title does not
    title_words: tuple[int, int] = (5, 12)
    mention: int = 3  # labels of a point whose words (title or hidden) its title carries
    word_keep: float = 0.85  # chance that a label word in a point's text is kept (else a noise word)
    noise_words: int = 2000
    filter_rate: float = 0.05
    content_words: int = 0

    def check(self) -> SyntheticSpec:
        if min(self.n_train, self.n_test, self.n_labels) < 1:
            raise XCConfigError(f"synthetic: counts must be >= 1, got {self.n_train}, {self.n_test}, {self.n_labels}")
        if not 1 <= self.labels_per_point <= self.n_labels:
            raise XCConfigError(f"synthetic: labels_per_point must lie in [1, {self.n_labels}], "
                                f"got {self.labels_per_point}")
        if not 1 <= self.title_words[0] <= self.title_words[1]:
            raise XCConfigError(f"synthetic: title_words must be 1 <= min <= max, got {self.title_words}")
        return self


def shape_spec(shape: str, scale: float = 1.0, **fields) -> SyntheticSpec:
    """The spec of a named shape (``131k``, ``1.3m``) or of ``N_TRAIN,N_TEST,L,LPP``, its counts times ``scale``."""
    if shape.lower() in SHAPES:
        n_train, n_test, n_labels, lpp = SHAPES[shape.lower()]
    else:
        try:
            a, b, c, d = shape.split(",")
            n_train, n_test, n_labels, lpp = int(a), int(b), int(c), float(d)
        except ValueError:
            raise XCConfigError(f"--shape must be one of {sorted(SHAPES)} or N_TRAIN,N_TEST,L,LPP, "
                                f"got {shape!r}") from None
    if not scale > 0:
        raise XCConfigError(f"--scale must be positive, got {scale}")
    n = [max(1, round(x * scale)) for x in (n_train, n_test, n_labels)]
    return SyntheticSpec(n[0], n[1], n[2], lpp, **fields).check()


@dataclass(frozen=True)
class LabelModel:
    """The labels in cluster order: position ``i`` holds label ``label_at[i]``; ``cdf`` is the cumulative
    frequency law over positions, clusters are the position ranges ``[start[c], end[c])``."""

    label_at: np.ndarray
    pos_of: np.ndarray
    cdf: np.ndarray
    cluster_of: np.ndarray  # per label
    start: np.ndarray
    end: np.ndarray
    cluster_word: np.ndarray  # word id per cluster
    label_words: np.ndarray  # (L, 3 + hidden) word ids: the n_title title words, the hidden words, -1 past them
    n_title: np.ndarray
    noise_cdf: np.ndarray
    words: WordBuffer
    cover: np.ndarray  # the label each cover point gets


def build_labels(spec: SyntheticSpec) -> LabelModel:
    """The label model of ``spec`` (clusters, frequency law, words); O(L) time and memory."""
    rng = np.random.default_rng([spec.seed, 0])
    L = spec.n_labels
    n_clusters = max(1, round(L / max(spec.cluster_size, 2 * spec.labels_per_point)))
    cuts = np.sort(rng.choice(L - 1, n_clusters - 1, replace=False)) + 1 if n_clusters > 1 else np.zeros(0, int)
    start, end = np.concatenate([[0], cuts]), np.concatenate([cuts, [L]])
    label_at = rng.permutation(L)
    pos_of = np.empty(L, dtype=np.int64)
    pos_of[label_at] = np.arange(L)
    weight = (np.arange(1, L + 1) + spec.zipf_offset) ** -spec.zipf_exponent
    cdf = np.cumsum(weight[rng.permutation(L)])
    cluster_of = np.repeat(np.arange(n_clusters), end - start)[pos_of]
    n_pool = max(3 + spec.hidden_words, math.ceil(spec.word_pool * L))  # room for distinct words per label
    words = make_vocabulary(rng, spec.noise_words + n_clusters + n_pool)
    n_title = 2 + (rng.random(L) < 0.5)
    raw = rng.integers(n_pool, size=(L, 3 + spec.hidden_words))
    while True:  # redraw the labels whose words repeat one (a few rows, once or twice)
        srt = np.sort(raw, 1)
        bad = (srt[:, 1:] == srt[:, :-1]).any(1)
        if not bad.any():
            break
        raw[bad] = rng.integers(n_pool, size=(int(bad.sum()), raw.shape[1]))
    raw += spec.noise_words + n_clusters
    short = np.concatenate([raw[:, :2], raw[:, 3:], np.full((L, 1), -1)], 1)  # two title words: no third
    sig = np.where((n_title == 3)[:, None], raw, short)
    noise_cdf = np.cumsum(1.0 / np.arange(1, spec.noise_words + 1))
    return LabelModel(label_at, pos_of, cdf, cluster_of, start, end, spec.noise_words + np.arange(n_clusters),
                      sig, n_title, noise_cdf, WordBuffer.of(words), rng.permutation(L))


def _draw(model: LabelModel, rng: np.random.Generator, n: int) -> np.ndarray:
    """``n`` label positions drawn independently by the frequency law (inverse CDF: sorted uniforms make the
    binary search cache-friendly, a random permutation makes the draws independent again)."""
    u = np.sort(rng.random(n)) * model.cdf[-1]
    pos = np.minimum(np.searchsorted(model.cdf, u, side="right"), len(model.cdf) - 1)
    return pos[rng.permutation(n)]


def _draw_in(model: LabelModel, u: np.ndarray, cluster: np.ndarray) -> np.ndarray:
    """Label positions by the frequency law within ``cluster`` (``u`` uniform in [0, 1)): a binary search over
    each cluster's own range, vectorised, log2(largest cluster) steps."""
    lo, hi = model.start[cluster], model.end[cluster] - 1
    base = np.where(lo > 0, model.cdf[np.maximum(lo - 1, 0)], 0.0)
    v = base + u * (model.cdf[hi] - base)
    for _ in range(max(0, math.ceil(math.log2(int((model.end - model.start).max()))))):
        mid = (lo + hi) // 2
        right = model.cdf[mid] <= v
        lo, hi = np.where(right, mid + 1, lo), np.where(right, hi, mid)
    return lo


def _rank_in_row(row: np.ndarray, n: int) -> np.ndarray:
    """The place of each entry within its row (``row`` sorted, ``n`` rows)."""
    count = np.bincount(row, minlength=n)
    return np.arange(len(row)) - np.repeat(np.cumsum(count) - count, count)


def sample_targets(model: LabelModel, spec: SyntheticSpec, rng: np.random.Generator,
                   anchors: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Labels of the points whose first labels (positions) are ``anchors``: (row, label) pairs in draw order,
    the anchor first in each row, without duplicates."""
    n, L = len(anchors), spec.n_labels
    k = np.minimum(rng.geometric(1.0 / spec.labels_per_point, n), min(L, math.ceil(10 * spec.labels_per_point)))
    m = 1 + OVERSAMPLE * (k - 1)
    row = np.repeat(np.arange(n), m)
    rank = np.arange(len(row)) - np.repeat(np.cumsum(m) - m, m)
    extra = rank > 0
    r_extra = row[extra]
    same = rng.random(len(r_extra)) < spec.cluster_share
    pos = np.empty(len(row), dtype=np.int64)
    pos[~extra] = anchors
    pos_extra = np.empty(len(r_extra), dtype=np.int64)
    pos_extra[~same] = _draw(model, rng, int((~same).sum()))
    pos_extra[same] = _draw_in(model, rng.random(int(same.sum())),
                               model.cluster_of[model.label_at[anchors[r_extra[same]]]])
    pos[extra] = pos_extra
    label = model.label_at[pos]
    _, first = np.unique(row * L + label, return_index=True)  # each (row, label) at its first draw
    first.sort()
    row, label = row[first], label[first]
    rank = _rank_in_row(row, n)
    keep = rank < k[row]
    return row[keep], label[keep]


def _signal_words(model: LabelModel, rng: np.random.Generator, row: np.ndarray, label: np.ndarray,
                  per_label: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``per_label[i]`` (at most all) distinct words (title or hidden) of each (row, label) pair."""
    n_own = model.n_title[label] + model.label_words.shape[1] - 3
    count = np.minimum(per_label, n_own)
    offset = rng.integers(0, n_own)
    rep = np.repeat(np.arange(len(label)), count)
    t = np.arange(len(rep)) - np.repeat(np.cumsum(count) - count, count)
    return row[rep], model.label_words[label[rep], (offset[rep] + t) % n_own[rep]]


def point_texts(model: LabelModel, spec: SyntheticSpec, rng: np.random.Generator, n: int, row: np.ndarray,
                label: np.ndarray, long: bool) -> list[str]:
    """Titles (``long``: contents) of ``n`` points from their (row, label) pairs in draw order."""
    rank = _rank_in_row(row, n)
    told = rank < (16 if long else spec.mention)
    n_told = int(told.sum())
    per_label = np.full(n_told, model.label_words.shape[1]) if long else 1 + (rng.random(n_told) < 0.5)
    s_row, s_word = _signal_words(model, rng, row[told], label[told], per_label)
    anchor = label[rank == 0]
    with_cluster = np.ones(n, bool) if long else rng.random(n) < 0.5
    c_row = np.flatnonzero(with_cluster)
    c_word = model.cluster_word[model.cluster_of[anchor[c_row]]]
    lo, hi = spec.title_words
    n_words = np.full(n, spec.content_words) if long else rng.integers(lo, hi + 1, n)
    words, counts = compose(rng, n, np.concatenate([s_row, c_row]), np.concatenate([s_word, c_word]),
                            n_words, model.noise_cdf, spec.word_keep)
    return model.words.join_rows(words, counts)


def _filters(model: LabelModel, spec: SyntheticSpec, rng: np.random.Generator, n: int, row: np.ndarray,
             label: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Filter pairs: ``filter_rate`` of the rows, each with a label of its first label's cluster it lacks."""
    anchor = label[np.concatenate([[0], np.flatnonzero(np.diff(row)) + 1])]
    pick = np.flatnonzero(rng.random(n) < spec.filter_rate)
    cand = model.label_at[_draw_in(model, rng.random(len(pick)), model.cluster_of[anchor[pick]])]
    keys = np.sort(row * spec.n_labels + label)
    want = pick * spec.n_labels + cand
    hit = keys[np.minimum(np.searchsorted(keys, want), len(keys) - 1)] == want
    return pick[~hit], cand[~hit]


def point_block(model: LabelModel, spec: SyntheticSpec, part: str, first: int, n: int) -> dict:
    """Points ``first`` .. ``first + n - 1`` of ``part`` (``train`` / ``test``): their JSON lines, sorted
    labels with row pointers, filter pairs and title lengths."""
    rng = np.random.default_rng([spec.seed, PARTS[part], first // BLOCK_POINTS])
    anchors = _draw(model, rng, n)
    if part == "train":  # cover points: point i * N // L gets label cover[i], so every label has a point
        n_cover = min(spec.n_labels, spec.n_train)
        slots = np.arange(n_cover) * spec.n_train // n_cover
        lo, hi = np.searchsorted(slots, [first, first + n])
        anchors[slots[lo:hi] - first] = model.pos_of[model.cover[lo:hi]]
    row, label = sample_targets(model, spec, rng, anchors)
    titles = point_texts(model, spec, rng, n, row, label, long=False)
    contents = point_texts(model, spec, rng, n, row, label, long=True) if spec.content_words else [""] * n
    f_row, f_label = _filters(model, spec, rng, n, row, label)
    order = np.lexsort((label, row))
    ptr = np.concatenate([[0], np.cumsum(np.bincount(row, minlength=n))]).tolist()
    tgt = label[order].tolist()
    rel = ["[" + ", ".join(["1.0"] * j) + "]" for j in range(max(np.diff(ptr), default=0) + 1)]
    prefix = "trn" if part == "train" else "tst"
    lines = [f'{{"uid": "{prefix}-{first + i}", "title": "{titles[i]}", "content": "{contents[i]}", '
             f'"target_ind": {tgt[ptr[i]:ptr[i + 1]]}, "target_rel": {rel[ptr[i + 1] - ptr[i]]}}}\n'
             for i in range(n)]
    return {"lines": lines, "labels": label, "filters": np.stack([f_row + first, f_label], 1),
            "title_words": sum(t.count(" ") + 1 for t in titles)}


def label_lines(model: LabelModel, spec: SyntheticSpec, first: int, n: int) -> list[str]:
    """JSON lines of labels ``first`` .. ``first + n - 1``: title = cluster word + title words."""
    ids = np.arange(first, first + n)
    cw = model.cluster_word[model.cluster_of[ids]]
    words = np.concatenate([cw[:, None], model.label_words[ids, :3]], 1)
    words = words[np.arange(4) <= model.n_title[ids][:, None]]
    titles = model.words.join_rows(words, 1 + model.n_title[ids])
    contents = [""] * n
    if spec.content_words:
        rng = np.random.default_rng([spec.seed, PARTS["labels"], first // BLOCK_POINTS])
        contents = point_texts(model, spec, rng, n, np.arange(n), ids, long=True)
    return [f'{{"uid": "lbl-{first + i}", "title": "{titles[i]}", "content": "{contents[i]}", '
            f'"target_ind": [], "target_rel": []}}\n' for i in range(n)]


def _blocks(total: int) -> Iterator[tuple[int, int]]:
    for first in range(0, total, BLOCK_POINTS):
        yield first, min(BLOCK_POINTS, total - first)


@contextlib.contextmanager
def _gzip(path: Path) -> Iterator[gzip.GzipFile]:
    """A gzip writer with a fixed header (no time, no name), so the same content gives the same bytes."""
    with open(path, "wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0,
                                                compresslevel=GZIP_LEVEL) as gz:
        yield gz


def write_points(model: LabelModel, spec: SyntheticSpec, part: str, folder: Path) -> dict:
    """``trn``/``tst.json.gz`` and its filter file, block by block; returns label counts and text statistics."""
    n_total = spec.n_train if part == "train" else spec.n_test
    name = "trn" if part == "train" else "tst"
    counts = np.zeros(spec.n_labels, dtype=np.int64)
    n_words = n_filters = 0
    with _gzip(folder / f"{name}.json.gz") as gz, \
            open(folder / f"filter_labels_{part}.txt", "w") as flt:
        for first, n in _blocks(n_total):
            block = point_block(model, spec, part, first, n)
            gz.write("".join(block["lines"]).encode("ascii"))
            counts += np.bincount(block["labels"], minlength=spec.n_labels)
            flt.writelines(f"{r} {c}\n" for r, c in block["filters"].tolist())
            n_filters += len(block["filters"])
            n_words += block["title_words"]
    return {"label_counts": counts, "title_words": n_words, "filter_pairs": n_filters}


def frequency_stats(counts: np.ndarray, n_points: int) -> dict:
    """Label-frequency statistics of one split (``counts``: points per label)."""
    return {"points": n_points, "labels_per_point": round(float(counts.sum()) / n_points, 3),
            "max": int(counts.max()), "median": float(np.median(counts)), "mean": round(float(counts.mean()), 3),
            "share_le_2": round(float((counts <= 2).mean()), 4), "share_zero": round(float((counts == 0).mean()), 4),
            "p99": float(np.percentile(counts, 99))}


def generate(spec: SyntheticSpec, out: Path, force: bool = False) -> dict:
    """Write the dataset of ``spec`` into ``out`` (built in a sibling folder, then renamed: it appears complete
    or not at all); returns the statistics also written to ``out/synthetic.json``."""
    spec.check()
    out = Path(out)
    if out.exists() and any(out.iterdir()) and not force:
        raise XCConfigError(f"{out} exists and is not empty (use --force to replace it)")
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        model = build_labels(spec)
        stats = {}
        for part, n in (("train", spec.n_train), ("test", spec.n_test)):
            got = write_points(model, spec, part, tmp)
            stats[part] = {**frequency_stats(got["label_counts"], n), "filter_pairs": got["filter_pairs"],
                           "title_words_mean": round(got["title_words"] / n, 2)}
        with _gzip(tmp / "lbl.json.gz") as gz:
            for first, n in _blocks(spec.n_labels):
                gz.write("".join(label_lines(model, spec, first, n)).encode("ascii"))
        stats["clusters"] = len(model.start)
        record = {"generator": "xc_dagster.data.synthetic", "spec": asdict(spec), "stats": stats}
        (tmp / "synthetic.json").write_text(json.dumps(record, indent=2) + "\n")
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return stats


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m xc_dagster.data.synthetic", description=__doc__.split("\n")[0])
    p.add_argument("--shape", required=True, help=f"{' | '.join(SHAPES)} | N_TRAIN,N_TEST,L,LPP")
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--scale", type=float, default=1.0, help="multiplies N_train, N_test and L")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--content-words", type=int, default=0, help="words of a long 'content' text (0: none)")
    p.add_argument("--force", action="store_true", help="replace a non-empty --out")
    a = p.parse_args(argv)
    try:
        spec = shape_spec(a.shape, a.scale, seed=a.seed, content_words=a.content_words)
        stats = generate(spec, a.out, a.force)
    except XCConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps({"out": str(a.out), "spec": asdict(spec), "stats": stats}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
