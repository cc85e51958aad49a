"""The dataset catalog: a YAML file under XC_HOME whose entries are the Dagster partitions.

Each dataset is a name, a source (local folder or file, ``file://``, ``http(s)://`` or any fsspec URI), a
layout (``auto`` detects it), an optional ``sha256`` of the source file/archive, and options (text fields,
max_len, propensity A/B, strategy, preset and ``stage.field`` hyperparameter overrides; ``gate_tolerance``,
the champion gate's tolerance for runs that give none in their run config, as the sensor's and the
schedule's runs). Options left unset
come from the registry of known public datasets (:mod:`xc_dagster.data.registry`) when the name is one of
them, else from the name (``Titles`` -> title, dataset family -> propensity A/B). Adding one needs no code
change: the partition exists as soon as the code location (re)loads.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import yaml

from xc_dagster.config import PRESETS, PipelineConfig, apply_overrides, resolve_config
from xc_dagster.data.layouts import LAYOUTS as DATA_LAYOUTS
from xc_dagster.data.registry import KnownDataset, lookup
from xc_dagster.data.sources import normalize_sha256
from xc_dagster.durable import atomic_write_text
from xc_dagster.errors import XCConfigError, XCDatasetNotFound
from xc_dagster.storage import file_lock
from xc_dagster.strategies import STRATEGIES

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_log = logging.getLogger(__name__)
TEXT_CHOICES = ("title", "title+content")
LAYOUTS = ("auto",) + DATA_LAYOUTS
BUILTIN_PREFIX = "builtin:"  # datasets embedded in the package, e.g. builtin:LF-WordNetNouns


def builtin_path(name: str) -> Path:
    """Folder of a dataset embedded in the package (``builtin:NAME`` sources)."""
    path = Path(__file__).resolve().parent / "builtin_data" / name
    if not path.is_dir():
        raise XCDatasetNotFound(f"source {BUILTIN_PREFIX}{name}: no embedded dataset {name!r} at {path}")
    return path


def parse_tolerance(value: Any, what: str = "tolerance") -> float:
    """A champion-gate tolerance in percentage points: a finite number >= 0 (numeric text too), as a float.

    Anything else raises :class:`XCConfigError` naming ``what`` (the field it came from).
    """
    try:
        if isinstance(value, bool):
            raise ValueError(value)
        pp = float(value)
    except (TypeError, ValueError):
        pp = math.nan
    if not (math.isfinite(pp) and pp >= 0):
        raise XCConfigError(f"{what}: expected a finite number of percentage points >= 0, got {value!r}")
    return pp


def default_text(name: str) -> str:
    """As the XC repository's tools: titles-only datasets (name contains 'Titles') use the title."""
    return "title" if "titles" in name.lower() else "title+content"


def default_propensity(name: str) -> tuple[float, float]:
    """Jain et al.'s A/B by dataset family: Amazon 0.6/2.6, Wikipedia 0.5/0.4, otherwise 0.55/1.5."""
    low = name.lower()
    if "amazon" in low:
        return 0.6, 2.6
    if "wiki" in low:
        return 0.5, 0.4
    return 0.55, 1.5


