"""The registered MLflow model of a dataset and its champion/challenger gate.

The model is an MLflow pyfunc (:class:`xc_dagster.serving.bundle.XCModel`) logged with *models from code*: the
model's code is a three-line file that imports it, so nothing is pickled; its one artifact is the serving
bundle. One registered model per dataset, ``xc-<dataset>``. The first version gets the alias ``champion``;
later ones get ``challenger`` and carry their test P@1 / PSP@1 as version tags, which the gate
(:func:`champion_gate`) compares with the champion's on the same test split (re-evaluating the champion when
its numbers were measured on another split) and, within the tolerance, promotes.

No Dagster here; ``assets/model_registry.py`` is the thin asset around :func:`register_model` and
:func:`champion_gate`.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import math
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import mlflow
import numpy as np
import pandas as pd
import torch
from mlflow.models import infer_signature

from xc_dagster.catalog import parse_tolerance
from xc_dagster.errors import XCError
from xc_dagster.evaluation.metrics import evaluate, remove_filtered
from xc_dagster.serving.bundle import (
    ServingBundle,
    load_bundle,
    predict_features,
    predict_topk,
    predictions_frame,
    serving_input,
    write_bundle,
)
from xc_dagster.serving.limits import has_content
from xc_dagster.serving.requests import FEATURES_COLUMN, feature_lines, input_features
from xc_dagster.tracking import fluent_run, mlflow_dataset, model_name, use_tracking_uri

if TYPE_CHECKING:  # pragma: no cover
    from mlflow.tracking import MlflowClient

    from xc_dagster.pipeline import StageContext
    from xc_dagster.tracking import Tracker

CHAMPION, CHALLENGER = "champion", "challenger"
GATE_METRICS = ("precision_at_1", "psprecision_at_1")
RUN_METRICS = ("precision_at_1", "precision_at_3", "precision_at_5", "psprecision_at_1", "psprecision_at_3",
               "psprecision_at_5", "ndcg_at_5", "shortlist_recall")
ASSET_TAG = "registered_model"
_EPS = 1e-9  # float slack of the tolerance comparison: a drop of exactly the tolerance is within it

# the model's code (MLflow "models from code"): importing this module, no pickle
MODEL_CODE = '''"""xc-dagster pyfunc model (models from code): text in, top-k labels out."""
import mlflow

from xc_dagster.serving.bundle import XCModel

mlflow.models.set_model(XCModel())
'''


# the third-party distributions a served model imports (versions: the ones installed when it was logged)
_REQUIREMENTS = ("mlflow", "torch", "transformers", "tokenizers", "safetensors", "faiss-cpu", "numpy", "scipy",
                 "pandas", "pyarrow")


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
    src = Path(__file__).resolve().parents[1]  # xc_dagster/, this module being xc_dagster/serving/registry.py
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
    # a text without a visible character gets no labels: no output types to infer the signature from
    bundle = load_bundle(bundle_dir, device)
    if bundle.input == "features":  # example_texts: request lines (serving.requests.feature_lines)
        example = [t for t in list(example_texts)[:2] if t.strip()] or ["0:1"]
        out = predictions_frame(*predict_features(input_features(example, bundle.num_features), bundle, default_k),
                                bundle)
        inp = pd.DataFrame({FEATURES_COLUMN: example})
    else:
        example = [t if has_content(t) else "example" for t in list(example_texts)[:2]] or ["example"]
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


def split_fingerprint(ctx: "StageContext") -> str:
    """SHA-256 of what the test metrics depend on besides the model: the test texts (or shipped tokens),
    test label matrix, test filter pairs and the labels' inverse propensities. Equal fingerprints = numbers
    measured on the same split, directly comparable."""
    ds = ctx.read.dataset(features=False)
    h = hashlib.sha256()
    Y = ds.Y_test.tocsr()
    h.update(repr(Y.shape).encode())
    for a in (Y.indptr.astype(np.int64), Y.indices.astype(np.int64), np.asarray(ds.filter_test, np.int64)):
        h.update(np.ascontiguousarray(a).tobytes())
    inv = ctx.inv_prop(ds.Y_train)
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
                   shortlist_size: int = 0, ef_search: int = 0, graph_above: int = 0) -> dict[str, Any]:
    """Log the dataset's model (one run tagged ``asset=registered_model`` in the dataset's experiment) and
    register it as ``xc-<dataset>``; alias ``champion`` if the model has none, else ``challenger``.

    The version's tags hold its test ``precision_at_1`` / ``psprecision_at_1`` (from the evaluation stage's
    ``metrics.json``; with a serving ``shortlist_size`` / ``ef_search`` other than the evaluated ones, or exact
    indexes served as HNSW graphs (``graph_above``, ``serving.bundle.write_bundle``), from
    a re-evaluation of the bundle on the test split, so they are the served model's numbers), the split
    fingerprint and the evaluation run id, so the gate reads both sides.
    Returns name, version, alias, URIs, run and model ids, metrics (and their source) and fingerprint.
    """
    metrics = ctx.read.metrics()
    metrics_source = "evaluation"
    missing = [m for m in GATE_METRICS if m not in metrics]
    if missing:
        raise XCError(f"dataset {ctx.name!r}: evaluate/metrics.json lacks {missing}; re-run evaluation")
    name = model_name(ctx.name)
    client = tracker.client
    exp_id = tracker.experiment_id(ctx.name)
    eval_run = _latest_run_id(client, exp_id, "evaluate")
    fp = split_fingerprint(ctx)
    ds = ctx.read.dataset(features=False)
    example = [t for t in ds.test_texts[:2] if t] or [t for t in ds.label_texts[:2] if t] or ["example"]
    if serving_input(ctx) == "features":
        example = feature_lines(ctx.read.features("test")[:2])
    params = {**ctx.cfg.flat(), "serving.default_k": default_k, "serving.bundle_code": bundle_code,
              "serving.shortlist_size": shortlist_size, "serving.ef_search": ef_search,
              "serving.graph_above": graph_above}
    run_tags = {"registered_model": name, **({"evaluation_run_id": eval_run} if eval_run else {}),
                **dict(tags or {})}
    with tempfile.TemporaryDirectory(prefix="xc-bundle-") as tmp, \
            tracker.run(ctx.name, ASSET_TAG, params, run_tags) as run, use_tracking_uri(tracker.tracking_uri), \
            fluent_run(run.run_id):
        bundle_dir = Path(tmp) / "bundle"
        info = write_bundle(ctx, bundle_dir, default_k, shortlist_size, ef_search, graph_above)
        if not info["as_evaluated"]:  # the served settings' own numbers
            metrics = evaluate_bundle(load_bundle(bundle_dir, device), ctx)
            metrics_source = "re-evaluated with the serving shortlist/efSearch/graphs"
        model_info = log_pyfunc(bundle_dir, example, default_k, bundle_code, registered_model_name=name,
                                device=device)
        version = str(model_info.registered_model_version)
        test_split = mlflow_dataset(ctx.name, fp, ctx.spec.source)  # digest: what the test metrics depend on
        run.log_dataset(test_split, "test")
        # on the run and on the LoggedModel (MLflow 3's Models view), measured on that dataset
        mlflow.log_metrics({m: float(metrics[m]) for m in RUN_METRICS if m in metrics and math.isfinite(metrics[m])},
                           step=0, model_id=model_info.model_id, dataset=test_split)
        run.log_dict(info, "serving.json")
        alias = CHALLENGER if CHAMPION in _aliases(client, name) else CHAMPION
        client.set_registered_model_alias(name, alias, version)
        if alias == CHAMPION:
            client.update_registered_model(
                name, description=f"xc-dagster model of dataset {ctx.name}: {info['input']} -> top-k labels with "
                                   "scores")
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
    ds = ctx.read.dataset(features=False)
    if ds.num_test and not any(ds.test_texts) and bundle.input != "features":
        raise XCError(f"dataset {ctx.name!r} has no test texts (pre-tokenized layout): cannot re-evaluate a model")
    if bundle.num_labels > ds.num_labels:
        raise XCError(f"model has {bundle.num_labels} labels, dataset {ctx.name!r} {ds.num_labels}")
    if bundle.input == "features":
        ids, scores = predict_features(ctx.read.features("test"), bundle, ctx.cfg.evaluate.top_k)
    else:
        ids, scores = predict_topk(ds.test_texts, bundle, ctx.cfg.evaluate.top_k)
    ids, scores = remove_filtered(ids, scores, ds.filter_test)
    inv = ctx.inv_prop(ds.Y_train)
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
