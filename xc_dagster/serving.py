"""Serving: the registered MLflow model (text in, top-k labels out) and champion/challenger promotion.

The model is an MLflow pyfunc (:class:`XCModel`) logged with *models from code*: the model's code is a
three-line file that imports this module, so nothing is pickled. Its one artifact is a *bundle* folder
that loads from plain files only:

=====================  ==================================================================================
``encoder/``           the trained encoder and its tokenizer (safetensors + HF JSON files, or the bag encoder)
``W.npy``              classifier matrix (L, D)
``label_emb.npy``      label embeddings (L, D)
``*.index``            the ANNS indexes of the shortlist sources the model was evaluated with (faiss HNSW
                       files, or ``.npy`` vectors for ``exact``): ``W.index``, ``label_emb.index`` and, for
                       SiameseXML's Module II, ``centroid.index``, ``knn.index`` (+ ``knn_labels.npz``)
``label_centroid.npy`` label centroids, when the sources or the label representation use them
``fusion.json``        the fitted fusion (alpha or tree), as the fusion stage wrote it
``inv_prop.npy``       inverse propensities of the labels (the tree fusion's third feature)
``labels.parquet``     label texts (column ``text``, row = label id)
``serving.json``       how to use them: max_len, pooling, index kind and efSearch, shortlist size, amp, k
=====================  ==================================================================================

``predict_topk(texts, bundle, k)`` is the whole inference path (tokenize with the training max_len, encode,
shortlist from the indexes, fuse, top-k): the pyfunc and ``bench/serving_bench.py`` both call it, and it
gives the evaluation stage's predictions for the same texts (same tokenizer, chunking and autocast).

Registry: one registered model per dataset, ``xc-<dataset>``. The first version gets the alias
``champion``; later ones get ``challenger`` and carry their test P@1 / PSP@1 as version tags, which the
gate (:func:`champion_gate`) compares with the champion's on the same test split (re-evaluating the
champion when its numbers were measured on another split) and, within the tolerance, promotes.

No Dagster here; ``assets/model_registry.py`` is the thin asset around :func:`register_model` and
:func:`champion_gate`.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import logging
import math
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Mapping, Sequence

import mlflow
import numpy as np
import pandas as pd
import torch

from xc_dagster.catalog import parse_tolerance
from xc_dagster.device import amp_dtype, resolve_device
from xc_dagster.encoder import encode_tokens, load_encoder, load_tokenizer
from xc_dagster.errors import XCConfigError, XCError
from xc_dagster.fusion import load_fusion
from xc_dagster.predict import (CENTROID_FILE, INDEX_FILES, KNN_LABELS_FILE, ShortlistSources, load_sources,
                                retrieve, topk_from_scores)
from xc_dagster.storage import load_json, save_json
from xc_dagster.warm_start import SERVING_FILE

if TYPE_CHECKING:  # pragma: no cover
    from mlflow.tracking import MlflowClient

    from xc_dagster.pipeline import StageContext
    from xc_dagster.tracking import Tracker

log = logging.getLogger("xc_dagster")

BUNDLE_FORMAT = 1
CHAMPION, CHALLENGER = "champion", "challenger"
GATE_METRICS = ("precision_at_1", "psprecision_at_1")
RUN_METRICS = ("precision_at_1", "precision_at_3", "precision_at_5", "psprecision_at_1", "psprecision_at_3",
               "psprecision_at_5", "ndcg_at_5", "shortlist_recall")
ASSET_TAG = "registered_model"
DEVICE_ENV = "XC_SERVING_DEVICE"  # device of a served model: auto (default) | cpu | cuda
THREADS_ENV = "XC_SERVING_THREADS"  # torch + faiss CPU threads of a served model (unset: their defaults)
_EPS = 1e-9  # float slack of the tolerance comparison: a drop of exactly the tolerance is within it

# the model's code (MLflow "models from code"): importing this module, no pickle
MODEL_CODE = '''"""xc-dagster pyfunc model (models from code): text in, top-k labels out."""
import mlflow

from xc_dagster.serving import XCModel

mlflow.models.set_model(XCModel())
'''
# the third-party distributions a served model imports (versions: the ones installed when it was logged)
_REQUIREMENTS = ("mlflow", "torch", "transformers", "tokenizers", "safetensors", "faiss-cpu", "numpy", "scipy",
                 "pandas", "pyarrow")


# ------------------------------------------------------------------------------------------------ bundle

@dataclass
class ServingBundle:
    """Everything ``predict_topk`` needs, loaded from a bundle folder."""

    encoder: torch.nn.Module
    tokenizer: Any
    max_len: int
    sources: ShortlistSources  # W, label representation and the shortlist's indexes
    fusion: Any  # load_fusion(...): .score(shortlist, inv_prop)
    inv_prop: np.ndarray
    label_texts: np.ndarray  # object array, row = label id
    shortlist_size: int
    device: torch.device
    dtype: torch.dtype | None
    batch_size: int
    default_k: int
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def W(self) -> np.ndarray:
        return self.sources.W

    @property
    def num_labels(self) -> int:
        return int(len(self.W))


def _link_or_copy(src: Path, dst: Path) -> None:
    """Hard-link ``src`` to ``dst`` (no second copy of a GB-sized index), copying across file systems."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _link_tree(src: Path, dst: Path) -> None:
    for f in sorted(src.rglob("*")):
        if f.is_file():
            _link_or_copy(f, dst / f.relative_to(src))


