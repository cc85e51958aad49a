"""Dataset ingest: XC repository layouts -> the canonical :class:`XCDataset`, its on-disk form, and sources."""

from xc_dagster.data.canonical import XCDataset, load_dataset, load_label_texts, save_dataset
from xc_dagster.data.layouts import LAYOUTS, detect_layout, read_dataset
from xc_dagster.data.sources import extract_archive, resolve_source

__all__ = ["LAYOUTS", "XCDataset", "detect_layout", "extract_archive", "load_dataset", "load_label_texts",
           "read_dataset", "resolve_source", "save_dataset"]
