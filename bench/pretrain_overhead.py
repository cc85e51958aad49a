"""Overhead of the training stages over the bare encoder: points/s of each step against the encoder's own
forward + backward + optimizer step on exactly the same texts.

Requirement: "points/s of each training stage against the bare encoder's forward+backward points/s on the
same batches (the sampler, clustering and loss together must cost under 15% on top)".

  python bench/pretrain_overhead.py [--encoders bag minilm] [--samplers random ngame siamesexml]
      [--batch-size 256] [--max-len 32] [--steps 40] [--minilm-steps 6] [--warmup 2] [--cluster-size 8]
      [--tau 5] [--classifier-modes shortlist in-batch both] [--classifier-steps 20] [--threads 2]
      [--out bench/results/pretrain_overhead.json]

A step count of 0 skips that part: ``--steps 0`` the bag-encoder rows, ``--minilm-steps 0`` the transformer
rows, ``--classifier-steps 0`` the classifier rows, ``--crosscheck-steps 0`` the ``train_siamese`` cross-check
(the JSON lists what was skipped under ``skipped``); skipping every part, with no ``--clustering-sizes``
either, is refused. Smoke run (about 1.5 minutes on 2 cores)::

  python bench/pretrain_overhead.py --encoders bag --samplers random siamesexml --steps 2 --warmup 1 \
      --classifier-modes shortlist --classifier-steps 2 --crosscheck-steps 0 --clustering-sizes \
      --out /tmp/pretrain_overhead_smoke.json

Method, per (encoder, sampler):
  (A) bare: the encoder on the step's point texts and label texts, in the same length-sorted chunks
      (``length_sorted_chunks`` + ``chunk_tensors``, as ``embed_rows``), loss = sum of the embeddings,
      backward, AdamW step. No sampling, masks, reordering, similarity matrix, mined loss, clipping or LR schedule.
  (B) full: what ``train_siamese`` does per step for that sampler, calling the same library functions in the
      same order (``sample_positives``, ``positive_mask``, ``embed_rows``, ``NGAMESampler.observe``,
      ``pair_loss``; for siamesexml the body of ``_label_batch_loss``), then zero_grad, backward,
      ``clip_grad_norm_``, AdamW step, LambdaLR step and ``float(loss)``, with a timer between the parts.
      The per-epoch batch building (``random_batches`` / ``NGAMESampler.epoch`` incl. ``balanced_clusters``
      on the memory bank / ``SiameseXMLSampler.epoch``) is timed separately and added amortised: for ngame one
      re-clustering epoch and tau - 1 plain epochs per tau epochs.
A and B are two copies of the same encoder with their own optimizers, so neither's updates touch the other.
Steps alternate ABBA... (A first on even steps, B first on odd ones) on the same batch; the first
``--warmup`` pairs are dropped. Reported: medians, overhead = median(B) / median(A) - 1 (B with the amortised
epoch share), and the median / spread of the per-pair ratios B_i / A_i (robust to load drifting over the run).
A cross-check runs ``train_siamese`` itself for a few steps (bag encoder) so the instrumented copy can be
compared with the library's loop.

The classifier stage is measured the same way: ``train_classifiers``' step (``sample_positives``,
``hardest_negatives``, W gather, normalise, scores, multi-positive triplet loss, backward, SparseAdam) against a
bare step (gather of the same label ids, dot, sum, backward, SparseAdam).

Data: the embedded LF-WordNetNouns, titles, tokenized with MiniLM's tokenizer (``tokenize_to_npy``), training
rows minus the pipeline's validation split. The ngame memory bank is the bag encoder's embeddings of every
training point (MiniLM encodes ~200 texts/s on a 2-core AVX2 CPU, too slow to fill a bank here); it is used
for both encoders' ngame batches and for the clustering times (which depend on N, D, C and the iterations
to converge, not on the encoder).
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
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from xc_dagster.catalog import builtin_path
from xc_dagster.config import ClassifierParams, PretrainParams
from xc_dagster.data import read_dataset
from xc_dagster.data.splits import validation_split
from xc_dagster.device import amp_dtype, autocast
from xc_dagster.encoders.encode import chunk_tensors, embed_rows, encode_tokens, length_sorted_chunks
from xc_dagster.encoders.loading import load_encoder
from xc_dagster.encoders.names import parse_bag_name
from xc_dagster.encoders.tokenizer import load_tokenizer, load_tokens, tokenize_to_npy
from xc_dagster.retrieval.ann import exact_topk
from xc_dagster.sampling.clustering import balanced_clusters
from xc_dagster.sampling.labels import positive_mask, sample_positives
from xc_dagster.training.classifier import classifier_batches, classifier_loss, hardest_negatives
from xc_dagster.training.siamese import (
    NGAMESampler,
    SiameseXMLSampler,
    label_batch_pair_loss,
    lr_lambda,
    pair_loss,
    random_batches,
    train_siamese,
)

pc = time.perf_counter
DEVICE = torch.device("cpu")


# ------------------------------------------------------------------------------------------ machine

def machine_info() -> dict[str, Any]:
    info: dict[str, Any] = {"platform": platform.platform(), "python": platform.python_version(),
                            "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
                            "cpu_count": os.cpu_count()}
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        for key in ("Model name", "CPU(s)", "Thread(s) per core", "Core(s) per socket"):
            m = re.search(rf"^{re.escape(key)}:\s*(.+)$", out, re.M)
            if m:
                info[key.lower().replace("(s)", "s").replace(" ", "_")] = m.group(1).strip()
        flags = set((re.search(r"^Flags:\s*(.+)$", out, re.M) or [None, ""])[1].split())
        info["simd"] = sorted(f for f in flags if f.startswith(("avx", "amx")) or f == "fma")
    except OSError:
        pass
    try:
        info["mkldnn_bf16"] = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        info["mkldnn_bf16"] = None
    info["amp_auto"] = str(amp_dtype(DEVICE, "auto"))
    try:
        info["mem_total_gb"] = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2 ** 30, 1)
    except (ValueError, OSError):
        pass
    return info


def loadavg() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


# --------------------------------------------------------------------------------------------- data

def load_data(max_len: int, tmp: Path) -> dict[str, Any]:
    """Titles of LF-WordNetNouns tokenized as the tokenize stage does; training rows as the pretrain stage."""
    t0 = pc()
    ds = read_dataset(builtin_path("LF-WordNetNouns"), text_fields=("title",), label_text_fields=("title",))
    tok = load_tokenizer("minilm")
    tokenize_to_npy(tok, ds.train_texts, max_len, tmp / "train_ids.npy", tmp / "train_len.npy")
    tokenize_to_npy(tok, ds.label_texts, max_len, tmp / "label_ids.npy", tmp / "label_len.npy")
    pt = load_tokens(tmp / "train_ids.npy", tmp / "train_len.npy")
    lt = load_tokens(tmp / "label_ids.npy", tmp / "label_len.npy")
    Y = ds.Y_train.tocsr()
    valid = validation_split(ds.num_train, 0.05, 5000, 0)  # IngestParams defaults
    rows = np.setdiff1d(np.arange(ds.num_train), valid)
    rows = rows[np.diff(Y.indptr)[rows] > 0]  # as train_siamese / train_classifiers
    return {"Y": Y, "pt": pt, "lt": lt, "rows": rows.astype(np.int64), "seconds": pc() - t0,
            "n_train": ds.num_train, "n_labels": ds.num_labels, "mean_point_len": float(pt[1].mean()),
            "mean_label_len": float(lt[1].mean())}


def make_encoder(name: str, pt, lt, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    enc = load_encoder(name).to(DEVICE)
    if parse_bag_name(name) is not None:  # as the pretrain stage: IDF of the training texts
        enc.fit_idf(pt, lt)
    return enc


# ------------------------------------------------------------------------------------------ helpers

def stats(xs: list[float]) -> dict[str, float]:
    if not xs:
        return {}
    q = np.quantile(xs, [0.25, 0.5, 0.75])
    return {"median": float(q[1]), "q25": float(q[0]), "q75": float(q[2]), "min": float(min(xs)),
            "max": float(max(xs)), "n": len(xs)}


def bare_forward(enc, tokens, rows: np.ndarray, chunk_size: int, dtype) -> torch.Tensor:
    """The encoder on ``rows`` in embed_rows' length-sorted chunks, without reordering the output."""
    ids, lens = tokens
    pieces = []
    with autocast(DEVICE, dtype):
        for local in length_sorted_chunks(lens[rows], chunk_size):
            t_ids, mask = chunk_tensors(ids, lens, rows[local], DEVICE)
            pieces.append(enc(t_ids, mask))
    return torch.cat(pieces)


