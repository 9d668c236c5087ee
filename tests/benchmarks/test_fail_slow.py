"""``benchmarks/fail_slow.py``'s table: the suite's shapes and rows, and a row's arithmetic from the runs' step
stamps and events (the runs themselves are emulated jobs of minutes, run by hand: see the module's docstring)."""
from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.emulated_figure import Case, Result
from benchmarks.fail_slow import SUITE, Row, main, row_line, setup
from ds_recycle.events import PlanSwitchEvent, RepartitionEvent


def _run(step_s: dict[int, float], events: tuple[object, ...] = ()) -> Result:
    """A finished run whose step ``k`` took ``step_s`` of the largest key at or below ``k``."""
    res = Result(Case("x", "recycle"), 4, 4, 8)
    t, keys = 0.0, sorted(step_s)
    for k in range(0, 20):
        t += step_s[max(x for x in keys if x <= k)]
        res.stamps[k] = t
    res.events = list(events)
    return res


def test_a_row_reads_the_slowdowns_after_the_move_and_the_share_mitigated(tmp_path: Path) -> None:
    st = setup("4x4", 2, 100.0, tmp_path)
    row = Row("4x4", ((1, 1),), 2.0)
    switch = PlanSwitchEvent(absent=(), rerouted=0, slow=((1, 1, 2.0),), iteration=12)
    move = RepartitionEvent(iteration=15, before=(0, 1), after=(0, 1), absent=(), layers_moved=1, bytes_received=0,
                            move_s=0.1)
    res = {"vanilla ff": _run({0: 1.0}), "vanilla slow": _run({0: 1.0, 5: 1.5}),
           "recycle ff": _run({0: 0.8}), "recycle slow": _run({0: 0.8, 5: 1.2, 13: 1.0, 16: 0.88}, (switch, move))}
    line, mitigated = row_line(row, st, res, 4, (840.0, 700.0))
    # S0 = 1.5, S1 = 0.88 / 0.8 = 1.1 after the move: (1.5 - 1.1) / 0.5
    assert mitigated == pytest.approx(0.8)
    cols = line.split()
    assert cols[:3] == ["4x4", "1:1", "x2"]
    assert cols[cols.index("1.500") + 4] == "1.100"  # S0 ... S1
    assert cols[-7:-5] == ["8", "11"]  # found and moved, in iterations after the first slow step
    # planned 840 / 700 ms; with the runtime's 0.1 s an iteration beyond the plan added to both: 0.94 / 0.8
    assert cols[-3:-1] == ["1.200", "1.175"]


def test_the_suite_covers_the_issues_cases_and_every_shape_sets_up(tmp_path: Path) -> None:
    rows = {(shape, slow, f) for shape, _, _, slow, factors in SUITE for f in factors}
    assert {("4x4", "1:1", 2.0), ("4x4", "1:1", 1.5), ("4x4", "1:1", 3.0), ("4x4", "1:1,2:2", 2.0),
            ("8x4", "1:1", 2.0)} <= rows
    for shape, blocks, f_ms, _, _ in SUITE:
        st = setup(shape, blocks, f_ms, tmp_path)
        assert st.layers is not None and st.base is not None and st.pfile.exists()
        assert len(st.layers.F) == blocks * st.stages + 3  # embedding, the blocks, the head's compute, the head


def test_bad_shapes_and_workers_are_named(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="shape '4by4'"):
        main(["--shape", "4by4", "--workdir", str(tmp_path)])
    with pytest.raises(SystemExit, match="--slow-workers '1-1'"):
        main(["--slow-workers", "1-1", "--workdir", str(tmp_path)])
