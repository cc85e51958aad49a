"""The compute device: CUDA (with AMP) when present, CPU otherwise; optional CPU thread count."""

from __future__ import annotations

import dagster as dg
import torch

from xc_dagster.device import resolve_device


class ComputeResource(dg.ConfigurableResource):
    """``device``: auto | cpu | cuda | cuda:N. ``threads``: torch CPU threads (0 = torch's default)."""

    device: str = "auto"
    threads: int = 0

    def torch_device(self) -> torch.device:
        if self.threads > 0:
            torch.set_num_threads(self.threads)
        return resolve_device(self.device)
