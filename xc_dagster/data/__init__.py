"""Dataset ingest: XC repository layouts -> the canonical :class:`XCDataset`, its on-disk form, and sources.

| module | what it holds |
|---|---|
| ``canonical`` | :class:`XCDataset` (texts, label matrices, filters, features, tokens) and its pickle-free folder |
| ``layouts`` | layout detection and :func:`read_dataset`: the registry of layout readers (``READERS``) |
| ``reader`` | :class:`ReadOptions` and the :class:`LayoutReader` protocol every layout reader implements |
| ``lf_raw`` | layout ``lf-raw``: ``{trn,tst,lbl}.json.gz`` JSON lines (Arrow fast path + line-by-line reference) |
| ``bow`` | layout ``bow``: legacy ``*train*.txt`` / ``*test*.txt`` with header ``N D L`` |
| ``bow_single`` | layout ``bow-single``: one ``<Name>_data.txt`` with ``_trSplit.txt`` / ``_tstSplit.txt`` tables |
| ``split_sparse`` | layout ``split-sparse``: ``{trn,tst}_X_{Xf,Y}.txt`` with header ``rows cols`` and text companions |
| ``tokenized`` | layout ``tokenized``: ``{trn_doc,tst_doc,lbl}_{input_ids,attention_mask}.npy`` + split-sparse labels |
| ``companions`` | files shared by layouts: filter files, ``Y.txt`` label names, vocabularies (BoW texts) |
| ``streaming`` | chunked, bounded-memory parsers of ``idx:val`` rows, BoW rows and split index tables |
| ``accumulators`` | sparse-row accumulators (chunk by chunk, row by row) with one CSR build at the end |
| ``textio`` | line / chunk input, UTF-8 and gzip errors, ``rows cols`` / ``N D L`` headers |
| ``limits`` | bounds on untrusted input (line length, expansion of compressed sources, unused header columns) |
| ``sources`` | :func:`resolve_source`: a source URI (path, ``file://``, ``http(s)://``, fsspec) -> a local folder |
| ``download`` | resumable HTTP(S) download of a source file |
| ``archives`` | safe extraction of ``.zip`` / ``.tar[.gz]`` / ``.tgz`` / single-file ``.gz`` sources |
| ``cache`` | the source cache (keys, atomic install, sweep of killed installs, lock) and SHA-256 checksums |
| ``registry`` | the XC repository's known datasets: published counts, text fields, A/B, reference results |
| ``checks`` | validation of an ingested dataset (the ingest asset's checks) and the label-frequency plot |
| ``clicklog_reader`` | reading and validating click-log files (Parquet, CSV, JSON lines) |
| ``clicklog`` | click logs over a time window -> an ``lf-raw`` dataset folder with a stable label map |
| ``splits`` | the validation split carved from the training points and its targets |
| ``synthetic`` | generated ``lf-raw`` datasets with planted structure, of any shape (its ``python -m`` CLI) |
| ``synthetic_text`` | the generator's made-up vocabulary and vectorised text composition |
"""

from xc_dagster.data.archives import extract_archive
from xc_dagster.data.canonical import XCDataset, load_dataset, load_label_texts, save_dataset
from xc_dagster.data.layouts import LAYOUTS, detect_layout, read_dataset
from xc_dagster.data.sources import resolve_source

__all__ = ["LAYOUTS", "XCDataset", "detect_layout", "extract_archive", "load_dataset", "load_label_texts",
           "read_dataset", "resolve_source", "save_dataset"]
