"""Checkpoints under kills and damage: a trainer SIGKILLed inside a checkpoint write resumes from the last whole
one to the uninterrupted result; a truncated or bit-flipped ``state.pt`` is logged by name, moved aside and
training starts over instead of failing every rerun (issue 27, item 7); so is one flipped in the zip's directory or
end records, which no zip CRC covers; one written before the SHA-256 record resumes under the earlier zip check; an
I/O error is raised, not taken for damage; two runs of one stage never tear each other's checkpoint, and a load racing
the other run's saves reads again rather than moving its checkpoint aside."""

from __future__ import annotations

import errno
import json
import logging
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
import scipy.sparse as sp
import torch

from tests.tinydata import kill_at_marker
from xc_dagster.config import ClassifierParams
from xc_dagster.training import checkpoint
from xc_dagster.training.checkpoint import CORRUPT, HASHES, STATE, TMP, Checkpointer, fingerprint
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
    (part,) = folder.glob(f"{TMP}*")
    assert part.stat().st_size < (folder / STATE).stat().st_size  # killed mid-write
    assert checkpointer(folder).load().epoch == 2  # the last whole checkpoint
    W, summary = _train(folder)
    assert summary["resumed_from_epoch"] == 2 and not list(folder.glob(f"{TMP}*"))  # the leftover swept
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


def _small_checkpoint(folder: Path) -> bytes:
    Checkpointer(folder, "k").save(3, {"model": {"w": torch.arange(40.0).reshape(4, 10)}}, np.random.default_rng(0))
    return (folder / STATE).read_bytes()


