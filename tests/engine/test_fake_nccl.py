"""The engine's schedules on a fake NCCL (tests/engine/fake_nccl.py): NCCL's matching, groups, a dead peer that
hangs, abort; a deadlock detector. The static check (engine/nccl_check.py) and the fake agree, and the engine's
lowering issued in match order runs every plan of the grid, with the stages' blocking gradient reductions, and
survives a kill before any of its steps."""
from __future__ import annotations

import pytest

from ds_recycle.engine.nccl_check import NcclPlanError, Transfer, check_waits, in_match_order, p2p_program, timeline
from tests.engine.fake_nccl import Collective, Step, engine_program, run_program
from tests.engine.plan_grid import grid

pytestmark = pytest.mark.timeout(240)


def _send(peer: int, i: int) -> Transfer:
    return Transfer("send", peer, "activation", (0, i))


def _recv(peer: int, i: int) -> Transfer:
    return Transfer("recv", peer, "activation", (0, i))


def test_head_to_head_sends_are_found_deadlocked_and_aborted_and_a_group_completes() -> None:
    apart = {0: [[_send(1, 0)], [_recv(1, 0)]], 1: [[_send(0, 0)], [_recv(0, 0)]]}
    out = run_program(apart, timeout_s=10)
    assert out.stall is not None and out.stall.deadlock, out
    assert out.ends == {0: "aborted", 1: "aborted"} and not out.errors
    assert "rank 0 waits for send activation 0.0 -> rank 1" in str(out.stall)
    together = {0: [[_send(1, 0), _recv(1, 0)]], 1: [[_send(0, 0), _recv(0, 0)]]}
    out = run_program(together, timeout_s=10)
    assert out.stall is None and out.ends == {0: "done", 1: "done"} and not out.errors


def test_messages_match_per_pair_in_posting_order_and_a_wrong_order_is_caught() -> None:
    out = run_program({0: [[_send(1, 0), _send(1, 1)]], 1: [[_recv(0, 1)], [_recv(0, 0)]]}, timeout_s=10)
    assert out.ends == {0: "done", 1: "done"}
    assert len(out.errors) == 2 and "received [(0, 'activation', (0, 0))], expected [(0, 'activation', (0, 1))]" \
        in out.errors[0]


def test_a_collective_completes_once_every_member_posted_it_and_a_dead_member_hangs_it() -> None:
    reduce = Collective("all-reduce", (0, 1, 2))
    assert run_program({r: [reduce] for r in range(3)}, timeout_s=10).ends == {0: "done", 1: "done", 2: "done"}
    out = run_program({r: [reduce] for r in range(3)}, kill=(2, 0), timeout_s=10)
    assert out.stall is not None and not out.stall.deadlock and out.stall.dead == {2}
    assert out.ends == {0: "aborted", 1: "aborted", 2: "killed"}


GRID = [(name, plan) for name, plan, _ in grid(pairs=3)]
"""Plans of the planner's grid the engine would run (the default schedule, up to three pairs of failed workers)."""


def test_the_fake_and_the_static_check_agree_on_every_plan_batched_as_lowered() -> None:
    """Transfers only, batches as the lowering places them (receives before their compute, sends after): the fake
    stalls exactly where the static check finds a wait cycle, and neither run nor check is wrong about the order of
    any pair."""
    agreed = stalled = 0
    for name, plan in GRID:
        try:
            check_waits(p2p_program(plan))  # type: ignore[arg-type]
            static_cycle = False
        except NcclPlanError:
            static_cycle = True
        out = run_program(engine_program(plan, match_order=False, reductions=False), timeout_s=20)  # type: ignore[arg-type]
        assert not out.errors, (name, out.errors)
        assert (out.stall is not None) == static_cycle, (name, out.stall)
        assert out.stall is None or out.stall.deadlock
        agreed += 1
        stalled += static_cycle
    assert agreed == len(GRID) and 0 < stalled < agreed


def test_every_plan_of_the_grid_runs_in_match_order_with_the_stages_blocking_reductions() -> None:
    for name, plan in GRID:
        program = engine_program(plan)  # type: ignore[arg-type]
        assert sum(isinstance(s, Collective) for steps in program.values() for s in steps) == len(program), name
        out = run_program(program, timeout_s=20)
        assert out.stall is None and not out.errors, (name, out.stall, out.errors)
        assert set(out.ends.values()) == {"done"}, (name, out.ends)


def test_a_kill_before_any_step_of_any_rank_hangs_the_survivors_until_the_abort_returns_them_all() -> None:
    """Every plan of the grid, each rank killed before its first, middle, reduction and last steps (the phases:
    the forward's transfers, the backward's, the gradient reduction, the tail): the survivors never fail by
    themselves (a dead peer hangs them, as on NCCL), the detector sees them stalled on the dead rank, and the
    epoch's abort returns every one of them."""
    runs = hung = 0
    for name, plan in GRID:
        ran, stuck = _kill_everywhere(name, engine_program(plan))  # type: ignore[arg-type]
        runs, hung = runs + ran, hung + stuck
    assert 0 < hung < runs


def _kill_everywhere(name: str, program: dict[int, list[Step]]) -> tuple[int, int]:
    """Kill each rank before each phase's step in turn: the number of runs, and of those whose survivors hung until
    aborted."""
    kills = [(rank, k) for rank, steps in program.items() for k in sorted(
            {0, len(steps) // 2, len(steps) - 1, *(j for j, s in enumerate(steps) if isinstance(s, Collective))})]
    hung = 0
    for rank, k in kills:
        out = run_program(program, kill=(rank, k), timeout_s=20)
        assert not out.errors, (name, rank, k, out.errors)
        assert out.ends[rank] == "killed"
        survivors = {r: e for r, e in out.ends.items() if r != rank}
        assert set(survivors.values()) <= {"done", "aborted"}, (name, rank, k, survivors)
        if "aborted" in survivors.values():
            assert out.stall is not None and out.stall.dead == {rank}, (name, rank, k, out.stall)
            assert out.abort_s is not None and out.abort_s < 5.0
            hung += 1
        else:  # every survivor finished: the dead rank owed nothing more to anyone
            assert out.stall is None
    return len(kills), hung


def test_the_timeline_the_fake_runs_is_the_engines_lowering() -> None:
    name, plan = GRID[5]
    lines = timeline(plan)  # type: ignore[arg-type]
    program = engine_program(plan, reductions=False)  # type: ignore[arg-type]
    assert program == {r: list(b) for r, b in in_match_order(lines).items()}, name
