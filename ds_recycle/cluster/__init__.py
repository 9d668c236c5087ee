"""Cluster-scale, trace-driven simulation of ReCycle against other fault-tolerance systems.

Pure Python, no torch import. ReCycle's throughput under every failure set comes from the planner
(:mod:`ds_recycle.plan`), and so does every other system's failure-free iteration time: one planner,
not two. See :mod:`ds_recycle.cluster.simulator` for the run and :mod:`ds_recycle.cluster.assumptions`
for every modelling number and its source.

    ds-recycle simulate --trace ../shared/traces/oobleck/1h.csv --model gpt3-2.7b --stages 6 --pipelines 5
"""
from __future__ import annotations

from ds_recycle.cluster.assumptions import Assumptions, ShrinkPolicy, resolve_assumptions
from ds_recycle.cluster.generator import generate_trace
from ds_recycle.cluster.ledger import Phase, Segment
from ds_recycle.cluster.simulator import SimulationResult, SystemResult, simulate
from ds_recycle.cluster.systems import SystemKind, parse_systems
from ds_recycle.cluster.timing import BaselineSchedule, JobShape, PipelineTimer
from ds_recycle.cluster.trace import Event, EventKind, Trace, TraceError, parse_trace, read_trace

__all__ = ["Assumptions", "ShrinkPolicy", "resolve_assumptions", "generate_trace", "Phase",
           "Segment", "SimulationResult", "SystemResult", "simulate", "SystemKind", "parse_systems",
           "BaselineSchedule", "JobShape", "PipelineTimer", "Event", "EventKind", "Trace",
           "TraceError", "parse_trace", "read_trace"]
