"""Compute device and mixed precision: CUDA with AMP when there is a GPU, CPU otherwise -- one code path."""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from xc_dagster.errors import XCConfigError


def resolve_device(name: str = "auto") -> torch.device:
    """``auto`` -> ``cuda`` when available else ``cpu``; an explicit ``cuda`` without a GPU is an error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise XCConfigError(f"device {name!r} requested but torch sees no CUDA GPU")
    return dev


def amp_dtype(device: torch.device, amp: str = "auto") -> torch.dtype | None:
    """The autocast dtype for ``amp`` on ``device``; None = full fp32.

    ``auto``: bf16 on CUDA GPUs that support it (fp16 otherwise), and bf16 on CPUs with bf16 matrix units
    (about 2x the fp32 throughput there); fp32 on other CPUs.
    """
    if amp == "off":
        return None
    if amp == "bf16":
        return torch.bfloat16
    if amp == "fp16":
        return torch.float16
    if amp != "auto":
        raise XCConfigError(f"amp: expected auto|bf16|fp16|off, got {amp!r}")
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    try:
        return torch.bfloat16 if torch.ops.mkldnn._is_mkldnn_bf16_supported() else None
    except (AttributeError, RuntimeError):
        return None


@contextlib.contextmanager
def autocast(device: torch.device, dtype: torch.dtype | None) -> Iterator[None]:
    """Autocast to ``dtype`` on ``device`` (no-op for None)."""
    if dtype is None:
        yield
        return
    with torch.autocast(device_type=device.type, dtype=dtype):
        yield


def seed_everything(seed: int) -> None:
    """Seed torch (CPU and CUDA) so training is reproducible; numpy generators are passed explicitly."""
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)
