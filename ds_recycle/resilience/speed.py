"""Fail-slow detection: which live worker is persistently slower than its stage's peers, and by how much.

Each iteration every member contributes one number, its *pace*: the seconds its F, B and W took per micro-batch
in the last full iteration (:meth:`~ds_recycle.engine.op_clock.OpClock.pace`, CPU devices only; time spent
waiting for a core does not count, so oversubscribed cores do not make a worker look slow).
The members sum the paces into one vector (each worker writes only its own slot), so every member holds the same
vector and :class:`SpeedWatch` makes the same decisions everywhere: no agreement round is needed, and the plan
switches at the same iteration boundary on every member.

A worker's *ratio* is its pace over the median pace of the other live workers of its stage (a stage with one
live worker has nothing to compare with and is never judged). Decisions use the median of the last
``window`` ratios, and need ``confirm`` consecutive checks that agree (``recycle.fail_slow``, :class:`~ds_recycle.config.FailSlowConfig`):

- a normal worker whose median ratio is at least ``enter`` becomes *slow* with that factor
  (rounded to :data:`STEP`);
- a slow worker whose median ratio falls to ``leave`` or below is *recovered* (factor 1);
- a slow worker whose median ratio stays more than a quarter (or a step) away from its factor gets a new one.

The gap between ``enter`` and ``leave`` and the confirmation are the hysteresis: an iteration's noise moves the
median of several little, and a verdict needs several checks in a row. A worker that turns slow moves the median
after ``window // 2 + 1`` checks and is decided ``confirm - 1`` checks later: 7 checks with the defaults, which read
the paces of the iteration before (the exchange is read one boundary after it is posted), so the plan changes at
most 8 iterations after the first slow one; a worker that recovers likewise. With the defaults, +-20% noise on
every worker's pace every iteration and a 3x spike of one worker every 7th iteration gave no verdict in 15,000
iterations of a 4 x 4 job (``tests/resilience/test_speed.py``). A slow worker that was given fewer micro-batches
still reports its pace per micro-batch, so its ratio keeps measuring its speed, not its load.

Membership changes reset the watch on every member alike (:meth:`SpeedWatch.reset`): the new epoch's plan
assumes normal speeds, and the next verdicts come from that epoch's measurements alone.
"""
from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from ds_recycle.config import FailSlowConfig

__all__ = ["MAX_FACTOR", "STEP", "SpeedVerdict", "SpeedWatch"]

Worker = tuple[int, int]


STEP = 0.25
"""Factors are rounded to multiples of this (plans are made for a few distinct factors, not for noise)."""
MAX_FACTOR = 8.0
"""Largest factor a plan assumes (a worker slower than this is planned as this slow)."""


@dataclass(frozen=True)
class SpeedVerdict:
    """A change of one worker's assumed speed."""

    worker: Worker
    factor: float
    """The factor the plans assume from now on (1.0: recovered)."""
    previous: float
    ratio: float
    """The median ratio measured that led to it."""


@dataclass
class _Track:
    ratios: deque[float]
    streak: int = 0
    """Consecutive checks whose median asked for a change."""


@dataclass
class SpeedWatch:
    """The fail-slow state of the job, the same on every member (see the module docstring)."""

    settings: FailSlowConfig = field(default_factory=FailSlowConfig)
    """The thresholds: the config's ``recycle.fail_slow`` section."""
    factors: dict[Worker, float] = field(default_factory=dict)
    """The slow workers and the factor the current plan assumes for each."""
    _tracks: dict[Worker, _Track] = field(default_factory=dict)

    def reset(self) -> None:
        """Forget every measurement and verdict (a new membership epoch)."""
        self.factors.clear()
        self._tracks.clear()

    def _round(self, ratio: float) -> float:
        return min(MAX_FACTOR, max(1.0, round(ratio / STEP) * STEP))

    def observe(self, paces: Mapping[Worker, float]) -> list[SpeedVerdict]:
        """One check: each live worker's pace (seconds per micro-batch; 0 or absent: not measured). Returns the
        changes of assumed speed, if any (the caller re-plans when the list is not empty)."""
        by_stage: dict[int, list[Worker]] = {}
        for w, pace in paces.items():
            if pace > 0:
                by_stage.setdefault(w[1], []).append(w)
        verdicts = []
        for stage_workers in by_stage.values():
            for w in sorted(stage_workers):
                others = [paces[o] for o in stage_workers if o != w]
                if not others:
                    continue
                verdict = self._judge(w, paces[w] / statistics.median(others))
                if verdict is not None:
                    verdicts.append(verdict)
        return verdicts

    def _judge(self, worker: Worker, ratio: float) -> SpeedVerdict | None:
        s = self.settings
        track = self._tracks.setdefault(worker, _Track(deque(maxlen=s.window)))
        track.ratios.append(ratio)
        if len(track.ratios) < s.window:
            return None
        median = statistics.median(track.ratios)
        now = self.factors.get(worker, 1.0)
        if now == 1.0:
            moved = median >= s.enter
        else:
            moved = median <= s.leave or abs(median - now) > max(STEP, 0.25 * now)
        if not moved:
            track.streak = 0
            return None
        track.streak += 1
        if track.streak < s.confirm:
            return None
        track.streak = 0
        factor = 1.0 if median < s.enter else self._round(median)  # below enter: normal, as a new worker would be
        if factor == now:
            return None
        if factor == 1.0:
            self.factors.pop(worker, None)
        else:
            self.factors[worker] = factor
        return SpeedVerdict(worker, factor, now, median)

    def assumed(self, live: Sequence[Worker]) -> dict[Worker, float]:
        """The factors of the slow workers among ``live``."""
        return {w: f for w, f in self.factors.items() if w in live}
