"""A budgeted training's plan, corrected as it trains.

The budget's plan (xc_dagster.training.budget) rests on a few steps and a sample's encoding timed before training.
Where those ran at another speed than the run's -- other work on the machine during the calibration, a machine
that slows as it heats, overheads the calibration never sees (re-clusterings, checkpoints) -- the plan is wrong
for the whole run: a calibration timed under load plans a fraction of the steps the budget holds, and one timed
too fast ends at the deadline with the learning rate never decayed. So every ``train.replan_every`` of the plan's
training seconds the trainer's steps of the last window are timed as trained (wall seconds over steps, overheads
included), and the steps that fit in what is left of the plan's training seconds become the new end of the run;
the schedule decays to it from where it is (``schedules.WarmupDecay.retotal``). The first window whose steps ran more
than ``RETIME_FACTOR`` faster or slower than calibrated also times the encoding's sample again (the encoding after
training was planned from the same moment's speed): the end of training and its deadline move by what it now takes
less or more. The later stages keep the reserve first planned. A trainer with an overhead every so many steps
(ASTRA's and MIPS-s' table builds) gives that ``period``: the rate then spans at least one period, so that windows
with and without a build do not move the end back and forth (docs/decisions.md#replan-as-trained).
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from xc_dagster.training.budget import encoding_seconds

REPLAN_MIN_CHANGE = 0.03  # of the planned steps: a smaller difference (timing noise) keeps the plan
RETIME_FACTOR = 1.25  # a window's seconds per step this far from the calibration's re-times the encoding (once)


@dataclass
class Replanner:
    """Re-plans a run's total steps from its own steps' seconds: ``start`` when training starts, ``check`` after
    every step (a new total, or None to keep the one it has). ``history``: every re-plan, for the stage's summary;
    ``shift``: how far the end of training (and so its deadline) moved with a re-timed encoding."""

    end: float  # the clock's value at which the plan's training seconds end
    every: float  # seconds between two re-plans
    max_steps: int = 0  # train.max_epochs' cap in steps; 0: none
    clock: Callable[[], float] = time.perf_counter
    calibrated: float = 0.0  # the plan's seconds per step
    encode_seconds: float = 0.0  # the plan's estimated encoding after training
    retime: Callable[[], float] | None = None  # the encoding's seconds, timed now
    share: float = 0.0  # train.replan_every: a moved end sets the windows to this share of the training's seconds
    started: float = 0.0  # the clock's value at which training began
    history: list[dict[str, float]] = field(default_factory=list)
    shift: float = 0.0
    period: int = 0  # steps between the trainer's periodic overheads: a rate spans at least this many steps
    _marks: list[tuple[float, int]] = field(default_factory=list)  # (clock, steps) at the windows' ends
    _next: float = math.inf

    @classmethod
    def for_plan(cls, plan: Any, started: float, train: Any, retime: Callable[[], float] | None = None,
                 clock: Callable[[], float] = time.perf_counter) -> Replanner | None:
        """The re-planner of a budget's ``plan`` (a ``BudgetPlan``) whose training began at ``started``, under
        ``train`` (``TrainParams``: ``replan_every``, ``max_epochs``); None where nothing was planned
        (explicit epochs, no budget, no step timed) or ``train.replan_every`` is 0."""
        if (plan.explicit or plan.budget_seconds <= 0 or plan.planned_train_seconds <= 0 or plan.steps_per_epoch <= 0
                or train.replan_every <= 0):
            return None
        cap = math.ceil(train.max_epochs * plan.steps_per_epoch) if train.max_epochs > 0 else 0
        return cls(started + plan.planned_train_seconds, train.replan_every * plan.planned_train_seconds, cap, clock,
                   plan.seconds_per_step, plan.encode_seconds, retime, train.replan_every, started)

    def start(self, steps: int, period: int = 0) -> None:
        """Training (re)starts at ``steps``: the first window begins. ``period``: the trainer's steps between two
        of its periodic overheads (0: none)."""
        now = self.clock()
        self.period, self._marks, self._next = max(0, int(period)), [(now, steps)], now + self.every

    def moved(self, deadline: float | None) -> float | None:
        """The training's ``deadline`` moved with its end."""
        return None if deadline is None else deadline + self.shift

    def check(self, steps: int, total: int) -> int | None:
        """After a step: at a window's end, the steps that fit in the plan's seconds left at the rate since
        ``_since``'s window end, where they differ from ``total`` by ``REPLAN_MIN_CHANGE`` (the run ends at
        ``total``)."""
        now = self.clock()
        if now < self._next:
            return None
        then, before = self._since(steps)
        self._marks.append((now, steps))
        self._next = now + self.every
        if steps <= before:
            return None
        seconds = (now - then) / (steps - before)
        retimed = self._retime(seconds)
        if retimed:
            now = self.clock()  # the re-timing's seconds are the run's, not the next window's
            self.every = max(self.every, self.share * (self.end - self.started))  # windows of the longer run
            self._marks, self._next = [(now, steps)], now + self.every
        new = steps + max(0, int((self.end - now) / seconds))  # none left: the run ends here
        if self.max_steps:
            new = max(min(new, self.max_steps), steps)
        if abs(new - total) < max(1.0, REPLAN_MIN_CHANGE * total) and not retimed:
            return None
        self.history.append({"step": steps, "seconds_per_step": round(seconds, 4), "total_steps": new,
                             **({"encode_seconds": round(self.encode_seconds, 2), "shift": round(self.shift, 2)}
                                if retimed else {})})
        return new

    def _since(self, steps: int) -> tuple[float, int]:
        """The latest window's end at least ``period`` steps before ``steps`` (the last one without a period; the
        first where none is that far back): the rate is timed from there. Older ends are dropped (a later rate
        starts at this one or after it)."""
        i = len(self._marks) - 1
        while i > 0 and steps - self._marks[i][1] < self.period:
            i -= 1
        del self._marks[:i]
        return self._marks[0]

    def _retime(self, seconds: float) -> bool:
        """Once, where ``seconds`` per step is ``RETIME_FACTOR`` from the calibration's: the encoding timed again,
        the end moved by what it takes less (or more) than planned."""
        if self.retime is None or self.calibrated <= 0 or \
                max(seconds / self.calibrated, self.calibrated / seconds) <= RETIME_FACTOR:
            return False
        retime, self.retime = self.retime, None
        encode = float(retime())
        moved = self.encode_seconds - encode
        self.end, self.shift, self.encode_seconds = self.end + moved, self.shift + moved, encode
        return True