class Timer:
    """Accumulates named part times of one step."""

    def __init__(self) -> None:
        self.parts: dict[str, float] = {}
        self.t = pc()

    def lap(self, name: str) -> None:
        now = pc()
        self.parts[name] = self.parts.get(name, 0.0) + now - self.t
        self.t = now

    @property
    def total(self) -> float:
        return sum(self.parts.values())


# ----------------------------------------------------------------------------------- pretrain steps

def timed_backward_step(tm: Timer, loss: torch.Tensor, opt, enc=None, sched=None) -> None:
    """Backward and optimizer step, timed; with ``enc`` the gradient is clipped at 1.0 first (train_siamese),
    with ``sched`` the schedule steps too."""
    opt.zero_grad(set_to_none=True)
    loss.backward()
    tm.lap("backward")
    if enc is not None:
        torch.nn.utils.clip_grad_norm_(enc.parameters(), 1.0)
        tm.lap("clip")
    opt.step()
    if sched is not None:
        sched.step()
    tm.lap("opt_step")


def timed_update(tm: Timer, loss: torch.Tensor, enc, opt, sched) -> None:
    """train_siamese's update after the loss (backward, clip at 1.0, AdamW + schedule, loss.item), timed."""
    timed_backward_step(tm, loss, opt, enc, sched)
    float(loss.detach())
    tm.lap("loss_item")


