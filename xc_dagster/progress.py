"""Progress of long work (encoding, training, index builds, evaluation) that a user can read while it runs.

A ``Progress`` counts work done towards a total. On a terminal it draws a tqdm bar on stderr; independently it
reports a line ``"<name>: <done>/<total> <unit> (<pct>%), <rate>/s, ETA <eta>"`` to a ``report`` callback (a
stage's ``info``: the Dagster log) at most once every ``XC_PROGRESS_SECONDS`` (default 30) seconds and once at
the end, the last one with the elapsed time added; with a ``metrics`` callback (a stage's ``log_metrics``: MLflow)
each line also logs the rate as ``<name>_per_s`` at step ``done``. Rates and times use tqdm's formats
(``tqdm.format_sizeof``, ``tqdm.format_interval``: mm:ss, h:mm:ss past an hour). It never changes a result, and
``update`` costs a counter, a clock read and the bar's own update.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
from time import monotonic
from typing import Callable, Iterator

from tqdm import tqdm

from xc_dagster.config.env import env_positive
from xc_dagster.errors import XCConfigError

SECONDS_ENV = "XC_PROGRESS_SECONDS"  # the least seconds between two reported lines
BAR_ENV = "XC_PROGRESS_BAR"  # 1: always draw the bar, 0: never; unset: when stderr is a terminal
DEFAULT_SECONDS = 30.0

Report = Callable[[str], None]
Metrics = Callable[[int, dict[str, float]], None]
Advance = Callable[[int], None]  # called with the units just done (``Progress.update``)


def bar_wanted(bar: bool | None = None) -> bool:
    """``bar`` when given, else ``$XC_PROGRESS_BAR`` (1 or 0), else whether stderr is a terminal."""
    if bar is not None:
        return bar
    raw = os.environ.get(BAR_ENV, "").strip().lower()
    if raw in ("1", "true", "yes", "on"):
        return True
    if raw in ("0", "false", "no", "off"):
        return False
    if raw:
        raise XCConfigError(f"{BAR_ENV}: expected 1 or 0 (unset: a bar when stderr is a terminal), got {raw!r}")
    return bool(getattr(sys.stderr, "isatty", lambda: False)())


class Progress:
    """``total`` ``unit`` of work named ``name``; ``update(n)`` as it gets done, ``close`` (or the end of a ``with``
    block) when it ends. ``initial``: work already done (a resumed run; the rate counts only what this run does);
    ``every``: seconds between reported lines (default ``$XC_PROGRESS_SECONDS``); ``bar``: see ``bar_wanted``."""

    def __init__(self, name: str, total: int, unit: str = "it", report: Report | None = None,
                 metrics: Metrics | None = None, *, initial: int = 0, every: float | None = None,
                 bar: bool | None = None):
        self.name, self.total, self.unit = name, int(total), unit
        self.report, self.metrics = report, metrics
        self.every = float(env_positive(SECONDS_ENV, DEFAULT_SECONDS, float)) if every is None else float(every)
        self.metric = re.sub(r"\W+", "_", name).strip("_") + "_per_s"
        self.initial = self.done = int(initial)
        self._bar = (tqdm(total=self.total, initial=self.done, desc=name, unit=unit, file=sys.stderr,
                          dynamic_ncols=True) if bar_wanted(bar) else None)
        self.started = self._last = monotonic()
        self._closed = False

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        self.close(final=exc_type is None)

    def update(self, n: int = 1) -> None:
        """``n`` more units done; reports a line when ``every`` seconds passed since the last one."""
        self.done += n
        if self._bar is not None:
            self._bar.update(n)
        now = monotonic()
        if now - self._last >= self.every:
            self._emit(now, final=False)

    def retotal(self, total: int) -> None:
        """The work turned out to be ``total`` units in all (a re-planned training)."""
        self.total = int(total)
        if self._bar is not None:
            self._bar.total = self.total
            self._bar.refresh()

    def note(self, text: str) -> None:
        """Report ``"<name>: <text>"`` now, e.g. that work without progress of its own (one faiss call) started."""
        if self.report is not None:
            with self._bar_cleared():
                self.report(f"{self.name}: {text}")

    def close(self, final: bool = True) -> None:
        """Close the bar; with ``final`` (the work ended normally) report the last line. Later calls do nothing."""
        if self._closed:
            return
        self._closed = True
        if self._bar is not None:
            self._bar.close()
        if final:
            self._emit(monotonic(), final=True)

    def rate(self, now: float) -> float:
        """Units per second done by this run up to ``now`` (0 before any time passed)."""
        elapsed = now - self.started
        return (self.done - self.initial) / elapsed if elapsed > 0 else 0.0

    def line(self, now: float, final: bool = False) -> str:
        """The progress line at clock time ``now``; ``final`` adds the elapsed time."""
        rate, left = self.rate(now), max(self.total - self.done, 0)
        pct = 100 * self.done // self.total if self.total > 0 else 100
        eta = tqdm.format_interval(left / rate if left else 0) if rate > 0 or not left else "?"
        text = (f"{self.name}: {self.done}/{self.total} {self.unit} ({pct}%), {tqdm.format_sizeof(rate)}/s, "
                f"ETA {eta}")
        return text + f", elapsed {tqdm.format_interval(now - self.started)}" if final else text

    def _emit(self, now: float, final: bool) -> None:
        self._last = now
        with self._bar_cleared():
            if self.report is not None:
                self.report(self.line(now, final))
            if self.metrics is not None:
                self.metrics(self.done, {self.metric: self.rate(now)})

    def _bar_cleared(self) -> contextlib.AbstractContextManager:
        """The bar cleared from the terminal meanwhile (the callbacks' log lines may go to the same stderr)."""
        return tqdm.external_write_mode(file=sys.stderr) if self._bar is not None else contextlib.nullcontext()


@contextlib.contextmanager
def in_one_call(name: str, total: int, unit: str, report: Report | None = None,
                what: str = "work") -> Iterator[Progress]:
    """Work done by one call that reports nothing itself (a faiss index build): a line when it starts and the
    final line, with its rate, when the block ends."""
    with Progress(name, total, unit, report) as prog:
        prog.note(f"{what} started: {total} {unit}")
        yield prog
        prog.update(total - prog.done)
