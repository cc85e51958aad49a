"""Peak memory (RSS) of the training steps that train the encoder, with and without gradient caching, and what
grad caching costs in time (docs/decisions.md#grad-cache; results in bench/TRAIN_MEMORY.md).

Every case runs in a child process of its own, so each peak RSS (``VmHWM`` of /proc/self/status) is that case's:

* ``calibrate``: one training forward + backward of a random BERT-shaped encoder per (shape, tokens, texts,
  precision), the peak over the RSS after a warm-up step (gradients and AdamW state allocated); fits
  ``xc_dagster.training.memory.ACTIVATION_COEFFS`` (non-negative least squares on relative errors) and prints the
  fit and each point's measured / predicted ratio.
* ``overhead``: seconds per pretraining step (``SiameseTrainer.step``, point batches), plain and grad-cached
  alternating on copies of one encoder, the first pair dropped: a random MiniLM-shaped transformer and the bag
  encoder.
* ``strategies``: a few steps of each strategy's trainer (ngame, siamesexml: ``SiameseTrainer``; astra, mips:
  ``EndToEndTrainer`` with the encoder trained) with the packaged MiniLM, at the papers' batch sizes: 16,384
  point texts filling ``max_len`` tokens (random token ids), 8,192 label texts of 8 to 24 tokens (titles), so a
  third of the end-to-end examples are label texts, as with LF-Amazon-131K's 295K points and 131K labels.

  python bench/train_memory.py calibrate --out bench/results/train_memory_calibrate.jsonl
  python bench/train_memory.py overhead --out bench/results/train_memory_overhead.jsonl
  python bench/train_memory.py strategies --max-lens 128 256 --out bench/results/train_memory_strategies.jsonl
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import scipy.sparse as sp
import torch
from scipy.optimize import nnls
from transformers import BertConfig, BertModel

from xc_dagster.config import PretrainParams, resolve_config
from xc_dagster.device import adamw, amp_dtype
from xc_dagster.encoders.loading import load_encoder
from xc_dagster.encoders.transformer import SiameseEncoder
from xc_dagster.errors import XCConfigError
from xc_dagster.training.end_to_end import EndToEndTrainer
from xc_dagster.training.memory import available_memory
from xc_dagster.training.siamese import SiameseTrainer

CPU = torch.device("cpu")
GIB = 2 ** 30
PAPER_BATCH = {"ngame": 1600, "siamesexml": 4095, "astra": 512, "mips": 512}  # docs in TRAIN_MEMORY.md
SHAPES = [(384, 6, 12, 1536), (256, 4, 4, 1024), (768, 2, 12, 3072), (128, 2, 2, 512)]


def proc_status(key: str) -> int:
    """A ``kB`` line of /proc/self/status (VmRSS, VmHWM) in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def reset_peak() -> int:
    """Reset VmHWM to the current RSS (Linux: clear_refs 5); returns that RSS."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return proc_status("VmRSS")


def random_bert(h: int, layers: int, heads: int, inter: int, seed: int = 0) -> SiameseEncoder:
    """A randomly initialised BERT of this shape over MiniLM's vocabulary size, dropout on (BERT's 0.1)."""
    torch.manual_seed(seed)
    cfg = BertConfig(vocab_size=30522, hidden_size=h, num_hidden_layers=layers, num_attention_heads=heads,
                     intermediate_size=inter, max_position_embeddings=512)
    return SiameseEncoder(BertModel(cfg))


def case_probe(c: dict[str, Any]) -> dict[str, Any]:
    """One training forward + backward of ``texts`` random texts of ``tokens`` tokens: peak RSS over the base."""
    enc = random_bert(c["h"], c["layers"], c["heads"], c["inter"])
    enc.train()
    opt = adamw(enc.parameters(), 1e-4, 0.01)
    dtype = torch.bfloat16 if c["dtype"] == "bf16" else None

    def step(n: int, t: int) -> None:
        ids, mask = torch.randint(1000, 30000, (n, t)), torch.ones(n, t, dtype=torch.long)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype is not None):
            out = enc(ids, mask)
        out.float().sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=False)

    step(2, 8)  # gradients and AdamW state exist from here on, as in training
    base = reset_peak()
    step(c["texts"], c["tokens"])
    return {**c, "peak_over_base": proc_status("VmHWM") - base, "base_rss": base}


def synthetic_tokens(n: int, width: int, lo: int, hi: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``n`` rows of random MiniLM token ids, ``lo``..``hi`` tokens long, in a (n, width) array."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(1000, 30000, (n, width)).astype(np.int32)
    return ids, rng.integers(lo, hi + 1, n).astype(np.int32)


def synthetic_labels(n_points: int, n_labels: int, per_point: int, seed: int) -> sp.csr_matrix:
    """Every label has a point (labels dealt round-robin first), then random extra labels per point."""
    rng = np.random.default_rng(seed)
    rows = np.concatenate([np.arange(n_labels) % n_points, np.repeat(np.arange(n_points), per_point)])
    cols = np.concatenate([np.arange(n_labels), rng.integers(0, n_labels, n_points * per_point)])
    Y = sp.csr_matrix((np.ones(len(rows), np.float32), (rows, cols)), shape=(n_points, n_labels))
    Y.data[:] = 1.0
    return Y


def case_overhead(c: dict[str, Any]) -> dict[str, Any]:
    """Seconds per ``SiameseTrainer.step``, plain and grad-cached alternating on copies of one encoder."""
    enc = random_bert(384, 6, 12, 1536) if c["encoder"] == "minilm-random" else load_encoder("bag")
    B, steps = c["batch_size"], c["steps"]
    n = B * (steps + 1)
    pt, lt = synthetic_tokens(n, c["tokens"], c["tokens"], c["tokens"], 1), synthetic_tokens(n, 24, 8, 24, 2)
    Y = synthetic_labels(n, n, 1, 3)
    dtype = amp_dtype(CPU, "auto")
    trainers, times, cpu = {}, {"off": [], "on": []}, {"off": [], "on": []}
    for mode in times:
        params = dataclasses.replace(PretrainParams(), batch_size=B, grad_cache=mode, lr=c["lr"])
        trainers[mode] = SiameseTrainer(copy.deepcopy(enc), pt, lt, Y, np.arange(n), params, CPU, dtype)
        trainers[mode].start()
    batches = trainers["off"].epoch_batches(0)[:steps]
    for batch in batches:
        for mode, trainer in trainers.items():
            t, t_cpu = time.perf_counter(), time.process_time()
            trainer.step(batch)
            times[mode].append(time.perf_counter() - t)
            cpu[mode].append(time.process_time() - t_cpu)
    off, on = (statistics.median(times[m][1:]) for m in ("off", "on"))
    cpu_off, cpu_on = (statistics.median(cpu[m][1:]) for m in ("off", "on"))
    return {**c, "amp": str(dtype), "seconds_off": off, "seconds_on": on, "overhead": on / off - 1,
            "cpu_seconds_off": cpu_off, "cpu_seconds_on": cpu_on, "cpu_overhead": cpu_on / cpu_off - 1,
            "times": times, "cpu_times": cpu, "chunk_on": trainers["on"].memory.chunk_size,
            "loadavg": os.getloadavg()}


def strategy_trainer(c: dict[str, Any]) -> tuple[Any, list[Any]]:
    """The strategy's trainer (paper preset + strategy settings, ``batch_size`` and ``grad_cache`` set) on
    synthetic long texts, and the batches of its first steps."""
    name, T = c["strategy"], c["max_len"]
    cfg = resolve_config("paper", name)
    n_points, n_labels = c["points"], c["labels"]
    pt = synthetic_tokens(n_points, T, T, T, 1)
    lt = synthetic_tokens(n_labels, T, 8, 24, 2)
    Y = synthetic_labels(n_points, n_labels, 2, 3)
    enc = load_encoder("minilm")
    dtype = amp_dtype(CPU, cfg.pretrain.amp)
    if name in ("ngame", "siamesexml"):
        p = dataclasses.replace(cfg.pretrain, batch_size=c["batch_size"], grad_cache=c["grad_cache"], epochs=1.0)
        trainer = SiameseTrainer(enc, pt, lt, Y, np.arange(n_points), p, CPU, dtype)
        trainer.start()
    else:
        q = dataclasses.replace(cfg.classifier, batch_size=c["batch_size"], grad_cache=c["grad_cache"], epochs=1.0)
        rng = np.random.default_rng(4)
        pe, le = (rng.standard_normal((n, enc.dim)).astype(np.float32) for n in (n_points, n_labels))
        trainer = EndToEndTrainer(pe, le, le.copy(), Y, np.arange(n_points), q, CPU, encoder=enc, point_tokens=pt,
                                  label_tokens=lt, dtype=dtype)
    return trainer, trainer.epoch_batches(0)[:c["steps"]]


def case_strategy(c: dict[str, Any]) -> dict[str, Any]:
    """Peak RSS of the first steps of a strategy's trainer; a refused step reports the memory check's error."""
    t0 = time.perf_counter()
    try:
        trainer, batches = strategy_trainer(c)
    except XCConfigError as exc:
        return {**c, "refused": str(exc), "peak_rss_gib": proc_status("VmHWM") / GIB}
    ready_rss, seconds = proc_status("VmRSS"), []
    for batch in batches:
        t = time.perf_counter()
        trainer.step(batch)
        seconds.append(time.perf_counter() - t)
    if hasattr(trainer, "close"):
        trainer.close()
    return {**c, "plan": trainer.memory.summary(), "ready_rss_gib": ready_rss / GIB,
            "peak_rss_gib": proc_status("VmHWM") / GIB, "step_seconds": seconds,
            "total_seconds": time.perf_counter() - t0}


CASES = {"probe": case_probe, "overhead": case_overhead, "strategy": case_strategy}


def run_child(kind: str, case: dict[str, Any]) -> dict[str, Any]:
    """Run one case in a fresh interpreter; its JSON result (or its error)."""
    proc = subprocess.run([sys.executable, __file__, "_case", kind, json.dumps(case)], capture_output=True,
                          text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        return {**case, "error": f"exit {proc.returncode}: {proc.stderr.strip()[-600:]}"}
    return json.loads(lines[-1])


def calibrate_cases() -> list[dict[str, Any]]:
    """16 texts: every shape at 64 and 256 tokens, MiniLM's at 32..256, in both precisions; linearity in the
    texts on MiniLM's shape: 4 and 48 texts (fp32), 48 texts at 256 tokens (bf16)."""
    cases = []
    for dt in ("fp32", "bf16"):
        for h, layers, heads, inter in SHAPES:
            for T in ((32, 64, 128, 256) if h == 384 else (64, 256)):
                cases.append({"h": h, "layers": layers, "heads": heads, "inter": inter, "tokens": T, "texts": 16,
                              "dtype": dt})
    minilm = {"h": 384, "layers": 6, "heads": 12, "inter": 1536}
    cases += [{**minilm, "tokens": T, "texts": n, "dtype": "fp32"} for T in (64, 256) for n in (48, 4)]
    return cases + [{**minilm, "tokens": 256, "texts": 48, "dtype": "bf16"}]


