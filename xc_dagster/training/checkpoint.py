"""Per-epoch training checkpoints, so a killed materialization resumes where it stopped.

A checkpoint is one file, ``state.pt``: model and optimizer state, the torch and numpy generator states, the
next epoch and a fingerprint of the configuration and inputs (tensors, numbers and strings only, read back
with ``torch.load(weights_only=True)``, so loading executes no code). It is written to a unique temporary name,
fsynced, its SHA-256 recorded in ``state.pt.sha256`` (with the previous checkpoint's, so a kill before the rename
leaves the previous one valid) and renamed over the previous one (the folder fsynced too), so a kill or a crash
mid-write leaves the previous checkpoint intact. A checkpoint whose bytes do not hash to a recorded SHA-256
(truncated, any byte flipped: torch's reader checks no CRC, and the zip's own CRCs cover neither its directory nor
its end records) or that does not load is logged by file name, moved aside to ``state.pt.corrupt`` and training
starts over, so a damaged file never blocks the stage (docs/decisions.md#checkpoint-corrupt-restart). One written
before the record existed gets the earlier check (every zip member's CRC, then ``torch.load``) and its hash is
recorded by the next save. An I/O error reading a checkpoint is raised, the file left alone; a mismatch is read
twice before it counts (another run's saves can race a read: loads take no lock). A checkpoint
whose fingerprint differs from the current run's (other hyperparameters, other upstream artifacts) is ignored and
overwritten, never resumed from. One run at a time writes a folder: the first save takes an exclusive ``flock`` on
``<folder>.lock`` beside it (as ``KeptWork`` does); a run of the same stage started meanwhile keeps no checkpoints.
The stage removes its checkpoint once its artifacts are written.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import pickle
import shutil
import uuid
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch

from xc_dagster.checksums import read_sha256
from xc_dagster.durable import atomic_write_text, fsync_dir, fsync_file
from xc_dagster.storage import file_lock

log = logging.getLogger("xc_dagster")
STATE, CORRUPT, HASHES = "state.pt", "state.pt.corrupt", "state.pt.sha256"
TMP = f"{STATE}.tmp-"  # unique temporary names: <TMP><8 hex>
# what a damaged file raises in the checks or in torch.load (the key/type errors: a loaded object of the wrong
# shape); not OSError, an I/O fault: only a checkpoint without a hash record takes one for damage (_read_unrecorded)
DAMAGED = (zipfile.BadZipFile, RuntimeError, EOFError, ValueError, KeyError, TypeError, pickle.UnpicklingError)


class DamagedCheckpoint(ValueError):
    """A checkpoint's bytes are not the ones its save recorded."""


def fingerprint(params: Any, *arrays: np.ndarray) -> str:
    """A short hash of the stage's hyperparameters and of its input arrays (shape, dtype and contents)."""
    h = hashlib.sha256(json.dumps(params, sort_keys=True, default=str).encode())
    for a in arrays:
        a = np.ascontiguousarray(a)
        h.update(f"{a.shape}{a.dtype}".encode())
        h.update(memoryview(a).cast("B"))
    return h.hexdigest()[:32]


def fingerprint_files(folder: Path) -> str:
    """A short hash of every file under ``folder`` (relative names and contents), e.g. a warm-start encoder."""
    h = hashlib.sha256()
    for f in sorted(Path(folder).rglob("*")):
        if f.is_file():
            h.update(f.relative_to(folder).as_posix().encode())
            with open(f, "rb") as fh:
                for block in iter(lambda: fh.read(1 << 20), b""):
                    h.update(block)
    return h.hexdigest()[:32]


@dataclass
class Resumed:
    """What a checkpoint restores: the next epoch to run, the tensors, and the numpy generator state."""

    epoch: int
    state: dict[str, Any]
    rng_state: dict[str, Any]


