"""Write a raw-text LF dataset (trn/tst/lbl.json.gz) as a BoW dataset without a vocabulary, in the XC repository's
layout (``<name>_train.txt`` / ``<name>_test.txt``: a "points features labels" header, then "l1,l2 f:v f:v" lines):
the shape of the repository's BoW sets, where the lexical source and its classifiers are the whole model.

  python bench/make_bow.py --source xc_dagster/builtin_data/LF-WordNetNouns --out /tmp/data/titles_bow

Features: scikit-learn's TfidfVectorizer on the points' titles, fitted on the training titles (terms in 2 or more),
4 decimals; points without a label are left out (the format has no empty label list); every label is kept.
"""

from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path

from sklearn.feature_extraction.text import TfidfVectorizer


def read(path: Path, field: str) -> tuple[list[str], list[list[int]]]:
    with gzip.open(path, "rt", encoding="utf-8") as fh:
        rows = [json.loads(line) for line in fh]
    texts = [" ".join(str(r.get(f, "")) for f in field.split("+")) for r in rows]  # "title+content": both, joined
    return texts, [list(r["target_ind"]) for r in rows]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--source", type=Path, required=True, help="a folder with trn/tst/lbl.json.gz")
    p.add_argument("--out", type=Path, required=True, help="the folder to write (its name prefixes the files)")
    p.add_argument("--field", default="title", help="title, content, or title+content")
    a = p.parse_args(argv)
    with gzip.open(a.source / "lbl.json.gz", "rt", encoding="utf-8") as fh:
        num_labels = sum(1 for _ in fh)
    train, test = read(a.source / "trn.json.gz", a.field), read(a.source / "tst.json.gz", a.field)
    vectorizer = TfidfVectorizer(min_df=2).fit(train[0])
    a.out.mkdir(parents=True, exist_ok=True)
    for split, (texts, labels) in (("train", train), ("test", test)):
        X = vectorizer.transform(texts).tocsr()
        keep = [i for i, y in enumerate(labels) if y]
        with open(a.out / f"{a.out.name}_{split}.txt", "w", encoding="utf-8") as fh:
            fh.write(f"{len(keep)} {X.shape[1]} {num_labels}\n")
            for i in keep:
                lo, hi = X.indptr[i], X.indptr[i + 1]
                features = " ".join(f"{j}:{v:.4f}" for j, v in zip(X.indices[lo:hi], X.data[lo:hi]))
                fh.write(f"{','.join(map(str, labels[i]))} {features}\n")
        print(f"{split}: {len(keep)} points, {X.shape[1]} features, {num_labels} labels")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
