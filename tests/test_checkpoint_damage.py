"""Checkpoints under kills and damage: a trainer SIGKILLed inside a checkpoint write resumes from the last whole
one to the uninterrupted result; a truncated or bit-flipped ``state.pt`` is logged by name, moved aside and
training starts over instead of failing every rerun (issue 27, item 7)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import scipy.sparse as sp
import torch

from tests.tinydata import kill_at_marker
from xc_dagster.config import ClassifierParams
from xc_dagster.training.checkpoint import CORRUPT, STATE, Checkpointer, fingerprint
from xc_dagster.training.classifier import train_classifiers

ROOT = Path(__file__).resolve().parent.parent
PARAMS = ClassifierParams(epochs=4, batch_size=32, lr=0.02, num_negatives=4, negatives="both", cluster_size=8,
                          num_positives=2)
# the child trains with checkpoints; in the third checkpoint write, after its first 4 KiB, it signals and hangs
CHILD = """
import sys, time
import torch
from tests.test_checkpoint_damage import PARAMS, problem, checkpointer
from xc_dagster.training.classifier import train_classifiers

real_save, calls = torch.save, []


class HangMidWrite:
    def __init__(self, f):
        self.f, self.n = f, 0

    def write(self, b):
        n = self.f.write(b)
        self.n += len(b)
        if self.n >= 4096:
            self.f.flush()
            print("mid-write", flush=True)
            time.sleep(600)
        return n

    def flush(self):
        self.f.flush()


def save(obj, f, *args, **kwargs):
    calls.append(obj["epoch"])
    if len(calls) < 3:
        return real_save(obj, f, *args, **kwargs)
    if not hasattr(f, "write"):  # given a path: open it as torch.save would
        f = open(f, "wb")
    return real_save(obj, HangMidWrite(f), *args, **kwargs)


torch.save = save
X, E, Y, sl, rows = problem()
train_classifiers(X, E, Y, sl, rows, PARAMS, torch.device("cpu"), checkpoint=checkpointer(sys.argv[1]))
"""


def problem(n: int = 160, L: int = 16, D: int = 16):
    """A small planted classification problem (points near their label's direction), the same in every process."""
    g = np.random.default_rng(0)
    mu = g.standard_normal((L, D)).astype(np.float32)
    y = g.integers(0, L, n)
    X = (mu[y] + 0.3 * g.standard_normal((n, D))).astype(np.float32)
    E = (mu + 0.9 * g.standard_normal((L, D))).astype(np.float32)
    Y = sp.csr_matrix((np.ones(n), (np.arange(n), y)), shape=(n, L))
    return X, E, Y, np.argsort(-(X @ E.T), axis=1)[:, :6], np.arange(n)


def checkpointer(folder) -> Checkpointer:
    X, E, _, sl, rows = problem()
    return Checkpointer(Path(folder), fingerprint(PARAMS.__dict__, X, E, sl, rows))


def _train(folder: Path | None):
    X, E, Y, sl, rows = problem()
    return train_classifiers(X, E, Y, sl, rows, PARAMS, torch.device("cpu"),
                             checkpoint=None if folder is None else checkpointer(folder))


def test_a_trainer_killed_inside_a_checkpoint_write_resumes_to_the_uninterrupted_weights(tmp_path):
    W_full, _ = _train(None)
    folder = tmp_path / "ckpt"
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(folder)], cwd=ROOT, stdout=subprocess.PIPE,
                             text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    kill_at_marker(child, "mid-write")
    part = folder / f"{STATE}.tmp"
    assert part.exists() and part.stat().st_size < (folder / STATE).stat().st_size  # killed mid-write
    assert checkpointer(folder).load().epoch == 2  # the last whole checkpoint
    W, summary = _train(folder)
    assert summary["resumed_from_epoch"] == 2
    assert np.array_equal(W, W_full)


def _damaged_run_starts_over(folder: Path, caplog) -> None:
    W_full, _ = _train(None)
    with caplog.at_level(logging.WARNING, logger="xc_dagster"):
        W, summary = _train(folder)
    assert summary["resumed_from_epoch"] == 0 and np.array_equal(W, W_full)
    assert str(folder / STATE) in caplog.text and "damaged" in caplog.text
    assert (folder / CORRUPT).exists()  # kept aside for a look, replaced by the run's own checkpoints
    assert checkpointer(folder).load().epoch == PARAMS.epochs


def test_a_truncated_checkpoint_is_named_moved_aside_and_training_starts_over(tmp_path, caplog):
    folder = tmp_path / "ckpt"
    _train(folder)
    data = (folder / STATE).read_bytes()
    (folder / STATE).write_bytes(data[: len(data) // 2])
    _damaged_run_starts_over(folder, caplog)
    caplog.clear()
    (folder / STATE).write_bytes(b"")  # an empty file too
    _damaged_run_starts_over(folder, caplog)


def test_a_flipped_byte_that_torch_load_reads_silently_is_caught(tmp_path, caplog):
    folder = tmp_path / "ckpt"
    _train(folder)
    data = bytearray((folder / STATE).read_bytes())
    middle = len(data) // 2
    data[middle:middle + 8] = bytes(b ^ 0xFF for b in data[middle:middle + 8])
    (folder / STATE).write_bytes(bytes(data))
    _damaged_run_starts_over(folder, caplog)
