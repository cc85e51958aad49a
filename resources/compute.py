"""The compute the stages run on: the device (CUDA with AMP when present, CPU otherwise), the CPU thread count, and
where the training stages run: in the Dagster step's process (default), or out of it through Dagster Pipes in a
subprocess, under torchrun (several data-parallel processes) or in a Kubernetes pod (``launcher``), the entry point
``python -m xc_dagster.training.launch``.

``dagster-k8s`` is the ``k8s`` extra of the package (``pip install 'xc-dagster[k8s]'``), imported only when a
stage is launched with ``launcher: k8s``.
"""

from __future__ import annotations

import importlib
import os
import re
import signal
from typing import Any, Mapping, Optional

import dagster as dg
import pydantic
import torch

from xc_dagster.device import resolve_device
from xc_dagster.errors import XCConfigError, XCError
from xc_dagster.remote_store import ROOT_ENV
from xc_dagster.training.launch import (
    DATA_PARALLEL_STAGES,
    LAUNCHED_STAGES,
    LaunchRequest,
    reported_summary,
)

LAUNCHERS = ("in_process", "subprocess", "torchrun", "k8s")
K8S_CONTAINER = "xc-train"  # the pod's one container
K8S_PYTHON = "python"  # the interpreter of the image, on its PATH
GPU_RESOURCE = "nvidia.com/gpu"  # the NVIDIA device plugin's extended resource


def _field(name: str) -> str:
    return f"compute resource field {name!r}"


def exit_message(stage: str, dataset: str, error: str, processes: int = 1) -> str:
    """What a failed training process's error says: the stage, and the signal that killed it or its exit code
    (read from the Pipes client's error, ``... failed with code N``: negative N is signal -N). ``processes`` > 1:
    torchrun's, which exits with 1 when any rank fails or is killed, after stopping the others."""
    where = f"stage {stage!r} of dataset {dataset!r}"
    kept = "; its artifacts were not replaced (the stage publishes its folder only once it is complete)"
    found = re.search(r"code (-?\d+)", error)
    if found is None:
        return f"{where}: the training process failed ({error}){kept}"
    code = int(found.group(1))
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        what = "torchrun launcher" if processes > 1 else "training process"
        return (f"{where}: the {what} was killed by signal {name} ({-code}; out of memory, or killed by "
                f"hand or by its scheduler){kept}")
    if processes > 1:
        return (f"{where}: torchrun's {processes} training processes exited with code {code}: a rank failed or was "
                f"killed and torchrun stopped the others (its 'Root Cause' lines in the step's stderr name the rank "
                f"and its exit code or signal); a re-run resumes from the last epoch's checkpoint{kept}")
    return f"{where}: the training process exited with code {code} (its error is in the step's log and stderr){kept}"