def step_bare(enc, opt, pt, lt, point_rows: np.ndarray, label_rows: np.ndarray, chunk_size: int,
              dtype) -> Timer:
    tm = Timer()
    p = bare_forward(enc, pt, point_rows, chunk_size, dtype)
    z = bare_forward(enc, lt, label_rows, chunk_size, dtype)
    tm.lap("forward")
    loss = p.float().sum() + z.float().sum()
    tm.lap("loss")
    timed_backward_step(tm, loss, opt)
    return tm


def step_full_points(enc, opt, sched, Y, pt, lt, batch: np.ndarray, params: PretrainParams,
                     rng: np.random.Generator, ngame: NGAMESampler | None, dtype) -> tuple[Timer, np.ndarray]:
    """One step of train_siamese's loop over point batches (random / ngame), with part timers."""
    tm = Timer()
    labels = sample_positives(Y, batch, 1, rng)[:, 0]
    mask = torch.from_numpy(positive_mask(Y, batch, np.broadcast_to(labels, (len(batch), len(labels)))))
    tm.lap("sample+mask")
    with autocast(DEVICE, dtype):
        p = embed_rows(enc, *pt, batch, params.chunk_size, DEVICE)
        z = embed_rows(enc, *lt, labels, params.chunk_size, DEVICE)
    tm.lap("forward")
    if ngame is not None:
        ngame.observe(batch, p)
        tm.lap("bank_update")
    loss = pair_loss(p.float() @ z.float().T, mask.to(DEVICE), params)
    tm.lap("loss")
    timed_update(tm, loss, enc, opt, sched)
    return tm, labels


def label_batch_texts(batch) -> tuple[np.ndarray, np.ndarray]:
    """Point rows (distinct) and label rows a siamesexml batch encodes."""
    return np.unique(np.concatenate([batch.anchors, batch.centroid.ravel()])), batch.labels


def step_full_labels(enc, opt, sched, Y, pt, lt, batch, params: PretrainParams, dtype) -> Timer:
    """One siamesexml step: the body of siamese._label_batch_loss, then train_siamese's update, timed."""
    tm = Timer()
    B, m = len(batch.labels), batch.centroid.shape[1]
    mask = positive_mask(Y, batch.anchors, np.broadcast_to(batch.labels, (B, B))).T
    mask_t = torch.from_numpy(np.ascontiguousarray(mask)).to(DEVICE)
    pts, where = np.unique(np.concatenate([batch.anchors, batch.centroid.ravel()]), return_inverse=True)
    tm.lap("sample+mask")
    with autocast(DEVICE, dtype):
        p = embed_rows(enc, *pt, pts, params.chunk_size, DEVICE).float()
        z = embed_rows(enc, *lt, batch.labels, params.chunk_size, DEVICE).float()
    tm.lap("forward")
    loss = label_batch_pair_loss(p, z, where, m, mask_t, params)
    tm.lap("loss")
    timed_update(tm, loss, enc, opt, sched)
    return tm