class Checkpointer:
    """Save/restore the training state of one stage in ``folder`` (None disables checkpointing)."""

    def __init__(self, folder: Path | None, key: str):
        self.folder = Path(folder) if folder is not None else None
        self.key = key
        self._lock = contextlib.ExitStack()
        self._owns: bool | None = None  # the folder's lock: not tried yet, held, or held by another run
        self._current: str | None = None  # the SHA-256 of state.pt as this run loaded or saved it

    def load(self) -> Resumed | None:
        """The saved state if it belongs to this run (same fingerprint), else None. A damaged checkpoint is logged,
        moved aside to ``state.pt.corrupt`` and treated as none (training starts over). Loads take no lock,
        so a mismatch is damage only when a second read finds it too: a concurrent save of the run holding the folder
        writes the record, then renames the file, and a read opens the file before it reads the record, so one save
        meanwhile is harmless but two are not; a mismatch read twice while another run holds the folder (it is
        saving there) is left to that run, not moved aside. An ``OSError`` reading a checkpoint (an I/O fault) is
        raised, the file left alone."""
        path = None if self.folder is None else self.folder / STATE
        if path is None or not path.exists():
            return None
        with contextlib.suppress(*DAMAGED):
            return self._resume(path)
        try:  # once more: another run's saves between this read's opening of the file and of its record
            return self._resume(path)
        except DAMAGED as exc:
            if self._saving_elsewhere():  # its saves may have raced both reads: its checkpoint, not damage to judge
                log.warning("checkpoint %s did not match its record twice while another run of the stage saves "
                            "there (%s); left to that run, this one starts from epoch 0", path, _brief(exc))
                return None
            with contextlib.suppress(FileNotFoundError):  # another run of the stage moved or cleared it first
                os.replace(path, self.folder / CORRUPT)
            log.warning("checkpoint %s is damaged (%s); moved to %s, training starts from epoch 0",
                        path, _brief(exc), self.folder / CORRUPT)
            return None

    def _resume(self, path: Path) -> Resumed | None:
        read = _read_whole(path)
        if read is None:  # removed since: another run of the stage finished and cleared it
            return None
        state, self._current = read
        if state.get("key") != self.key:
            return None
        return Resumed(int(state["epoch"]), state, state["rng_state"])

    def _saving_elsewhere(self) -> bool:
        """Whether another run holds the folder's lock now (it saves there), checked without keeping the lock."""
        if self._owns:
            return False
        with file_lock(self._lock_path(), blocking=False) as got:
            return not got

    def _lock_path(self) -> Path:
        """The folder's lock: held by the run that saves there (``_own``)."""
        return self.folder.with_name(f"{self.folder.name}.lock")

    def _own(self) -> bool:
        """Take the folder's lock on first use (non-blocking); False while another run of the stage holds it."""
        if self._owns is None:
            self.folder.parent.mkdir(parents=True, exist_ok=True)
            self._owns = self._lock.enter_context(file_lock(self._lock_path(), blocking=False))
            if not self._owns:
                log.warning("%s: another run of this stage is checkpointing there; this run keeps no checkpoints",
                            self.folder)
            elif self.folder.is_dir():
                for leftover in self.folder.glob(f"{TMP}*"):  # killed writes': no other writer is alive
                    leftover.unlink(missing_ok=True)
        return self._owns

    def save(self, epoch: int, state: dict[str, Any], rng: np.random.Generator) -> None:
        """Record that epochs ``< epoch`` are done, with the state to continue from (durable once it returns)."""
        if self.folder is None or not self._own():
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        tmp = self.folder / f"{TMP}{uuid.uuid4().hex[:8]}"
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []
        try:
            torch.save({**state, "key": self.key, "epoch": int(epoch), "rng_state": rng.bit_generator.state,
                        "torch_rng": torch.get_rng_state(), "cuda_rng": cuda}, tmp)
            fsync_file(tmp)  # on the disk before the rename makes it the checkpoint
            with open(tmp, "rb") as f:
                digest = read_sha256(f)
            # the previous checkpoint's hash stays valid: a kill before the rename leaves it the checkpoint
            hashes = [digest] + ([self._current] if self._current else [])
            atomic_write_text(self.folder / HASHES, json.dumps({"sha256": hashes}) + "\n")
            os.replace(tmp, self.folder / STATE)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        self._current = digest
        fsync_dir(self.folder)

    def clear(self) -> None:
        """Remove the folder (unless another run of the stage holds it) and let it go."""
        if self.folder is not None and self._own() and self.folder.exists():
            shutil.rmtree(self.folder, ignore_errors=True)
        self.close()

    def close(self) -> None:
        """Release the folder's lock (the kernel does when the process dies)."""
        self._lock.close()
        self._owns = None