def replanner_for(plan: Any, started: float, train: Any, encoder: Any, point_tokens: Any, label_tokens: Any,
                  device: Any, dtype: Any, batch_size: int, seed: int) -> Replanner | None:
    """``Replanner.for_plan`` for a run training ``encoder``: its ``retime`` times the encoding's sample again
    mid-training (``budget.encoding_seconds``), the encoder back in train mode after it."""
    def retime() -> float:
        try:
            return encoding_seconds(encoder, point_tokens, label_tokens, device, dtype, batch_size, seed)
        finally:
            encoder.train()
    return Replanner.for_plan(plan, started, train, retime)


class Replannable:
    """What a re-plan moves in a trainer (``SiameseTrainer``, ``EndToEndTrainer``): its ``total_steps``, its
    ``params.epochs`` (float) and ``n_epochs``, its schedule's end. The trainer has ``steps`` and ``replanned``, and
    gives its schedule (``_schedule``: a factor with ``retotal``) and its steps per epoch (``_epoch_steps``)."""

    def batches_in(self, epoch: int, n: int) -> int:
        """How many of ``epoch``'s ``n`` batches run: all but in the fractional last epoch of the run's epochs
        (none past it: a re-plan shortened the run)."""
        if epoch >= self.n_epochs:
            return 0
        if epoch == self.n_epochs - 1 and self.params.epochs < self.n_epochs:
            return max(1, math.ceil((self.params.epochs - epoch) * n))
        return n

    def retotal(self, total: int) -> None:
        """``total`` steps in all (a budgeted run re-planned as it trains): the schedule decays to it from the next
        step on, and the epochs follow."""
        self._schedule().retotal(self.steps, total)
        self._set_total(total)

    def follow(self, replanner: Replanner | None, progress: Any, report: Callable[[str], None] | None,
               stage: str) -> None:
        """After a step: the new total ``replanner`` gives, if any, becomes the run's and ``progress``'s end, and is
        reported (``"<stage>: ... s/step as trained: N steps in all"``)."""
        total = replanner.check(self.steps, self.total_steps) if replanner is not None else None
        if total is None:
            return
        self.retotal(total)
        replanner.period = self.overhead_period()  # a moved end may move the trainer's intervals too
        progress.retotal(total)
        if report is not None:
            report(f"{stage}: {replanner.history[-1]['seconds_per_step']:.2f} s/step as trained: {total} steps in all")

    def overhead_period(self) -> int:
        """Steps between two of the trainer's periodic overheads (0: none; ``Replanner.period``)."""
        return 0

    def replanned_end(self) -> bool:
        """A re-planned run ends at its total steps, where its schedule does."""
        return self.replanned and self.steps >= self.total_steps

    def _resume_total(self, state: dict[str, Any]) -> None:
        """A checkpoint's ``total_steps`` where a re-plan moved them before it was written."""
        if int(state.get("total_steps", self.total_steps)) != self.total_steps:
            self._set_total(int(state["total_steps"]))

    def _set_total(self, total: int) -> None:
        self.replanned, self.total_steps = True, int(total)
        self.params = dataclasses.replace(self.params, epochs=total / self._epoch_steps())
        self.n_epochs = math.ceil(self.params.epochs)

    def _schedule(self) -> Any:
        raise NotImplementedError

    def _epoch_steps(self) -> int:
        raise NotImplementedError
