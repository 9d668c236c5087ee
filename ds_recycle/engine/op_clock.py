"""Each worker times its own F, B, W, optimizer step and transfers, so that a job can hand the planner its own costs.

:class:`OpClock` keeps, for the last ``window`` iterations, the time each timed instruction the worker ran took,
by kind: ``F`` (a micro-batch's forward), ``B`` (input gradients), ``W`` (weight gradients), ``BW`` (a fused
backward, 1F1B), ``O`` (the optimizer step with its gradient all-reduce) and ``R`` (a receive of an activation or
a gradient from another worker), and the iteration's wall time.

On a CPU device an instruction returns when its work is done, and its time is read with a :class:`DeviceTimer`:
wall time less the time the worker's thread waited for a core (Linux's per-thread run-queue wait,
``/proc/thread-self/schedstat``). A CPU job with more workers than cores (tests, the demo) shares the cores by the
OS scheduler's whim: measured on a 2 x 3 job on 2 cores, the wall time of one worker's ops over those of its
stage's peers swung from 0.3 to 2.7 from one iteration to the next. Without the wait the time is what the op
would take on a core of its own: the worker's own speed, a sleeping (emulated or throttled) device included.
Where the file is missing it is plain wall time.

On an accelerator an instruction returns once its kernels are queued: the clock records a pair of timing events
on the current stream around it (DeepSpeed's accelerator ``Event``) and never waits for them. At each iteration's
end it files every earlier iteration whose last event the device has passed (``query()``, which does not block)
and leaves the rest for a later end: the times come an iteration or so late and cost no host synchronisation. At
most :data:`EVENT_ITERATIONS` iterations wait; older ones are dropped (a device that stopped making progress).
(The event path has not run on a GPU yet.)

A receive's time includes waiting for its sender. The transfer's own cost is that of receives whose message was
already on its way: :meth:`OpClock.medians` gives the :data:`TRANSFER_QUANTILE` quantile for ``R`` and the median
for the other kinds. :func:`stage_costs` turns every worker's figures, summed over the members with their counts,
into a :class:`~ds_recycle.plan.costs.CostModel` (a stage's value is the mean of its replicas'; a fused backward
with no separate B and W counts as half each; ``comm`` is the mean over the stages that received).
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
from ds_recycle.engine.devices import HOST
from ds_recycle.plan.costs import CostModel

__all__ = ["KINDS", "DeviceTimer", "OpClock", "stage_costs", "timed_kind"]

KINDS = ("F", "B", "W", "BW", "O", "R")
"""The kinds timed, in the order of the rows :meth:`OpClock.as_row` writes."""

TRANSFER_QUANTILE = 0.1
"""The quantile of a worker's receive times taken as its transfer cost (the quickest receives found their message
already sent)."""

EVENT_ITERATIONS = 4
"""Iterations whose accelerator events may wait to be read before the oldest is dropped."""

_TIMED: dict[type, str] = {ins.ForwardMicroBatch: "F", ins.StaggeredOptimizerStep: "O"}
_RECEIVES = (ins.RecvActivation, ins.RecvGrad)


def timed_kind(cmd: Any, weights_pending: Callable[[int], bool], rank: int = -1) -> str | None:
    """The kind a training instruction is timed as, or None: a forward ``F``, an optimizer step ``O``, a
    ``BackwardInput`` ``B`` (``BW`` when it runs the fused backward), a ``BackwardWeight`` ``W`` unless its buffer
    has no weight work left (after a fused backward it only frees the buffer), a receive from another worker ``R``
    (not one that a repair serves from this worker's own log: ``peer == rank``)."""
    if isinstance(cmd, ins.BackwardInput):
        return "BW" if cmd.kwargs.get("weights") else "B"
    if isinstance(cmd, ins.BackwardWeight):
        return "W" if weights_pending(cmd.kwargs["buffer_id"]) else None
    if isinstance(cmd, _RECEIVES):
        return "R" if cmd.kwargs.get("peer", rank) != rank else None
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
    """Times of this worker's timed instructions over the last ``window`` iterations (see the module docstring).

    ``events``: a factory of accelerator timing events (``get_accelerator().Event(enable_timing=True)``) on an
    accelerator; None on a CPU device, where the engine times each instruction itself and calls :meth:`record`.
    Either way the engine brackets each instruction with :meth:`begin` and :meth:`end`."""

    def __init__(self, window: int = 20, events: Callable[[], Any] | None = None) -> None:
        if window < 1:
            raise ValueError(f"OpClock(window={window}): keep at least one iteration")
        self._done: deque[dict[str, list[float]]] = deque(maxlen=window)
        self._now: dict[str, list[float]] = defaultdict(list)
        self._iterations: deque[float] = deque(maxlen=window)
        self._events = events
        self._spans: list[tuple[str, Any, Any]] = []
        self._waiting: deque[tuple[list[tuple[str, Any, Any]], float | None]] = deque()
        self.dropped = 0
        """Iterations whose events were dropped unread (more than :data:`EVENT_ITERATIONS` waited)."""

    @property
    def on_device(self) -> bool:
        """Whether instructions are timed by accelerator events."""
        return self._events is not None

    def begin(self) -> Any:
        """A mark before an instruction: an event recorded on the current stream (None on a CPU device)."""
        if self._events is None:
            return None
        event = self._events()
        event.record()
        return event

    def end(self, kind: str, mark: Any, seconds: float) -> None:
        """After the instruction begun at ``mark``: on a CPU device file ``seconds`` (the engine's own reading),
        on an accelerator record the closing event; its time is read once the device has passed it."""
        if self._events is None:
            self.record(kind, seconds)
            return
        event = self._events()
        event.record()
        self._spans.append((kind, mark, event))

    def record(self, kind: str, seconds: float) -> None:
        self._now[kind].append(seconds)

    def end_iteration(self, seconds: float | None) -> None:
        """Close the iteration that took ``seconds`` (None: its time is not one iteration's, e.g. a repaired one)."""
        if self._events is not None:
            self._waiting.append((self._spans, seconds))
            self._spans = []
            self._file_passed()
            return
        self._close(dict(self._now), seconds)
        self._now = defaultdict(list)

    def _close(self, times: dict[str, list[float]], seconds: float | None) -> None:
        self._done.append(times)
        if seconds is not None:
            self._iterations.append(seconds)

    def _file_passed(self) -> None:
        """File the waiting iterations the device has finished, oldest first; drop the oldest beyond the bound."""
        while self._waiting:
            spans, seconds = self._waiting[0]
            if spans and not spans[-1][2].query():  # one stream runs in order: its last event passed, all did
                break
            self._waiting.popleft()
            times: dict[str, list[float]] = defaultdict(list)
            for kind, start, stop in spans:
                times[kind].append(start.elapsed_time(stop) / 1000.0)
            self._close(dict(times), seconds)
        while len(self._waiting) > EVENT_ITERATIONS:
            self._waiting.popleft()
            self.dropped += 1

    def medians(self) -> dict[str, float]:
        """Seconds per instruction of each kind timed in the window: the median, for ``R`` the
        :data:`TRANSFER_QUANTILE` quantile."""
        pooled: dict[str, list[float]] = defaultdict(list)
        for iteration in self._done:
            for kind, values in iteration.items():
                pooled[kind].extend(values)
        return {kind: _quantile(values, TRANSFER_QUANTILE) if kind == "R" else statistics.median(values)
                for kind, values in pooled.items() if values}

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
        return torch.tensor([[medians.get(k, 0.0), 1.0 if k in medians else 0.0] for k in KINDS], device=HOST,
                            dtype=torch.float64)


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[int(q * (len(ordered) - 1))]


def stage_costs(rows: torch.Tensor) -> CostModel | None:
    """The costs per stage from ``rows[stage, kind] = (sum of medians, replicas measured)``; None when a stage has
    no forward measured (no worker of it timed anything yet). ``comm``: the mean transfer over the stages that
    timed receives (0 with none)."""
    sums, counts = rows[..., 0], rows[..., 1]
    if bool((counts[:, KINDS.index("F")] == 0).any()):
        return None
    mean = torch.where(counts > 0, sums / counts.clamp(min=1), torch.zeros_like(sums)).tolist()
    f, b, w, bw, o, r = (KINDS.index(k) for k in KINDS)
    received = [row[r] for row, n in zip(mean, counts[:, r].tolist(), strict=True) if n > 0]
    comm = sum(received) / len(received) if received else 0.0
    per_stage = [(r[f], r[b] if r[b] else r[bw] / 2, r[w] if r[w] else r[bw] / 2, r[o]) for r in mean]
    return CostModel(F=tuple(s[0] for s in per_stage), B=tuple(s[1] for s in per_stage),
                     W=tuple(s[2] for s in per_stage), O=tuple(s[3] for s in per_stage), comm=comm)
