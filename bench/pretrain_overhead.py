"""Overhead of the training stages over the bare encoder: points/s of the library's training steps against the
encoder's own forward + backward + optimizer step on the same texts (the sampler, clustering and loss together
must cost under 15% on top). A step count of 0 skips that part. Smoke run (about 1.5 minutes on 2 cores)::

  python bench/pretrain_overhead.py --encoders bag --samplers random siamesexml --steps 2 --warmup 1 \\
      --classifier-modes shortlist --classifier-steps 2 --crosscheck-steps 0 --clustering-sizes \\
      --out /tmp/pretrain_overhead_smoke.json

Method: (A) bare: the encoder on the step's point and label texts in ``embed_rows``' chunks, loss = sum of the
embeddings, backward, AdamW. (B) full: ``SiameseTrainer.batch_loss`` then ``.update``, each timed; the epoch's
batch building (ngame: one re-clustering epoch and tau - 1 plain ones per tau epochs) added amortised. A draws
B's positives from a copy of B's generator; steps alternate ABBA... on the same batch, the first ``--warmup``
pairs dropped. Reported: medians, overhead = median(B) / median(A) - 1, the spread of the pairs' B_i / A_i. The
classifier likewise: ``ClassifierTrainer.candidates``, ``.candidate_loss`` and ``.update`` against a second
``ShardedClassifier`` scoring the same ids. A cross-check runs ``train_siamese`` itself. Data: LF-WordNetNouns
titles, training rows minus the validation split; the ngame memory bank, the classifier's inputs and what is
clustered are the bag encoder's embeddings of every point.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import platform
import re
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from xc_dagster.catalog import builtin_path
from xc_dagster.config import ClassifierParams, PretrainParams
from xc_dagster.data import read_dataset
from xc_dagster.data.splits import validation_split
from xc_dagster.device import adamw, amp_dtype, autocast
from xc_dagster.encoders.encode import chunk_tensors, encode_tokens, length_sorted_chunks
from xc_dagster.encoders.loading import load_encoder
from xc_dagster.encoders.names import parse_bag_name
from xc_dagster.encoders.tokenizer import load_tokenizer, load_tokens, tokenize_to_npy
from xc_dagster.retrieval.ann import exact_topk
from xc_dagster.sampling.batches import BATCH_SAMPLERS, LabelBatch
from xc_dagster.sampling.clustering import balanced_clusters
from xc_dagster.sampling.hard_negatives import hardest
from xc_dagster.sampling.labels import sample_positives
from xc_dagster.training.classifier import ClassifierTrainer
from xc_dagster.training.sharded import ShardedClassifier, ShardedOptimizer
from xc_dagster.training.siamese import SiameseTrainer, train_siamese

pc = time.perf_counter
DEVICE = torch.device("cpu")


def machine_info() -> dict[str, Any]:
    """Platform, versions, CPU model, SIMD flags, bf16 support and memory (every bench's machine description)."""
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2 ** 30
    info: dict[str, Any] = {"platform": platform.platform(), "python": platform.python_version(),
                            "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
                            "cpu_count": os.cpu_count(), "amp_auto": str(amp_dtype(DEVICE, "auto")),
                            "mem_total_gb": round(mem, 1)}
    try:
        lscpu = dict(re.findall(r"^([^:\n]+):\s*(.+)$", subprocess.run(["lscpu"], capture_output=True,
                                                                        text=True).stdout, re.M))
    except OSError:
        lscpu = {}
    for key in ("Model name", "CPU(s)", "Thread(s) per core", "Core(s) per socket"):
        if key in lscpu:
            info[key.lower().replace("(s)", "s").replace(" ", "_")] = lscpu[key].strip()
    info["simd"] = sorted(f for f in lscpu.get("Flags", "").split() if f.startswith(("avx", "amx")) or f == "fma")
    try:
        info["mkldnn_bf16"] = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        info["mkldnn_bf16"] = None
    return info


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def load_data(max_len: int, tmp: Path) -> dict[str, Any]:
    """Titles of LF-WordNetNouns tokenized as the tokenize stage does; training rows as the pretrain stage."""
    t0 = pc()
    ds = read_dataset(builtin_path("LF-WordNetNouns"), text_fields=("title",), label_text_fields=("title",))
    tok = load_tokenizer("minilm")
    tokens = []
    for name, texts in (("train", ds.train_texts), ("label", ds.label_texts)):
        tokenize_to_npy(tok, texts, max_len, tmp / f"{name}_ids.npy", tmp / f"{name}_len.npy")
        tokens.append(load_tokens(tmp / f"{name}_ids.npy", tmp / f"{name}_len.npy"))
    Y = ds.Y_train.tocsr()
    rows = np.setdiff1d(np.arange(ds.num_train), validation_split(ds.num_train, 0.05, 5000, 0))  # ingest defaults
    rows = rows[np.diff(Y.indptr)[rows] > 0]  # as train_siamese / train_classifiers
    pt, lt = tokens
    return {"Y": Y, "pt": pt, "lt": lt, "rows": rows.astype(np.int64), "seconds": pc() - t0,
            "n_train": ds.num_train, "n_labels": ds.num_labels, "mean_point_len": float(pt[1].mean()),
            "mean_label_len": float(lt[1].mean())}


def make_encoder(name: str, pt, lt, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    enc = load_encoder(name).to(DEVICE)
    if parse_bag_name(name) is not None:  # as the pretrain stage: IDF of the training texts
        enc.fit_idf(pt, lt)
    return enc


def stats(xs: list[float]) -> dict[str, float]:
    q = np.quantile(xs, [0.25, 0.5, 0.75])
    return {"median": float(q[1]), "q25": float(q[0]), "q75": float(q[2]), "min": float(min(xs)),
            "max": float(max(xs)), "n": len(xs)}


def timed(parts: list[tuple[str, Callable[[Any], Any]]], value: Any) -> dict[str, float]:
    """Seconds of each part of a step, each part fed the previous one's result."""
    out, t = {}, pc()
    for name, part in parts:
        value = part(value)
        out[name], t = pc() - t, pc()
    return out


def alternate(batches: list[Any], warmup: int, run_a: Callable[[Any], dict], run_b: Callable[[Any], dict],
              verbose: bool = False) -> dict[str, Any]:
    """A and B on each batch, A first on even steps and B first on odd ones; part times after the warm-up."""
    rec: dict[str, Any] = {"a": [], "b": [], "a_parts": {}, "b_parts": {}}
    for i, batch in enumerate(batches):
        first, second = (run_a, run_b) if i % 2 == 0 else (run_b, run_a)
        t1, t2 = first(batch), second(batch)
        ta, tb = (t1, t2) if i % 2 == 0 else (t2, t1)
        if verbose:
            print(f"  step {i}: A {sum(ta.values()):.3f}s B {sum(tb.values()):.3f}s", flush=True)
        for side, parts in (("a", ta), ("b", tb)) if i >= warmup else ():
            rec[side].append(sum(parts.values()))
            for k, v in parts.items():
                rec[f"{side}_parts"].setdefault(k, []).append(v)
    return rec


def overhead(rec: dict[str, Any], share: float, items: float) -> dict[str, Any]:
    """Medians, points/s and the overhead of B over A, B charged ``share`` seconds of epoch work per step."""
    a_med, b_med = statistics.median(rec["a"]), statistics.median(rec["b"])
    r = np.asarray(rec["b"]) / np.asarray(rec["a"]) - 1 + share / a_med
    return {"steps_timed": len(rec["a"]), "bare_step_s": stats(rec["a"]), "full_step_s": stats(rec["b"]),
            "bare_points_per_s": items / a_med, "full_points_per_s": items / (b_med + share),
            "overhead": (b_med + share) / a_med - 1.0,
            "overhead_paired": {"median": float(np.median(r)), "q25": float(np.quantile(r, 0.25)),
                                "q75": float(np.quantile(r, 0.75)), "min": float(r.min()), "max": float(r.max())},
            "bare_parts_median_s": {k: statistics.median(v) for k, v in rec["a_parts"].items()},
            "full_parts_median_s": {k: statistics.median(v) for k, v in rec["b_parts"].items()}}


def bare_loss(enc, texts: list[tuple[tuple[np.ndarray, np.ndarray], np.ndarray]], chunk_size: int,
              dtype) -> torch.Tensor:
    """Sum of the encoder's outputs on each (tokens, rows) in embed_rows' length-sorted chunks (not reordered)."""
    pieces = []
    with autocast(DEVICE, dtype):
        for (ids, lens), rows in texts:
            for local in length_sorted_chunks(lens[rows], chunk_size):
                pieces.append(enc(*chunk_tensors(ids, lens, rows[local], DEVICE)))
    return torch.cat(pieces).float().sum()


def sampler_params(sampler: str, enc_name: str, args) -> PretrainParams:
    k = max(int(round(math.log2(max(args.cluster_size, 2)))), 1)  # ngame: C = 2^k from epoch 0 on the filled bank
    extra = {"siamesexml": dict(loss="siamesexml", num_negatives=1),  # the siamesexml strategy's overrides
             "ngame": dict(curriculum=(0,) * k, seed_bank=True, max_cluster_size=2 ** k, cluster_every=args.tau)}
    return PretrainParams(batch_size=args.batch_size, sampler=sampler, **extra.get(sampler, {}),
                          lr=1e-2 if parse_bag_name(enc_name) is not None else 2e-4)


def bench_pretrain(enc_name: str, sampler: str, data: dict[str, Any], bank: np.ndarray, args,
                   steps: int) -> dict[str, Any]:
    """One (encoder, sampler) row: A/B steps on one epoch's batches, the epoch's building amortised."""
    Y, pt, lt, rows = data["Y"], data["pt"], data["lt"], data["rows"]
    params = sampler_params(sampler, enc_name, args)
    params.epochs = 2  # ngame: a re-clustering epoch and a plain one
    dtype = amp_dtype(DEVICE, params.amp)
    enc_b = make_encoder(enc_name, pt, lt, params.seed)
    enc_a = copy.deepcopy(enc_b).train()
    opt_a = adamw(enc_a.parameters(), params.lr, params.weight_decay)
    out: dict[str, Any] = {"encoder": enc_name, "sampler": sampler, "loss": params.loss,
                           "batch_size": params.batch_size, "amp": str(dtype), "loadavg_start": loadavg()}
    t = pc()
    trainer = SiameseTrainer(enc_b, pt, lt, Y, rows, params, DEVICE, dtype)  # mostly the sampler's set-up
    if sampler == "siamesexml":
        out["sampler_init_s"] = pc() - t  # once per training run
    if sampler == "ngame":
        trainer.sampler.bank[:] = bank
    enc_b.train()  # not trainer.start(): the ngame bank is filled above, not by encoding every point
    t = pc()
    batches = trainer.epoch_batches(0)
    t_epoch, spe = pc() - t, len(batches)
    out.update(epoch_build_s=t_epoch, steps_per_epoch=spe, epoch_share_s=t_epoch / spe)
    if sampler == "ngame":  # that epoch re-clustered; the next one reuses the clusters
        t = pc()
        batches = trainer.epoch_batches(1)
        t_plain, spe, tau = pc() - t, len(batches), args.tau
        assert trainer.sampler.reclusterings == 1, trainer.sampler.reclusterings
        out.update(cluster_size=trainer.sampler.size, tau_epochs=tau, recluster_epoch_build_s=t_epoch,
                   plain_epoch_build_s=t_plain, clustering_s=t_epoch - t_plain, steps_per_epoch=spe,
                   steps_per_epoch_first=out["steps_per_epoch"], batch_sizes=stats([float(len(b)) for b in batches]),
                   epoch_share_s=(t_epoch + (tau - 1) * t_plain) / (tau * spe),
                   clustering_share_s=(t_epoch - t_plain) / (tau * spe))
    n = args.warmup + steps
    if n > len(batches):
        raise SystemExit(f"{n} steps asked, an epoch has {len(batches)} batches")
    rng_a, points = copy.deepcopy(trainer.rng), []  # A draws B's positives, outside its timing

    def run_a(batch) -> dict[str, float]:
        if isinstance(batch, LabelBatch):
            a_pts, a_lab = np.unique(np.concatenate([batch.anchors, batch.centroid.ravel()])), batch.labels
        else:
            a_pts, a_lab = batch, sample_positives(Y, batch, 1, rng_a)[:, 0]
        points.append(len(a_pts))
        return timed([("loss", lambda _: bare_loss(enc_a, [(pt, a_pts), (lt, a_lab)], params.chunk_size, dtype)),
                      ("update", lambda loss: (opt_a.zero_grad(set_to_none=True), loss.backward(), opt_a.step()))],
                     None)

    cpu0, wall0 = time.process_time(), pc()
    rec = alternate(batches[:n], args.warmup, run_a,
                    lambda batch: timed([("loss", trainer.batch_loss), ("update", trainer.update)], batch),
                    args.verbose)
    assert trainer.rng.bit_generator.state == rng_a.bit_generator.state, "A and B must see the same texts"
    pts, share = float(np.mean(points[args.warmup:])), out["epoch_share_s"]
    return {**out, **overhead(rec, share, pts), "warmup": args.warmup, "points_per_step": pts,
            "label_texts_per_step": float(params.batch_size),
            "full_step_with_epoch_share_s": statistics.median(rec["b"]) + share, "loadavg_end": loadavg(),
            # CPU seconds of this process per wall second: ~threads when it has the cores to itself
            "cpu_util": (time.process_time() - cpu0) / (pc() - wall0)}


def bench_classifier(mode: str, data: dict[str, Any], point_emb: np.ndarray, label_emb: np.ndarray,
                     args) -> dict[str, Any]:
    Y, rows = data["Y"], data["rows"]
    cs = args.cluster_size if mode != "shortlist" else 0  # NGAME M2 in-batch negatives come from cluster batches
    params = ClassifierParams(negatives=mode, cluster_size=cs, batch_size=args.classifier_batch_size)
    shortlist = np.full((len(point_emb), 100), -1, dtype=np.int64)  # filled below for the rows the steps use
    t = pc()
    trainer = ClassifierTrainer(point_emb, label_emb, Y, shortlist, rows, params, DEVICE)
    t_cluster = pc() - t if cs > 1 else 0.0  # the set-up is the clustering, once per stage
    t = pc()
    batches = trainer.epoch_batches(0)
    t_epoch, n = pc() - t, args.warmup + args.classifier_steps
    if n > len(batches):
        raise SystemExit(f"{n} classifier steps asked, an epoch has {len(batches)} batches")
    batches = batches[:n]
    used = np.unique(np.concatenate(batches))  # the mined shortlist: exact top-100 label embeddings
    shortlist[used] = exact_topk(point_emb[used], label_emb, 100, device=DEVICE)[1]
    clf_a = ShardedClassifier(np.asarray(label_emb, dtype=np.float32), [DEVICE])
    opt_a = ShardedOptimizer(clf_a, "sparse-adam", params.lr)
    W0, X, rng_a = trainer.W.detach().clone(), trainer.X, copy.deepcopy(trainer.rng)

    def run_a(batch) -> dict[str, float]:
        # A's ids: the same positives, hardest negatives under the initial W (outside A's timing)
        pos = sample_positives(Y, batch, params.num_positives, rng_a)
        ids = torch.cat([torch.from_numpy(pos), hardest(trainer.pool, X[batch], W0, batch, pos,
                                                        params.num_negatives)], dim=1)
        return timed([("loss", lambda x: clf_a.scores(x, ids).sum()),
                      ("update", lambda loss: (loss.backward(), opt_a.step()))], X[batch])

    cpu0, wall0 = time.process_time(), pc()
    rec = alternate(batches, args.warmup, run_a, lambda batch: timed(
        [("negatives", trainer.candidates), ("loss", trainer.candidate_loss), ("update", trainer.update)], batch),
                    args.verbose)
    share = (t_epoch + t_cluster / params.epochs) / trainer.steps_per_epoch  # clustering once, batches per epoch
    return {"negatives": mode, "cluster_size": cs, "batch_size": params.batch_size,
            "num_negatives": params.num_negatives, "loss": params.loss,
            "ids_per_point": int(params.num_positives + params.num_negatives),
            "epoch_build_s": t_epoch, "clustering_s": t_cluster, "epoch_share_s": share,
            **overhead(rec, share, float(np.mean([len(b) for b in batches]))),
            "loadavg_end": loadavg(), "cpu_util": (time.process_time() - cpu0) / (pc() - wall0)}


def fmt_row(r: dict[str, Any]) -> str:
    op = r["overhead_paired"]
    return (f"{r.get('encoder', 'classifier'):>7} {r.get('sampler', r.get('negatives')):>10}: "
            f"bare {r['bare_points_per_s']:8.1f} pts/s  full {r['full_points_per_s']:8.1f} pts/s  "
            f"overhead {100 * r['overhead']:+6.1f}%  (paired median {100 * op['median']:+6.1f}%, "
            f"IQR {100 * op['q25']:+.1f}..{100 * op['q75']:+.1f}%)")


def step_count(text: str) -> int:
    """argparse type of the step counts: a whole number >= 0 (0 = skip that part)."""
    if not text.strip().isdigit():
        raise argparse.ArgumentTypeError(f"expected a whole number >= 0 (0 = skip that part), got {text!r}")
    return int(text)


def plan_parts(args: argparse.Namespace) -> tuple[list[tuple[str, int]], list[str], list[str]]:
    """What runs: the pretrain (encoder, steps) pairs, the cross-check samplers, the classifier modes; the
    parts a step count of 0 (or an empty list) skips go to ``args.skipped``."""
    args.skipped, encoders = [], []
    for enc_name in args.encoders:
        bag = parse_bag_name(enc_name) is not None
        steps = args.steps if bag else args.minilm_steps
        if steps == 0:
            args.skipped.append(f"pretrain {enc_name}: {'--steps' if bag else '--minilm-steps'} 0")
        elif args.samplers:
            encoders.append((enc_name, steps))
    if args.crosscheck_steps == 0:
        args.skipped.append("crosscheck: --crosscheck-steps 0")
    if args.classifier_steps == 0:
        args.skipped.append("classifier: --classifier-steps 0")
    cross = [s for s in args.samplers if s != "ngame"] if args.crosscheck_steps > 0 else []
    return encoders, cross, list(args.classifier_modes) if args.classifier_steps > 0 else []


def parse_args() -> tuple[argparse.Namespace, list[tuple[str, int]], list[str], list[str]]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--encoders", nargs="*", default=["bag", "minilm"])
    ap.add_argument("--samplers", nargs="*", default=["random", "ngame", "siamesexml"])
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--max-len", type=int, default=32)
    ap.add_argument("--steps", type=step_count, default=40, help="timed A/B pairs per sampler (bag encoder)")
    ap.add_argument("--minilm-steps", type=step_count, default=6, help="timed A/B pairs per sampler (transformers)")
    ap.add_argument("--warmup", type=step_count, default=2, help="A/B pairs run first and not timed")
    ap.add_argument("--cluster-size", type=int, default=8, help="ngame C for the timed batches (power of 2)")
    ap.add_argument("--clustering-sizes", type=int, nargs="*", default=[2, 8, 64], help="C values timed")
    ap.add_argument("--tau", type=int, default=5, help="ngame re-clustering period in epochs")
    ap.add_argument("--classifier-modes", nargs="*", default=["shortlist", "in-batch", "both"])
    ap.add_argument("--classifier-steps", type=step_count, default=20, help="timed A/B pairs per classifier mode")
    ap.add_argument("--classifier-batch-size", type=int, default=1024)
    ap.add_argument("--crosscheck-steps", type=step_count, default=20, help="steps of train_siamese itself (bag)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--verbose", action="store_true")
    ap.add_argument("--out", type=Path, default=Path("bench/results/pretrain_overhead.json"))
    args = ap.parse_args()
    encoders, cross, modes = plan_parts(args)
    if not (encoders or cross or modes or args.clustering_sizes):
        ap.error("nothing to measure: every part is skipped (" + "; ".join(args.skipped) + ") and no "
                 "--clustering-sizes are given")
    return args, encoders, cross, modes


def main() -> None:
    args, encoders, cross, modes = parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    t_start = pc()
    result: dict[str, Any] = {"machine": machine_info(), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
                              "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                              "loadavg_start": loadavg(), "skipped": args.skipped, "pretrain": [], "crosscheck": [],
                              "classifier": []}
    print(json.dumps(result["machine"]), *(f"skipped: {note}" for note in args.skipped), sep="\n", flush=True)
    with tempfile.TemporaryDirectory() as tmp:  # the tokens are memory-mapped from it
        data = load_data(args.max_len, Path(tmp))
        result["data"] = {**{k: v for k, v in data.items() if k not in ("Y", "pt", "lt", "rows")},
                          "train_rows": int(len(data["rows"]))}
        print(f"data: {len(data['rows'])} training rows, {data['n_labels']} labels, "
              f"{data['seconds']:.1f}s to read + tokenize", flush=True)
        point_emb = label_emb = None  # the (untrained) bag encoder's embeddings of every text (not for the cross-check)
        if encoders or modes or args.clustering_sizes:
            t = pc()
            bag = make_encoder("bag", data["pt"], data["lt"], 0)
            point_emb, label_emb = (encode_tokens(bag, *data[k], DEVICE, None, 1024) for k in ("pt", "lt"))
            result["bank_seconds"] = pc() - t
        result["clustering"] = []
        for c in sorted(set(args.clustering_sizes)):  # balanced_clusters on the bank, as NGAMESampler.epoch calls it
            t = pc()
            lab = balanced_clusters(point_emb[data["rows"]], c, seed=0)
            result["clustering"].append({"cluster_size": c, "n": int(len(data["rows"])), "seconds": pc() - t,
                                         "clusters": int(lab.max() + 1), "loadavg": loadavg()})
            print(f"balanced_clusters N={len(data['rows'])} C={c}: {pc() - t:.2f}s, {lab.max() + 1} clusters")
        for enc_name, steps in encoders:
            for sampler in args.samplers:
                t = pc()
                result["pretrain"].append({**bench_pretrain(enc_name, sampler, data, point_emb, args, steps),
                                           "wall_s": pc() - t})
                print(fmt_row(result["pretrain"][-1]) + f"  [{pc() - t:.0f}s]", flush=True)
                args.out.write_text(json.dumps({**result, "wall_s": pc() - t_start}, indent=2, default=float) + "\n")
        for sampler in cross:  # train_siamese itself, seconds per step as the library reports them
            params, enc = sampler_params(sampler, "bag", args), make_encoder("bag", data["pt"], data["lt"], 0)
            params.epochs = args.crosscheck_steps / BATCH_SAMPLERS[sampler].from_params(
                data["Y"], data["rows"], params, enc.dim).steps_per_epoch()
            res = train_siamese(enc, data["pt"], data["lt"], data["Y"], data["rows"], params, DEVICE,
                                amp_dtype(DEVICE, params.amp))
            result["crosscheck"].append({
                "encoder": "bag", "sampler": sampler, "steps": res.steps, "points": res.points, "seconds": res.seconds,
                "points_per_s": res.points / res.seconds,
                "note": "includes optimizer state allocation on step 1 and the whole epoch's batch building"})
            print(f"train_siamese bag/{sampler}: {res.steps} steps, {res.points / res.seconds:.1f} points/s")
        for mode in modes:
            result["classifier"].append(bench_classifier(mode, data, point_emb, label_emb, args))
            print(fmt_row(result["classifier"][-1]), flush=True)
        result.update(loadavg_end=loadavg(), wall_s=pc() - t_start)
        args.out.write_text(json.dumps(result, indent=2, default=float) + "\n")
        print(f"wrote {args.out} ({pc() - t_start:.0f}s)")


if __name__ == "__main__":
    main()