def sampler_params(sampler: str, batch_size: int, cluster_size: int, tau: int, lr: float) -> PretrainParams:
    if sampler == "siamesexml":  # the siamesexml strategy's overrides
        return PretrainParams(batch_size=batch_size, sampler="siamesexml", loss="siamesexml", num_negatives=1,
                              lr=lr)
    if sampler == "ngame":  # curriculum at C = cluster_size from epoch 0 (each 0 doubles C once)
        k = max(int(round(math.log2(max(cluster_size, 2)))), 1)
        return PretrainParams(batch_size=batch_size, sampler="ngame", curriculum=(0,) * k,
                              max_cluster_size=2 ** k, cluster_every=tau, lr=lr)
    return PretrainParams(batch_size=batch_size, sampler="random", lr=lr)


def bench_pretrain(enc_name: str, sampler: str, data: dict[str, Any], bank: np.ndarray, args,
                   steps: int) -> dict[str, Any]:
    Y, pt, lt, rows = data["Y"], data["pt"], data["lt"], data["rows"]
    lr = 1e-2 if parse_bag_name(enc_name) is not None else 2e-4
    params = sampler_params(sampler, args.batch_size, args.cluster_size, args.tau, lr)
    dtype = amp_dtype(DEVICE, params.amp)
    enc_b = make_encoder(enc_name, pt, lt, params.seed)
    enc_a = copy.deepcopy(enc_b)
    enc_a.train()
    enc_b.train()
    opt_a = torch.optim.AdamW(enc_a.parameters(), lr=params.lr, weight_decay=params.weight_decay)
    opt_b = torch.optim.AdamW(enc_b.parameters(), lr=params.lr, weight_decay=params.weight_decay)
    n = args.warmup + steps
    sched_b = torch.optim.lr_scheduler.LambdaLR(opt_b, lr_lambda(params.warmup_steps, max(n, 1000)))
    rng_epoch = np.random.default_rng(params.seed)
    cpu0, wall0 = time.process_time(), pc()
    out: dict[str, Any] = {"encoder": enc_name, "sampler": sampler, "loss": params.loss,
                           "batch_size": params.batch_size, "amp": str(dtype), "loadavg_start": loadavg()}

    # ---- epoch-level batch building (timed, amortised per step)
    ngame = None
    if sampler == "siamesexml":
        t = pc()
        lw = SiameseXMLSampler(Y, rows, params)
        out["sampler_init_s"] = pc() - t  # once per training run
        t = pc()
        batches = lw.epoch(params.batch_size, rng_epoch)
        t_epoch = pc() - t
        out["epoch_build_s"] = t_epoch
        out["steps_per_epoch"] = len(batches)
        out["epoch_share_s"] = t_epoch / len(batches)
    elif sampler == "ngame":
        ngame = NGAMESampler(Y.shape[0], enc_b.dim, params)
        ngame.bank[:] = bank
        t = pc()
        first = list(ngame.epoch(0, rows, params.batch_size, rng_epoch))  # re-clusters (epoch 0 % tau == 0)
        t_recluster = pc() - t
        t = pc()
        batches = list(ngame.epoch(1, rows, params.batch_size, rng_epoch))  # same clusters, new batches
        t_plain = pc() - t
        assert ngame.reclusterings == 1, ngame.reclusterings
        spe = len(batches)
        out.update({"cluster_size": ngame.size, "tau_epochs": args.tau, "recluster_epoch_build_s": t_recluster,
                    "plain_epoch_build_s": t_plain, "clustering_s": t_recluster - t_plain,
                    "steps_per_epoch": spe, "steps_per_epoch_first": len(first),
                    "batch_sizes": stats([float(len(b)) for b in batches]),
                    "epoch_share_s": (t_recluster + (args.tau - 1) * t_plain) / (args.tau * spe),
                    "clustering_share_s": (t_recluster - t_plain) / (args.tau * spe)})
    else:
        t = pc()
        batches = list(random_batches(rows, params.batch_size, rng_epoch))
        t_epoch = pc() - t
        out.update({"epoch_build_s": t_epoch, "steps_per_epoch": len(batches),
                    "epoch_share_s": t_epoch / len(batches)})
    if n > len(batches):
        raise SystemExit(f"{n} steps asked, an epoch has {len(batches)} batches")

    # ---- interleaved steps
    rng_b = np.random.default_rng(params.seed + 1)
    rng_a = copy.deepcopy(rng_b)  # the same positives as B draws, drawn outside A's timing
    a_times, b_times, ratios, points = [], [], [], []
    a_parts: dict[str, list[float]] = {}
    b_parts: dict[str, list[float]] = {}
    for i in range(n):
        batch = batches[i]
        if sampler == "siamesexml":
            a_pts, a_lab = label_batch_texts(batch)
        else:
            a_pts, a_lab = batch, sample_positives(Y, batch, 1, rng_a)[:, 0]

        def run_a() -> Timer:
            return step_bare(enc_a, opt_a, pt, lt, a_pts, a_lab, params.chunk_size, dtype)

        def run_b() -> Timer:
            if sampler == "siamesexml":
                return step_full_labels(enc_b, opt_b, sched_b, Y, pt, lt, batch, params, dtype)
            tm, labels = step_full_points(enc_b, opt_b, sched_b, Y, pt, lt, batch, params, rng_b, ngame, dtype)
            assert np.array_equal(labels, a_lab), "A and B must see the same texts"
            return tm

        if i % 2 == 0:
            ta, tb = run_a(), run_b()
        else:
            tb, ta = run_b(), run_a()
        if i < args.warmup:
            continue
        a_times.append(ta.total)
        b_times.append(tb.total)
        ratios.append(tb.total / ta.total)
        points.append(len(a_pts))
        for k, v in ta.parts.items():
            a_parts.setdefault(k, []).append(v)
        for k, v in tb.parts.items():
            b_parts.setdefault(k, []).append(v)
        if args.verbose:
            print(f"  {enc_name}/{sampler} step {i}: A {ta.total:.3f}s B {tb.total:.3f}s", flush=True)

    a_med, b_med = statistics.median(a_times), statistics.median(b_times)
    share = out["epoch_share_s"]
    pts = float(np.mean(points))
    r = np.asarray(ratios)
    out.update({
        "steps_timed": len(a_times), "warmup": args.warmup, "points_per_step": pts,
        "label_texts_per_step": float(params.batch_size),
        "bare_step_s": stats(a_times), "full_step_s": stats(b_times),
        "full_step_with_epoch_share_s": b_med + share,
        "bare_points_per_s": pts / a_med, "full_points_per_s": pts / (b_med + share),
        "overhead": (b_med + share) / a_med - 1.0,
        "overhead_paired": {"median": float(np.median(r) - 1 + share / a_med),
                            "q25": float(np.quantile(r, 0.25) - 1 + share / a_med),
                            "q75": float(np.quantile(r, 0.75) - 1 + share / a_med),
                            "min": float(r.min() - 1 + share / a_med), "max": float(r.max() - 1 + share / a_med)},
        "bare_parts_median_s": {k: statistics.median(v) for k, v in a_parts.items()},
        "full_parts_median_s": {k: statistics.median(v) for k, v in b_parts.items()},
        "loadavg_end": loadavg(),
        # CPU seconds of this process per wall second: ~threads when it has the cores to itself, lower when
        # other processes take CPU time (or in single-threaded numpy parts)
        "cpu_util": (time.process_time() - cpu0) / (pc() - wall0),
    })
    return out


