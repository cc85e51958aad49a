"""Warm starts: retrain from a previous model (the dataset's champion) instead of from the base encoder.

``pretrain.warm_start`` names where the previous model comes from: ``""`` (cold start from
``tokenize.encoder``), ``champion`` (the registered champion ``models:/xc-<dataset>@champion`` of the MLflow
tracking store; a cold start when the dataset has none yet) or the path of a serving bundle folder (as
:func:`xc_dagster.serving.bundle.write_bundle` writes it). Pretraining then starts from the bundle's encoder, and the
classifiers from its W: a label is matched to the previous model's label by its text (click-log windows keep
label texts and ids stable), and labels new to this window start from their text embeddings E(z_l), as in a
cold start (Module III / NGAME M2 initialisation).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import mlflow
import numpy as np
import pyarrow.parquet as pq
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from xc_dagster.encoders.tokenizer import load_tokenizer
from xc_dagster.errors import XCConfigError
from xc_dagster.home import Home
from xc_dagster.serving.bundle import SERVING_FILE
from xc_dagster.serving.bundle_checks import read_part
from xc_dagster.serving.bundle_files import verify_bundle
from xc_dagster.storage import load_json
from xc_dagster.tracking import model_name, use_tracking_uri


def is_bundle(folder: Path) -> bool:
    return (Path(folder) / SERVING_FILE).is_file() and (Path(folder) / "encoder").is_dir()


def checked_bundle(folder: Path) -> Path:
    """``folder`` once its files match its manifest (the encoder, W and label texts a warm start reads)."""
    info = read_part(Path(folder) / SERVING_FILE, load_json)
    verify_bundle(folder, required=isinstance(info, dict) and bool(info.get("manifest")))
    return Path(folder)


def champion_bundle(dataset: str, tracking_uri: str, dest: Path) -> Path | None:
    """Download the dataset's champion model into ``dest`` and return its bundle folder; None if no champion."""
    name = model_name(dataset)
    client = MlflowClient(tracking_uri=tracking_uri)
    try:
        version = client.get_model_version_by_alias(name, "champion").version
    except MlflowException:
        return None
    dest = Path(dest)
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    with use_tracking_uri(tracking_uri):
        local = mlflow.artifacts.download_artifacts(artifact_uri=f"models:/{name}/{version}", dst_path=str(dest))
    bundle = Path(local) / "artifacts" / "bundle"
    if not is_bundle(bundle):
        raise XCConfigError(f"pretrain.warm_start=champion: models:/{name}/{version} holds no serving bundle "
                            f"({bundle})")
    return checked_bundle(bundle)


def resolve_warm_start(value: str, dataset: str, tracking_uri: str | None, dest: Path) -> Path | None:
    """The bundle folder ``pretrain.warm_start`` names, or None for a cold start (see the module docstring).

    ``tracking_uri`` None: the store the MLflow resource uses by default (``$MLFLOW_TRACKING_URI``, else
    ``$XC_HOME/mlflow.db``)."""
    if not value:
        return None
    if value == "champion":
        if not tracking_uri:  # as the MLflow resource defaults: $MLFLOW_TRACKING_URI, else $XC_HOME/mlflow.db
            tracking_uri = Home.from_env().mlflow_uri
        return champion_bundle(dataset, tracking_uri, dest)
    path = Path(value).expanduser()
    if not is_bundle(path):
        raise XCConfigError(f"pretrain.warm_start={value!r}: expected 'champion' or a serving bundle folder "
                            f"(with {SERVING_FILE} and encoder/), found none at {path}")
    return checked_bundle(path)


def check_same_vocabulary(bundle: Path, tokenizer) -> None:
    """The previous encoder must read the token ids this dataset was tokenized with."""
    theirs = load_tokenizer(str(Path(bundle) / "encoder")).get_vocab()
    if theirs != tokenizer.get_vocab():
        raise XCConfigError(f"pretrain.warm_start: the encoder in {bundle} uses another vocabulary "
                            f"({len(theirs)} tokens) than tokenize.encoder ({len(tokenizer.get_vocab())} tokens)")


def classifier_init(bundle: Path, label_texts: list[str], label_emb: np.ndarray) -> tuple[np.ndarray, int]:
    """Initial W: the previous model's w for labels whose text it knows, E(z_l) for new labels.

    Returns (W0 float32 (L, D), number of labels taken from the previous model). When a text occurs several
    times among the previous labels, the first one is used.
    """
    bundle = Path(bundle)
    W_prev = np.load(bundle / "W.npy", mmap_mode="r")
    if W_prev.shape[1] != label_emb.shape[1]:
        raise XCConfigError(f"pretrain.warm_start: W in {bundle} has dimension {W_prev.shape[1]}, the encoder "
                            f"{label_emb.shape[1]}")
    prev = pq.read_table(bundle / "labels.parquet", columns=["text"]).column("text").to_pylist()
    first: dict[str, int] = {}
    for i, t in enumerate(prev):
        if t is not None:
            first.setdefault(t, i)
    src = np.array([first.get(t, -1) for t in label_texts], dtype=np.int64)
    W0 = np.array(label_emb, dtype=np.float32, copy=True)
    hit = src >= 0
    W0[hit] = W_prev[src[hit]]
    return W0, int(hit.sum())