def fit(rows: list[dict[str, Any]]) -> dict[str, list[float]]:
    """Per precision: the (T h, T i, heads T^2, T h outside the layers, fixed) coefficients, relative errors."""
    out = {}
    for dt in ("fp32", "bf16"):
        rs = [r for r in rows if r.get("dtype") == dt and "peak_over_base" in r]
        if not rs:
            continue
        X = np.array([[r["texts"] * r["layers"] * r["tokens"] * r["h"], r["texts"] * r["layers"] * r["tokens"]
                       * r["inter"], r["texts"] * r["layers"] * r["heads"] * r["tokens"] ** 2,
                       r["texts"] * r["tokens"] * r["h"], 1.0] for r in rs])
        y = np.array([r["peak_over_base"] for r in rs], dtype=float)
        coef, _ = nnls(X / y[:, None], np.ones(len(y)))
        ratio = y / (X @ coef)
        for r, q in zip(rs, ratio):
            r["measured_over_fit"] = round(float(q), 3)
        out[dt] = [round(float(v), 2) for v in coef] + [round(float(ratio.max()), 3)]
    return out


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "_case":
        print(json.dumps(CASES[sys.argv[2]](json.loads(sys.argv[3]))), flush=True)
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("part", choices=["calibrate", "overhead", "strategies"])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--max-lens", type=int, nargs="+", default=[128, 256])
    ap.add_argument("--strategies", nargs="+", default=list(PAPER_BATCH))
    ap.add_argument("--grad-cache", nargs="+", default=["auto"], help="modes to run per strategy case")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=0, help="0 = each strategy's paper batch")
    args = ap.parse_args()
    if args.part == "calibrate":
        cases = [("probe", c) for c in calibrate_cases()]
    elif args.part == "overhead":
        cases = [("overhead", {"encoder": enc, "tokens": T, "batch_size": B, "steps": 6, "lr": lr})
                 for enc, lr in (("minilm-random", 2e-4), ("bag", 0.01)) for T, B in ((32, 256), (128, 64))]
    else:
        cases = [("strategy", {"strategy": s, "max_len": T, "grad_cache": mode, "steps": args.steps,
                               "batch_size": args.batch_size or PAPER_BATCH[s], "points": 16384, "labels": 8192})
                 for T in args.max_lens for s in args.strategies for mode in args.grad_cache]
    rows = []
    with args.out.open("a") as f:
        for kind, case in cases:
            row = run_child(kind, case)
            row["available_gib"] = (available_memory(CPU) or 0) / GIB
            rows.append(row)
            f.write(json.dumps(row) + "\n")
            f.flush()
            print(json.dumps({k: v for k, v in row.items() if k not in ("times",)}), flush=True)
    if args.part == "calibrate":
        print(json.dumps({"fit": fit(rows)}))


if __name__ == "__main__":
    main()
