"""Trace parsing (good and bad lines, with line numbers) and the shipped traces."""
from __future__ import annotations

from pathlib import Path

import pytest

from ds_recycle.cluster.trace import EventKind, TraceError, parse_trace, read_trace


def test_parse_good_lines_and_skip_comments() -> None:
    trace = parse_trace(["# header comment", "0,add,node1", "", "0,add,node2", "1500,remove,node1",
                         "2000,add,node1"])
    assert [(e.time_s, e.kind, e.node) for e in trace.events] == [
        (0.0, EventKind.ADD, "node1"), (0.0, EventKind.ADD, "node2"),
        (1.5, EventKind.REMOVE, "node1"), (2.0, EventKind.ADD, "node1")]
    assert trace.removals == 1
    assert trace.nodes_at(1.5) == {"node2"}
    assert parse_trace(trace.to_csv().splitlines()).events == trace.events


@pytest.mark.parametrize("lines, lineno, words", [
    (["0,add,node1", "5,add"], 2, "2 fields"),
    (["0,add,node1,x"], 1, "4 fields"),
    (["zero,add,node1"], 1, "not an integer"),
    (["1.5,add,node1"], 1, "not an integer"),
    (["-1,add,node1"], 1, "negative"),
    (["0,join,node1"], 1, "unknown"),
    (["0,add,node 1"], 1, "not a name"),
    (["0,add,node1", "10,add,node2", "5,remove,node1"], 3, "before the previous"),
    (["0,add,node1", "1,add,node1"], 2, "already present"),
    (["0,add,node1", "1,remove,node2"], 2, "not present"),
])
def test_bad_lines_are_rejected_with_their_number(lines: list[str], lineno: int, words: str) -> None:
    with pytest.raises(TraceError) as err:
        parse_trace(lines, source="t.csv")
    assert f"t.csv:{lineno}:" in str(err.value)
    assert words in str(err.value)
    assert "Fix:" in str(err.value)


def test_empty_and_missing_traces(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="no events"):
        parse_trace(["# nothing"])
    with pytest.raises(TraceError, match="does not exist"):
        read_trace(tmp_path / "absent.csv")


@pytest.mark.parametrize("name, removals, adds", [
    ("5m.csv", 15, 30), ("10m.csv", 15, 30), ("30m.csv", 15, 30), ("1h.csv", 15, 30),
    ("3h.csv", 15, 30), ("6h.csv", 15, 30), ("g4dn-trace.csv", 74, 79)])
def test_shipped_traces_parse(traces_dir: Path, name: str, removals: int, adds: int) -> None:
    trace = read_trace(traces_dir / name)
    assert trace.removals == removals
    assert sum(1 for e in trace.events if e.kind is EventKind.ADD) == adds


def test_synthetic_trace_spacing(traces_dir: Path) -> None:
    """The synthetic traces remove one node every period (10m: 601.2 s apart)."""
    trace = read_trace(traces_dir / "10m.csv")
    times = [e.time_s for e in trace.events if e.kind is EventKind.REMOVE]
    gaps = {round(b - a, 3) for a, b in zip(times, times[1:])}
    assert gaps == {601.2}
