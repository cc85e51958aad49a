"""Known public XC datasets: published statistics, text fields, max_len, propensity A/B and layout.

``xc-dagster datasets add LF-AmazonTitles-131K --source <download>`` takes its defaults from here (explicit
options still win), and the ingest stage checks the parsed counts against the published ones
(:func:`verify_counts`; ``ingest.verify_counts=false`` skips it).

Statistics: the XC repository's tables (train N, test N', labels L, BoW feature dimension D where the
dataset's usual download carries features and the number is certain; ``None`` = not checked); Bibtex and
Delicious as the Mulan sets in ``shared/data`` (same numbers as the repository); LF-WordNetNouns as built.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from xc_dagster.errors import XCError

COUNT_FIELDS = ("n_train", "n_test", "n_labels", "n_features")


@dataclass(frozen=True)
class KnownDataset:
    """One public benchmark: published counts and the options it is trained with."""

    name: str
    n_train: int
    n_test: int
    n_labels: int
    n_features: int | None  # BoW feature dimension D, when the download has features and D is certain
    text: str  # "title" | "title+content" (BoW datasets: the text rebuilt from the vocabulary)
    max_len: int  # 32 titles, 128 full text, 256 Wikipedia
    propensity_a: float
    propensity_b: float
    layout: str  # layout of the usual download ("lf-raw", "bow"); ingest still auto-detects

    def counts(self) -> dict[str, int | None]:
        """The published counts by stats() field name."""
        return {f: getattr(self, f) for f in COUNT_FIELDS}

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


_AMAZON = (0.6, 2.6)
_WIKI = (0.5, 0.4)
_OTHER = (0.55, 1.5)


def _lf(name: str, n_train: int, n_test: int, n_labels: int, ab: tuple[float, float],
        max_len: int | None = None) -> KnownDataset:
    titles = "titles" in name.lower()
    return KnownDataset(name, n_train, n_test, n_labels, None, "title" if titles else "title+content",
                        max_len or (32 if titles else 128), ab[0], ab[1], "lf-raw")


def _bow(name: str, n_train: int, n_test: int, n_labels: int, n_features: int,
         ab: tuple[float, float]) -> KnownDataset:
    return KnownDataset(name, n_train, n_test, n_labels, n_features, "title+content", 128, ab[0], ab[1], "bow")


KNOWN_DATASETS: dict[str, KnownDataset] = {d.name: d for d in (
    _lf("LF-AmazonTitles-131K", 294_805, 134_835, 131_073, _AMAZON),
    _lf("LF-Amazon-131K", 294_805, 134_835, 131_073, _AMAZON),
    _lf("LF-WikiSeeAlsoTitles-320K", 693_082, 177_515, 312_330, _WIKI),
    _lf("LF-WikiSeeAlso-320K", 693_082, 177_515, 312_330, _WIKI),
    _lf("LF-AmazonTitles-1.3M", 2_248_619, 970_237, 1_305_265, _AMAZON),
    _lf("LF-Wikipedia-500K", 1_813_391, 783_743, 501_070, _WIKI, max_len=256),
    _lf("LF-WordNetNouns", 57_480, 24_599, 21_523, _OTHER),
    _lf("LF-WordNetNounsTitles", 57_480, 24_599, 21_523, _OTHER),
    _bow("Amazon-670K", 490_449, 153_025, 670_091, 135_909, _AMAZON),
    _bow("AmazonCat-13K", 1_186_239, 306_782, 13_330, 203_882, _AMAZON),
    _bow("EURLex-4K", 15_539, 3_809, 3_993, 5_000, _OTHER),
    _bow("Wiki10-31K", 14_146, 6_616, 30_938, 101_938, _WIKI),
    _bow("Bibtex", 4_880, 2_515, 159, 1_836, _OTHER),
    _bow("Delicious", 12_920, 3_185, 983, 500, _OTHER),
)}

_BY_LOWER = {k.lower(): v for k, v in KNOWN_DATASETS.items()}


def lookup(name: str) -> KnownDataset | None:
    """The registry entry of a dataset name (exact, else case-insensitive), or None when unknown."""
    return KNOWN_DATASETS.get(name) or _BY_LOWER.get(str(name).lower())


class XCCountMismatch(XCError, ValueError):
    """Parsed counts differ from a known dataset's published ones: names the dataset, field, expected, got."""

    def __init__(self, dataset: str, mismatches: list[tuple[str, int, int]], registry_name: str, where: str = ""):
        self.dataset = dataset
        self.mismatches = mismatches
        self.field, self.expected, self.got = mismatches[0]
        parts = "; ".join(f"{f}: expected {e}, got {g}" for f, e, g in mismatches)
        src = f" (parsed from {where})" if where else ""
        super().__init__(f"dataset {dataset!r}: counts differ from the published {registry_name} statistics{src}: "
                         f"{parts}. Check the download, or set ingest.verify_counts=false to skip this check")


