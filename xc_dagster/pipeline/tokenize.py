"""Stage ``tokenize``: token-id arrays (memmap .npy) and lengths of the train points, test points and labels."""

from __future__ import annotations

import time
from typing import Any

from xc_dagster.artifacts import SUMMARY, TOKEN_SPLITS, token_files
from xc_dagster.encoders.tokenizer import check_positions, load_tokenizer, save_pretokenized, tokenize_to_npy
from xc_dagster.pipeline.context import StageContext
from xc_dagster.storage import save_json


def run(ctx: StageContext) -> dict[str, Any]:
    """Token-id arrays (memmap .npy) and lengths for train points, test points and labels.

    Splits that the dataset ships pre-tokenized (``tokenized`` layout) are used as given: their ids must come
    from the configured encoder's tokenizer.
    """
    p = ctx.cfg.tokenize
    t0 = time.perf_counter()
    ds = ctx.read.dataset(features=False)
    tok = load_tokenizer(p.encoder)
    check_positions(p.encoder, tok, {"tokenize.max_len": p.max_len, "tokenize.label_max_len": p.label_max_len})
    texts = {"train": ds.train_texts, "test": ds.test_texts, "label": ds.label_texts}
    summary: dict[str, Any] = {"encoder": p.encoder, "max_len": p.max_len}
    with ctx.writing() as out:
        for split in TOKEN_SPLITS:
            max_len = (p.label_max_len or p.max_len) if split == "label" else p.max_len
            ids, lens = (out / f for f in token_files(split))
            given = getattr(ds, f"{split}_tokens")
            if given is not None:
                st = save_pretokenized(*given, max_len, ids, lens)
            else:
                st = tokenize_to_npy(tok, texts[split], max_len, ids, lens)
            summary.update({f"{split}_{k}": v for k, v in st.items()})
        summary["seconds"] = time.perf_counter() - t0
        save_json(out / SUMMARY, summary)
    return summary
