"""Layout detection and dispatch: which XC repository layout a folder holds, and the reader that parses it.

Five layouts (see ALGORITHMS.md, "XC repository file formats"), each read by one class in its own module:

- ``lf-raw`` (:mod:`~xc_dagster.data.lf_raw`): ``trn.json.gz``, ``tst.json.gz``, ``lbl.json.gz`` JSON lines;
- ``bow`` (:mod:`~xc_dagster.data.bow`): legacy ``*train*.txt`` / ``*test*.txt`` with header ``N D L``;
- ``bow-single`` (:mod:`~xc_dagster.data.bow_single`): the XC repository's single ``<Name>_data.txt`` with
  ``<name>_trSplit.txt`` / ``<name>_tstSplit.txt`` index tables;
- ``split-sparse`` (:mod:`~xc_dagster.data.split_sparse`): ``{trn,tst}_X_{Xf,Y}.txt`` with header ``rows cols``;
- ``tokenized`` (:mod:`~xc_dagster.data.tokenized`): ``{trn_doc,tst_doc,lbl}_{input_ids,attention_mask}.npy``
  plus the split-sparse label files.

Filter files ``filter_labels_{train,test}.txt`` are read for every layout when present.
Every problem in a file raises :class:`XCFormatError` naming the file, the 1-based line and what was expected.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from xc_dagster.data.bow import BowLayout
from xc_dagster.data.bow_single import BowSingleLayout
from xc_dagster.data.canonical import XCDataset
from xc_dagster.data.lf_raw import LF_FILES, LFRawLayout
from xc_dagster.data.reader import LayoutReader, ReadOptions
from xc_dagster.data.split_sparse import REQUIRED as SPLIT_REQUIRED
from xc_dagster.data.split_sparse import SplitSparseLayout
from xc_dagster.data.textio import DEFAULT_CHUNK_LINES
from xc_dagster.data.tokenized import TokenizedLayout
from xc_dagster.errors import XCConfigError, XCDatasetNotFound, XCFormatError

READERS: dict[str, LayoutReader] = {
    "lf-raw": LFRawLayout(),
    "bow": BowLayout(),
    "bow-single": BowSingleLayout(),
    "split-sparse": SplitSparseLayout(),
    "tokenized": TokenizedLayout(),
}
LAYOUTS = tuple(READERS)
# the order folders are tested in (first match wins): a tokenized folder also holds the split-sparse label
# files, and the legacy BoW file-name rule is the loosest
DETECTION_ORDER = ("lf-raw", "tokenized", "split-sparse", "bow-single", "bow")
TEXT_FIELDS = ("title", "content")


def _check_folder(folder: Path) -> Path:
    folder = Path(folder)
    if not folder.is_dir():
        raise XCDatasetNotFound(f"dataset folder {folder} does not exist or is not a folder")
    return folder


def detect_layout(folder: Path) -> str:
    """Which layout a folder holds: ``lf-raw``, ``tokenized``, ``split-sparse``, ``bow-single`` or ``bow``
    (checked in that order)."""
    folder = _check_folder(folder)
    names = sorted(p.name for p in folder.iterdir())
    for layout in DETECTION_ORDER:
        if READERS[layout].detect(folder, names):
            return layout
    listing = ", ".join(names[:30]) + (f", ... ({len(names)} in all)" if len(names) > 30 else "")
    raise XCFormatError(
        folder, None,
        f"a known dataset layout: lf-raw ({', '.join(LF_FILES)}), tokenized "
        f"(trn_doc_input_ids.npy, ... with {', '.join(SPLIT_REQUIRED)}), split-sparse ({', '.join(SPLIT_REQUIRED)}), "
        "bow-single (<Name>_data.txt with <name>_trSplit.txt, <name>_tstSplit.txt) or bow (one *train*.txt "
        "and one *test*.txt starting with 'N D L'); "
        f"files found: {listing or 'none'}")


def _check_fields(fields: Sequence[str], what: str) -> tuple[str, ...]:
    if isinstance(fields, str):
        fields = (fields,)
    out = tuple(fields)
    if not out or any(f not in TEXT_FIELDS for f in out):
        raise XCConfigError(f"{what} must be a non-empty subset of {TEXT_FIELDS}, got {out!r}")
    return out


def read_dataset(folder: Path, *, layout: str = "auto", text_fields: Sequence[str] = ("title",),
                 label_text_fields: Sequence[str] | None = None, split: int = 0,
                 chunk_lines: int = DEFAULT_CHUNK_LINES) -> XCDataset:
    """Parse a dataset folder into an :class:`XCDataset` (``layout="auto"`` detects it).

    ``text_fields``/``label_text_fields`` (subsets of ``title``, ``content``) compose point and label texts
    of the ``lf-raw`` layout; other layouts carry a single text per point. ``split`` picks the column of the
    ``bow-single`` split tables (0-based); ``chunk_lines`` is the streaming parsers' chunk size in lines.
    """
    if chunk_lines < 1:
        raise XCConfigError(f"chunk_lines must be >= 1, got {chunk_lines!r}")
    folder = _check_folder(folder)
    fields = _check_fields(text_fields, "text_fields")
    lfields = fields if label_text_fields is None else _check_fields(label_text_fields, "label_text_fields")
    if layout == "auto":
        layout = detect_layout(folder)
    reader = READERS.get(layout) if isinstance(layout, str) else None
    if reader is None:
        raise XCConfigError(f"layout must be 'auto' or one of {LAYOUTS}, got {layout!r}")
    opts = ReadOptions(text_fields=fields, label_text_fields=lfields, split=split, chunk_lines=chunk_lines)
    ds = reader.read(folder, opts)
    require_content(ds, folder)
    return ds


def require_content(ds: XCDataset, folder: Path) -> None:
    """Refuse a dataset that parses but holds nothing to learn from (no labels, points, label entries or point
    input): later stages would fail on it far from the cause."""
    X = ds.X_train
    no_x = X is None or not X.data.any()  # stored zeros are no feature
    no_input = ds.train_tokens is None and no_x and not any(ds.train_texts)
    problems = (
        (ds.num_labels == 0, "at least one label", "0 labels"),
        (ds.num_train == 0 or ds.num_test == 0, "at least one training and one test point",
         f"{ds.num_train} training and {ds.num_test} test points"),
        (ds.Y_train.nnz == 0, "at least one label of a training point", "an all-zero training label matrix"),
        (X is not None and no_x, "at least one non-zero feature of a training point (or no feature files)",
         "an all-zero training feature matrix"),
        (no_input, "point texts, features or token arrays for the training points", "every training text empty"),
    )
    for bad, expected, got in problems:
        if bad:
            raise XCFormatError(folder, None, f"{expected} ({ds.layout} layout)", got=got)