def crosscheck_train_siamese(enc_name: str, sampler: str, data: dict[str, Any], args, steps: int) -> dict:
    """train_siamese itself for ``steps`` steps (fractional epoch): seconds per step as the library reports."""
    Y, pt, lt, rows = data["Y"], data["pt"], data["lt"], data["rows"]
    lr = 1e-2 if parse_bag_name(enc_name) is not None else 2e-4
    params = sampler_params(sampler, args.batch_size, args.cluster_size, args.tau, lr)
    if sampler == "siamesexml":
        spe = SiameseXMLSampler(Y, rows, params).steps_per_epoch(params.batch_size)
    else:
        spe = math.ceil(len(rows) / params.batch_size)
    params.epochs = steps / spe
    enc = make_encoder(enc_name, pt, lt, params.seed)
    res = train_siamese(enc, pt, lt, Y, rows, params, DEVICE, amp_dtype(DEVICE, params.amp))
    return {"encoder": enc_name, "sampler": sampler, "steps": res.steps, "points": res.points,
            "seconds": res.seconds, "points_per_s": res.points / res.seconds,
            "note": "includes optimizer state allocation on step 1 and the whole epoch's batch building"}


# --------------------------------------------------------------------------------- classifier steps

def clf_step_full(W, opt, X, Y, batch, shortlist, params: ClassifierParams, rng) -> tuple[Timer, torch.Tensor]:
    """One step of train_classifiers' loop, with part timers; returns the label ids it scored."""
    tm = Timer()
    pos = sample_positives(Y, batch, params.num_positives, rng)
    x = X[batch].to(DEVICE)
    tm.lap("sample")
    neg = hardest_negatives(x, W.weight, batch, pos, shortlist, Y, params.negatives, params.num_negatives)
    ids = torch.cat([torch.from_numpy(pos).to(DEVICE), neg], dim=1)
    valid = ids >= 0
    is_pos = torch.zeros_like(valid)
    is_pos[:, :pos.shape[1]] = True
    tm.lap("hardest_negatives")
    w = W(ids.clamp_min(0))
    if params.normalize:
        w = F.normalize(w, dim=-1)
    scores = torch.einsum("bd,bkd->bk", x, w)
    tm.lap("gather+dot")
    loss = classifier_loss(scores, is_pos, valid, params)
    tm.lap("loss")
    timed_backward_step(tm, loss, opt)
    float(loss.detach())
    tm.lap("loss_item")
    return tm, ids


