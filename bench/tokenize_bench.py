"""Time ``tokenize_to_npy`` (the tokenize stage's work) over a folder's training texts.

  python -m xc_dagster.data.synthetic --shape 131k --out /tmp/syn131k
  python bench/tokenize_bench.py --source /tmp/syn131k [--encoder minilm] [--max-len 32]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from xc_dagster.data.lf_raw import read_lf_raw
from xc_dagster.encoders.tokenizer import load_tokenizer, tokenize_to_npy


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--source", type=Path, required=True, help="an lf-raw folder (trn/tst/lbl.json.gz)")
    ap.add_argument("--encoder", default="minilm")
    ap.add_argument("--max-len", type=int, default=32)
    a = ap.parse_args()
    texts = read_lf_raw(a.source, ["title"], ["title"]).train_texts
    tok = load_tokenizer(a.encoder)
    with tempfile.TemporaryDirectory() as tmp:
        t = time.perf_counter()
        st = tokenize_to_npy(tok, texts, a.max_len, Path(tmp) / "ids.npy", Path(tmp) / "lens.npy")
        sec = time.perf_counter() - t
    print(f"{len(texts)} texts in {sec:.1f} s: {len(texts) / sec:,.0f} texts/s (mean length {st['mean_len']:.1f})")


if __name__ == "__main__":
    main()
