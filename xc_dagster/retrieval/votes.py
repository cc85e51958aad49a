"""The kNN votes chosen on validation: how many neighbours K vote for their labels, and the power p their
similarities are raised to, in both kNN scores (the dense ``knn`` source's and the ``lexical`` source's sparse kNN).

``fusion.vote_grid`` lists candidate pairs "K:p"; the fusion stage fits the fusion once per candidate on the same
validation (or cross-fitted) points and keeps the pair of the best objective, written into ``fusion.json`` under
:data:`VOTES_KEY`; evaluation and the serving bundle score with it (``xc_dagster.retrieval.fitted_sources``).
Datasets with many labels per point gain from more, sharper votes (Delicious: 19 labels per point), sparse ones
lose (docs/decisions.md#vote-grid). An empty grid keeps the index stage's ``index.knn_*`` / ``index.lexical_*``.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from xc_dagster.errors import XCConfigError
from xc_dagster.retrieval.shortlist import ShortlistSources
from xc_dagster.retrieval.sparse_rows import check_power

VOTES_KEY = "votes"  # fusion.json: {"neighbours": K, "power": p}, absent when no grid was searched
Votes = tuple[int, float]  # (K, p)
# settings a user may have set for the kNN votes themselves; set explicitly, they win over a strategy's vote grid
VOTE_SETTINGS = ("index.knn_neighbours", "index.knn_power", "index.lexical_neighbours", "index.lexical_power")


def parse_vote_grid(items: Sequence[str], field: str = "fusion.vote_grid") -> list[Votes]:
    """The candidates of ``fusion.vote_grid``, each "K:p" with K an int >= 1 and p a number > 0, in order, without
    repeats; an error naming ``field`` and the bad item otherwise."""
    out: list[Votes] = []
    for item in items:
        k, sep, p = str(item).partition(":")
        try:
            votes = (int(k), check_power(float(p), field))
        except (ValueError, XCConfigError):
            votes = None
        if not sep or votes is None or votes[0] < 1 or str(votes[0]) != k.strip():
            raise XCConfigError(f"{field}: expected items K:p (K neighbours, an int >= 1; p, their similarities' "
                                f"power, a number > 0), e.g. 10:2,25:4; got {item!r}")
        if votes not in out:
            out.append(votes)
    return out


def vote_candidates(grid: Sequence[str], sources: Sequence[str], explicit: Collection[str]) -> list[Votes | None]:
    """The (K, p) candidates a fusion is fitted with: the ``fusion.vote_grid`` items ``grid``, or [None] (the index
    stage's votes) when it is empty, when ``sources`` have neither a kNN nor a lexical source, or when the user set
    the votes themselves (``VOTE_SETTINGS`` in ``explicit``) but not the grid. The fusion stage and the planner
    both count them here."""
    candidates = parse_vote_grid(grid)
    if not candidates or not {"knn", "lexical"} & set(sources) or (
            "fusion.vote_grid" not in explicit and any(k in explicit for k in VOTE_SETTINGS)):
        return [None]
    return candidates


def has_votes(src: ShortlistSources) -> bool:
    """Whether ``src`` scores kNN votes that a (K, p) changes: a dense kNN source or a lexical one."""
    return "knn" in src.indexes or src.lexical is not None


def with_votes(src: ShortlistSources, votes: Votes | None) -> ShortlistSources:
    """``src`` whose dense and lexical kNN scores take the K nearest neighbours' votes raised to p (``votes``);
    ``src`` itself for None. The indexes and arrays are shared, not copied."""
    if votes is None:
        return src
    k, p = int(votes[0]), check_power(votes[1], "votes")
    if k < 1:
        raise XCConfigError(f"votes: expected K >= 1 neighbours, got {k}")
    lexical = src.lexical
    if lexical is not None:
        lexical = copy.copy(lexical)  # a shallow copy: its matrices stay shared
        lexical.neighbours, lexical.power = k, p
    knn = "knn" in src.indexes
    return dataclasses.replace(src, knn_neighbours=k if knn else src.knn_neighbours,
                               knn_power=p if knn else src.knn_power, lexical=lexical)


def fitted_votes(fusion_file: Mapping[str, Any]) -> Votes | None:
    """The (K, p) a fusion stage chose (``fusion.json``'s :data:`VOTES_KEY`), or None when it searched none."""
    v = fusion_file.get(VOTES_KEY)
    if v is None:
        return None
    if not isinstance(v, Mapping) or "neighbours" not in v or "power" not in v:
        raise XCConfigError(f"fusion file: {VOTES_KEY!r} should hold neighbours and power, got {v!r}")
    return int(v["neighbours"]), check_power(v["power"], f"fusion file {VOTES_KEY}.power")


def votes_record(votes: Votes) -> dict[str, Any]:
    """The :data:`VOTES_KEY` entry of ``fusion.json``."""
    return {"neighbours": int(votes[0]), "power": float(votes[1])}
