"""The classifier stage's trainer with W's label ranges over 1 or N processes: points/s, the rows each rank holds and
the communication of one step.

  python bench/label_sharded_bench.py --threads 2 --out bench/results/label_sharded_1proc.json
  torchrun --standalone --nproc_per_node 2 bench/label_sharded_bench.py --threads 1 \
      --out bench/results/label_sharded_2proc.json

``train_classifiers`` (hardest negatives from a shortlist, SparseAdam, the stage's defaults otherwise) on random
unit embeddings: ``--points`` x ``--dim`` points with 1-4 random labels each among ``--labels``, a random
``--shortlist``-wide shortlist per point. Points/s = points trained / the trainer's seconds. The communication of a
step is timed apart, with the tensors a step moves: two all-reduces of the (batch, positives + negatives) scores
(the hardest negatives' choice and the loss), synchronised and repeated ``--comm-reps`` times (median).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import scipy.sparse as sp
import torch
import torch.distributed as dist

from xc_dagster.config import ClassifierParams
from xc_dagster.training.classifier import train_classifiers
from xc_dagster.training.distributed import DistEnv, label_range

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, for bench.ddp_bench
from bench.ddp_bench import timed, write_result  # noqa: E402


def _data(n: int, n_labels: int, dim: int, width: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((n, dim), dtype=np.float32)
    X /= np.linalg.norm(X, axis=1, keepdims=True)
    E = rng.standard_normal((n_labels, dim), dtype=np.float32)
    E /= np.linalg.norm(E, axis=1, keepdims=True)
    counts = rng.integers(1, 5, n)
    rows = np.repeat(np.arange(n), counts)
    Y = sp.csr_matrix((np.ones(len(rows), np.float32), (rows, rng.integers(0, n_labels, len(rows)))),
                      shape=(n, n_labels))
    Y.sum_duplicates()
    return X, E, Y, rng.integers(0, n_labels, (n, width))


def _comm_ms(env: DistEnv, batch: int, width: int, reps: int) -> float:
    """Milliseconds of one step's two score all-reduces (0 with one process)."""
    if not env.active:
        return 0.0
    scores = torch.ones(batch, width)
    return 1e3 * timed(lambda: (dist.all_reduce(scores), dist.all_reduce(scores)), env, reps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--points", type=int, default=65_536)
    ap.add_argument("--labels", type=int, default=131_072)
    ap.add_argument("--dim", type=int, default=384)
    ap.add_argument("--shortlist", type=int, default=100)
    ap.add_argument("--batch-size", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=0, help="torch threads per process (0: torch's default)")
    ap.add_argument("--comm-reps", type=int, default=20)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    env = DistEnv.from_env(device="cpu").init(timeout_s=300)
    try:
        X, E, Y, sl = _data(args.points, args.labels, args.dim, args.shortlist)
        params = ClassifierParams(epochs=1, batch_size=args.batch_size)
        _, summary = train_classifiers(X, E, Y, sl, np.arange(args.points), params, torch.device("cpu"), env=env)
        width = params.num_positives + params.num_negatives
        comm = _comm_ms(env, args.batch_size, width, args.comm_reps)
        if env.is_main:
            lo, hi = label_range(args.labels, env.rank, env.world_size)
            result = {
                "world_size": env.world_size, "threads_per_process": torch.get_num_threads(),
                "points": args.points, "labels": args.labels, "dim": args.dim, "shortlist": args.shortlist,
                "batch": args.batch_size, "steps": summary["steps"], "train_seconds": round(summary["seconds"], 2),
                "points_per_s": round(args.points / summary["seconds"], 1),
                "step_ms": round(1e3 * summary["seconds"] / summary["steps"], 2),
                "comm_ms_per_step": round(comm, 3),
                "w_and_adam_mb_per_rank": round(3 * (hi - lo) * args.dim * 4 / 2**20, 1),
            }
            write_result(result, args.out)
    finally:
        env.close()


if __name__ == "__main__":
    main()