def write_bundle(ctx: "StageContext", out: Path, default_k: int = 10, shortlist_size: int = 0,
                 ef_search: int = 0) -> dict[str, Any]:
    """Assemble the serving bundle of ``ctx``'s dataset from the stages' artifacts into ``out``.

    Reads the deployed encoder and label_emb.npy (pretrain's, or classifier's when trained end to end), classifier/W.npy, the index stage's files,
    fusion/fusion.json and the ingested label texts; computes the inverse propensities as evaluation does.
    ``shortlist_size`` / ``ef_search`` > 0 override the evaluated ``index.shortlist_size`` /
    ``index.hnsw_ef_search`` (a faster, slightly less exact serving setting). Returns ``serving.json``.
    """
    from xc_dagster.data import load_dataset
    from xc_dagster.metrics import inverse_propensity

    if default_k < 1:
        raise XCConfigError(f"serving default_k: expected >= 1, got {default_k}")
    if shortlist_size < 0 or ef_search < 0:
        raise XCConfigError(f"serving shortlist_size / ef_search: expected >= 0 (0 = as evaluated), got "
                            f"{shortlist_size} / {ef_search}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    from xc_dagster.pipeline import model_dir

    pre, idx = model_dir(ctx), ctx.dir("index")  # the deployed encoder: pretrain's, or the end-to-end one
    _link_tree(pre / "encoder", out / "encoder")
    _link_or_copy(pre / "label_emb.npy", out / "label_emb.npy")
    _link_or_copy(ctx.dir("classifier") / "W.npy", out / "W.npy")
    idx_summary = load_json(idx / "summary.json")
    sources = idx_summary.get("sources", ["W", "label"])
    for name in [INDEX_FILES[n] for n in sources] + [KNN_LABELS_FILE, CENTROID_FILE]:
        if (idx / name).exists():
            _link_or_copy(idx / name, out / name)
    _link_or_copy(ctx.dir("fusion") / "fusion.json", out / "fusion.json")
    ds_dir = ctx.dir("ingest") / "dataset"
    _link_or_copy(ds_dir / "label_texts.parquet", out / "labels.parquet")
    ds = load_dataset(ds_dir, texts=False, features=False)
    inv = inverse_propensity(ds.Y_train, ctx.cfg.evaluate.propensity_a, ctx.cfg.evaluate.propensity_b)
    np.save(out / "inv_prop.npy", np.asarray(inv, dtype=np.float64), allow_pickle=False)
    pre_summary = load_json(pre / "summary.json")
    tok_summary = load_json(ctx.dir("tokenize") / "summary.json")
    fusion_method = load_json(out / "fusion.json").get("method")
    info = {
        "format": BUNDLE_FORMAT, "dataset": ctx.name, "strategy": ctx.cfg.strategy, "preset": ctx.cfg.preset,
        "encoder_source": ctx.cfg.tokenize.encoder, "encoder_type": pre_summary.get("encoder_type"),
        "pooling": pre_summary.get("pooling", ctx.cfg.pretrain.pooling),
        "max_len": int(tok_summary.get("max_len", ctx.cfg.tokenize.max_len)),
        "amp": ctx.cfg.pretrain.amp, "encode_batch_size": int(ctx.cfg.pretrain.encode_batch_size),
        "index_kind": idx_summary["kind"], "sources": list(sources),
        "label_repr": idx_summary.get("label_repr", "text"),
        "knn_neighbours": int(idx_summary.get("knn_neighbours", 0)), "ef_search": int(ef_search or ctx.cfg.index.hnsw_ef_search),
        "shortlist_size": int(shortlist_size or ctx.cfg.index.shortlist_size), "fusion": fusion_method,
        "as_evaluated": (not shortlist_size or shortlist_size == ctx.cfg.index.shortlist_size)
                        and (not ef_search or ef_search == ctx.cfg.index.hnsw_ef_search),
        "num_labels": int(idx_summary["labels"]), "dim": int(idx_summary["dim"]), "default_k": int(default_k),
        "propensity_a": ctx.cfg.evaluate.propensity_a, "propensity_b": ctx.cfg.evaluate.propensity_b,
    }
    save_json(out / SERVING_FILE, info)
    return info


def load_bundle(folder: str | Path, device: str | torch.device | None = None) -> ServingBundle:
    """Load a bundle folder (no pickle: safetensors, .npy, faiss files, JSON, Parquet).

    ``device``: ``auto`` (CUDA when present), ``cpu`` or ``cuda``; default ``$XC_SERVING_DEVICE`` or auto.
    Autocast follows the ``pretrain.amp`` value the model was evaluated with, on this device.
    """
    import pyarrow.parquet as pq

    folder = Path(folder)
    path = folder / SERVING_FILE
    if not path.is_file():
        raise XCError(f"serving bundle {folder}: no {SERVING_FILE}; not a bundle written by write_bundle")
    info = load_json(path)
    if info.get("format") != BUNDLE_FORMAT:
        raise XCError(f"serving bundle {path}: format {info.get('format')!r}, this code reads {BUNDLE_FORMAT}")
    dev = device if isinstance(device, torch.device) else resolve_device(device or os.environ.get(DEVICE_ENV)
                                                                          or "auto")
    encoder = load_encoder(str(folder / "encoder"), info["pooling"]).to(dev).eval()
    tokenizer = load_tokenizer(str(folder / "encoder"))
    kind, efs = info["index_kind"], int(info["ef_search"])
    labels = pq.read_table(folder / "labels.parquet", columns=["text"]).column("text").to_pylist()
    label_texts = np.array(["" if t is None else t for t in labels], dtype=object)
    W = np.load(folder / "W.npy", allow_pickle=False)
    if len(label_texts) != len(W):
        raise XCError(f"serving bundle {folder}: {len(label_texts)} label texts for {len(W)} classifiers")
    return ServingBundle(
        encoder=encoder, tokenizer=tokenizer, max_len=int(info["max_len"]),
        sources=load_sources(folder, tuple(info.get("sources", ("W", "label"))), info.get("label_repr", "text"),
                             kind, efs, W, np.load(folder / "label_emb.npy", allow_pickle=False),
                             int(info.get("knn_neighbours", 0))),
        fusion=load_fusion(load_json(folder / "fusion.json")),
        inv_prop=np.load(folder / "inv_prop.npy", allow_pickle=False), label_texts=label_texts,
        shortlist_size=int(info["shortlist_size"]), device=dev, dtype=amp_dtype(dev, info.get("amp", "auto")),
        batch_size=int(info.get("encode_batch_size", 256)), default_k=int(info.get("default_k", 10)), info=info)


# --------------------------------------------------------------------------------------------- inference

def tokenize_texts(tokenizer, texts: Sequence[str], max_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Token ids (n, longest) int32 and lengths, as the tokenize stage writes them (empty text -> " ")."""
    batch = [t if isinstance(t, str) and t else " " for t in texts]
    if not batch:
        return np.zeros((0, 1), dtype=np.int32), np.zeros(0, dtype=np.int32)
    enc = tokenizer(batch, truncation=True, max_length=max_len, padding="longest", return_attention_mask=True,
                    return_tensors="np")
    ids = enc["input_ids"].astype(np.int32)
    mask = enc["attention_mask"]
    ids[mask == 0] = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    return ids, mask.sum(1).astype(np.int32)


def encode_texts(texts: Sequence[str], bundle: ServingBundle) -> np.ndarray:
    """Unit embeddings (n, D) float32 of ``texts`` with the bundled tokenizer and encoder."""
    ids, lens = tokenize_texts(bundle.tokenizer, texts, bundle.max_len)
    if len(lens) == 0:
        return np.zeros((0, bundle.W.shape[1]), dtype=np.float32)
    return encode_tokens(bundle.encoder, ids, lens, bundle.device, bundle.dtype, bundle.batch_size)


def rank(queries: np.ndarray, bundle: ServingBundle, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The index + fusion part: shortlist from the indexes, fused scores, top-k (ids -1 padded)."""
    if k < 1:
        raise XCConfigError(f"k: expected >= 1, got {k}")
    if len(queries) == 0:
        return np.zeros((0, k), dtype=np.int64), np.zeros((0, k), dtype=np.float32)
    sl = retrieve(queries, bundle.sources, bundle.shortlist_size)
    return topk_from_scores(sl.ids, bundle.fusion.score(sl, bundle.inv_prop), k)


def predict_topk(texts: Sequence[str], bundle: ServingBundle, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Top-k (label ids int64, scores float32) per text, ids -1 (score -inf) past the shortlist's end."""
    return rank(encode_texts(texts, bundle), bundle, k)


def predictions_frame(ids: np.ndarray, scores: np.ndarray, bundle: ServingBundle) -> pd.DataFrame:
    """One row per input: ``label_ids`` (list[int]), ``labels`` (list[str]), ``scores`` (list[float])."""
    out_ids, out_labels, out_scores = [], [], []
    for row_ids, row_s in zip(ids, scores):
        keep = row_ids >= 0
        r = row_ids[keep]
        out_ids.append([int(i) for i in r])
        out_labels.append([str(t) for t in bundle.label_texts[r]])
        out_scores.append([float(s) for s in row_s[keep]])
    return pd.DataFrame({"label_ids": out_ids, "labels": out_labels, "scores": out_scores})


def _input_texts(model_input: Any) -> list[str]:
    if isinstance(model_input, pd.DataFrame):
        if "text" in model_input.columns:
            col = model_input["text"]
        elif model_input.shape[1] == 1:
            col = model_input.iloc[:, 0]
        else:
            raise XCError(f"model input: expected a column 'text', got columns {list(model_input.columns)}")
        return ["" if v is None or (isinstance(v, float) and math.isnan(v)) else str(v) for v in col]
    if isinstance(model_input, str):
        return [model_input]
    if isinstance(model_input, (list, tuple, pd.Series, np.ndarray)):
        return [str(v) for v in model_input]
    if isinstance(model_input, Mapping) and "text" in model_input:
        return _input_texts(pd.DataFrame({"text": list(np.atleast_1d(model_input["text"]))}))
    raise XCError(f"model input: expected a DataFrame with a 'text' column, got {type(model_input).__name__}")


def _param_k(params: Mapping[str, Any] | None, default: int) -> int:
    k = (params or {}).get("k", default)
    try:
        k = int(k)
    except (TypeError, ValueError):
        raise XCConfigError(f"param k: expected an integer, got {k!r}") from None
    if k < 1:
        raise XCConfigError(f"param k: expected >= 1, got {k}")
    return k


class XCModel(mlflow.pyfunc.PythonModel):
    """MLflow pyfunc: ``predict(DataFrame({"text": [...]}), params={"k": 10})`` -> per row the top-k
    ``label_ids``, ``labels`` (texts) and ``scores``; fewer than k when the shortlist is shorter."""

    def __init__(self) -> None:
        self.bundle: ServingBundle | None = None

    def load_context(self, context) -> None:
        threads = os.environ.get(THREADS_ENV)
        if threads:  # e.g. 1 per worker: single queries are too small to split across cores
            import faiss

            torch.set_num_threads(int(threads))
            faiss.omp_set_num_threads(int(threads))
        self.bundle = load_bundle(context.artifacts["bundle"])

    def predict(self, context, model_input: pd.DataFrame, params: dict[str, Any] | None = None) -> pd.DataFrame:
        if self.bundle is None:  # pragma: no cover - MLflow always calls load_context first
            self.load_context(context)
        k = _param_k(params, self.bundle.default_k)
        ids, scores = predict_topk(_input_texts(model_input), self.bundle, k)
        return predictions_frame(ids, scores, self.bundle)


# ---------------------------------------------------------------------------------------------- logging

def model_name(dataset: str) -> str:
    """The registered model name of a dataset: ``xc-<dataset>``, characters other than [A-Za-z0-9._-]
    replaced by '-' (names go into ``models:/<name>@<alias>`` URIs)."""
    return "xc-" + re.sub(r"[^A-Za-z0-9._-]+", "-", dataset).strip("-")


@contextlib.contextmanager
def use_tracking_uri(uri: str) -> Iterator[None]:
    """Point MLflow's fluent API (start_run, log_model, load_model of ``models:/``) at ``uri`` for a while.

    ``mlflow.set_tracking_uri`` also exports ``MLFLOW_TRACKING_URI`` (MLflow 3), which would outlive the
    call and redirect every later tracker of the process (``Home.mlflow_uri`` reads it): both are restored.
    """
    from mlflow.tracking._tracking_service import utils as tracking_utils

    old_uri = getattr(tracking_utils, "_tracking_uri", None)
    old_env = os.environ.get("MLFLOW_TRACKING_URI")
    mlflow.set_tracking_uri(uri)
    try:
        yield
    finally:
        tracking_utils.set_tracking_uri(old_uri)  # None unsets the fluent URI (and the variable)
        if old_env is None:
            os.environ.pop("MLFLOW_TRACKING_URI", None)
        else:
            os.environ["MLFLOW_TRACKING_URI"] = old_env


def pip_requirements() -> list[str]:
    """Pinned requirements of a served model: the installed versions (faiss-gpu counts for faiss-cpu).

    xc-dagster itself is not on PyPI: its code travels with the model (``code_paths``) or comes from the
    environment the server runs in (``--env-manager local``).
    """
    out = []
    for dist in _REQUIREMENTS:
        for cand in ((dist, "faiss-gpu", "faiss-gpu-cu12") if dist == "faiss-cpu" else (dist,)):
            try:
                out.append(f"{cand}=={importlib.metadata.version(cand)}")
                break
            except importlib.metadata.PackageNotFoundError:
                continue
    return out


def _library_copy(dst: Path) -> Path:
    """A copy of the xc_dagster package without its embedded datasets and caches (the model's code)."""
    src = Path(__file__).resolve().parent
    target = dst / "xc_dagster"
    shutil.copytree(src, target, ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "builtin_data"))
    return target


def log_pyfunc(bundle_dir: Path, example_texts: Sequence[str], default_k: int = 10, bundle_code: bool = True,
               registered_model_name: str | None = None, device: str | torch.device | None = None):
    """Log the bundle as an MLflow pyfunc model (models from code) in the active run; returns the ModelInfo.

    The signature (input: column ``text``; output: ``label_ids`` / ``labels`` / ``scores`` arrays;
    params: ``k``, default ``default_k``) is inferred from a prediction of ``example_texts`` by the bundle
    itself, which is also the input example. ``bundle_code`` ships a copy of the library as the model's
    ``code_paths`` (then the model serves with the code it was logged with).
    """
    from mlflow.models import infer_signature

    example = [t if t else " " for t in list(example_texts)[:2]] or ["example"]
    bundle = load_bundle(bundle_dir, device)
    out = predictions_frame(*predict_topk(example, bundle, default_k), bundle)
    inp = pd.DataFrame({"text": example})
    signature = infer_signature(inp, out, params={"k": int(default_k)})
    with tempfile.TemporaryDirectory(prefix="xc-model-code-") as tmp:
        code_file = Path(tmp) / "xc_model.py"
        code_file.write_text(MODEL_CODE)
        code_paths = [str(_library_copy(Path(tmp) / "lib"))] if bundle_code else None
        return mlflow.pyfunc.log_model(
            name="model", python_model=str(code_file), artifacts={"bundle": str(bundle_dir)},
            code_paths=code_paths, signature=signature, input_example=inp,
            pip_requirements=pip_requirements(), registered_model_name=registered_model_name)


# --------------------------------------------------------------------------------------------- registry

def split_fingerprint(ctx: "StageContext") -> str:
    """SHA-256 of what the test metrics depend on besides the model: the test texts (or shipped tokens),
    test label matrix, test filter pairs and the labels' inverse propensities. Equal fingerprints = numbers
    measured on the same split, directly comparable."""
    from xc_dagster.data import load_dataset
    from xc_dagster.metrics import inverse_propensity

    ds = load_dataset(ctx.dir("ingest") / "dataset", features=False)
    h = hashlib.sha256()
    Y = ds.Y_test.tocsr()
    h.update(repr(Y.shape).encode())
    for a in (Y.indptr.astype(np.int64), Y.indices.astype(np.int64), np.asarray(ds.filter_test, np.int64)):
        h.update(np.ascontiguousarray(a).tobytes())
    inv = inverse_propensity(ds.Y_train, ctx.cfg.evaluate.propensity_a, ctx.cfg.evaluate.propensity_b)
    h.update(np.round(np.asarray(inv, dtype=np.float64), 9).tobytes())
    for t in ds.test_texts:
        h.update(t.encode("utf-8", "surrogatepass") + b"\0")
    if ds.test_tokens is not None:
        h.update(np.ascontiguousarray(ds.test_tokens[0]).tobytes())
    return h.hexdigest()


def _latest_run_id(client: "MlflowClient", experiment_id: str, asset: str) -> str | None:
    runs = client.search_runs([experiment_id], f"tags.asset = '{asset}' and attributes.status = 'FINISHED'",
                              order_by=["attributes.start_time DESC"], max_results=1)
    return runs[0].info.run_id if runs else None


def _aliases(client: "MlflowClient", name: str) -> dict[str, str]:
    return {a: str(v) for a, v in (client.get_registered_model(name).aliases or {}).items()}


def register_model(ctx: "StageContext", tracker: "Tracker", tags: Mapping[str, str] | None = None,
                   default_k: int = 10, bundle_code: bool = True, device: str | torch.device | None = None,
                   shortlist_size: int = 0, ef_search: int = 0) -> dict[str, Any]:
    """Log the dataset's model (one run tagged ``asset=registered_model`` in the dataset's experiment) and
    register it as ``xc-<dataset>``; alias ``champion`` if the model has none, else ``challenger``.

    The version's tags hold its test ``precision_at_1`` / ``psprecision_at_1`` (from the evaluation stage's
    ``metrics.json``; with a serving ``shortlist_size`` / ``ef_search`` other than the evaluated ones, from
    a re-evaluation of the bundle on the test split, so they are the served model's numbers), the split
    fingerprint and the evaluation run id, so the gate reads both sides.
    Returns name, version, alias, URIs, run and model ids, metrics (and their source) and fingerprint.
    """
    metrics = load_json(ctx.dir("evaluate") / "metrics.json")
    metrics_source = "evaluation"
    missing = [m for m in GATE_METRICS if m not in metrics]
    if missing:
        raise XCError(f"dataset {ctx.name!r}: evaluate/metrics.json lacks {missing}; re-run evaluation")
    name = model_name(ctx.name)
    client = tracker.client
    exp_id = tracker.experiment_id(ctx.name)
    eval_run = _latest_run_id(client, exp_id, "evaluate")
    fp = split_fingerprint(ctx)
    from xc_dagster.data import load_dataset

    ds = load_dataset(ctx.dir("ingest") / "dataset", features=False)
    example = [t for t in ds.test_texts[:2] if t] or [t for t in ds.label_texts[:2] if t] or ["example"]
    params = {**ctx.cfg.flat(), "serving.default_k": default_k, "serving.bundle_code": bundle_code,
              "serving.shortlist_size": shortlist_size, "serving.ef_search": ef_search}
    run_tags = {"registered_model": name, **({"evaluation_run_id": eval_run} if eval_run else {}),
                **dict(tags or {})}
    with tempfile.TemporaryDirectory(prefix="xc-bundle-") as tmp, \
            tracker.run(ctx.name, ASSET_TAG, params, run_tags) as run, use_tracking_uri(tracker.tracking_uri), \
            mlflow.start_run(run_id=run.run_id):
        bundle_dir = Path(tmp) / "bundle"
        info = write_bundle(ctx, bundle_dir, default_k, shortlist_size, ef_search)
        if not info["as_evaluated"]:  # the served settings' own numbers
            metrics = evaluate_bundle(load_bundle(bundle_dir, device), ctx)
            metrics_source = "re-evaluated with the serving shortlist/efSearch"
        model_info = log_pyfunc(bundle_dir, example, default_k, bundle_code, registered_model_name=name,
                                device=device)
        version = str(model_info.registered_model_version)
        run.log_final({m: float(metrics[m]) for m in RUN_METRICS if m in metrics})
        run.log_dict(info, "serving.json")
        alias = CHALLENGER if CHAMPION in _aliases(client, name) else CHAMPION
        client.set_registered_model_alias(name, alias, version)
        if alias == CHAMPION:
            client.update_registered_model(
                name, description=f"xc-dagster model of dataset {ctx.name}: text -> top-k labels with scores")
        version_tags = {"dataset": ctx.name, "test_split": fp, "registered_as": alias, "run_id": run.run_id,
                        "metrics_source": metrics_source,
                        "strategy": ctx.cfg.strategy, "preset": ctx.cfg.preset, "fusion": str(info["fusion"]),
                        **{m: repr(float(metrics[m])) for m in GATE_METRICS}}
        if eval_run:
            version_tags["evaluation_run_id"] = eval_run
        for k, v in version_tags.items():
            client.set_model_version_tag(name, version, k, v)
    ctx.info(f"registered {name} version {version} as {alias}")
    return {"name": name, "version": version, "alias": alias, "model_uri": f"models:/{name}/{version}",
            "alias_uri": f"models:/{name}@{alias}", "run_id": run.run_id, "model_id": model_info.model_id,
            "artifact_uri": model_info.model_uri, "evaluation_run_id": eval_run, "test_split": fp,
            "metrics": {m: float(metrics[m]) for m in GATE_METRICS}, "metrics_source": metrics_source,
            "serving": info}


def evaluate_bundle(bundle: ServingBundle, ctx: "StageContext") -> dict[str, float]:
    """The evaluation stage's test metrics of a bundle on ``ctx``'s current test split (texts through
    ``predict_topk``, filter pairs removed, same top_k and propensities)."""
    from xc_dagster.data import load_dataset
    from xc_dagster.metrics import evaluate, inverse_propensity, remove_filtered

    ds = load_dataset(ctx.dir("ingest") / "dataset", features=False)
    if ds.num_test and not any(ds.test_texts):
        raise XCError(f"dataset {ctx.name!r} has no test texts (pre-tokenized layout): cannot re-evaluate a model")
    if bundle.num_labels > ds.num_labels:
        raise XCError(f"model has {bundle.num_labels} labels, dataset {ctx.name!r} {ds.num_labels}")
    ids, scores = predict_topk(ds.test_texts, bundle, ctx.cfg.evaluate.top_k)
    ids, scores = remove_filtered(ids, scores, ds.filter_test)
    inv = inverse_propensity(ds.Y_train, ctx.cfg.evaluate.propensity_a, ctx.cfg.evaluate.propensity_b)
    return evaluate(ids, ds.Y_test, ks=(1, 3, 5), inv_prop=inv, filter_pairs=ds.filter_test)


def load_served_bundle(model_uri: str, tracking_uri: str, device: str | torch.device | None = None
                       ) -> ServingBundle:
    """The bundle of a logged/registered model (``models:/name/version``), loaded through MLflow."""
    with use_tracking_uri(tracking_uri):
        local = mlflow.artifacts.download_artifacts(artifact_uri=model_uri)
    return load_bundle(Path(local) / "artifacts" / "bundle", device)


def champion_metrics(client: "MlflowClient", tracking_uri: str, name: str, version: str, ctx: "StageContext",
                     fingerprint: str, device: str | torch.device | None = None) -> tuple[dict[str, float], str]:
    """The champion version's test P@1 / PSP@1 on the split ``fingerprint`` names, and where they come from:
    its version tags when it was measured on that split, else a re-evaluation of it on ``ctx``'s split."""
    mv = client.get_model_version(name, version)
    tags = mv.tags or {}
    if tags.get("test_split") == fingerprint and all(m in tags for m in GATE_METRICS):
        return {m: float(tags[m]) for m in GATE_METRICS}, "version tags (same test split)"
    bundle = load_served_bundle(f"models:/{name}/{version}", tracking_uri, device)
    m = evaluate_bundle(bundle, ctx)
    return {k: float(m[k]) for k in GATE_METRICS}, "re-evaluated on this test split (the champion's numbers " \
                                                    "were measured on another split)"


def promotion_decision(challenger: Mapping[str, float], champion: Mapping[str, float] | None,
                       tolerance: float = 0.0) -> dict[str, Any]:
    """Promote the challenger iff neither its test P@1 nor its PSP@1 is below the champion's by more than
    ``tolerance`` percentage points (metrics are fractions in [0, 1]; 0.5 = half a point). A drop of exactly
    the tolerance passes; a missing or NaN number refuses. ``champion=None``: the first version, promoted.
    """
    tolerance = parse_tolerance(tolerance)
    chal = {m: float(challenger.get(m, float("nan"))) for m in GATE_METRICS}
    out: dict[str, Any] = {"metrics": list(GATE_METRICS), "tolerance_pp": float(tolerance), "challenger": chal}
    if champion is None:
        return {**out, "promote": True, "first": True, "champion": None, "delta_pp": None, "worse": [],
                "reasons": ["no champion yet: the first version becomes the champion"]}
    champ = {m: float(champion.get(m, float("nan"))) for m in GATE_METRICS}
    reasons, worse, delta = [], [], {}
    for m in GATE_METRICS:
        c, h = chal[m], champ[m]
        if not (math.isfinite(c) and math.isfinite(h)):
            worse.append(m)
            reasons.append(f"{m}: challenger {c} vs champion {h}: not comparable")
            delta[m] = None
            continue
        d = 100.0 * (c - h)
        delta[m] = d
        if d < -tolerance - _EPS:
            worse.append(m)
            reasons.append(f"{m}: {100 * c:.2f} vs champion {100 * h:.2f} ({d:+.2f} pp): worse by more than "
                           f"the tolerance {tolerance:g} pp")
        else:
            reasons.append(f"{m}: {100 * c:.2f} vs champion {100 * h:.2f} ({d:+.2f} pp): within the tolerance "
                           f"{tolerance:g} pp")
    return {**out, "promote": not worse, "first": False, "champion": champ, "delta_pp": delta, "worse": worse,
            "reasons": reasons}


def apply_decision(client: "MlflowClient", name: str, version: str, decision: Mapping[str, Any]) -> dict[str, str]:
    """Record the decision on the version (tags) and, when promoted, move ``champion`` to it and drop its
    ``challenger`` alias. A refused version keeps ``challenger`` (until a later one replaces it). Returns the
    model's aliases afterwards."""
    version = str(version)
    before = _aliases(client, name)
    client.set_model_version_tag(name, version, "promotion", "promoted" if decision["promote"] else "refused")
    client.set_model_version_tag(name, version, "promotion_reasons", "; ".join(decision["reasons"])[:4900])
    if decision["promote"]:
        old = before.get(CHAMPION)
        client.set_registered_model_alias(name, CHAMPION, version)
        if before.get(CHALLENGER) == version:
            client.delete_registered_model_alias(name, CHALLENGER)
        if old is not None and old != version:
            client.set_model_version_tag(name, old, "superseded_by", version)
            client.set_model_version_tag(name, version, "previous_champion", old)
    return _aliases(client, name)


def champion_gate(ctx: "StageContext", tracker: "Tracker", registration: Mapping[str, Any], tolerance: float = 0.0,
                  device: str | torch.device | None = None) -> dict[str, Any]:
    """The champion/challenger gate for a version ``register_model`` just made: compare, decide, apply.

    Returns the decision (see :func:`promotion_decision`) plus both versions, where the champion's
    numbers come from, and the aliases afterwards.
    """
    client, name, version = tracker.client, registration["name"], str(registration["version"])
    challenger = registration["metrics"]
    champ_version = _aliases(client, name).get(CHAMPION)
    if champ_version is None or champ_version == version:
        decision = promotion_decision(challenger, None, tolerance)
        source = None
    else:
        champ, source = champion_metrics(client, tracker.tracking_uri, name, champ_version, ctx,
                                         registration["test_split"], device)
        decision = promotion_decision(challenger, champ, tolerance)
    decision.update({"model_name": name, "challenger_version": version,
                     "champion_version": None if decision["first"] else champ_version,
                     "champion_metrics_source": source})
    decision["aliases"] = apply_decision(client, name, version, decision)
    verdict = "first version: champion" if decision["first"] else ("promoted to champion" if decision["promote"]
                                                                     else "refused: stays challenger")
    decision["verdict"] = verdict
    ctx.info(f"champion gate {name} v{version}: {verdict} ({'; '.join(decision['reasons'])})")
    return decision
