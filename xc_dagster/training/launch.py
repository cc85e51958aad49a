"""One training stage run in a process of its own: ``python -m xc_dagster.training.launch --payload JSON``.

The Dagster asset of a training stage (``pretrain``, ``classifier``) starts it when the compute resource's
``launcher`` is ``subprocess`` or ``k8s`` (assets/_stage.py, resources/compute.py), through Dagster Pipes. The
parent resolves everything first and passes it in the payload (:class:`LaunchRequest`): the stage, the dataset's
catalog entry and the flat config the asset resolved, upstream sections as their artifacts were built
(``with_upstream_params``) and the names the user set (``explicit``) included, so the child runs with exactly that
config and reads no catalog. The environment names the rest: ``XC_HOME`` (the artifact store, or its cache under
``XC_ARTIFACT_ROOT``), ``MLFLOW_TRACKING_URI`` and ``MLFLOW_RUN_ID``, the parent's open MLflow run of the stage.

The child runs the stage as the step process would (``run_stage``: its own ``ctx.writing()`` publishes the stage
folder atomically, so a killed child leaves no half-written folder), logs each step's metrics into the parent's
MLflow run with MLflow's client (no run of its own) and, under Pipes, sends its log lines (the step lines the
in-process path logs, the stage's own lines) with ``pipes.log`` and, at the end, its summary as a custom message.
The parent then reads the summary the child wrote to the artifact store.

Several processes (``torchrun --nproc_per_node N -m xc_dagster.training.launch --payload ...``: torchrun's
``WORLD_SIZE`` > 1) train the ``pretrain`` stage data parallel (xc_dagster/training/data_parallel.py) and the
``classifier`` stage with W's label ranges over the ranks (xc_dagster/training/label_sharded.py): every rank
joins the process group, brings the stage's inputs to its local store and trains; rank 0 alone writes the stage's
artifacts, records and publishes them and reports through Pipes, the other ranks write and report nothing. Any
other stage with ``WORLD_SIZE`` > 1 is refused with an :class:`XCConfigError`, as the parent refuses
``nproc_per_node`` > 1 (its launchers start one process).

``dagster_pipes`` is the one Dagster package the library imports, and only in this module: the dependency-free
protocol package meant for external processes (it imports no ``dagster``); tests/test_architecture.py allows
exactly that.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch
from dagster_pipes import PipesEnvVarParamsLoader, open_dagster_pipes
from mlflow.tracking import MlflowClient

from xc_dagster.artifacts import ArtifactReader
from xc_dagster.catalog import DatasetSpec
from xc_dagster.config import PipelineConfig, apply_overrides
from xc_dagster.device import resolve_device
from xc_dagster.errors import XCConfigError, XCError
from xc_dagster.home import Home
from xc_dagster.pipeline.context import StageContext
from xc_dagster.pipeline.run import STAGES, finish_stage, run_stage, sync_reads
from xc_dagster.storage import ArtifactStore
from xc_dagster.tracking import RunLogger
from xc_dagster.training.distributed import DistEnv, world_size

log = logging.getLogger(__name__)

MODULE = "xc_dagster.training.launch"
LAUNCHED_STAGES = ("pretrain", "classifier")  # the training stages; every other stage runs in the step process
RUN_ID_ENV = "MLFLOW_RUN_ID"  # the parent's MLflow run of the stage, which the child logs its step metrics into
TRACKING_URI_ENV = "MLFLOW_TRACKING_URI"
HOME_ENV = "XC_HOME"
NOT_DISTRIBUTED = ("only the pretrain stage (data parallel) and the classifier stage (W's label ranges over the ranks) "
                   "train with several processes; the others run in one")
SUMMARY_MESSAGE = "summary"  # the key of the child's last Pipes custom message: its run_stage summary
DATA_PARALLEL_STAGES = LAUNCHED_STAGES  # the stages that train with several processes (WORLD_SIZE > 1): all of them


def check_stage(stage: str, where: str) -> str:
    if stage not in LAUNCHED_STAGES:
        raise XCConfigError(f"{where}: stage {stage!r} cannot be launched in a process of its own; the launched "
                            f"stages are {', '.join(LAUNCHED_STAGES)} (the others run in the Dagster step)")
    return stage


def _jsonable(obj: Any) -> Any:
    return json.loads(json.dumps(obj, default=str))


def config_from_flat(flat: Mapping[str, Any], explicit: Sequence[str], where: str) -> PipelineConfig:
    """The config whose ``flat()`` is ``flat`` (tuples as JSON lists), with ``explicit`` as the names the user set;
    refuses a payload it would not reproduce exactly."""
    if not isinstance(flat, Mapping) or not isinstance(flat.get("preset"), str) or \
            not isinstance(flat.get("strategy"), str):
        raise XCConfigError(f"{where}: field 'config': expected the flat config (stage.field -> value, with "
                            f"'preset' and 'strategy'), got {type(flat).__name__}")
    cfg = PipelineConfig(preset=flat["preset"], strategy=flat["strategy"])
    apply_overrides(cfg, {k: v for k, v in flat.items() if k not in ("preset", "strategy")}, f"{where} config")
    cfg.explicit = frozenset(explicit)
    rebuilt = _jsonable(cfg.flat())
    differs = sorted(k for k in set(rebuilt) | set(flat) if rebuilt.get(k) != flat.get(k))
    if differs:
        raise XCConfigError(f"{where}: field 'config': missing or not reproducible values of {differs[:10]}")
    return cfg


@dataclass
class LaunchRequest:
    """What the child runs: ``stage`` of ``spec``'s dataset with ``cfg`` on ``device`` (``threads``: torch CPU
    threads, 0 = torch's default)."""

    stage: str
    spec: DatasetSpec
    cfg: PipelineConfig
    device: str = "auto"
    threads: int = 0

    def payload(self) -> str:
        return json.dumps({"stage": self.stage, "dataset": _jsonable(dataclasses.asdict(self.spec)),
                           "config": _jsonable(self.cfg.flat()), "explicit": sorted(self.cfg.explicit),
                           "device": self.device, "threads": self.threads}, sort_keys=True)

    @classmethod
    def from_payload(cls, text: str, where: str = "--payload") -> LaunchRequest:
        try:
            d = json.loads(text)
        except ValueError as exc:
            raise XCConfigError(f"{where}: not valid JSON ({exc})") from None
        missing = [k for k in ("stage", "dataset", "config") if not isinstance(d, dict) or k not in d]
        if missing:
            raise XCConfigError(f"{where}: expected a JSON object with 'stage', 'dataset' and 'config' (the "
                                f"launching asset writes it), missing {missing}")
        stage = check_stage(str(d["stage"]), where)
        try:
            spec = DatasetSpec(**d["dataset"]).validate(f"{where} field 'dataset'")
        except TypeError as exc:
            raise XCConfigError(f"{where}: field 'dataset': expected a catalog entry ({exc})") from None
        cfg = config_from_flat(d["config"], d.get("explicit") or [], where)
        return cls(stage, spec, cfg, str(d.get("device") or "auto"), int(d.get("threads") or 0))

    def command(self, python: str = sys.executable, nproc: int = 1) -> list[str]:
        """The child's command line (``python``: the interpreter; a container's own ``python`` under k8s); with
        ``nproc`` > 1 under torchrun (one machine, a free rendezvous port), one rank per process."""
        torchrun = ["-m", "torch.distributed.run", "--standalone", "--nnodes", "1", "--nproc_per_node", str(nproc)]
        return [python, *(torchrun if nproc > 1 else []), "-m", MODULE, "--payload", self.payload()]