def clf_step_bare(W, opt, X, batch, ids: torch.Tensor) -> Timer:
    tm = Timer()
    x = X[batch]
    w = W(ids.clamp_min(0))
    scores = torch.einsum("bd,bkd->bk", x, w)
    tm.lap("gather+dot")
    loss = scores.sum()
    timed_backward_step(tm, loss, opt)
    return tm


def bench_classifier(mode: str, data: dict[str, Any], point_emb: np.ndarray, label_emb: np.ndarray,
                     clusters_by_size: dict[int, tuple[np.ndarray, float]], args) -> dict[str, Any]:
    Y, rows = data["Y"], data["rows"]
    cs = args.cluster_size if mode != "shortlist" else 0  # NGAME M2 in-batch negatives come from cluster batches
    params = ClassifierParams(negatives=mode, cluster_size=cs, batch_size=args.classifier_batch_size)
    rng = np.random.default_rng(params.seed)
    clusters, t_cluster = None, 0.0
    if cs > 1:
        lab, t_cluster = clusters_by_size[cs]
        clusters = np.full(len(point_emb), -1, dtype=np.int64)
        clusters[rows] = lab
    t = pc()
    batches = classifier_batches(rows, params, rng, clusters)
    t_epoch = pc() - t
    n = args.warmup + args.classifier_steps
    if n > len(batches):
        raise SystemExit(f"{n} classifier steps asked, an epoch has {len(batches)} batches")
    batches = batches[:n]
    # the mined shortlist (exact top-100 label embeddings), computed for the rows these batches use only
    used = np.unique(np.concatenate(batches))
    shortlist = np.full((len(point_emb), 100), -1, dtype=np.int64)
    shortlist[used] = exact_topk(point_emb[used], label_emb, 100, device=DEVICE)[1]
    X = torch.from_numpy(np.ascontiguousarray(point_emb, dtype=np.float32))
    torch.manual_seed(params.seed)

    def make_w():
        W = torch.nn.Embedding(label_emb.shape[0], label_emb.shape[1], sparse=True)
        with torch.no_grad():
            W.weight.copy_(torch.from_numpy(np.ascontiguousarray(label_emb, dtype=np.float32)))
        return W, torch.optim.SparseAdam(W.parameters(), lr=params.lr)

    cpu0, wall0 = time.process_time(), pc()
    W_a, opt_a = make_w()
    W_b, opt_b = make_w()
    rng_b = np.random.default_rng(params.seed + 1)
    rng_a = copy.deepcopy(rng_b)
    a_times, b_times, ratios = [], [], []
    a_parts: dict[str, list[float]] = {}
    b_parts: dict[str, list[float]] = {}
    W0 = W_a.weight.detach().clone()
    for i, batch in enumerate(batches):
        # A's ids: the same positives, hardest negatives under the initial W (outside A's timing)
        pos = sample_positives(Y, batch, params.num_positives, rng_a)
        neg = hardest_negatives(X[batch], W0, batch, pos, shortlist, Y, mode, params.num_negatives)
        ids_a = torch.cat([torch.from_numpy(pos), neg], dim=1)
        if i % 2 == 0:
            ta = clf_step_bare(W_a, opt_a, X, batch, ids_a)
            tb, _ = clf_step_full(W_b, opt_b, X, Y, batch, shortlist, params, rng_b)
        else:
            tb, _ = clf_step_full(W_b, opt_b, X, Y, batch, shortlist, params, rng_b)
            ta = clf_step_bare(W_a, opt_a, X, batch, ids_a)
        if i < args.warmup:
            continue
        a_times.append(ta.total)
        b_times.append(tb.total)
        ratios.append(tb.total / ta.total)
        for k, v in ta.parts.items():
            a_parts.setdefault(k, []).append(v)
        for k, v in tb.parts.items():
            b_parts.setdefault(k, []).append(v)
    spe = math.ceil(len(rows) / params.batch_size)
    share = (t_epoch + t_cluster / params.epochs) / spe  # clustering once per stage, batches once per epoch
    a_med, b_med = statistics.median(a_times), statistics.median(b_times)
    bs = float(np.mean([len(b) for b in batches]))
    r = np.asarray(ratios)
    return {"negatives": mode, "cluster_size": cs, "batch_size": params.batch_size,
            "num_negatives": params.num_negatives, "loss": params.loss, "steps_timed": len(a_times),
            "ids_per_point": int(params.num_positives + params.num_negatives),
            "epoch_build_s": t_epoch, "clustering_s": t_cluster, "epoch_share_s": share,
            "bare_step_s": stats(a_times), "full_step_s": stats(b_times),
            "bare_points_per_s": bs / a_med, "full_points_per_s": bs / (b_med + share),
            "overhead": (b_med + share) / a_med - 1.0,
            "overhead_paired": {"median": float(np.median(r) - 1 + share / a_med),
                                "q25": float(np.quantile(r, 0.25) - 1 + share / a_med),
                                "q75": float(np.quantile(r, 0.75) - 1 + share / a_med)},
            "bare_parts_median_s": {k: statistics.median(v) for k, v in a_parts.items()},
            "full_parts_median_s": {k: statistics.median(v) for k, v in b_parts.items()},
            "loadavg_end": loadavg(), "cpu_util": (time.process_time() - cpu0) / (pc() - wall0)}


