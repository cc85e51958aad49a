"""The training budget's estimate of the encoding after pretraining against the encoding itself, on a home's
tokenized dataset: ``encode_rate`` with one 512-row pass (the estimate before docs/decisions.md#encode-rate-sample),
with a pass lasting 2 s, and with a pass lasting 2 s that is encoded as the whole set is (the pipeline's, as
``calibrate_stage`` calls it), each turned into seconds for every point and label at the points' rate; the last
pass's rate with the labels by their padded tokens against the points' (``labels_by_tokens``) and its seconds per
padded token times every point's and label's (``by_padded_tokens``: the pipeline's estimate,
``training.budget.encoding_seconds``); and the timed encoding of the points and of the labels with the configured
(untrained) encoder.

  python bench/encode_estimate.py --home <home> --name <NAME> [--json out.jsonl]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from xc_dagster.catalog import Catalog
from xc_dagster.device import amp_dtype
from xc_dagster.encoders.encode import encode_plan, encode_tokens, encoded_as, padded_tokens
from xc_dagster.encoders.loading import load_encoder
from xc_dagster.home import Home
from xc_dagster.pipeline import StageContext
from xc_dagster.storage import ArtifactStore
from xc_dagster.training.budget import ENCODE_SAMPLE_SECONDS, encode_rate, padded_seconds

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, for bench.rows
from bench.rows import emit  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--home", type=Path, required=True)
    ap.add_argument("--name", required=True)
    ap.add_argument("--json", type=Path, help="append the row to this JSON-lines file")
    args = ap.parse_args()
    home = Home(args.home)
    spec = Catalog(home.catalog).get(args.name)
    ctx = StageContext(ArtifactStore(home.artifacts), spec, spec.config(), home.cache, stage="pretrain")
    p = ctx.cfg.pretrain
    encoder = load_encoder(ctx.cfg.tokenize.encoder, p.pooling).to(ctx.device)
    dtype = amp_dtype(ctx.device, p.amp)
    pt, lt = ctx.read.tokens("train"), ctx.read.tokens("label")
    n = len(pt[1]) + len(lt[1])

    seen = []

    def encode(rows):
        seen.append(rows)
        return encode_tokens(encoder, pt[0][rows], pt[1][rows], ctx.device, dtype, p.encode_batch_size)

    as_whole = encoded_as(encoder, pt[1], ctx.device, p.encode_batch_size)
    threads = encode_plan(encoder, pt[1], ctx.device, p.encode_batch_size)[1]
    row = {"name": args.name, "texts": n, "device": str(ctx.device), "threads": threads}
    for key, min_seconds, whole in (("one_pass", 0.0, None), ("lasting", ENCODE_SAMPLE_SECONDS, None),
                                    ("as_whole", ENCODE_SAMPLE_SECONDS, as_whole)):
        t0 = time.perf_counter()
        rate = encode_rate(encode, len(pt[1]), seed=p.seed, min_seconds=min_seconds, runs_as_whole=whole)
        row[f"{key}_estimate_s"], row[f"{key}_probe_s"] = round(n / rate, 1), round(time.perf_counter() - t0, 1)
    # the labels at the points' rate (as above); by their padded tokens against the points' (labels_by_tokens);
    # every point and label by padded tokens at the timed sample's seconds per padded token (by_padded_tokens)
    def work(lengths):
        return padded_tokens(encoder, lengths, ctx.device, p.encode_batch_size)

    sample, points, labels = seen[-1], work(pt[1]), work(lt[1])
    row["labels_by_tokens_estimate_s"] = round(len(pt[1]) / rate * (1.0 + labels / points), 1)
    row["by_padded_tokens_estimate_s"] = round(padded_seconds(encoder, pt[1][sample], len(sample) / rate,
                                                              points + labels, ctx.device, p.encode_batch_size), 1)
    row["padded_tokens"] = {"points": points, "labels": labels, "sample": work(pt[1][sample]),
                            "sample_rows": len(sample)}
    for key, (ids, lens) in (("points", pt), ("labels", lt)):
        t0 = time.perf_counter()
        encode_tokens(encoder, ids, lens, ctx.device, dtype, p.encode_batch_size)
        row[f"actual_{key}_s"] = round(time.perf_counter() - t0, 1)
    row["actual_s"] = round(row["actual_points_s"] + row["actual_labels_s"], 1)
    emit(row, args.json)


if __name__ == "__main__":
    main()
