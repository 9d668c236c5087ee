"""Failure traces: node add/remove events over time.

A trace file is CSV without a header, one event a line::

    time_ms,add|remove,nodeN

the format of the public traces of Oobleck's simulator ("Oobleck: Resilient Distributed Training of
Large Models Using Pipeline Templates", arXiv 2309.08125; repository SymbioticLab/Oobleck,
`tools/simulator/traces/`). Times are milliseconds from the start of the job and never decrease; a
node is added before it is removed and is not added twice while present. Blank lines and lines
starting with `#` are skipped. Every malformed line is rejected with its line number::

    trace = read_trace("../shared/traces/oobleck/1h.csv")
    trace.events[0]          # Event(time_s=0.0, kind=EventKind.ADD, node='node1')
"""
from __future__ import annotations

import enum
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["EventKind", "Event", "Trace", "TraceError", "read_trace", "parse_trace"]

_NODE_RE = re.compile(r"^[A-Za-z][A-Za-z0-9_.-]*$")


class TraceError(ValueError):
    """A trace line (or the whole trace) is malformed; the message names the file, line and fix."""


class EventKind(enum.Enum):
    """What happens to a node."""

    ADD = "add"
    """The node becomes available (joins the cluster; usable after its start-up delay)."""
    REMOVE = "remove"
    """The node fails or is preempted: everything it was running stops at once."""


@dataclass(frozen=True)
class Event:
    """One trace event: at `time_s` seconds, `node` is added or removed."""

    time_s: float
    kind: EventKind
    node: str


@dataclass(frozen=True)
class Trace:
    """A time-ordered list of events and where it came from.

    `duration_s` is the span the trace describes: the time of its last event unless given.
    """

    events: tuple[Event, ...]
    source: str = "<memory>"

    @property
    def last_time_s(self) -> float:
        return self.events[-1].time_s if self.events else 0.0

    @property
    def removals(self) -> int:
        return sum(1 for e in self.events if e.kind is EventKind.REMOVE)

    def nodes_at(self, time_s: float) -> frozenset[str]:
        """The nodes present just after every event at or before `time_s`."""
        present: set[str] = set()
        for event in self.events:
            if event.time_s > time_s:
                break
            (present.add if event.kind is EventKind.ADD else present.discard)(event.node)
        return frozenset(present)

    def to_csv(self) -> str:
        """The trace in its file format (times rounded to whole milliseconds)."""
        return "".join(f"{round(e.time_s * 1000)},{e.kind.value},{e.node}\n" for e in self.events)


def _fail(source: str, lineno: int, line: str, problem: str, fix: str) -> TraceError:
    return TraceError(f"{source}:{lineno}: {problem} in line {line!r}. Fix: {fix}")


def _parse_line(source: str, lineno: int, line: str) -> Event:
    fields = [f.strip() for f in line.split(",")]
    if len(fields) != 3:
        raise _fail(source, lineno, line, f"{len(fields)} fields, expected 3",
                    "write 'time_ms,add|remove,nodeN'")
    time_text, kind_text, node = fields
    try:
        time_ms = int(time_text)
    except ValueError:
        raise _fail(source, lineno, line, f"time {time_text!r} is not an integer",
                    "give the time in whole milliseconds") from None
    if time_ms < 0:
        raise _fail(source, lineno, line, f"time {time_ms} is negative", "times start at 0")
    try:
        kind = EventKind(kind_text)
    except ValueError:
        raise _fail(source, lineno, line, f"action {kind_text!r} is unknown",
                    "use 'add' or 'remove'") from None
    if not _NODE_RE.match(node):
        raise _fail(source, lineno, line, f"node name {node!r} is not a name",
                    "use a name such as 'node12'")
    return Event(time_ms / 1000.0, kind, node)


def parse_trace(lines: Iterable[str], source: str = "<memory>") -> Trace:
    """Parse trace lines; raise :class:`TraceError` naming the first bad line."""
    events: list[Event] = []
    present: set[str] = set()
    for lineno, raw in enumerate(lines, start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        event = _parse_line(source, lineno, line)
        if events and event.time_s < events[-1].time_s:
            raise _fail(source, lineno, line,
                        f"time {event.time_s * 1000:.0f} ms is before the previous event's "
                        f"{events[-1].time_s * 1000:.0f} ms", "sort the events by time")
        if event.kind is EventKind.ADD and event.node in present:
            raise _fail(source, lineno, line, f"{event.node} is added while already present",
                        "remove it first, or give the new node another name")
        if event.kind is EventKind.REMOVE and event.node not in present:
            raise _fail(source, lineno, line, f"{event.node} is removed but not present",
                        "add the node before removing it")
        (present.add if event.kind is EventKind.ADD else present.discard)(event.node)
        events.append(event)
    if not events:
        raise TraceError(f"{source}: the trace has no events. Fix: give at least one 'add' line")
    return Trace(tuple(events), source)


def read_trace(path: str | os.PathLike[str]) -> Trace:
    """Read and parse a trace file; a missing file is a :class:`TraceError` naming the path."""
    path = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as handle:
            return parse_trace(handle, source=path)
    except FileNotFoundError:
        raise TraceError(f"trace file {path!r} does not exist. Fix: pass the path of a "
                         "'time_ms,add|remove,nodeN' CSV file") from None
