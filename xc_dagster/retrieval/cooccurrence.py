"""The ``cooccurrence`` shortlist source: labels voted for by the query's nearest labels through the training
labels' co-occurrence (Gandalf's label points, Kharbanda et al., KDD 2023).

Gandalf reads a label's text as a point whose targets are the labels that co-occur with it in training,
G[h, l] = #(points with h and l) / #(points with h). Here those label points vote at inference, as the ``knn``
source's training points do: the query's K nearest labels h by embedding (the ``label`` index's search), each
voting max(sim, 0) ** p, give label l the score sum_h vote_h * G[h, l] / K, and its top labels join the shortlist.
Where queries and labels are the same kind of item (LF datasets: a product and the products bought with it, a
synset and its hypernyms), the label nearest to a query is often the query itself or a sibling, and the labels
co-occurring with it are the query's. G is built by blocks of labels, each row keeping its ``max_entries`` largest
entries (O(L x max_entries) memory at any number of points), and is not symmetric: G[h, l] is P(l | h).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import scipy.sparse as sp

from xc_dagster.errors import XCConfigError, XCError
from xc_dagster.retrieval.files import COOCCURRENCE_FILE
from xc_dagster.retrieval.sparse_rows import cap_postings, check_power, vote_weights, work_blocks

BLOCK_ENTRIES = 1 << 24  # products summed per block of labels (its rows before the cap: ~200 MB at most)


@dataclass(frozen=True)
class CooccurrenceSettings:
    """``index.cooccurrence_*``: K nearest labels voting, their similarities' power, entries kept per label."""

    neighbours: int = 3
    power: float = 4.0
    max_entries: int = 100

    def check(self) -> CooccurrenceSettings:
        for name in ("neighbours", "max_entries"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise XCConfigError(f"index.cooccurrence_{name}: expected an int >= 1, got {value!r}")
        check_power(self.power, "index.cooccurrence_power")
        return self


class LabelCooccurrence:
    """G (L x L CSR, float64 as the votes sum) and the votes' settings; owns ``COOCCURRENCE_FILE``."""

    def __init__(self, matrix: sp.csr_matrix, settings: CooccurrenceSettings) -> None:
        self.matrix = sp.csr_matrix(matrix, dtype=np.float64)
        self.settings = settings.check()

    @classmethod
    def fit(cls, Y: sp.spmatrix, settings: CooccurrenceSettings,
            block_entries: int = BLOCK_ENTRIES) -> LabelCooccurrence:
        """G of the training label matrix ``Y`` (points x labels; any stored value counts as 1), diagonal 0."""
        settings = settings.check()
        Yb = sp.csr_matrix(Y, dtype=np.float64, copy=True)
        Yb.eliminate_zeros()
        Yb.data[:] = 1.0
        Yt = Yb.T.tocsr()
        freq = np.diff(Yt.indptr)
        # a label's products: the labels of every point it is on (before the diagonal and the cap)
        work = Yt @ np.diff(Yb.indptr).astype(np.float64)
        blocks = []
        for s, e in work_blocks(work, block_entries, Yt.shape[0]):
            P = (Yt[s:e] @ Yb).tocsr()
            P.setdiag(0.0, k=s)  # row r is label s + r: its own column is s + r
            P.eliminate_zeros()
            P = cap_postings(P, settings.max_entries)
            blocks.append(sp.diags(1.0 / np.maximum(freq[s:e], 1)) @ P)
        L = Yb.shape[1]
        G = sp.vstack(blocks, format="csr") if blocks else sp.csr_matrix((L, L))
        G.sort_indices()
        return cls(G, settings)

    @property
    def num_labels(self) -> int:
        return self.matrix.shape[0]

    def votes(self, nbrs: np.ndarray, sims: np.ndarray) -> sp.csr_matrix:
        """(n, L) CSR: each query's vote of its first K labels of ``nbrs`` (-1 = none; by similarity descending,
        as an index search returns them) through G, their similarities ``sims`` raised to p, over K."""
        K = min(self.settings.neighbours, nbrs.shape[1])
        n = len(nbrs)
        near, w = nbrs[:, :K], vote_weights(np.asarray(sims[:, :K], dtype=np.float32), self.settings.power)
        ok = near >= 0
        N = sp.csr_matrix((w[ok].astype(np.float64) / max(K, 1), (np.nonzero(ok)[0], near[ok])),
                          shape=(n, self.num_labels))
        V = (N @ self.matrix).tocsr()
        V.sort_indices()  # sparse_lookup's sorted search
        return V

    def save(self, folder: Path | str) -> None:
        """One ``.npz`` of plain arrays (no pickle) in ``folder`` (a stage's folder, written whole or not at all):
        G's CSR parts and the settings."""
        G, s = self.matrix, self.settings
        np.savez(Path(folder) / COOCCURRENCE_FILE, data=G.data.astype(np.float32), indices=G.indices,
                 indptr=G.indptr, shape=np.asarray(G.shape, dtype=np.int64),
                 settings=np.asarray([s.neighbours, s.power, s.max_entries], dtype=np.float64))

    @classmethod
    def load(cls, folder: Path | str) -> LabelCooccurrence:
        path = Path(folder) / COOCCURRENCE_FILE
        try:
            with np.load(path, allow_pickle=False) as z:
                shape = tuple(int(x) for x in z["shape"])
                G = sp.csr_matrix((z["data"], z["indices"], z["indptr"]), shape=shape)
                k, p, m = (float(x) for x in z["settings"])
        except (OSError, KeyError, ValueError) as e:
            raise XCError(f"{path}: not a label co-occurrence file ({e})") from None
        if len(shape) != 2 or shape[0] != shape[1] or not all(math.isfinite(x) for x in (k, p, m)):
            raise XCError(f"{path}: expected a square label x label matrix and finite settings")
        return cls(G, CooccurrenceSettings(int(k), p, int(m)))