def count_mismatches(stats: dict[str, Any], known: KnownDataset) -> list[tuple[str, int, int]]:
    """``(field, expected, got)`` for each published count that the parsed ``stats`` disagree with.

    ``n_features`` is compared only when both are known (LF raw text has no features).
    """
    out = []
    for f, expected in known.counts().items():
        got = stats.get(f)
        if expected is None or got is None:
            continue
        if int(got) != int(expected):
            out.append((f, int(expected), int(got)))
    return out


def verify_counts(dataset: str, stats: dict[str, Any], known: KnownDataset | None, where: str = "") -> None:
    """Raise :class:`XCCountMismatch` when ``stats`` (``XCDataset.stats()``) disagree with ``known``."""
    if known is None:
        return
    bad = count_mismatches(stats, known)
    if bad:
        raise XCCountMismatch(dataset, bad, known.name, where)


@dataclass(frozen=True)
class ReferenceResult:
    """A published or team-measured result on a known dataset, shown beside a user's runs (values in %)."""

    method: str
    source: str  # where the number comes from: paper and table, or how/where it was measured
    metrics: dict[str, float]  # precision_at_1, psprecision_at_5, ... in percent
    train_hours: float | None = None


def _ref(method: str, source: str, hours: float | None = None, **metrics: float) -> ReferenceResult:
    return ReferenceResult(method, source, dict(metrics), hours)


_NGAME = "NGAME paper, one V100"
_WORDNET_REFS = "measured by the team on a 2-core CPU, same split, filters removed, A/B 0.55/1.5"

REFERENCE_RESULTS: dict[str, tuple[ReferenceResult, ...]] = {
    "LF-AmazonTitles-131K": (
        _ref("NGAME", _NGAME, 12.59, precision_at_1=46.01, precision_at_3=30.28, precision_at_5=21.47,
             psprecision_at_1=38.81, psprecision_at_3=44.40, psprecision_at_5=49.43),
        _ref("ASTRA", "ASTRA paper, one V100", 2.02, precision_at_1=46.20, precision_at_3=30.72,
             precision_at_5=21.95, psprecision_at_1=39.36, psprecision_at_5=50.57),
        _ref("SiameseXML", "SiameseXML paper, one V100", 1.13, precision_at_1=41.42, precision_at_5=21.21,
             psprecision_at_1=35.80, psprecision_at_5=46.19),
        _ref("NGAME encoder only", "NGAME ablation", precision_at_1=42.61, precision_at_5=20.69),
        _ref("NGAME classifier only", "NGAME ablation", precision_at_1=44.95, precision_at_5=21.20),
    ),
    "LF-AmazonTitles-1.3M": (
        _ref("NGAME", _NGAME, precision_at_1=56.75, precision_at_5=44.09, psprecision_at_1=29.18),
    ),
    "Amazon-670K": (
        _ref("MIPS-s (BERT)", "Qaraei & Babbar", precision_at_1=46.1),
        _ref("LightXML", "as reported by Qaraei & Babbar", precision_at_1=46.8),
    ),
    "LF-WordNetNounsTitles": (
        _ref("Omikuji (Parabel-like, TF-IDF 1-2 grams)", _WORDNET_REFS, precision_at_1=27.6,
             psprecision_at_1=13.8),
        _ref("napkinXC (PLT)", _WORDNET_REFS, precision_at_1=27.0),
        _ref("MiniLM zero-shot", _WORDNET_REFS, precision_at_1=12.4, psprecision_at_1=14.4),
    ),
    "LF-WordNetNouns": (
        _ref("Omikuji (Parabel-like, TF-IDF 1-2 grams)", _WORDNET_REFS, precision_at_1=59.2,
             psprecision_at_1=29.7),
        _ref("MiniLM zero-shot", _WORDNET_REFS, precision_at_1=24.4, psprecision_at_1=26.8),
    ),
    "Bibtex": (
        _ref("Omikuji (Parabel-like)", "measured by the team on a 2-core CPU, same split, A/B 0.55/1.5",
             precision_at_1=64.0, psprecision_at_1=50.0),
    ),
}


def reference_results(name: str) -> tuple[ReferenceResult, ...]:
    """Published/measured reference results of a known dataset (by registry name), empty if none."""
    known = lookup(name)
    return REFERENCE_RESULTS.get(known.name, ()) if known is not None else ()
