"""Classifier step time and peak memory against the number of labels L: ASTRA, MIPS-s, full softmax (issue 6).

Requirement (issue 6, item 3): "Memory and time do not grow with L: the classifier forward and backward touch
only B x (positives + negatives) rows of W. Measure peak memory and time per step at L = 131K and L = 1M generated
labels, and against a full-softmax (all labels) step at the same sizes: ASTRA's step must stay about flat in L."

  python bench/classifier_scaling.py [--labels 16384 131072 1000000] [--methods astra mips full]
      [--dim 384] [--batch-size 128] [--queries 4096] [--steps 20] [--warmup 3] [--max-timed-seconds 60]
      [--hnsw-ef-construction 40] [--out bench/results/classifier_scaling.json]
  python bench/classifier_scaling.py --labels 2048 --steps 2 --out /tmp/smoke.json    # smoke

Generated data (seeded): W = L random unit rows of dimension D, a bank of ``--queries`` random unit query
embeddings, each query with k_p = 7 random positive labels. The encoder is left out: its cost per step depends on
the batch and the text length, not on L, and the issue is about the classifier. One step = what
``xc_dagster.training.end_to_end.train_end_to_end`` does per batch with ``train_encoder`` off, calling the same library
functions in the same order (``sampler.before_step``, ``sample_positives``, ``sampler.sample``,
``ShardedClassifier.scores``, ``masked_bce_loss``, backward, ``ShardedOptimizer.step``, ``float(loss)``):

- ``astra``: k_p = 7 positives, k_h = 50 hard negatives looked up in a per-query table, k_r = 400 uniform draws
  with weight L / k_r (``AstraNegatives``), SGD (lr 0.05, weight decay 1e-4, ASTRA Table 11) on the touched rows,
  dropout 0.85 on the query. The table comes from one refresh, timed separately and not part of the step (ASTRA
  builds it in the background every tau_r epochs): ``ShardedClassifier.snapshot`` + ``IndexSettings.build``
  (faiss HNSW, M 32, efConstruction ``--hnsw-ef-construction``, efSearch 100) + ``hard_negatives`` over all
  queries, handed to ``AstraNegatives`` as its initial table (the path ``train_end_to_end`` takes with a shortlist).
- ``mips``: ``MipsNegatives`` with k = 5 IVF negatives (faiss IVF-Flat inner product, round(sqrt(L)) partitions,
  nprobe 64, built once in the setup = one refresh, timed) + 95 uniform, unweighted; the per-step IVF search of the
  fresh query embeddings is inside the step (``sampler.sample``), as in MIPS-s. Same SGD.
- ``full``: the O(L) Renee-style baseline: W a dense torch Parameter, logits = x W^T over all L labels, BCE over
  all L (sum per row, mean over rows: the ``masked_bce_loss`` maths with every label valid, unit weights),
  backward (dense L x D gradient), ``torch.optim.SGD`` (same lr and weight decay) on all of W.

Each (method, L) runs in a fresh subprocess with one thread (torch, faiss, BLAS). Setup RSS: VmRSS after the
setup (W allocated, table / index built, everything temporary freed and ``malloc_trim``-ed). Then the warm-up
steps run; then freed heap is trimmed again, the kernel's peak counter is reset (``5`` > /proc/self/clear_refs
resets VmHWM; checked at start-up) and VmRSS is read; the timed steps run and VmHWM is read: step peak extra =
VmHWM - VmRSS before the timed steps. The reset comes after the warm-ups because the first step faults in
~250 MB of library code and lazily initialised kernels (file-backed pages count in RSS) whatever L is; that
first-step figure is kept as ``warmup_peak_extra_mb`` (peak over setup RSS during the warm-ups). Step
times: median and p90 of the timed steps (perf_counter around the whole step), with the parts (sample / forward +
loss / backward / update) alongside. When a warm-up step is slow (full softmax at 1M) the timed steps are capped
so that they take about ``--max-timed-seconds`` (at least 5); the JSON says how many ran.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

for _v in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ.setdefault(_v, "1")

import faiss  # noqa: E402
import numpy as np  # noqa: E402
import scipy.sparse as sp  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from xc_dagster.config import ClassifierParams  # noqa: E402
from xc_dagster.sampling.labels import sample_positives  # noqa: E402
from xc_dagster.sampling.negatives import AstraNegatives, MipsNegatives  # noqa: E402
from xc_dagster.sampling.stale_index import IndexSettings, extra_neighbours, hard_negatives  # noqa: E402
from xc_dagster.training.end_to_end import sampled_bce  # noqa: E402
from xc_dagster.training.schedules import cosine_with_warmup  # noqa: E402
from xc_dagster.training.sharded import ShardedClassifier, ShardedOptimizer  # noqa: E402

pc = time.perf_counter
CPU = torch.device("cpu")
K_P, K_H, K_R = 7, 50, 400  # ASTRA Table 11
MIPS_K, MIPS_R = 5, 100  # MIPS-s: k MIPS negatives of R
LR, WD, DROPOUT = 0.05, 1e-4, 0.85  # ASTRA Table 11 (classifier SGD)
STEP_PARAMS = ClassifierParams(dropout=DROPOUT, normalize=False, scale=1.0)
TAU_R_EPOCHS = 5  # ASTRA: refresh every 5 epochs
MIPS_REFRESH_PER_EPOCH = 8  # MIPS-s: P = 8 refreshes per epoch
NEVER = 10 ** 9


# ------------------------------------------------------------------------------------------- memory

def proc_status_kb(key: str) -> int:
    with open("/proc/self/status") as fh:
        m = re.search(rf"^{key}:\s+(\d+) kB", fh.read(), re.M)
    return int(m.group(1)) if m else -1


def reset_peak() -> bool:
    """Reset VmHWM to the current RSS; True when the kernel did it (checked by allocating and freeing 64 MB)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.malloc_trim(0)  # give freed heap back, so that the steps cannot reuse setup garbage unseen
    except OSError:
        pass
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
    except OSError:
        return False
    return proc_status_kb("VmHWM") <= proc_status_kb("VmRSS") + 1024


