"""Data-parallel Siamese pretraining: points/s with 1 and N processes, and the communication of one step.

  python bench/ddp_bench.py --threads 2 --out bench/results/ddp_cpu_1proc.json              # one process
  torchrun --standalone --nproc_per_node 2 bench/ddp_bench.py --threads 1 \
      --out bench/results/ddp_cpu_2proc.json                                                # 2 gloo ranks
  torchrun --standalone --nproc_per_node 1 bench/ddp_bench.py --encoder minilm --device cuda \
      --out bench/results/ddp_gpu_1proc.json                                                # one process per GPU

The trainer is the pipeline's (``train_siamese`` with a ``DistEnv``, xc_dagster/training/data_parallel.py) on random
token ids of ``--seq-len`` tokens: the same global batch for every world size, so points/s compare directly.
Points/s is the median of the trainer's own windowed rate (``pretrain_points_per_s``, rank 0) after the first
window. The communication of one step is timed apart, after training, with the tensors a step moves: the all-gather
of the batch's point and label embeddings (``gather_with_grad``) and the all-reduce of the flat gradient
(``average_gradients``), each synchronised and repeated ``--comm-reps`` times (median).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import time
from pathlib import Path

import numpy as np
import scipy.sparse as sp
import torch
import torch.distributed as dist

from xc_dagster.config import PretrainParams
from xc_dagster.device import amp_dtype
from xc_dagster.encoders.loading import load_encoder
from xc_dagster.training.distributed import DistEnv
from xc_dagster.training.siamese import train_siamese

VOCAB = 30_522  # MiniLM's tokenizer: the bag encoder and MiniLM read the same ids


def _data(n: int, n_labels: int, seq_len: int, seed: int = 0):
    rng = np.random.default_rng(seed)

    def tokens(k: int) -> tuple[np.ndarray, np.ndarray]:
        ids = rng.integers(1000, VOCAB, (k, seq_len)).astype(np.int32)
        ids[:, 0] = 101  # [CLS]
        return ids, np.full(k, seq_len, np.int32)

    rows = np.repeat(np.arange(n), 2)
    Y = sp.csr_matrix((np.ones(2 * n, np.float32), (rows, rng.integers(0, n_labels, 2 * n))), shape=(n, n_labels))
    Y.sum_duplicates()
    return tokens(n), tokens(n_labels), Y


def timed(fn, env: DistEnv, reps: int) -> float:
    """Median seconds of ``fn`` over ``reps`` runs after one warm-up, every rank in step."""
    times = []
    for i in range(reps + 1):
        env.barrier()
        if env.device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if env.device.type == "cuda":
            torch.cuda.synchronize()
        if i:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _comm(encoder: torch.nn.Module, env: DistEnv, batch: int, dim: int, reps: int) -> dict:
    """Seconds of one step's collectives at this world size (0 with one process: nothing is exchanged)."""
    if not env.active:
        return {"gather_embeddings_ms": 0.0, "all_reduce_gradient_ms": 0.0, "gradient_mb": 0.0}
    n_grad = sum(p.numel() for p in encoder.parameters() if p.requires_grad)
    flat = torch.ones(n_grad, device=env.device)
    part = torch.ones(-(-2 * batch // env.world_size), dim, device=env.device)  # points + labels, this rank's rows
    out = [torch.empty_like(part) for _ in range(env.world_size)]
    return {"gather_embeddings_ms": 1e3 * timed(lambda: dist.all_gather(out, part), env, reps),
            "all_reduce_gradient_ms": 1e3 * timed(lambda: dist.all_reduce(flat), env, reps),
            "gradient_mb": n_grad * 4 / 2**20}


def write_result(result: dict, out: Path | None) -> None:
    """Print ``result`` (with the machine) as JSON and write it to ``out``."""
    result["machine"] = f"{platform.machine()} {platform.processor()}".strip()
    print(json.dumps(result, indent=2))
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--encoder", default="bag", help="bag | minilm | a model folder (load_encoder's names)")
    ap.add_argument("--device", default=None, help="cpu | cuda (default: cuda:LOCAL_RANK when there is a GPU)")
    ap.add_argument("--points", type=int, default=8192)
    ap.add_argument("--labels", type=int, default=4096)
    ap.add_argument("--seq-len", type=int, default=32)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--threads", type=int, default=0, help="torch threads per process (0: torch's default)")
    ap.add_argument("--amp", default="auto")
    ap.add_argument("--comm-reps", type=int, default=20)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    env = DistEnv.from_env(device=args.device).init(timeout_s=300)
    try:
        torch.manual_seed(0)
        encoder = load_encoder(args.encoder).to(env.device)
        pt, lt, Y = _data(args.points, args.labels, args.seq_len)
        params = dataclasses.replace(PretrainParams(), batch_size=args.batch_size, amp=args.amp, warmup_steps=2,
                                     epochs=args.steps * args.batch_size / args.points, seed_bank=False)
        rates: list[float] = []

        def log(step: int, values: dict[str, float]) -> None:
            if "pretrain_points_per_s" in values:
                rates.append(values["pretrain_points_per_s"])

        if env.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        res = train_siamese(encoder, pt, lt, Y, np.arange(args.points), params, env.device,
                            amp_dtype(env.device, args.amp), log_metrics=log, log_every=4, env=env)
        comm = _comm(encoder, env, args.batch_size, int(encoder.dim), args.comm_reps)
        if env.is_main:
            step_s = args.batch_size / statistics.median(rates[1:] or rates)
            result = {
                "world_size": env.world_size, "backend": env.backend if env.active else None,
                "device": torch.cuda.get_device_name() if env.device.type == "cuda" else "cpu",
                "threads_per_process": torch.get_num_threads(), "encoder": args.encoder, "points": args.points,
                "labels": args.labels, "seq_len": args.seq_len, "global_batch": args.batch_size,
                "amp": str(amp_dtype(env.device, args.amp)), "steps": res.steps,
                "points_per_s": round(args.batch_size / step_s, 1), "step_ms": round(1e3 * step_s, 2),
                "windows_points_per_s": [round(r, 1) for r in rates],
                "comm_ms_per_step": round(comm["gather_embeddings_ms"] + comm["all_reduce_gradient_ms"], 3),
                **{k: round(v, 3) for k, v in comm.items()},
                "gpu_peak_gb": (round(torch.cuda.max_memory_allocated() / 2**30, 2)
                                if env.device.type == "cuda" else None),
            }
            write_result(result, args.out)
    finally:
        env.close()


if __name__ == "__main__":
    main()
