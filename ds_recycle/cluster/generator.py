"""Synthetic failure traces at a chosen mean time between failures (seeded, reproducible).

Model: the cluster starts with `nodes` nodes at time 0. Failures form a Poisson process over the
whole cluster with mean time between failures `mtbf_hours` (exponential gaps, the usual model of
independent hardware faults; e.g. "Revisiting Reliability in Large-Scale Machine Learning Research
Clusters", arXiv 2410.21680, fits cluster failures this way); each failure removes one node chosen
uniformly among those present. With `repair_hours`, a removed node comes back after an exponential
repair time of that mean (same name, as a repaired machine does); without it nodes never return, as
in the synthetic traces of Oobleck's simulator::

    trace = generate_trace(nodes=512, hours=24, mtbf_hours=1.0, seed=0, repair_hours=2.0)
"""
from __future__ import annotations

import heapq
import random
from dataclasses import dataclass

from ds_recycle.cluster.trace import Event, EventKind, Trace

__all__ = ["GeneratorSpec", "generate_trace"]


@dataclass(frozen=True)
class GeneratorSpec:
    """Parameters of a synthetic trace (see the module docstring for the model)."""

    nodes: int
    hours: float
    mtbf_hours: float
    seed: int = 0
    repair_hours: float | None = None

    def __post_init__(self) -> None:
        if self.nodes < 1:
            raise ValueError(f"nodes={self.nodes}: a trace needs at least one node. Fix: nodes >= 1")
        if not self.hours > 0:
            raise ValueError(f"hours={self.hours}: the trace must last. Fix: hours > 0")
        if not self.mtbf_hours > 0:
            raise ValueError(f"mtbf_hours={self.mtbf_hours}: must be positive. Fix: e.g. 1.0")
        if self.repair_hours is not None and not self.repair_hours > 0:
            raise ValueError(f"repair_hours={self.repair_hours}: must be positive or None "
                             "(nodes never return). Fix: e.g. 2.0")


def generate_trace(nodes: int, hours: float, mtbf_hours: float, seed: int = 0,
                   repair_hours: float | None = None) -> Trace:
    """A trace of `nodes` nodes over `hours` with cluster-wide failures every `mtbf_hours` on average."""
    spec = GeneratorSpec(nodes, hours, mtbf_hours, seed, repair_hours)
    rng = random.Random(spec.seed)
    end_s = spec.hours * 3600.0
    names = [f"node{i + 1}" for i in range(spec.nodes)]
    events = [Event(0.0, EventKind.ADD, name) for name in names]
    present = list(names)
    repairs: list[tuple[float, str]] = []
    t = 0.0
    while True:
        t += rng.expovariate(1.0 / (spec.mtbf_hours * 3600.0))
        while repairs and repairs[0][0] <= min(t, end_s):
            back_s, name = heapq.heappop(repairs)
            events.append(Event(_ms(back_s), EventKind.ADD, name))
            present.append(name)
        if t > end_s:
            break
        if not present:
            continue
        name = present.pop(rng.randrange(len(present)))
        events.append(Event(_ms(t), EventKind.REMOVE, name))
        if spec.repair_hours is not None:
            heapq.heappush(repairs, (t + rng.expovariate(1.0 / (spec.repair_hours * 3600.0)), name))
    events.sort(key=lambda e: e.time_s)  # stable: a node's remove stays before its later add
    source = (f"generated(nodes={spec.nodes}, hours={spec.hours}, mtbf_hours={spec.mtbf_hours}, "
              f"seed={spec.seed}, repair_hours={spec.repair_hours})")
    return Trace(tuple(events), source)


def _ms(t_s: float) -> float:
    """Round to whole milliseconds, the resolution of the file format."""
    return round(t_s * 1000.0) / 1000.0
