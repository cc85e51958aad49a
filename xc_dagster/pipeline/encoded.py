"""A split's embeddings kept between runs of a stage, reused while the encoder and the tokens are the same.

Evaluation encodes the test texts with the deployed encoder on every run: at the 131K shape with MiniLM on 2 CPU
cores that is 359 of its 657 seconds, though a re-evaluation after a change to the indexes or the fusion (or an
ablation, ``bench/ablate.py``) encodes exactly what the last run did. The embeddings are kept under
``$XC_HOME/artifacts/<dataset>/_cache/encoded/<split>-<key>.npy``, the key a hash of the version folders of the
stage that wrote the encoder and of the tokenize stage (a new one at every write), the pooling, the device kind,
the dtype, the batch size and the package version. The key is in the file's name, so a file is never read under
another key; it is written to a temporary name, fsynced and renamed, and another key's file of the split is
removed once the new one is in place (one file per split: the disk holds one more copy of the split's embeddings).
A file that does not read back whole, or whose shape is not the split's, is encoded again
(docs/decisions.md#encoded-cache).
"""

from __future__ import annotations

import contextlib
import logging
import time
from pathlib import Path

import numpy as np

from xc_dagster import __version__
from xc_dagster.durable import atomic_write
from xc_dagster.training.checkpoint import fingerprint

log = logging.getLogger("xc_dagster")
STALE_TMP_S = 3600  # a temporary file older than this was left by a killed write
DAMAGED = (OSError, ValueError, EOFError)  # what np.load raises on a truncated or damaged .npy


class EncodedCache:
    """The kept embeddings of one ``split`` in ``folder``, valid for ``settings`` (hashed with the package
    version into the file's name)."""

    def __init__(self, folder: Path, split: str, settings: dict):
        self.folder = Path(folder)
        self.split = split
        self.key = fingerprint({**settings, "split": split, "xc_dagster": __version__})
        self.path = self.folder / f"{split}-{self.key}.npy"

    def load(self, rows: int) -> np.ndarray | None:
        """The kept embeddings when they are there whole, ``rows`` of them; else None."""
        if not self.path.exists():
            return None
        try:
            emb = np.load(self.path, allow_pickle=False)
        except DAMAGED as exc:
            log.warning("kept embeddings %s do not read back (%s: %s); encoding again", self.path,
                        type(exc).__name__, exc)
            return None
        if emb.ndim != 2 or len(emb) != rows or emb.dtype != np.float32:
            log.warning("kept embeddings %s hold %s %s, not %d rows of float32; encoding again", self.path,
                        emb.shape, emb.dtype, rows)
            return None
        return emb

    def save(self, emb: np.ndarray) -> None:
        """Keep ``emb`` (durable once this returns) and remove the split's files under other keys."""
        self.folder.mkdir(parents=True, exist_ok=True)

        def write(tmp: Path) -> None:
            with open(tmp, "wb") as fh:  # a handle: np.save would append ".npy" to the temporary name
                np.save(fh, np.ascontiguousarray(emb, dtype=np.float32))

        atomic_write(self.path, write)  # temporary name ".<name>.tmp-<8 hex>", swept below once stale
        for old in self.folder.glob(f"{self.split}-*.npy"):
            if old != self.path:
                old.unlink(missing_ok=True)
        for left in self.folder.glob(f".{self.split}-*.npy.tmp-*"):  # a killed write's; a live one is seconds old
            with contextlib.suppress(OSError):
                if time.time() - left.stat().st_mtime > STALE_TMP_S:
                    left.unlink()
