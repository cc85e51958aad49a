"""Step metrics averaged over a window of steps, for the trainers' periodic logging."""

from __future__ import annotations

import time

import numpy as np


class MetricsWindow:
    """Losses and items (points, examples) of the steps since the last ``flush``."""

    def __init__(self) -> None:
        self.t = time.perf_counter()
        self.losses: list[float] = []
        self.items = 0

    def add(self, loss: float, items: int) -> None:
        self.losses.append(loss)
        self.items += items

    def flush(self) -> tuple[float, float]:
        """(mean loss, items per second) since the last flush; starts a new window."""
        now = time.perf_counter()
        out = float(np.mean(self.losses)), self.items / max(now - self.t, 1e-9)
        self.t, self.losses, self.items = now, [], 0
        return out