# ---------------------------------------------------------------------------------------------- main

def fmt_row(r: dict[str, Any]) -> str:
    op = r["overhead_paired"]
    return (f"{r.get('encoder', 'classifier'):>7} {r.get('sampler', r.get('negatives')):>10}: "
            f"bare {r['bare_points_per_s']:8.1f} pts/s  full {r['full_points_per_s']:8.1f} pts/s  "
            f"overhead {100 * r['overhead']:+6.1f}%  (paired median {100 * op['median']:+6.1f}%, "
            f"IQR {100 * op['q25']:+.1f}..{100 * op['q75']:+.1f}%)")


def step_count(text: str) -> int:
    """argparse type of the step counts: a whole number >= 0 (0 = skip that part)."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 0 (0 = skip that part), got {text!r}")
    return value


def plan_parts(args: argparse.Namespace) -> tuple[list[tuple[str, int]], list[str], list[str]]:
    """What runs: the pretrain (encoder, steps) pairs, the cross-check samplers, the classifier modes; the
    parts a step count of 0 (or an empty list) skips go to ``args.skipped``."""
    skipped: list[str] = []
    encoders = []
    for enc_name in args.encoders:
        bag = parse_bag_name(enc_name) is not None
        steps = args.steps if bag else args.minilm_steps
        if steps == 0:
            skipped.append(f"pretrain {enc_name}: {'--steps' if bag else '--minilm-steps'} 0")
        elif args.samplers:
            encoders.append((enc_name, steps))
    cross = [s for s in args.samplers if s != "ngame"] if args.crosscheck_steps > 0 else []
    if args.crosscheck_steps == 0:
        skipped.append("crosscheck: --crosscheck-steps 0")
    modes = list(args.classifier_modes) if args.classifier_steps > 0 else []
    if args.classifier_steps == 0:
        skipped.append("classifier: --classifier-steps 0")
    args.skipped = skipped
    return encoders, cross, modes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--encoders", nargs="*", default=["bag", "minilm"])
    ap.add_argument("--samplers", nargs="*", default=["random", "ngame", "siamesexml"])
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--max-len", type=int, default=32)
    ap.add_argument("--steps", type=step_count, default=40,
                    help="timed A/B pairs per sampler (bag encoder; 0 = skip its rows)")
    ap.add_argument("--minilm-steps", type=step_count, default=6,
                    help="timed A/B pairs per sampler (transformers; 0 = skip their rows)")
    ap.add_argument("--warmup", type=step_count, default=2, help="A/B pairs run first and not timed")
    ap.add_argument("--cluster-size", type=int, default=8, help="ngame C for the timed batches (power of 2)")
    ap.add_argument("--clustering-sizes", type=int, nargs="*", default=[2, 8, 64],
                    help="C values balanced_clusters is timed at on the memory bank")
    ap.add_argument("--tau", type=int, default=5, help="ngame re-clustering period in epochs")
    ap.add_argument("--classifier-modes", nargs="*", default=["shortlist", "in-batch", "both"])
    ap.add_argument("--classifier-steps", type=step_count, default=20,
                    help="timed A/B pairs per classifier mode (0 = skip the classifier rows)")
    ap.add_argument("--classifier-batch-size", type=int, default=1024)
    ap.add_argument("--crosscheck-steps", type=step_count, default=20,
                    help="train_siamese itself for this many steps (bag encoder; 0 = skip)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--verbose", action="store_true")
    ap.add_argument("--out", type=Path, default=Path("bench/results/pretrain_overhead.json"))
    args = ap.parse_args()
    encoders, cross, modes = plan_parts(args)
    if not (encoders or cross or modes or args.clustering_sizes):
        ap.error("nothing to measure: every part is skipped (" + "; ".join(args.skipped) + ") and no "
                 "--clustering-sizes are given")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    t_start = pc()
    result: dict[str, Any] = {"machine": machine_info(), "args": {k: str(v) if isinstance(v, Path) else v
                                                                  for k, v in vars(args).items()},
                              "date": time.strftime("%Y-%m-%d %H:%M:%S"), "loadavg_start": loadavg()}
    print(json.dumps(result["machine"]), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        data = load_data(args.max_len, Path(tmp))
        result["data"] = {k: v for k, v in data.items() if k not in ("Y", "pt", "lt", "rows")}
        result["data"]["train_rows"] = int(len(data["rows"]))
        print(f"data: {len(data['rows'])} training rows, {data['n_labels']} labels, "
              f"{data['seconds']:.1f}s to read + tokenize", flush=True)

        result["skipped"] = args.skipped
        for note in args.skipped:
            print(f"skipped: {note}", flush=True)

        # memory bank / frozen embeddings: the (untrained) bag encoder's embeddings of every text (the ngame
        # memory bank of the pretrain rows, the classifier rows' inputs, what is clustered; the cross-check
        # needs none of them)
        sizes = set(args.clustering_sizes)
        if args.cluster_size > 1 and any(m != "shortlist" for m in modes):
            sizes.add(args.cluster_size)
        point_emb = label_emb = None
        if encoders or modes or sizes:
            t = pc()
            bag = make_encoder("bag", data["pt"], data["lt"], 0)
            point_emb = encode_tokens(bag, *data["pt"], DEVICE, None, 1024)
            label_emb = encode_tokens(bag, *data["lt"], DEVICE, None, 1024)
            del bag
            result["bank_seconds"] = pc() - t

        # clustering of the memory bank (training rows), as NGAMESampler.epoch / train_classifiers call it:
        # the --clustering-sizes, plus --cluster-size when a classifier mode batches by clusters
        clusters_by_size: dict[int, tuple[np.ndarray, float]] = {}
        result["clustering"] = []
        for c in sorted(sizes):
            t = pc()
            lab = balanced_clusters(point_emb[data["rows"]], c, seed=0)
            dt = pc() - t
            clusters_by_size[c] = (lab, dt)
            result["clustering"].append({"cluster_size": c, "n": int(len(data["rows"])), "seconds": dt,
                                         "clusters": int(lab.max() + 1), "loadavg": loadavg()})
            print(f"balanced_clusters N={len(data['rows'])} C={c}: {dt:.2f}s, {lab.max() + 1} clusters", flush=True)

        result["pretrain"] = []
        for enc_name, steps in encoders:
            for sampler in args.samplers:
                t = pc()
                r = bench_pretrain(enc_name, sampler, data, point_emb, args, steps)
                r["wall_s"] = pc() - t
                result["pretrain"].append(r)
                print(fmt_row(r) + f"  [{r['wall_s']:.0f}s]", flush=True)
                result["wall_s"] = pc() - t_start
                write(args.out, result)

        result["crosscheck"] = []
        for sampler in cross:
            r = crosscheck_train_siamese("bag", sampler, data, args, args.crosscheck_steps)
            result["crosscheck"].append(r)
            print(f"train_siamese bag/{sampler}: {r['steps']} steps, {r['points_per_s']:.1f} points/s", flush=True)

        result["classifier"] = []
        for mode in modes:
            r = bench_classifier(mode, data, point_emb, label_emb, clusters_by_size, args)
            result["classifier"].append(r)
            print(fmt_row(r), flush=True)
    result["loadavg_end"] = loadavg()
    result["wall_s"] = pc() - t_start
    write(args.out, result)
    print(f"wrote {args.out} ({result['wall_s']:.0f}s)")


def write(path: Path, obj: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=2, default=float) + "\n")


if __name__ == "__main__":
    main()
