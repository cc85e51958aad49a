"""Per-epoch training checkpoints, so a killed materialization resumes where it stopped.

A checkpoint is one file, ``state.pt``: model and optimizer state, the torch and numpy generator states, the
next epoch and a fingerprint of the configuration and inputs (tensors, numbers and strings only, read back
with ``torch.load(weights_only=True)``, so loading executes no code). It is written to a temporary name, fsynced
and renamed over the previous one (the folder fsynced too), so a kill or a crash mid-write leaves the previous
checkpoint intact. A checkpoint that does not read back whole (truncated, a zip CRC mismatch: torch's reader
checks no CRC) is logged by file name, moved aside to ``state.pt.corrupt`` and training starts over, so a damaged
file never blocks the stage (docs/decisions.md#checkpoint-corrupt-restart). A checkpoint whose
fingerprint differs from the current run's (other hyperparameters, other upstream artifacts) is ignored and
overwritten, never resumed from. The stage removes its checkpoint once its artifacts are written.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
import shutil
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from xc_dagster.durable import fsync_dir, fsync_file

log = logging.getLogger("xc_dagster")
STATE, CORRUPT = "state.pt", "state.pt.corrupt"
# what a damaged file raises in the CRC check or in torch.load (the key/type errors: a loaded object of the wrong shape)
DAMAGED = (zipfile.BadZipFile, RuntimeError, EOFError, ValueError, KeyError, TypeError, pickle.UnpicklingError)


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

    def load(self) -> Resumed | None:
        """The saved state if it belongs to this run (same fingerprint), else None. A damaged checkpoint is logged,
        moved aside to ``state.pt.corrupt`` and treated as none (training starts over)."""
        path = None if self.folder is None else self.folder / STATE
        if path is None or not path.exists():
            return None
        try:
            state = _read_whole(path)
            if state.get("key") != self.key:
                return None
            return Resumed(int(state["epoch"]), state, state["rng_state"])
        except DAMAGED as exc:
            os.replace(path, self.folder / CORRUPT)
            log.warning("checkpoint %s is damaged (%s: %s); moved to %s, training starts from epoch 0",
                        path, type(exc).__name__, str(exc).split("\n")[0][:200], self.folder / CORRUPT)
            return None

    def save(self, epoch: int, state: dict[str, Any], rng: np.random.Generator) -> None:
        """Record that epochs ``< epoch`` are done, with the state to continue from (durable once it returns)."""
        if self.folder is None:
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        tmp = self.folder / f"{STATE}.tmp"  # one fixed name: a killed write's leftover is overwritten, not piled up
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []
        torch.save({**state, "key": self.key, "epoch": int(epoch), "rng_state": rng.bit_generator.state,
                    "torch_rng": torch.get_rng_state(), "cuda_rng": cuda}, tmp)
        fsync_file(tmp)  # on the disk before the rename makes it the checkpoint
        os.replace(tmp, self.folder / STATE)
        fsync_dir(self.folder)

    def clear(self) -> None:
        if self.folder is not None and self.folder.exists():
            shutil.rmtree(self.folder, ignore_errors=True)


def _read_whole(path: Path) -> dict[str, Any]:
    """Load a checkpoint after checking every zip member's CRC (``torch.load`` reads a flipped byte silently)."""
    with zipfile.ZipFile(path) as z:
        bad = z.testzip()
    if bad is not None:
        raise zipfile.BadZipFile(f"member {bad} fails its CRC check")
    state = torch.load(path, map_location="cpu", weights_only=True)
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