@dataclass
class DatasetSpec:
    name: str
    source: str
    layout: str = "auto"
    text: str | None = None
    max_len: int | None = None
    propensity_a: float | None = None
    propensity_b: float | None = None
    strategy: str = "ngame"
    preset: str = "quick"
    overrides: dict[str, Any] = field(default_factory=dict)
    sha256: str | None = None  # hex SHA-256 of the source file/archive, checked before it is ingested
    # champion gate (asset registered_model): percentage points of test P@1 and PSP@1 a challenger may lose
    # and still be promoted, for runs whose run config sets no tolerance (sensor, schedule); None = 0
    gate_tolerance: float | None = None

    def validate(self, where: str = "catalog") -> "DatasetSpec":
        if not NAME_RE.fullmatch(self.name or ""):  # fullmatch: `$` alone would let a final newline through
            raise XCConfigError(f"{where}: dataset name {self.name!r} must match {NAME_RE.pattern}")
        if not str(self.source or "").strip():
            raise XCConfigError(f"{where}: dataset {self.name!r} has no source (expected a folder, file or URI)")
        if self.layout not in LAYOUTS:
            raise XCConfigError(f"{where}: dataset {self.name!r} layout {self.layout!r}; one of {LAYOUTS}")
        if self.text is not None and self.text not in TEXT_CHOICES:
            raise XCConfigError(f"{where}: dataset {self.name!r} text {self.text!r}; one of {TEXT_CHOICES}")
        if self.strategy not in STRATEGIES:
            raise XCConfigError(
                f"{where}: dataset {self.name!r} strategy {self.strategy!r}; one of {sorted(STRATEGIES)}")
        if self.preset not in PRESETS:
            raise XCConfigError(f"{where}: dataset {self.name!r} preset {self.preset!r}; one of {sorted(PRESETS)}")
        if self.max_len is not None and int(self.max_len) < 2:
            raise XCConfigError(f"{where}: dataset {self.name!r} max_len must be >= 2, got {self.max_len}")
        for key in ("propensity_a", "propensity_b"):
            self._check_propensity(key, where)
        try:
            self.sha256 = normalize_sha256(self.sha256)
        except XCConfigError as exc:
            raise XCConfigError(f"{where}: dataset {self.name!r} {exc}") from None
        if self.gate_tolerance is not None:
            self.gate_tolerance = parse_tolerance(self.gate_tolerance,
                                                  f"{where}: dataset {self.name!r} gate_tolerance")
        apply_overrides(PipelineConfig(), self.overrides, f"{where}: dataset {self.name!r} overrides")
        try:
            self.config()  # the ranges that depend on another field's value in the layered config
        except XCConfigError as exc:
            raise XCConfigError(f"{where}: dataset {self.name!r}: {exc}") from None
        return self

    def _check_propensity(self, key: str, where: str) -> None:
        """Option ``key`` (``--propensity A B``) unset, 0 (by dataset family) or a finite number > 0."""
        value = getattr(self, key)
        try:
            ok = value is None or (not isinstance(value, bool) and math.isfinite(float(value)) and float(value) >= 0)
        except (TypeError, ValueError):
            ok = False
        if not ok:
            raise XCConfigError(f"{where}: dataset {self.name!r} {key} (evaluate.{key}): expected a finite number "
                                f">= 0 (0 = by dataset family), got {value!r}")

    def family_propensity(self) -> tuple[float, float]:
        """Propensity A / B when none is given: the registry's for a known public dataset, else by family."""
        known = self.known
        return (known.propensity_a, known.propensity_b) if known else default_propensity(self.name)

    def propensity(self, a: float, b: float) -> tuple[float, float]:
        """``a`` / ``b`` with 0 (documented as "by dataset family") replaced by :meth:`family_propensity`'s."""
        fa, fb = self.family_propensity()
        return (a or fa, b or fb)

    @property
    def known(self) -> KnownDataset | None:
        """The registry entry of a known public dataset of this name, or None."""
        return lookup(self.name)

    @property
    def text_fields(self) -> str:
        known = self.known
        return self.text or (known.text if known else default_text(self.name))

    def option_overrides(self) -> dict[str, Any]:
        """The dataset options as ``stage.field`` overrides (layered under the explicit overrides).

        Unset options: the registry entry's values for a known public dataset, else defaults by name.
        """
        known = self.known
        a, b = self.propensity(self.propensity_a or 0.0, self.propensity_b or 0.0)  # unset or 0: by family
        text = self.text_fields
        if self.max_len:
            max_len = self.max_len
        elif known is not None and text == known.text:
            max_len = known.max_len
        else:
            max_len = 32 if text == "title" else 128
        return {
            "ingest.text": text,
            "tokenize.max_len": max_len,
            "evaluate.propensity_a": a,
            "evaluate.propensity_b": b,
        }

    def config(self, run_overrides: dict[str, Any] | None = None) -> PipelineConfig:
        """Effective config: preset < strategy < dataset options < catalog overrides < run overrides; an
        ``evaluate.propensity_a/b`` of 0 set by a later layer means the dataset family's value, as unset."""
        cfg = resolve_config(self.preset, self.strategy,
                             (f"dataset {self.name!r} options", self.option_overrides()),
                             (f"catalog overrides of {self.name!r}", self.overrides),
                             ("run config", run_overrides or {}))
        a, b = self.propensity(cfg.evaluate.propensity_a, cfg.evaluate.propensity_b)
        cfg.evaluate = dataclasses.replace(cfg.evaluate, propensity_a=a, propensity_b=b)
        return cfg

    def champion_tolerance(self, run_config: float | None = None) -> tuple[float, str]:
        """The champion gate's tolerance in percentage points and where it comes from: the run config's value
        when one is given, else this entry's ``gate_tolerance``, else 0."""
        if run_config is not None:
            return parse_tolerance(run_config, "run config registered_model.tolerance"), "run config"
        if self.gate_tolerance is not None:
            return (parse_tolerance(self.gate_tolerance, f"catalog dataset {self.name!r} gate_tolerance"),
                    "catalog gate_tolerance")
        return 0.0, "default"

    def to_yaml_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("name")
        return {k: v for k, v in d.items() if v not in (None, {}, "")}


