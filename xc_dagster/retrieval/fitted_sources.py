"""What the fusion stage chooses of the sources besides the fusion's weights, and scoring as it chose.

Two choices, each fitted on the same validation (or cross-fitted) points, the best ``fusion.objective`` kept and
written into ``fusion.json``, which evaluation and the serving bundle read (:func:`as_fitted`):

* the kNN votes (K, p) of ``fusion.vote_grid`` (``xc_dagster.retrieval.votes``, key ``votes``);
* whether the lexical source scores its classifiers' part (``fusion.try_without_lexical_classifiers``, key
  ``lexical_classifiers``): their pass is picked on held-out P@1 + P@5 and the fusion's lexical weight multiplies
  the whole lexical score, so where the classifiers lift the head at the tail's cost no fused weight undoes it
  (a generated long-text shape: PSP@1 47.34 with them, 77.49 without; docs/decisions.md#lexical-classifiers-optional).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from xc_dagster.errors import XCConfigError
from xc_dagster.retrieval.lexical_weight import without_classifier
from xc_dagster.retrieval.shortlist import ShortlistSources
from xc_dagster.retrieval.votes import VOTES_KEY, Votes, fitted_votes, votes_record, with_votes

CLASSIFIERS_KEY = "lexical_classifiers"  # fusion.json: false when fitted without the lexical classifiers' part


@dataclass(frozen=True)
class Choice:
    """One candidate the fusion is fitted with: the kNN votes (None: the index stage's) and whether the lexical
    source's classifiers are scored."""

    votes: Votes | None = None
    lexical_classifiers: bool = True

    def record(self) -> dict[str, Any]:
        """Its entries of ``fusion.json`` (none for the index stage's sources as they are)."""
        out: dict[str, Any] = {} if self.votes is None else {VOTES_KEY: votes_record(self.votes)}
        return out if self.lexical_classifiers else {**out, CLASSIFIERS_KEY: False}


def choices(votes: list[Votes | None], without_classifiers: bool) -> list[Choice]:
    """The candidates: each of ``votes`` with the lexical classifiers, and, where ``without_classifiers``, each
    without them right after it (the fusion stage breaks ties for the classifiers, then for the earlier)."""
    out = []
    for v in votes:
        out += [Choice(v)] + ([Choice(v, False)] if without_classifiers else [])
    return out


def without_lexical_classifiers(src: ShortlistSources) -> ShortlistSources:
    """``src`` whose lexical source scores its label-text and kNN parts alone (its matrices shared)."""
    if src.lexical is None or src.lexical.classifier is None:
        return src
    return dataclasses.replace(src, lexical=without_classifier(src.lexical))


def with_choice(src: ShortlistSources, choice: Choice) -> ShortlistSources:
    """``src`` scoring as ``choice`` says."""
    src = with_votes(src, choice.votes)
    return src if choice.lexical_classifiers else without_lexical_classifiers(src)


def fitted_choice(fusion_file: Mapping[str, Any]) -> Choice:
    """The choice a fusion stage wrote into ``fusion.json`` (a file of before it: the index stage's sources)."""
    keep = fusion_file.get(CLASSIFIERS_KEY, True)
    if not isinstance(keep, bool):
        raise XCConfigError(f"fusion file: {CLASSIFIERS_KEY!r} should be true or false, got {keep!r}")
    return Choice(fitted_votes(fusion_file), keep)


def as_fitted(src: ShortlistSources, fusion_file: Mapping[str, Any]) -> ShortlistSources:
    """``src`` scoring as the fusion was fitted (as it was evaluated and is served)."""
    return with_choice(src, fitted_choice(fusion_file))
