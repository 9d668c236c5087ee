"""The failure generator: seeded, its mean time between failures, repairs."""
from __future__ import annotations

import pytest

from ds_recycle.cluster.generator import generate_trace
from ds_recycle.cluster.trace import EventKind, parse_trace


def _removal_times(trace) -> list[float]:  # type: ignore[no-untyped-def]
    return [e.time_s for e in trace.events if e.kind is EventKind.REMOVE]


def test_mean_time_between_failures_matches() -> None:
    trace = generate_trace(nodes=5000, hours=3000.0, mtbf_hours=1.5, seed=3)
    times = _removal_times(trace)
    assert len(times) > 1500
    gaps = [b - a for a, b in zip(times, times[1:])]
    mean_h = sum(gaps) / len(gaps) / 3600
    assert mean_h == pytest.approx(1.5, rel=0.06)


def test_seeded_and_valid() -> None:
    a = generate_trace(nodes=64, hours=48.0, mtbf_hours=2.0, seed=7, repair_hours=3.0)
    b = generate_trace(nodes=64, hours=48.0, mtbf_hours=2.0, seed=7, repair_hours=3.0)
    c = generate_trace(nodes=64, hours=48.0, mtbf_hours=2.0, seed=8, repair_hours=3.0)
    assert a.events == b.events
    assert a.events != c.events
    # it round-trips through the file format and its parser's rules (no double add or remove)
    assert parse_trace(a.to_csv().splitlines()).events == a.events
    readds = [e for e in a.events if e.kind is EventKind.ADD and e.time_s > 0]
    assert readds, "with repairs, removed nodes come back"


def test_without_repairs_nodes_never_return() -> None:
    trace = generate_trace(nodes=8, hours=100.0, mtbf_hours=1.0, seed=1)
    assert all(e.time_s == 0 for e in trace.events if e.kind is EventKind.ADD)
    assert trace.removals == 8  # every node eventually fails, then failures stop


@pytest.mark.parametrize("kwargs, word", [
    ({"nodes": 0, "hours": 1.0, "mtbf_hours": 1.0}, "nodes"),
    ({"nodes": 4, "hours": 0.0, "mtbf_hours": 1.0}, "hours"),
    ({"nodes": 4, "hours": 1.0, "mtbf_hours": -1.0}, "mtbf_hours"),
    ({"nodes": 4, "hours": 1.0, "mtbf_hours": 1.0, "repair_hours": 0.0}, "repair_hours"),
])
def test_bad_parameters(kwargs: dict, word: str) -> None:
    with pytest.raises(ValueError, match=word):
        generate_trace(**kwargs)
