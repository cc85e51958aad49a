"""Small generated datasets and a tiny random transformer for fast, reproducible pipeline tests."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np

WORDS = ["apple", "river", "stone", "cloud", "music", "paper", "glass", "horse", "light", "metal",
         "ocean", "plant", "sugar", "tiger", "water", "wheel", "bread", "chair", "dream", "earth"]


def write_lf_dataset(folder: Path, n_train: int = 120, n_test: int = 40, n_labels: int = 20,
                     seed: int = 0) -> Path:
    """An LF raw-text dataset whose point titles name their labels' words (so it is learnable)."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    labels = [{"uid": f"L{j}", "title": WORDS[j % len(WORDS)] + (f" {j}" if j >= len(WORDS) else ""),
               "content": f"about {WORDS[j % len(WORDS)]}", "target_ind": [], "target_rel": []}
              for j in range(n_labels)]

    def rows(n: int, offset: int) -> list[dict]:
        out = []
        for i in range(n):
            k = int(rng.integers(1, 4))
            tgt = sorted(rng.choice(n_labels, size=k, replace=False).tolist())
            title = " ".join(WORDS[t % len(WORDS)] for t in tgt) + f" item{offset + i}"
            out.append({"uid": f"P{offset + i}", "title": title, "content": "a generated point",
                        "target_ind": tgt, "target_rel": [1.0] * k})
        return out

    for name, data in (("trn.json.gz", rows(n_train, 0)), ("tst.json.gz", rows(n_test, n_train)),
                       ("lbl.json.gz", labels)):
        with gzip.open(folder / name, "wt") as fh:
            for r in data:
                fh.write(json.dumps(r) + "\n")
    (folder / "filter_labels_test.txt").write_text("0 19\n3 18\n")
    (folder / "filter_labels_train.txt").write_text("1 17\n")
    return folder


def write_tiny_encoder(folder: Path, seed: int = 0) -> Path:
    """A 2-layer, 32-wide random BERT with the packaged MiniLM tokenizer, saved as an HF folder."""
    import torch
    from transformers import AutoTokenizer, BertConfig, BertModel

    from xc_dagster.encoders.names import resolve_encoder_path

    if (folder / "config.json").exists():
        return folder
    torch.manual_seed(seed)
    tok = AutoTokenizer.from_pretrained(resolve_encoder_path("minilm"))
    cfg = BertConfig(vocab_size=tok.vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=64, max_position_embeddings=128)
    BertModel(cfg).save_pretrained(folder, safe_serialization=True)
    tok.save_pretrained(folder)
    return folder


def stop_process_group(proc, timeout: float = 30.0) -> None:
    """SIGTERM a server started with ``start_new_session=True`` and its children; SIGKILL if it lingers."""
    import os
    import signal
    import subprocess

    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=timeout)
    except ProcessLookupError:
        pass
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
