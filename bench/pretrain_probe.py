"""Probe the Siamese pretraining (NGAME M1 / SiameseXML Module I) alone: train from the starting encoder with a
strategy's settings plus overrides, then score the embedding ranking the strategies deploy.

  python bench/pretrain_probe.py [--name LF-WordNetNounsTitles] [--source builtin:LF-WordNetNouns] \
      [--strategy ngame] [--work /tmp/pretrain_probe] [--set pretrain.field=value ...] [--label NAME] \
      [--no-test] [--out bench/results/pretrain_probe.jsonl]

Ingest and tokenize run once into ``--work`` (the pipeline's own stages, reused by later probes with the same
name). Each probe then trains a fresh encoder with ``xc_dagster.training.siamese.train_siamese`` on the training rows
(the validation split held out, as the pretrain stage does), encodes the training points, the labels and (unless
``--no-test``) the test points, and ranks every label by exact search with

- ``text``: E(z_l).E(x), the label text embedding (NGAME's embedding score), and
- ``text+centroid``: (E(z_l) + v_l).E(x) with v_l the label's centroid (SiameseXML), the ngame / siamesexml
  strategies' deployed embedding score,

on the validation points (their labels without training points dropped and centroids over the other training
points, as the fusion is fitted) and on the test points (centroids over every training point, filter pairs
removed, as the evaluate stage does). It prints P@1 / PSP@1 / P@5 / PSP@5 for each and appends one JSON line
(settings, machine, timings, metrics) to ``--out``. A diagnostic of the encoder alone: the classifiers, the kNN
score and the fusion change the final numbers (bench/RESULTS.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import time
from pathlib import Path

import numpy as np
import torch

from xc_dagster.catalog import DatasetSpec
from xc_dagster.config import parse_set_options
from xc_dagster.data.splits import filter_rows, validation_targets
from xc_dagster.device import amp_dtype, resolve_device, seed_everything
from xc_dagster.encoders.encode import encode_tokens
from xc_dagster.encoders.loading import load_encoder
from xc_dagster.encoders.names import parse_bag_name
from xc_dagster.evaluation.metrics import evaluate, remove_filtered
from xc_dagster.pipeline import StageContext, run_all
from xc_dagster.pipeline.pretrain import label_points_named
from xc_dagster.retrieval.ann import exact_topk
from xc_dagster.retrieval.shortlist import label_centroids, label_representation
from xc_dagster.storage import ArtifactStore
from xc_dagster.training.siamese import train_siamese

REPORTED = ("precision_at_1", "psprecision_at_1", "precision_at_5", "psprecision_at_5")


def ranking_metrics(queries: np.ndarray, reprs: np.ndarray, Y, filter_pairs: np.ndarray, inv: np.ndarray,
                    k: int = 5) -> dict[str, float]:
    """P@1/PSP@1/P@5/PSP@5 (percent) of every label ranked by exact inner product with ``reprs``, filter pairs
    removed before the top k is read (a filtered label never takes a rank)."""
    scores, ids = exact_topk(queries, reprs, k + 10, device=torch.device("cpu"))
    ids, scores = remove_filtered(ids, scores, filter_pairs)
    m = evaluate(ids[:, :k], Y, ks=(1, 5), inv_prop=inv)
    return {key: round(100 * float(m[key]), 2) for key in REPORTED}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--name", default="LF-WordNetNounsTitles")
    ap.add_argument("--source", default="builtin:LF-WordNetNouns")
    ap.add_argument("--strategy", default="ngame")
    ap.add_argument("--preset", default="quick")
    ap.add_argument("--work", type=Path, default=Path("/tmp/pretrain_probe"))
    ap.add_argument("--set", action="append", default=[], help="stage.field=value (pretrain.* and tokenize.*)")
    ap.add_argument("--label", default="", help="a name for this probe in the output")
    ap.add_argument("--no-test", action="store_true", help="validation only (skips encoding the test split)")
    ap.add_argument("--out", type=Path, default=Path("bench/results/pretrain_probe.jsonl"))
    args = ap.parse_args()

    spec = DatasetSpec(args.name, args.source, preset=args.preset, strategy=args.strategy,
                       overrides=parse_set_options(args.set)).validate("bench")
    cfg = spec.config()
    ctx = StageContext(ArtifactStore(args.work / "artifacts"), spec, cfg, args.work / "cache",
                       info=lambda m: print(m, flush=True))
    prep = [s for s in ("ingest", "tokenize") if not ctx.store.stage_dir(args.name, s).is_dir()]
    if prep:
        run_all(ctx, tuple(prep))
    p = label_points_named(ctx, cfg.pretrain)  # the label points the pretrain stage would train on
    seed_everything(p.seed)
    ds = ctx.read.labels()
    valid = ctx.read.valid_rows()
    rows = ctx.read.train_rows(ds.num_train)
    device = resolve_device("auto")
    dtype = amp_dtype(device, p.amp)
    encoder = load_encoder(cfg.tokenize.encoder, p.pooling).to(device)
    pt, lt = ctx.read.tokens("train"), ctx.read.tokens("label")
    if parse_bag_name(cfg.tokenize.encoder) is not None:  # a fresh bag encoder: IDF of the texts, as pretrain
        encoder.fit_idf(pt, lt)
    losses: list[float] = []
    res = train_siamese(encoder, pt, lt, ds.Y_train, rows, p, device, dtype,
                        log_metrics=lambda step, m: losses.extend(v for k, v in m.items() if k == "pretrain_loss"))
    print(f"trained {res.steps} steps, {res.points} points in {res.seconds:.0f}s "
          f"({res.points / max(res.seconds, 1e-9):.1f} points/s), last loss {res.final_loss:.4f}", flush=True)
    t_enc = time.perf_counter()
    point_emb = encode_tokens(encoder, *pt, device, dtype, p.encode_batch_size)
    label_emb = encode_tokens(encoder, *lt, device, dtype, p.encode_batch_size)
    inv = ctx.inv_prop(ds.Y_train)
    Yv, pairs, _ = validation_targets(ds.Y_train, valid, rows, filter_rows(ds.filter_train, valid))
    cent_v = label_centroids(point_emb, ds.Y_train, rows)
    results = {"valid": {"text": ranking_metrics(point_emb[valid], label_emb, Yv, pairs, inv),
                         "text+centroid": ranking_metrics(point_emb[valid],
                                                          label_representation(label_emb, cent_v, "text+centroid"),
                                                          Yv, pairs, inv)}}
    if not args.no_test:
        test_emb = encode_tokens(encoder, *ctx.read.tokens("test"), device, dtype, p.encode_batch_size)
        cent = label_centroids(point_emb, ds.Y_train)
        results["test"] = {
            "text": ranking_metrics(test_emb, label_emb, ds.Y_test, ds.filter_test, inv),
            "text+centroid": ranking_metrics(test_emb, label_representation(label_emb, cent, "text+centroid"),
                                             ds.Y_test, ds.filter_test, inv)}
    record = {"label": args.label, "dataset": args.name, "strategy": args.strategy, "overrides": args.set,
              "pretrain": dataclasses.asdict(p), "amp": str(dtype),
              "machine": {"platform": platform.platform(), "processor": platform.processor(),
                          "threads": torch.get_num_threads()},
              "steps": res.steps, "points": res.points, "train_seconds": round(res.seconds, 1),
              "points_per_s": round(res.points / max(res.seconds, 1e-9), 1),
              "encode_seconds": round(time.perf_counter() - t_enc, 1), "final_loss": res.final_loss,
              "loss_curve": [round(x, 4) for x in losses], "metrics": results}
    for split, by_repr in results.items():
        for repr_name, m in by_repr.items():
            print(f"{split:5s} {repr_name:13s} " + "  ".join(f"{k} {v:.2f}" for k, v in m.items()))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("a") as f:
        f.write(json.dumps(record, default=str) + "\n")


if __name__ == "__main__":
    main()