def launched_summary(store: ArtifactStore, dataset: str, stage: str,
                     reported: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The summary a child wrote to the artifact store (fetched from a remote root first), with the numbers it
    reported of its own run on top (``run_stage``'s: ``peak_rss_mb``, ``published_version``)."""
    summary = ArtifactReader(store, dataset, None).summary(stage, missing_ok=True)
    if summary is None:
        raise XCError(f"stage {stage!r} of dataset {dataset!r}: the training process exited without writing its "
                      f"artifacts ({store.stage_dir(dataset, stage)})")
    return {**summary, **(reported or {})}


def reported_summary(messages: Sequence[Any]) -> dict[str, Any] | None:
    """The summary among a child's Pipes custom messages (its last), or None."""
    found = [m[SUMMARY_MESSAGE] for m in messages if isinstance(m, dict) and SUMMARY_MESSAGE in m]
    return found[-1] if found else None


def step_logger(stage: str, info: Callable[[str], None],
                run: RunLogger | None) -> Callable[[int, dict[str, float]], None]:
    """A stage's ``log_metrics``: into the parent's MLflow run (when given) and as the step line the in-process
    path logs."""
    def log_metrics(step: int, values: dict[str, float]) -> None:
        if run is not None:
            run.log_metrics(step, values)
        info(f"{stage} step {step}: " + ", ".join(f"{k}={v:.4g}" for k, v in values.items()))

    return log_metrics


def run_request(request: LaunchRequest, environ: Mapping[str, str], info: Callable[[str], None]) -> dict[str, Any]:
    """Run the request's stage on the home ``environ`` names; returns ``run_stage``'s summary."""
    home = Home(Path(environ[HOME_ENV]).expanduser().resolve()) if environ.get(HOME_ENV) else Home.from_env()
    uri = environ.get(TRACKING_URI_ENV) or home.mlflow_uri
    home.ensure(tracking_uri=uri)
    run_id = environ.get(RUN_ID_ENV, "").strip()
    run = RunLogger(MlflowClient(tracking_uri=uri), run_id) if run_id else None
    if request.threads > 0:
        torch.set_num_threads(request.threads)
    ctx = StageContext(store=ArtifactStore(home.artifacts), spec=request.spec, cfg=request.cfg, cache_dir=home.cache,
                       device=resolve_device(request.device), log_metrics=step_logger(request.stage, info, run),
                       info=info, tracking_uri=uri, stage=request.stage)
    if world_size(environ) > 1:
        return run_data_parallel(ctx, request, environ)
    info(f"{request.stage} {request.spec.name}: launched in process {os.getpid()} on {ctx.device}")
    return run_stage(ctx, request.stage)


def rank_env(request: LaunchRequest, environ: Mapping[str, str]) -> DistEnv:
    """This process's rank from torchrun's variables, on the request's device (``auto``: ``cuda:LOCAL_RANK`` when
    CUDA is available, else the CPU)."""
    return DistEnv.from_env(environ, device=None if request.device == "auto" else request.device)


def run_data_parallel(ctx: StageContext, request: LaunchRequest, environ: Mapping[str, str]) -> dict[str, Any]:
    """``run_stage`` of a stage of ``DATA_PARALLEL_STAGES`` as one rank of torchrun's world (pretrain: data
    parallel; classifier: W's label ranges over the ranks): every rank trains, rank 0 records and publishes the
    artifacts it wrote; returns the stage's summary (rank 0) or the rank's training numbers."""
    env = rank_env(request, environ).init()
    try:
        ctx = dataclasses.replace(ctx, device=env.device,
                                  log_metrics=ctx.log_metrics if env.is_main else None).for_stage(request.stage)
        ctx.info(f"{request.stage} {request.spec.name}: rank {env.rank} of {env.world_size} launched in process "
                 f"{os.getpid()} on {env.device}")
        sync_reads(ctx, request.stage)
        summary = STAGES[request.stage](ctx, env)  # pretrain.run / classifier.run take the rank
        return finish_stage(ctx, request.stage, summary, writer=env.is_main)
    finally:
        env.close()


def read_request(payload: str, environ: Mapping[str, str]) -> LaunchRequest:
    """The request to run; in a world of several processes (torchrun's WORLD_SIZE > 1) only a data-parallel
    stage's."""
    n = world_size(environ)
    if n == 1:
        return LaunchRequest.from_payload(payload)
    try:
        stage = json.loads(payload).get("stage")
    except (ValueError, AttributeError):
        stage = None
    if stage not in DATA_PARALLEL_STAGES:
        raise XCConfigError(f"WORLD_SIZE = {n}: {NOT_DISTRIBUTED}; the payload's stage is {stage!r}")
    return LaunchRequest.from_payload(payload)


def main(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    """Run the ``--payload`` request; under Pipes (launched by the asset) its lines, summary and any error go to the
    Dagster step, else its lines go to stderr."""
    environ = os.environ if environ is None else environ
    parser = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.split("\n\n")[0])
    parser.add_argument("--payload", required=True, help="the launch request (JSON: stage, dataset, config)")
    args = parser.parse_args(argv)
    rank = environ.get("RANK", "0").strip() or "0"
    if not PipesEnvVarParamsLoader().is_dagster_pipes_process() or rank != "0":  # by hand; a rank other than 0
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
        run_request(read_request(args.payload, environ), environ, log.info)
        return 0
    with open_dagster_pipes() as pipes:  # an error in the block is reported to the step before the exit
        summary = run_request(read_request(args.payload, environ), environ, pipes.log.info)
        pipes.report_custom_message({SUMMARY_MESSAGE: _jsonable(summary)})
    return 0

if __name__ == "__main__":
    sys.exit(main())