class ComputeResource(dg.ConfigurableResource):
    """``device``: auto | cpu | cuda | cuda:N. ``threads``: torch CPU threads (0 = torch's default).

    ``launcher``: where the training stages (pretrain, classifier) run: ``in_process`` (the step's process),
    ``subprocess`` (a child process on the same machine), ``torchrun`` (``nproc_per_node`` processes on this
    machine: the pretrain stage data parallel, the classifier stage with W's label ranges over them) or ``k8s`` (a pod:
    ``image``, ``namespace`` (empty: the current one, else ``default``), ``gpus_per_pod`` (0: no GPU limit),
    ``k8s_env``: more environment variables). The other stages always run in the step's process."""

    device: str = "auto"
    threads: int = 0
    launcher: str = "in_process"
    nproc_per_node: int = 1
    image: str = ""
    namespace: str = ""
    gpus_per_pod: int = 0
    k8s_env: Optional[dict[str, str]] = None

    @pydantic.field_validator("launcher")
    @classmethod
    def _check_launcher(cls, value: str) -> str:
        if value not in LAUNCHERS:
            raise XCConfigError(f"{_field('launcher')}: expected one of {', '.join(map(repr, LAUNCHERS))}, "
                                f"got {value!r}")
        return value

    @pydantic.field_validator("nproc_per_node")
    @classmethod
    def _check_nproc(cls, value: int) -> int:
        if value < 1:
            raise XCConfigError(f"{_field('nproc_per_node')}: expected an integer >= 1, got {value}")
        return value

    @pydantic.field_validator("gpus_per_pod")
    @classmethod
    def _check_gpus(cls, value: int) -> int:
        if value < 0:
            raise XCConfigError(f"{_field('gpus_per_pod')}: expected an integer >= 0 (0: no GPU), got {value}")
        return value

    @pydantic.model_validator(mode="after")
    def _check_k8s(self) -> "ComputeResource":
        if self.launcher == "k8s" and not self.image.strip():
            raise XCConfigError(f"{_field('image')}: expected the container image the k8s launcher runs the "
                                f"training stages in (with xc-dagster installed), got {self.image!r}")
        return self

    def torch_device(self) -> torch.device:
        if self.threads > 0:
            torch.set_num_threads(self.threads)
        return resolve_device(self.device)

    def launches(self, stage: str) -> bool:
        """Whether ``stage`` runs out of the step's process. ``nproc_per_node`` > 1 needs the ``torchrun`` launcher
        (refused here otherwise, before anything runs)."""
        if stage not in LAUNCHED_STAGES:
            return False
        if self.nproc_per_node > 1 and self.launcher != "torchrun":
            raise XCConfigError(f"{_field('nproc_per_node')} = {self.nproc_per_node}: several training processes "
                                f"need launcher 'torchrun', got {self.launcher!r}")
        return self.launcher != "in_process"

    def processes(self, stage: str) -> int:
        """Training processes of ``stage``: ``nproc_per_node`` under torchrun for the stages that train with several
        (pretrain, classifier), else one."""
        data_parallel = self.launcher == "torchrun" and stage in DATA_PARALLEL_STAGES
        return self.nproc_per_node if data_parallel else 1

    def launch(self, context: dg.AssetExecutionContext, request: LaunchRequest,
               env: Mapping[str, str]) -> dict[str, Any] | None:
        """Run ``request`` with this launcher through Dagster Pipes (``env``: the child's XC_HOME, MLflow URI and run
        id); returns the summary the child reported, if any. A failed child raises an :class:`XCError` naming the
        stage and the signal or exit code."""
        dataset = request.spec.name
        try:
            if self.launcher in ("subprocess", "torchrun"):
                invocation = dg.PipesSubprocessClient().run(
                    context=context, command=request.command(nproc=self.processes(request.stage)), env=env)
            elif self.launcher == "k8s":
                client = self._k8s_module().PipesK8sClient()
                invocation = client.run(context=context, namespace=self.namespace or None,
                                        base_pod_spec=self.k8s_pod_spec(request, env))
            else:
                raise XCConfigError(f"{_field('launcher')}: {self.launcher!r} runs no process of its own")
        except XCError:
            raise
        except Exception as exc:  # the Pipes client's error: the exit code, or why the pod failed
            raise XCError(exit_message(request.stage, dataset, str(exc), self.processes(request.stage))) from exc
        return reported_summary(invocation.get_custom_messages())

    def _k8s_module(self) -> Any:
        try:
            return importlib.import_module("dagster_k8s")  # the k8s extra: loaded only when a stage launches a pod
        except ImportError:
            raise XCConfigError(f"{_field('launcher')}: 'k8s' needs the dagster-k8s package: "
                                f"pip install 'xc-dagster[k8s]'") from None

    def k8s_env_vars(self, env: Mapping[str, str]) -> dict[str, str]:
        """The pod's environment: ``env`` (XC_HOME, MLflow URI, run id), XC_ARTIFACT_ROOT when set here (the pod
        reads and publishes the artifacts there), then ``k8s_env`` (which may override them)."""
        out = dict(env)
        if os.environ.get(ROOT_ENV, "").strip():
            out[ROOT_ENV] = os.environ[ROOT_ENV].strip()
        out.update(self.k8s_env or {})
        return out

    def k8s_pod_spec(self, request: LaunchRequest, env: Mapping[str, str]) -> dict[str, Any]:
        """The ``base_pod_spec`` PipesK8sClient starts: one container of ``image`` running the entry point with
        ``request``, its environment (:meth:`k8s_env_vars`; the client adds the Pipes variables) and, with
        ``gpus_per_pod`` > 0, that many GPUs as its limit; never restarted (a retry is Dagster's)."""
        container: dict[str, Any] = {
            "name": K8S_CONTAINER, "image": self.image, "command": request.command(K8S_PYTHON),
            "env": [{"name": k, "value": v} for k, v in self.k8s_env_vars(env).items()],
        }
        if self.gpus_per_pod > 0:
            container["resources"] = {"limits": {GPU_RESOURCE: self.gpus_per_pod}}
        return {"containers": [container], "restartPolicy": "Never"}