def test_a_flip_in_the_zip_directory_or_end_records_is_damage(tmp_path):
    """Flips anywhere in the last 400 bytes (central directory, zip64 end records: testzip raised OSError on some,
    and torch.load read others as other weights) are moved aside."""
    good = tmp_path / "good"
    data = _small_checkpoint(good)
    assert Checkpointer(good, "k").load().epoch == 3
    for offset in [*range(len(data) - 400, len(data)), 0, len(data) // 2]:
        folder = tmp_path / f"flip{offset}"
        folder.mkdir()
        (folder / HASHES).write_bytes((good / HASHES).read_bytes())
        (folder / STATE).write_bytes(data[:offset] + bytes([data[offset] ^ 0xFF]) + data[offset + 1:])
        assert Checkpointer(folder, "k").load() is None, offset
        assert (folder / CORRUPT).exists() and not (folder / STATE).exists(), offset


def _zip_check_raises_oserror(path: Path) -> bool:
    try:
        with zipfile.ZipFile(path) as z:  # a file: the seek before its start is an OSError (a ValueError in memory)
            z.testzip()
    except OSError:
        return True
    except Exception:  # BadZipFile and the like: the structure is found broken another way
        return False
    return False


def test_a_checkpoint_of_before_the_hash_record_resumes_and_its_next_save_records_it(tmp_path, caplog):
    """A run interrupted before the upgrade resumes: without a record the earlier check (zip CRCs, torch.load)
    decides, a broken zip structure (the OSError of a damaged end record included) being damage."""
    good = tmp_path / "good"
    data = _small_checkpoint(good)
    (good / HASHES).unlink()
    ckpt = Checkpointer(good, "k")
    assert ckpt.load().epoch == 3 and not (good / CORRUPT).exists()
    ckpt.save(4, {"model": {"w": torch.zeros(4, 10)}}, np.random.default_rng(1))
    assert len(json.loads((good / HASHES).read_text())["sha256"]) == 2  # the new one's and the resumed one's
    assert Checkpointer(good, "k").load().epoch == 4

    middle = len(data) // 2  # inside the tensor's bytes: its member's CRC fails
    damaged = {"truncated": data[: len(data) // 2], "tensor": data[:middle] + b"\xff" * 8 + data[middle + 8:]}
    probe = tmp_path / "probe.pt"
    for offset in range(len(data) - 400, len(data)):
        probe.write_bytes(flipped := data[:offset] + bytes([data[offset] ^ 0xFF]) + data[offset + 1:])
        if _zip_check_raises_oserror(probe):  # a flip in the zip64 end records: zipfile seeks before the start
            damaged[f"end record {offset}"] = flipped
    assert len(damaged) > 2
    for name, content in damaged.items():
        folder = tmp_path / name.replace(" ", "-")
        folder.mkdir()
        (folder / STATE).write_bytes(content)
        with caplog.at_level(logging.WARNING, logger="xc_dagster"):
            assert Checkpointer(folder, "k").load() is None, name
        assert (folder / CORRUPT).exists() and not (folder / STATE).exists(), name
    assert "is damaged" in caplog.text


def test_an_io_error_reading_a_recorded_checkpoint_is_raised_and_the_checkpoint_kept(tmp_path, monkeypatch):
    folder = tmp_path / "ckpt"
    _small_checkpoint(folder)

    def failing_disk(f):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(checkpoint, "read_sha256", failing_disk)
    with pytest.raises(OSError, match="Input/output error"):
        Checkpointer(folder, "k").load()
    monkeypatch.undo()
    assert not (folder / CORRUPT).exists() and Checkpointer(folder, "k").load().epoch == 3


def test_a_save_that_fails_before_its_rename_leaves_the_previous_checkpoint_loadable(tmp_path, monkeypatch):
    folder = tmp_path / "ckpt"
    _small_checkpoint(folder)
    ckpt = Checkpointer(folder, "k")
    assert ckpt.load().epoch == 3
    real = os.replace

    def fail_on_the_checkpoint(src, dst):
        if Path(dst).name == STATE:
            raise OSError("disk gone")
        real(src, dst)

    monkeypatch.setattr(os, "replace", fail_on_the_checkpoint)
    with pytest.raises(OSError, match="disk gone"):
        ckpt.save(4, {"model": {"w": torch.zeros(4, 10)}}, np.random.default_rng(1))
    monkeypatch.undo()
    assert Checkpointer(folder, "k").load().epoch == 3  # the record written before the rename names both


# saves a checkpoint of epoch 1 to argv[1], prints "saved", waits for the file argv[2], saves epochs 2..5
HOLDER = """
import sys, time
from pathlib import Path
import numpy as np, torch
from xc_dagster.training.checkpoint import Checkpointer
c, rng = Checkpointer(Path(sys.argv[1]), "k"), np.random.default_rng(0)
c.save(1, {"w": torch.ones(64, 64)}, rng)
print("saved", flush=True)
while not Path(sys.argv[2]).exists():
    time.sleep(0.01)
for epoch in range(2, 6):
    c.save(epoch, {"w": torch.ones(64, 64)}, rng)
"""


def test_a_second_run_of_a_stage_keeps_no_checkpoints_while_the_first_one_does(tmp_path, caplog):
    folder, go = tmp_path / "_checkpoints" / "classifier", tmp_path / "go"
    first = subprocess.Popen([sys.executable, "-c", HOLDER, str(folder), str(go)], cwd=ROOT, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        assert first.stdout.readline().strip() == "saved"
        second = Checkpointer(folder, "k")
        with caplog.at_level(logging.WARNING, logger="xc_dagster"):
            for epoch in range(2, 12):
                second.save(epoch, {"w": torch.zeros(64, 64)}, np.random.default_rng(1))
        assert "this run keeps no checkpoints" in caplog.text
        assert Checkpointer(folder, "k").load().epoch == 1  # the first run's, untouched
        second.clear()  # the live first run's folder is not removed
        assert (folder / STATE).exists()
    finally:
        go.touch()
    _, err = first.communicate(timeout=60)
    assert first.returncode == 0, err
    resumed = Checkpointer(folder, "k").load()
    assert resumed.epoch == 5 and torch.equal(resumed.state["w"], torch.ones(64, 64))
    third = Checkpointer(folder, "k")  # the first run is gone: its lock with it
    third.save(6, {"w": torch.ones(64, 64)}, np.random.default_rng(2))
    assert Checkpointer(folder, "k").load().epoch == 6
    third.clear()
    assert not folder.exists()


# saves a checkpoint of each epoch read from stdin to argv[1] (holding the folder's lock), answering "saved <epoch>"
OWNER = """
import sys
from pathlib import Path
import numpy as np, torch
from xc_dagster.training.checkpoint import Checkpointer
c, rng = Checkpointer(Path(sys.argv[1]), "k"), np.random.default_rng(0)
for line in sys.stdin:
    c.save(int(line), {"w": torch.full((64, 64), float(line))}, rng)
    print("saved", int(line), flush=True)
"""


def test_a_load_racing_the_other_runs_saves_never_moves_its_checkpoint_aside(tmp_path, monkeypatch, caplog):
    """The owner saves between another run's opening of state.pt and its reading of the record: once (the record
    still names the opened file: it resumes from it), then twice (the record names neither: the read mismatches,
    and the second read resumes from the owner's newest checkpoint instead of moving it aside), then twice before
    each of the two reads (both mismatch: the owner holds the folder, so its checkpoint is left to it, not moved
    aside, and the load starts over; once the owner is gone the newest checkpoint loads)."""
    folder = tmp_path / "_checkpoints" / "classifier"
    owner = subprocess.Popen([sys.executable, "-c", OWNER, str(folder)], cwd=ROOT, stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def save(epoch: int) -> None:
        owner.stdin.write(f"{epoch}\n")
        owner.stdin.flush()
        assert owner.stdout.readline().split() == ["saved", str(epoch)]

    try:
        save(1)
        real, saves = checkpoint._recorded_hashes, iter([[2], [3, 4], [], [5, 6], [7, 8]])  # per read

        def racing(where):
            for epoch in next(saves, []):
                save(epoch)
            return real(where)

        monkeypatch.setattr(checkpoint, "_recorded_hashes", racing)
        resumed = Checkpointer(folder, "k").load()
        assert resumed.epoch == 1 and torch.equal(resumed.state["w"], torch.full((64, 64), 1.0))
        with caplog.at_level(logging.WARNING, logger="xc_dagster"):
            resumed = Checkpointer(folder, "k").load()
        assert resumed.epoch == 4 and torch.equal(resumed.state["w"], torch.full((64, 64), 4.0))
        assert not (folder / CORRUPT).exists() and "damaged" not in caplog.text
        with caplog.at_level(logging.WARNING, logger="xc_dagster"):
            assert Checkpointer(folder, "k").load() is None  # both reads raced: left to the owner, not moved
        assert not (folder / CORRUPT).exists() and "left to that run" in caplog.text
        assert next(saves, None) is None  # every racing read ran
    finally:
        _, err = owner.communicate(timeout=60)  # closes its stdin: it exits
    assert owner.returncode == 0, err
    monkeypatch.undo()
    resumed = Checkpointer(folder, "k").load()
    assert resumed.epoch == 8 and torch.equal(resumed.state["w"], torch.full((64, 64), 8.0))
