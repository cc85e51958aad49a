"""Learning-rate schedules, as factors of the base rate per step (``torch.optim.lr_scheduler.LambdaLR``)."""

from __future__ import annotations

import math
from typing import Callable


def linear_with_warmup(warmup: int, total: int) -> Callable[[int], float]:
    """Linear warm-up then linear decay to zero (pretraining)."""
    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / max(warmup, 1)
        return max(0.0, (total - step) / max(total - warmup, 1))
    return f


def cosine_with_warmup(warmup: int, total: int) -> Callable[[int], float]:
    """Linear warm-up to 1 over ``warmup`` steps, then cosine decay to 0 at ``total`` (the BCE trainer)."""
    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / max(warmup, 1)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, (step - warmup) / max(total - warmup, 1))))
    return f
