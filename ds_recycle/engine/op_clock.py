"""Each worker times its own F, B, W and optimizer step, so that a job can hand the planner its own costs.

:class:`OpClock` keeps, for the last ``window`` iterations, the time each compute instruction the worker ran
took, by kind: ``F`` (a micro-batch's forward), ``B`` (input gradients), ``W`` (weight gradients), ``BW`` (a fused
backward, 1F1B) and ``O`` (the optimizer step with its gradient all-reduce), and the iteration's wall time.
The clock runs on CPU devices only, where an instruction returns when its compute is done (on a GPU it returns
once its kernels are queued, and timing it would need a synchronisation the engine does not otherwise make: not
measured there yet).

An instruction's time is read with a :class:`DeviceTimer`: wall time less the time the worker's thread waited
for a core (Linux's per-thread run-queue wait, ``/proc/thread-self/schedstat``). A CPU job with more workers than
cores (tests, the demo) shares the cores by the OS scheduler's whim: measured on a 2 x 3 job on 2 cores, the wall
time of one worker's ops over those of its stage's peers swung from 0.3 to 2.7 from one iteration to the next.
Without the wait the time is what the op would take on a core of its own: the worker's own speed, a sleeping
(emulated or throttled) device included. Where the file is missing it is plain wall time.

:meth:`OpClock.medians` gives the medians per kind; :func:`stage_costs` turns every worker's medians, summed over
the members with their counts, into a :class:`~ds_recycle.plan.costs.CostModel` (a stage's value is the mean of
its replicas' medians; a fused backward with no separate B and W counts as half each).
"""
from __future__ import annotations

import os
import statistics
import time
from collections import defaultdict, deque
from collections.abc import Callable
from typing import Any

import torch

from ds_recycle.engine import instructions as ins
from ds_recycle.plan.costs import CostModel

__all__ = ["KINDS", "DeviceTimer", "OpClock", "stage_costs", "timed_kind"]

KINDS = ("F", "B", "W", "BW", "O")
"""The kinds timed, in the order of the rows :meth:`OpClock.as_row` writes."""


_TIMED: dict[type, str] = {ins.ForwardMicroBatch: "F", ins.StaggeredOptimizerStep: "O"}


def timed_kind(cmd: Any, weights_pending: Callable[[int], bool]) -> str | None:
    """The kind a training instruction is timed as, or None: a forward ``F``, an optimizer step ``O``, a
    ``BackwardInput`` ``B`` (``BW`` when it runs the fused backward), a ``BackwardWeight`` ``W`` unless its buffer
    has no weight work left (after a fused backward it only frees the buffer)."""
    if isinstance(cmd, ins.BackwardInput):
        return "BW" if cmd.kwargs.get("weights") else "B"
    if isinstance(cmd, ins.BackwardWeight):
        return "W" if weights_pending(cmd.kwargs["buffer_id"]) else None
    return _TIMED.get(type(cmd))


class DeviceTimer:
    """Seconds on a clock that stands still while the creating thread waits for a core (see the module docstring).

    Reads cost about a microsecond (one ``pread`` of an open procfs file). Create it on the thread it times."""

    _SCHEDSTAT = "/proc/thread-self/schedstat"

    def __init__(self) -> None:
        self._fd: int | None = None
        try:
            fd = os.open(self._SCHEDSTAT, os.O_RDONLY)
        except OSError:
            return
        try:
            int(os.pread(fd, 128, 0).split()[1])
        except (OSError, ValueError, IndexError):
            os.close(fd)
            return
        self._fd = fd

    @property
    def excludes_waits(self) -> bool:
        """False where run-queue waits cannot be read (not Linux): :meth:`now` is then wall time."""
        return self._fd is not None

    def now(self) -> float:
        if self._fd is None:
            return time.perf_counter()
        waited = self._waited_ns()
        while True:  # a wait for a core between the two reads would count against the wrong side: read again
            wall = time.perf_counter()
            again = self._waited_ns()
            if again == waited:
                return wall - waited * 1e-9
            waited = again

    def _waited_ns(self) -> int:
        assert self._fd is not None
        return int(os.pread(self._fd, 128, 0).split()[1])

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class OpClock:
    """Times of this worker's compute instructions over the last ``window`` iterations (:class:`DeviceTimer`)."""

    def __init__(self, window: int = 20) -> None:
        if window < 1:
            raise ValueError(f"OpClock(window={window}): keep at least one iteration")
        self._done: deque[dict[str, list[float]]] = deque(maxlen=window)
        self._now: dict[str, list[float]] = defaultdict(list)
        self._iterations: deque[float] = deque(maxlen=window)

    def record(self, kind: str, seconds: float) -> None:
        self._now[kind].append(seconds)

    def end_iteration(self, seconds: float | None) -> None:
        """Close the iteration that took ``seconds`` (None: its time is not one iteration's, e.g. a repaired one)."""
        self._done.append(dict(self._now))
        self._now = defaultdict(list)
        if seconds is not None:
            self._iterations.append(seconds)

    def medians(self) -> dict[str, float]:
        """Median seconds per instruction of each kind timed in the window."""
        pooled: dict[str, list[float]] = defaultdict(list)
        for iteration in self._done:
            for kind, values in iteration.items():
                pooled[kind].extend(values)
        return {kind: statistics.median(values) for kind, values in pooled.items() if values}

    def pace(self) -> float:
        """Seconds of F, B and W (fused or not) per forwarded micro-batch in the last closed iteration that had one
        timed; 0.0 before any. A worker's speed whatever its load (:mod:`ds_recycle.resilience.speed`)."""
        for iteration in reversed(self._done):
            forwards = len(iteration.get("F", ()))
            if forwards:
                return sum(sum(iteration.get(k, ())) for k in ("F", "B", "W", "BW")) / forwards
        return 0.0

    def iteration_median(self) -> float | None:
        """Median wall seconds of the iterations in the window."""
        return statistics.median(self._iterations) if self._iterations else None

    def as_row(self) -> torch.Tensor:
        """``[median, count]`` per kind of :data:`KINDS` (count 1 where measured), for a sum over the members."""
        medians = self.medians()
        return torch.tensor([[medians.get(k, 0.0), 1.0 if k in medians else 0.0] for k in KINDS],
                            dtype=torch.float64)


def stage_costs(rows: torch.Tensor, comm: float = 0.0) -> CostModel | None:
    """The costs per stage from ``rows[stage, kind] = (sum of medians, replicas measured)``; None when a stage has
    no forward measured (no worker of it timed anything yet)."""
    sums, counts = rows[..., 0], rows[..., 1]
    if bool((counts[:, KINDS.index("F")] == 0).any()):
        return None
    mean = torch.where(counts > 0, sums / counts.clamp(min=1), torch.zeros_like(sums)).tolist()
    f, b, w, bw, o = (KINDS.index(k) for k in KINDS)
    per_stage = [(r[f], r[b] if r[b] else r[bw] / 2, r[w] if r[w] else r[bw] / 2, r[o]) for r in mean]
    return CostModel(F=tuple(s[0] for s in per_stage), B=tuple(s[1] for s in per_stage),
                     W=tuple(s[2] for s in per_stage), O=tuple(s[3] for s in per_stage), comm=comm)
