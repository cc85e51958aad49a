"""Learning-rate schedules, as factors of the base rate per step (``torch.optim.lr_scheduler.LambdaLR``)."""

from __future__ import annotations

import math
from typing import Callable


def linear_with_warmup(warmup: int, total: int) -> Callable[[int], float]:
    """Linear warm-up then linear decay to zero (pretraining)."""
    return LinearWithWarmup(warmup, total)


class WarmupDecay:
    """Linear warm-up to 1 over ``warmup`` steps, then a decay to 0 at ``total`` (``_decay``), whose end may move
    while it runs (``retotal``: a budgeted run re-planned as it trains). An object, so ``LambdaLR.state_dict`` keeps
    its attributes and a resumed run decays to the same end."""

    def __init__(self, warmup: int, total: int):
        self.warmup, self.total = int(warmup), int(total)
        self.anchor_step: int | None = None  # past the warm-up, a moved end decays from here ...
        self.anchor_value = 1.0  # ... and this factor, so the rate never jumps

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / max(self.warmup, 1)
        return self._decay(step)

    def retotal(self, step: int, total: int) -> None:
        """Decay to zero at ``total`` instead, from the factor of ``step`` (the next step's) on; during the warm-up
        only the end moves (the decay starts at 1 either way)."""
        if step >= self.warmup:
            self.anchor_value, self.anchor_step = self(step), step
        self.total = int(total)

    def _decay(self, step: int) -> float:
        raise NotImplementedError


class LinearWithWarmup(WarmupDecay):
    """Linear decay to zero at ``total`` (from the anchor's factor, once the end moved)."""

    def _decay(self, step: int) -> float:
        if self.anchor_step is None:
            return max(0.0, (self.total - step) / max(self.total - self.warmup, 1))
        return max(0.0, self.anchor_value * (self.total - step) / max(self.total - self.anchor_step, 1))


def cosine_with_warmup(warmup: int, total: int) -> Callable[[int], float]:
    """Linear warm-up to 1 over ``warmup`` steps, then cosine decay to 0 at ``total`` (the BCE trainer)."""
    return CosineWithWarmup(warmup, total)


class CosineWithWarmup(WarmupDecay):
    """Cosine decay to 0 at ``total``; once the end moved, from the anchor's factor along a half cosine to 0 at the
    new end."""

    def _decay(self, step: int) -> float:
        start = self.warmup if self.anchor_step is None else self.anchor_step
        share = min(1.0, max(0, step - start) / max(self.total - start, 1))
        return self.anchor_value * 0.5 * (1.0 + math.cos(math.pi * share))
