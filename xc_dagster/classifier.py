"""One-vs-all classifiers W (NGAME M2/M4, SiameseXML Module IV) on a frozen encoder.

w_l starts from the label embedding E(z_l) (Module III transfer) and is trained on each point's positives
plus the hardest of its mined shortlist negatives, re-ranked by the current W every step. W is an
``nn.Embedding(sparse=True)`` updated with SparseAdam: a step touches only the rows it scored, so memory
and time per step do not grow with L.
"""

from __future__ import annotations

import math
import time
from typing import Callable

import numpy as np
import scipy.sparse as sp
import torch
import torch.nn.functional as F

from xc_dagster.config import ClassifierParams
from xc_dagster.errors import XCConfigError
from xc_dagster.losses import masked_bce_loss, multi_positive_triplet_loss
from xc_dagster.sampling import positive_mask, sample_positives

MetricsFn = Callable[[int, dict[str, float]], None]
LOSSES = ("bce", "triplet")


def train_classifiers(point_emb: np.ndarray, label_emb: np.ndarray, Y: sp.csr_matrix, shortlist: np.ndarray,
                      train_rows: np.ndarray, params: ClassifierParams, device: torch.device,
                      log_metrics: MetricsFn | None = None) -> tuple[np.ndarray, dict[str, float]]:
    """Return W (L x D float32) and a summary; ``shortlist[i]`` are point i's mined candidate labels (-1 pad)."""
    if params.loss not in LOSSES:
        raise XCConfigError(f"classifier.loss: expected one of {LOSSES}, got {params.loss!r}")
    Y = Y.tocsr()
    rows = np.asarray(train_rows, dtype=np.int64)
    rows = rows[np.diff(Y.indptr)[rows] > 0]
    rng = np.random.default_rng(params.seed)
    torch.manual_seed(params.seed)
    W = torch.nn.Embedding(label_emb.shape[0], label_emb.shape[1], sparse=True).to(device)
    with torch.no_grad():
        W.weight.copy_(torch.from_numpy(np.ascontiguousarray(label_emb, dtype=np.float32)))
    opt = torch.optim.SparseAdam(W.parameters(), lr=params.lr)
    X = torch.from_numpy(np.ascontiguousarray(point_emb, dtype=np.float32))
    n_neg = min(params.num_negatives, shortlist.shape[1])
    steps, t0, last = 0, time.perf_counter(), float("nan")
    steps_per_epoch = math.ceil(len(rows) / params.batch_size)
    for epoch in range(params.epochs):
        perm = rng.permutation(rows)
        ep_loss = []
        for s in range(0, len(perm), params.batch_size):
            batch = perm[s:s + params.batch_size]
            pos = sample_positives(Y, batch, params.num_positives, rng)
            cand = shortlist[batch].astype(np.int64)
            cand_is_pos = positive_mask(Y, batch, cand)
            cand = np.where(cand_is_pos, -1, cand)  # positives never act as negatives
            x = X[batch].to(device)
            c_t = torch.from_numpy(cand).to(device)
            with torch.no_grad():  # hardest negatives under the current W
                cs = torch.einsum("bd,bkd->bk", x, W.weight[c_t.clamp_min(0)])
                cs = cs.masked_fill(c_t < 0, float("-inf"))
                hard = cs.topk(n_neg, dim=1).indices
            neg = torch.gather(c_t, 1, hard)
            ids = torch.cat([torch.from_numpy(pos).to(device), neg], dim=1)
            valid = ids >= 0
            is_pos = torch.zeros_like(valid)
            is_pos[:, :pos.shape[1]] = True
            w = W(ids.clamp_min(0))
            if params.normalize:
                w = F.normalize(w, dim=-1)
            scores = torch.einsum("bd,bkd->bk", x, w)
            if params.loss == "bce":
                loss = masked_bce_loss(params.scale * scores, is_pos, valid)
            else:
                loss = multi_positive_triplet_loss(scores, is_pos, valid, params.margin)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            steps += 1
            ep_loss.append(float(loss.detach()))
        last = float(np.mean(ep_loss)) if ep_loss else float("nan")
        if log_metrics is not None:
            log_metrics(epoch + 1, {"classifier_loss": last})
    Wn = W.weight.detach()
    if params.normalize:
        Wn = F.normalize(Wn, dim=-1)
    return Wn.cpu().numpy().astype(np.float32), {"steps": steps, "seconds": time.perf_counter() - t0,
                                                 "final_loss": last, "steps_per_epoch": steps_per_epoch}