def _brief(exc: BaseException) -> str:
    first_line = str(exc).split("\n")[0][:200]
    return f"{type(exc).__name__}: {first_line}"


def _recorded_hashes(folder: Path) -> list[str] | None:
    """The SHA-256s ``save`` recorded; None without a record (a checkpoint of before it). A record that does not
    parse is damage; one that cannot be read (an I/O fault) raises its ``OSError``."""
    try:
        hashes = json.loads((folder / HASHES).read_text())["sha256"]
    except FileNotFoundError:
        return None
    except (ValueError, KeyError, TypeError) as exc:
        raise DamagedCheckpoint(f"{HASHES} beside it does not parse ({type(exc).__name__})") from None
    return [h for h in hashes if isinstance(h, str)] if isinstance(hashes, list) else []


def _read_whole(path: Path) -> tuple[dict[str, Any], str] | None:
    """The checkpoint at ``path`` and its SHA-256 (None: it is gone). Its bytes must hash to one that ``save``
    recorded (``torch.load`` reads a flipped byte silently); without a record, :func:`_read_unrecorded` checks it.
    The record is read after the file is opened: a save records its hash before its rename, so the record read
    names the opened file unless two saves ran in between."""
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        return None
    with f:
        hashes = _recorded_hashes(path.parent)
        digest = read_sha256(f)
        f.seek(0)
        if hashes is None:
            return _read_unrecorded(f), digest
        if digest not in hashes:
            raise DamagedCheckpoint(f"SHA-256 {digest} is none of the recorded {hashes}")
        return _torch_load(f), digest


def _read_unrecorded(f: BinaryIO) -> dict[str, Any]:
    """The check of checkpoints written before the hash record: every zip member's CRC, then ``torch.load``. A
    broken zip structure is damage, the ``OSError`` zipfile raises seeking by a damaged end record included (the
    file was just read whole to hash it, so an I/O fault here is unlikely)."""
    try:
        with zipfile.ZipFile(f) as z:  # a file object passed in: closing the ZipFile leaves it open
            bad = z.testzip()
        if bad is not None:
            raise zipfile.BadZipFile(f"member {bad} fails its CRC check")
        f.seek(0)
        return _torch_load(f)
    except OSError as exc:
        raise DamagedCheckpoint(f"a broken zip structure ({type(exc).__name__}: {exc})") from None


def _torch_load(f: BinaryIO) -> dict[str, Any]:
    state = torch.load(f, map_location="cpu", weights_only=True)
    if not isinstance(state, dict):
        raise TypeError(f"expected a dict, got {type(state).__name__}")
    return state


class Resumable:
    """A trainer that restores a checkpoint with ``load_state(resumed)``."""

    def load_state(self, resumed: Resumed) -> None:  # pragma: no cover - each trainer has its own
        raise NotImplementedError

    def start(self, checkpoint: Checkpointer | None = None) -> int:
        """Resume from a matching checkpoint (returns its next epoch), else 0."""
        resumed = checkpoint.load() if checkpoint is not None else None
        if resumed is None:
            return 0
        self.load_state(resumed)
        return resumed.epoch


def restore_rng(rng: np.random.Generator, resumed: Resumed) -> None:
    """Put ``rng`` and torch's global generator back where the checkpoint left them."""
    rng.bit_generator.state = resumed.rng_state
    torch.set_rng_state(resumed.state["torch_rng"])
    if resumed.state.get("cuda_rng") and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(resumed.state["cuda_rng"])


def to_tensors(x: Any) -> Any:
    """numpy arrays inside a (nested) state -> tensors, so the checkpoint loads with ``weights_only=True``."""
    if isinstance(x, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(x))
    if isinstance(x, dict):
        return {k: to_tensors(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [to_tensors(v) for v in x]
    return x


def to_arrays(x: Any) -> Any:
    """The inverse of ``to_tensors``: tensors inside a (nested) state -> numpy arrays."""
    if isinstance(x, torch.Tensor):
        return x.numpy()
    if isinstance(x, dict):
        return {k: to_arrays(v) for k, v in x.items()}
    if isinstance(x, list):
        return [to_arrays(v) for v in x]
    return x