class Catalog:
    """Read/write the catalog YAML (``datasets: {name: {source: ..., ...}}``).

    Writes replace the file atomically (temp + fsync + rename), so a reader needs no lock; every change is a
    read-modify-write under an exclusive ``flock`` on ``.catalog.yaml.lock`` beside it (:meth:`editing`), so
    concurrent processes (CLI, sensor) lose no entry (docs/decisions.md#catalog-flock).
    """

    def __init__(self, path: Path):
        self.path = Path(path)

    @property
    def lock_path(self) -> Path:
        return self.path.parent / f".{self.path.name}.lock"

    def load(self) -> dict[str, DatasetSpec]:
        if not self.path.exists():
            return {}
        try:
            raw = yaml.safe_load(self.path.read_text()) or {}
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            line = f":{mark.line + 1}" if mark is not None else ""
            raise XCConfigError(f"{self.path}{line}: not valid YAML ({exc})") from exc
        if not isinstance(raw, dict) or not isinstance(raw.get("datasets", {}), dict):
            raise XCConfigError(f"{self.path}: expected a mapping with a 'datasets' mapping")
        out = {}
        known = set(DatasetSpec.__dataclass_fields__) - {"name"}
        for name, entry in (raw.get("datasets") or {}).items():
            if not isinstance(entry, dict):
                raise XCConfigError(f"{self.path}: dataset {name!r}: expected a mapping, got {entry!r}")
            unknown = set(entry) - known
            if unknown:
                raise XCConfigError(f"{self.path}: dataset {name!r}: unknown keys {sorted(unknown)}; "
                                    f"known keys are {sorted(known)}")
            out[str(name)] = DatasetSpec(name=str(name), **_without_ignored_keys(entry, name, self.path)).validate(
                str(self.path))
        return out

    def names(self) -> list[str]:
        return sorted(self.load())

    def get(self, name: str) -> DatasetSpec:
        ds = self.load()
        if name not in ds:
            raise XCDatasetNotFound(f"dataset {name!r} is not in the catalog {self.path}; "
                                    f"known: {', '.join(sorted(ds)) or 'none'} (add it with "
                                    f"'xc-dagster datasets add {name} --source URI')")
        return ds[name]

    def save(self, datasets: dict[str, DatasetSpec]) -> None:
        """Replace the whole catalog with ``datasets`` (atomically, but without the lock: a change to the
        current entries goes through :meth:`editing`)."""
        body = {"datasets": {n: datasets[n].to_yaml_dict() for n in sorted(datasets)}}
        header = ("# xc-dagster dataset catalog: each entry is a Dagster partition.\n"
                  "# Keys: source, layout, text, max_len, propensity_a, propensity_b, strategy, preset, overrides,"
                  " sha256, gate_tolerance\n")
        atomic_write_text(self.path, header + yaml.safe_dump(body, sort_keys=False))

    @contextlib.contextmanager
    def editing(self) -> Iterator[dict[str, DatasetSpec]]:
        """Yield the current entries with the catalog locked; what the block leaves in them is saved when it
        succeeds (an error saves nothing). Not re-entrant: call no other changing method inside."""
        with file_lock(self.lock_path):
            ds = self.load()
            yield ds
            self.save(ds)

    def add(self, spec: DatasetSpec, replace: bool = False) -> None:
        spec.validate("datasets add")
        with self.editing() as ds:
            if spec.name in ds and not replace:
                raise XCConfigError(f"dataset {spec.name!r} is already in {self.path}; use --replace to change it")
            ds[spec.name] = spec

    def update(self, name: str, change: Callable[[DatasetSpec | None], DatasetSpec]) -> DatasetSpec:
        """Set entry ``name`` to ``change(current entry or None)``, read and written under the lock (an entry
        derived from the one it replaces, as the click-log registration's); returns the new entry."""
        with self.editing() as ds:
            spec = change(ds.get(name)).validate("catalog update")
            if spec.name != name:
                raise XCConfigError(f"catalog update of {name!r} returned the entry {spec.name!r}")
            ds[name] = spec
        return spec

    def remove(self, name: str) -> None:
        with self.editing() as ds:
            if name not in ds:
                raise XCDatasetNotFound(f"dataset {name!r} is not in the catalog {self.path}")
            del ds[name]


def _without_ignored_keys(entry: dict[str, Any], name: Any, path: Path) -> dict[str, Any]:
    """``entry`` without the ``preset`` / ``strategy`` overrides that earlier versions stored (``--set strategy=...``)
    and never applied: they are refused when given now, but an old catalog must still load (one bad entry would stop
    every partition); the entry keeps the preset and strategy it has always run with, and the user is told."""
    overrides = entry.get("overrides")
    if not isinstance(overrides, dict) or not {"preset", "strategy"} & set(overrides):
        return entry
    dropped = {k: overrides[k] for k in ("preset", "strategy") if k in overrides}
    _log.warning("%s: dataset %r: overrides %s were never applied (set them with --preset / --strategy); "
                 "ignored as before", path, name, dropped)
    return {**entry, "overrides": {k: v for k, v in overrides.items() if k not in dropped}}
