"""A system's timeline: what the job did at every moment, and how much of it counts.

The ledger is piecewise constant: between events a system either trains at a rate (samples per
second) or is paused (reconfiguring, restarting, checkpointing, waiting for nodes). Training is cut
into iterations of a known length; checkpoints are taken every `interval_s` of training, blocking for
`cost_s`. Work can be lost in two ways, and the ledger re-labels the time it took as LOST:

- the iteration in flight when a failure strikes (`lose_inflight`): time since the last iteration
  boundary of the current training stretch;
- everything since the last completed checkpoint when the job rolls back (`rollback`).

Effective throughput = samples of the TRAINING and DEGRADED segments / the whole span.
"""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass, replace

__all__ = ["Phase", "Segment", "CheckpointPolicy", "Ledger"]

_EPS = 1e-9


class Phase(enum.Enum):
    """What a stretch of wall time was spent on."""

    TRAINING = "training"
    """Training at the system's failure-free rate."""
    DEGRADED = "degraded"
    """Training, slower than failure-free (fewer nodes, re-routed or redundant work)."""
    RECONFIGURING = "reconfiguring"
    """Paused while survivors re-form groups or pipelines, or a node rejoins (no restart)."""
    RESTARTING = "restarting"
    """Paused while the job restarts from a checkpoint (launch, init, load)."""
    CHECKPOINTING = "checkpointing"
    """Paused while a periodic checkpoint is written."""
    WAITING = "waiting"
    """Stopped: not enough nodes to train at all."""
    LOST = "lost"
    """Trained, but the work was thrown away (an interrupted iteration or a rollback)."""


#: Phases whose samples count.
USEFUL = (Phase.TRAINING, Phase.DEGRADED)


@dataclass(frozen=True)
class Segment:
    """`[start_s, end_s)` spent in `phase`; `rate` samples/s while it ran (0 when paused)."""

    start_s: float
    end_s: float
    phase: Phase
    rate: float

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s


@dataclass(frozen=True)
class CheckpointPolicy:
    """Periodic blocking checkpoints: every `interval_s` seconds of training, `cost_s` seconds."""

    interval_s: float
    cost_s: float

    def __post_init__(self) -> None:
        if not self.interval_s > 0 or self.cost_s < 0:
            raise ValueError(f"checkpoint interval {self.interval_s} s, cost {self.cost_s} s. "
                             "Fix: interval > 0 and cost >= 0")


class Ledger:
    """Accumulates segments as a system's state changes; see the module docstring."""

    def __init__(self, full_rate: float, checkpoint: CheckpointPolicy | None, start_s: float = 0.0):
        self.full_rate = full_rate
        self.checkpoint = checkpoint
        self.segments: list[Segment] = []
        self.now = start_s
        self.rate = 0.0
        self.iteration_s = math.inf
        self._pause_end = start_s
        self._pause_phase = Phase.WAITING
        self._stretch_start = start_s
        self._since_ckpt = 0.0
        self._last_ckpt_end = start_s

    # -- state changes (call `advance(t)` first) -------------------------------------------------
    def set_rate(self, rate: float, iteration_s: float) -> None:
        """Train at `rate` from now (or from the end of the current pause)."""
        self.rate, self.iteration_s = rate, iteration_s
        self._stretch_start = max(self.now, self._pause_end)

    def pause(self, phase: Phase, duration_s: float) -> None:
        """Stop training for `duration_s` from now, replacing any pause in progress, except that a
        restart in progress is not cut short by a shorter reconfiguration (the restart re-forms every
        group when it ends anyway)."""
        end = self.now + duration_s
        if self.paused and self._pause_phase is Phase.RESTARTING and phase is not Phase.RESTARTING \
                and self._pause_end >= end:
            return
        self._pause_phase, self._pause_end = phase, end
        self._stretch_start = self._pause_end

    @property
    def paused(self) -> bool:
        return self._pause_end > self.now + _EPS

    def lose_inflight(self) -> float:
        """Throw away the iteration in flight; returns the seconds lost."""
        if self.paused or self.rate <= 0 or not math.isfinite(self.iteration_s):
            return 0.0
        partial = (self.now - self._stretch_start) % self.iteration_s
        self._relabel(self.now - partial, self.now)
        return partial

    def rollback(self) -> float:
        """Throw away everything trained since the last completed checkpoint; returns the seconds."""
        lost = self._relabel(self._last_ckpt_end, self.now)
        self._last_ckpt_end = self.now
        self._since_ckpt = 0.0
        return lost

    def checkpoint_now(self) -> None:
        """Count the state as saved now (a planned restart saves first; its cost is in its pause)."""
        self._last_ckpt_end = self.now
        self._since_ckpt = 0.0

    # -- time passing -----------------------------------------------------------------------------
    def advance(self, t: float) -> None:
        """Emit segments from `now` to `t` under the current state."""
        while self.now < t - _EPS:
            if self.paused:
                end = min(self._pause_end, t)
                self._emit(end, self._pause_phase, 0.0)
                if self.now >= self._pause_end - _EPS and self._pause_phase is Phase.CHECKPOINTING:
                    self._last_ckpt_end, self._since_ckpt = self.now, 0.0
                continue
            if self.rate <= 0:
                self._emit(t, Phase.WAITING, 0.0)
                break
            to_ckpt = self.checkpoint.interval_s - self._since_ckpt if self.checkpoint else math.inf
            end = min(t, self.now + max(to_ckpt, 0.0))
            start = self.now
            self._emit(end, self._train_phase(), self.rate)
            self._since_ckpt += end - start
            if self.checkpoint and self._since_ckpt >= self.checkpoint.interval_s - _EPS:
                self.pause(Phase.CHECKPOINTING, self.checkpoint.cost_s)

    def _train_phase(self) -> Phase:
        return Phase.TRAINING if self.rate >= self.full_rate * (1 - 1e-9) else Phase.DEGRADED

    def _emit(self, end: float, phase: Phase, rate: float) -> None:
        if end > self.now + _EPS:
            last = self.segments[-1] if self.segments else None
            if last and last.phase is phase and last.rate == rate and abs(last.end_s - self.now) < _EPS:
                self.segments[-1] = replace(last, end_s=end)
            else:
                self.segments.append(Segment(self.now, end, phase, rate))
        self.now = max(self.now, end)

    def _relabel(self, start: float, end: float) -> float:
        """Turn the useful parts of `[start, end)` into LOST (keeping their rate for drawing)."""
        lost = 0.0
        out: list[Segment] = []
        for seg in self.segments:
            if seg.phase not in USEFUL or seg.end_s <= start + _EPS or seg.start_s >= end - _EPS:
                out.append(seg)
                continue
            a, b = max(seg.start_s, start), min(seg.end_s, end)
            if a > seg.start_s + _EPS:
                out.append(replace(seg, end_s=a))
            out.append(Segment(a, b, Phase.LOST, seg.rate))
            lost += b - a
            if b < seg.end_s - _EPS:
                out.append(replace(seg, start_s=b))
        self.segments = out
        return lost