def check_reset() -> dict[str, Any]:
    """Does clear_refs 5 reset VmHWM on this kernel? Allocate 256 MB, free, reset, allocate 64 MB, free."""
    a = np.ones(256 * 2 ** 20 // 8)
    del a
    before = proc_status_kb("VmHWM")
    ok = reset_peak()
    base = proc_status_kb("VmRSS")
    b = np.ones(64 * 2 ** 20 // 8)
    del b
    peak = proc_status_kb("VmHWM")
    return {"hwm_before_reset_kb": before, "reset_ok": ok, "rss_kb": base, "hwm_after_64mb_kb": peak,
            "works": bool(ok and 60 * 1024 <= peak - base <= 80 * 1024)}


# --------------------------------------------------------------------------------------------- data

def unit_rows(rng: np.random.Generator, n: int, d: int, block: int = 1 << 16) -> np.ndarray:
    out = np.empty((n, d), dtype=np.float32)
    for s in range(0, n, block):
        x = rng.standard_normal((min(block, n - s), d), dtype=np.float32)
        x /= np.linalg.norm(x, axis=1, keepdims=True)
        out[s:s + len(x)] = x
    return out


def random_positives(rng: np.random.Generator, n: int, L: int, k: int) -> sp.csr_matrix:
    """n rows with k distinct random labels each."""
    cols = np.empty((n, k), dtype=np.int64)
    for i in range(n):  # n is small (the query bank); distinct labels per row
        cols[i] = rng.choice(L, size=k, replace=False) if L < 10 * k else np.unique(rng.integers(0, L, 2 * k))[:k]
    cols.sort(axis=1)
    Y = sp.csr_matrix((np.ones(n * k, np.float32), cols.ravel(), np.arange(0, n * k + 1, k)), shape=(n, L))
    Y.sort_indices()
    return Y


# ------------------------------------------------------------------------------------------- worker

# a method's step on a batch at a step number: (sample, forward + loss, backward, update) seconds, rows of W
# touched, loss value
StepFn = Callable[[np.ndarray, int, np.random.Generator], tuple[tuple[float, float, float, float], int, float]]
PARTS = ("sample", "forward_loss", "backward", "update")


def sampled_step(clf: ShardedClassifier, sampler: AstraNegatives | MipsNegatives, bank: np.ndarray,
                 Y: sp.csr_matrix) -> StepFn:
    """The step of train_end_to_end (train_encoder off): the same calls in the same order."""
    w_opt = ShardedOptimizer(clf, "sgd", LR, WD)
    sched_f = cosine_with_warmup(0, NEVER)  # factor ~1 over the measured steps (a cosine schedule, as trained)

    def step(batch: np.ndarray, step: int, rng: np.random.Generator):
        ta = pc()
        sampler.before_step(step, clf.snapshot)
        pos = sample_positives(Y, batch, K_P, rng)
        x = torch.from_numpy(bank[batch]).to(CPU)
        x_np = x.detach().float().cpu().numpy()
        neg = sampler.sample(batch, x_np, step, rng)
        tb = pc()
        loss = sampled_bce(clf, x, pos, neg, STEP_PARAMS)  # scale 1, no bias (ASTRA: plain w.x)
        tc = pc()
        loss.backward()
        td = pc()
        rows = sum(int(r.numel()) for _, r, _ in clf._leaves)
        w_opt.step(sched_f(step))
        last = float(loss.detach())
        return (tb - ta, tc - tb, td - tc, pc() - td), rows, last
    return step


def setup_astra(data: dict[str, Any], args: argparse.Namespace, res: dict[str, Any]) -> tuple[StepFn, Any]:
    """ASTRA's classifiers and sampler, its table from one refresh (timed: snapshot, HNSW build, search)."""
    clf = ShardedClassifier(data.pop("W0"), [CPU])  # W0 is freed: one copy of W
    bank, Y, n, L = data["bank"], data["Y"], len(data["bank"]), clf.num_labels
    idx = IndexSettings("hnsw", m=32, ef_construction=args.hnsw_ef_construction, ef_search=100, seed=args.seed)
    t1 = pc()
    snap = clf.snapshot()  # what AstraNegatives._build gets from snapshot_fn()
    t2 = pc()
    indexes = idx.build(snap)
    t3 = pc()
    table = hard_negatives(indexes, bank, Y, np.arange(n), K_H, extra_neighbours(Y))
    t4 = pc()
    del indexes, snap
    N = args.examples_per_label * L  # training examples of a real dataset of this L (points + label texts)
    build_s, search_q_ms = (t2 - t1) + (t3 - t2), (t4 - t3) / n * 1e3
    res["refresh"] = {
        "index": f"faiss HNSW M 32 efConstruction {args.hnsw_ef_construction} efSearch 100",
        "snapshot_s": t2 - t1, "build_s": t3 - t2, "search_s": t4 - t3, "search_queries": n,
        "search_ms_per_query": search_q_ms, "k_searched": K_H + extra_neighbours(Y),
        "table_filled_fraction": float((table >= 0).mean()),
        "assumed_examples": N, "tau_r_epochs": TAU_R_EPOCHS,
        "refresh_s_for_assumed_examples": build_s + search_q_ms * N / 1e3,
        # per step: (snapshot + build + search of all N queries) / (tau_r * N / B steps)
        "amortised_ms_per_step": (build_s * 1e3 + search_q_ms * N) / (TAU_R_EPOCHS * N / args.batch_size)}
    sampler = AstraNegatives(Y, bank, K_H, K_R, start_step=0, refresh_steps=NEVER, lead_steps=0, index=idx,
                             asynchronous=False, initial_table=table, total_steps=args.warmup + args.steps)
    return sampled_step(clf, sampler, bank, Y), sampler


def setup_mips(data: dict[str, Any], args: argparse.Namespace, res: dict[str, Any]) -> tuple[StepFn, Any]:
    """MIPS-s's classifiers and sampler, its IVF index built at step 0 (= one refresh, timed)."""
    clf = ShardedClassifier(data.pop("W0"), [CPU])  # W0 is freed: one copy of W
    sampler = MipsNegatives(data["Y"], MIPS_K, MIPS_R, NEVER, IndexSettings("ivf", nlist=0, nprobe=64, seed=args.seed))
    t1 = pc()
    sampler.before_step(0, clf.snapshot)  # step 0: snapshot + IVF build (= one refresh)
    build = pc() - t1
    spe = args.examples_per_label * clf.num_labels / args.batch_size
    res["refresh"] = {"index": f"faiss IVF-Flat IP nlist {sampler.indexes[0][1]._index.nlist} nprobe 64",
                      "build_s": build, "refreshes_per_epoch": MIPS_REFRESH_PER_EPOCH,
                      "amortised_ms_per_step": build * 1e3 * MIPS_REFRESH_PER_EPOCH / spe}
    return sampled_step(clf, sampler, data["bank"], data["Y"]), sampler


def setup_full(data: dict[str, Any], args: argparse.Namespace, res: dict[str, Any]) -> tuple[StepFn, Any]:
    """The O(L) baseline: every label scored, dense gradient and update."""
    W = torch.nn.Parameter(torch.from_numpy(data.pop("W0")))  # shares W0's memory: one copy of W
    opt = torch.optim.SGD([W], lr=LR, weight_decay=WD)
    bank, Y, L = data["bank"], data["Y"], W.shape[0]

    def step(batch: np.ndarray, step: int, rng: np.random.Generator):
        ta = pc()
        pos = sample_positives(Y, batch, K_P, rng)
        xd = F.dropout(torch.from_numpy(bank[batch]).float(), DROPOUT, training=True)
        target = torch.zeros(len(batch), L)
        p = torch.from_numpy(pos)
        target.scatter_(1, p.clamp_min(0), (p >= 0).float())
        tb = pc()
        logits = xd @ W.T
        loss = F.binary_cross_entropy_with_logits(logits, target, reduction="sum") / len(batch)
        tc = pc()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        td = pc()
        opt.step()
        last = float(loss.detach())
        del logits, target
        return (tb - ta, tc - tb, td - tc, pc() - td), L, last
    return step, None


SETUPS = {"astra": setup_astra, "mips": setup_mips, "full": setup_full}


def timed_steps(step_fn: StepFn, n: int, rng: np.random.Generator, args: argparse.Namespace,
                res: dict[str, Any]) -> np.ndarray:
    """The warm-up steps, then the timed ones (capped near --max-timed-seconds) with the peak counter reset in
    between; times, memory and rows touched go to ``res``. Returns the last permutation of the queries."""
    reset_peak()
    rss_setup = proc_status_kb("VmRSS")
    res["setup_rss_mb"] = rss_setup / 1024
    parts: dict[str, list[float]] = {k: [] for k in PARTS}
    totals, touched, losses = [], [], []
    perm, B, n_timed, rss0 = rng.permutation(n), args.batch_size, args.steps, -1
    step, i = 1, 0  # mips built its index at step 0 in the setup
    while i < args.warmup + n_timed:
        batch = perm[(i * B) % n:(i * B) % n + B]
        if len(batch) < B:
            perm = rng.permutation(n)
            batch = perm[:B]
        if i == args.warmup:  # steady state: peak counter reset after the warm-ups (first-call costs apart)
            res["warmup_peak_extra_mb"] = (proc_status_kb("VmHWM") - rss_setup) / 1024
            res["peak_reset_ok"] = reset_peak()
            rss0 = proc_status_kb("VmRSS")
            res["rss_before_timed_mb"] = rss0 / 1024
        times, rows, last = step_fn(batch, step, rng)
        if i == 0 and args.max_timed_seconds > 0:  # slow steps (full softmax at 1M): cap the timed steps
            n_timed = max(min(args.steps, 5), min(args.steps, int(args.max_timed_seconds / sum(times))))
        if i >= args.warmup:
            totals.append(sum(times))
            for k, v in zip(parts, times):
                parts[k].append(v * 1e3)
            touched.append(rows)
            losses.append(last)
        step += 1
        i += 1
    hwm = proc_status_kb("VmHWM")
    ms = np.array(totals) * 1e3
    res.update({"timed_steps": len(totals), "warmup_steps": args.warmup, "step_ms_median": float(np.median(ms)),
                "step_ms_p90": float(np.percentile(ms, 90)), "step_ms_all": [round(float(v), 3) for v in ms],
                "parts_ms_median": {k: float(np.median(v)) for k, v in parts.items()},
                "step_peak_extra_mb": (hwm - rss0) / 1024, "step_peak_rss_mb": hwm / 1024,
                # peak of the timed steps over the setup state: counts buffers that live from step to step (the
                # full softmax's dense L x D gradient, allocated in the first step and held until the next
                # zero_grad), which the extra above, taken against the RSS after the warm-ups, does not
                "step_peak_over_setup_mb": (hwm - rss_setup) / 1024,
                "rows_touched_mean": float(np.mean(touched)), "loss_last": losses[-1]})
    return perm


def run_worker(method: str, L: int, args: argparse.Namespace) -> dict[str, Any]:
    """One (method, L) measurement, in its own process: generate, set up (timed), step (timed)."""
    torch.set_num_threads(1)
    faiss.omp_set_num_threads(1)
    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    n, D, B = args.queries, args.dim, args.batch_size
    res: dict[str, Any] = {"method": method, "labels": L, "dim": D, "batch_size": B, "queries": n,
                           "torch_threads": torch.get_num_threads(), "load_avg_start": list(os.getloadavg())}
    t0 = pc()
    data = {"W0": unit_rows(rng, L, D), "bank": unit_rows(rng, n, D)}
    data["Y"] = random_positives(rng, n, L, K_P)
    res["generate_s"] = pc() - t0
    t0 = pc()
    step_fn, sampler = SETUPS[method](data, args, res)
    res["setup_s"] = pc() - t0
    res["setup_peak_rss_mb"] = proc_status_kb("VmHWM") / 1024
    res["W_mb"] = L * D * 4 / 2 ** 20
    perm = timed_steps(step_fn, n, rng, args, res)
    res["rows_scored_per_step"] = {"astra": B * (K_P + K_H + K_R), "mips": B * (K_P + MIPS_R), "full": B * L}[method]
    if method == "mips":  # the per-step IVF search alone (outside the measured steps), same call as sample()
        qs = []
        for j in range(10):
            b = perm[(j * B) % n:(j * B) % n + B]
            t = pc()
            hard_negatives(sampler.indexes, np.ascontiguousarray(data["bank"][b]), data["Y"], b, MIPS_K,
                           extra_neighbours(data["Y"]))
            qs.append((pc() - t) * 1e3)
        res["mips_search_ms_per_batch_median"] = float(np.median(qs))
    res["load_avg_end"] = list(os.getloadavg())
    if sampler is not None:
        sampler.close()
    return res


# --------------------------------------------------------------------------------------------- main

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--labels", type=int, nargs="+", default=[16384, 131072, 1000000])
    ap.add_argument("--methods", nargs="+", default=["astra", "mips", "full"], choices=["astra", "mips", "full"])
    ap.add_argument("--dim", type=int, default=384)
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--queries", type=int, default=4096, help="query bank (the per-query table covers these)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--max-timed-seconds", type=float, default=60.0)
    ap.add_argument("--hnsw-ef-construction", type=int, default=40)
    ap.add_argument("--examples-per-label", type=float, default=3.0,
                    help="training examples N = this x L for the amortised refresh cost (LF-AmazonTitles-131K: "
                         "(294,805 points + 131,073 label texts) / 131,073 = 3.25; -1.3M: 2.72)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("bench/results/classifier_scaling.json"))
    ap.add_argument("--worker", nargs=2, metavar=("METHOD", "L"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print("RESULT " + json.dumps(run_worker(args.worker[0], int(args.worker[1]), args)), flush=True)
        return

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    # here, not at the top: it imports the transformer stack, which the workers (whose memory is measured) skip
    from pretrain_overhead import machine_info  # one machine description for every bench

    torch.set_num_threads(1)
    result: dict[str, Any] = {"machine": machine_info(), "command": "python " + " ".join(sys.argv),
                              "clear_refs_check": check_reset(), "load_avg_start": list(os.getloadavg()),
                              "settings": {"k_p": K_P, "k_h": K_H, "k_r": K_R, "mips_k": MIPS_K, "mips_R": MIPS_R,
                                           "lr": LR, "weight_decay": WD, "dropout": DROPOUT,
                                           "tau_r_epochs": TAU_R_EPOCHS,
                                           "mips_refreshes_per_epoch": MIPS_REFRESH_PER_EPOCH},
                              "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()
                                       if k != "worker"},
                              "runs": []}
    print(json.dumps(result["machine"]), json.dumps(result["clear_refs_check"]), flush=True)
    t_all = pc()
    base = [sys.executable, str(Path(__file__).resolve())] + [
        a for a in sys.argv[1:] if a]  # workers get the same options
    for L in args.labels:
        for method in args.methods:
            t = pc()
            out = subprocess.run(base + ["--worker", method, str(L)], capture_output=True, text=True,
                                 cwd=Path(__file__).resolve().parent.parent)
            line = next((s for s in out.stdout.splitlines() if s.startswith("RESULT ")), None)
            if out.returncode != 0 or line is None:
                print(out.stdout[-2000:], out.stderr[-4000:], file=sys.stderr)
                raise SystemExit(f"worker {method} L={L} failed (rc {out.returncode})")
            r = json.loads(line[len("RESULT "):])
            r["wall_s"] = pc() - t
            result["runs"].append(r)
            print(f"{method:5s} L={L:>8d}  step {r['step_ms_median']:9.2f} ms (p90 {r['step_ms_p90']:9.2f}, "
                  f"{r['timed_steps']} steps)  peak extra {r['step_peak_extra_mb']:8.1f} MB  setup RSS "
                  f"{r['setup_rss_mb']:8.1f} MB  rows {r['rows_touched_mean']:.0f}  "
                  f"refresh {r.get('refresh', {}).get('build_s', float('nan')):.1f} s  wall {r['wall_s']:.0f} s",
                  flush=True)
    result["total_s"] = pc() - t_all
    result["load_avg_end"] = list(os.getloadavg())
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out} in {result['total_s']:.0f} s", flush=True)


if __name__ == "__main__":
    main()
