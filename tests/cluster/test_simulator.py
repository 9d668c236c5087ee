"""The simulator against hand-computed cases.

The job (conftest): S=2 stages x D=2 pipelines, M=4 micro-batches of one sample, F=B=W=0.1 s, no
communication, no optimizer cost; 1F1B on n stages with m micro-batches takes (m + n - 1) * 0.6 / n s.
Nodes n1..n4 fill pipeline 0 then pipeline 1; n1 is worker (pipeline 0, stage 0).
"""
from __future__ import annotations

from dataclasses import replace

import pytest

from ds_recycle.cluster.assumptions import Assumptions
from ds_recycle.cluster.ledger import Phase
from ds_recycle.cluster.simulator import simulate
from ds_recycle.cluster.systems import SystemKind
from ds_recycle.cluster.timing import PipelineTimer
from ds_recycle.cluster.trace import parse_trace
from ds_recycle.cluster.workload import Workload
from ds_recycle.plan import make_plan

from .conftest import SHAPE

HOUR = 3600.0
T_FAIL = 1000.0
SAMPLES = 8  # D x M x 1


def _trace(*extra: str):  # type: ignore[no-untyped-def]
    return parse_trace([f"0,add,n{i}" for i in range(1, 5)] + list(extra))


def _run(kind: SystemKind, w: Workload, a: Assumptions, *extra: str):  # type: ignore[no-untyped-def]
    return simulate(_trace(*extra), w, SHAPE, [kind], hours=1.0, assumptions=a).systems[kind]


def t1f1b(n: int, m: int) -> float:
    """1F1B on n stages sharing the model's 0.6 s of F+B+W per micro-batch evenly."""
    return (m + n - 1) * 0.6 / n


def test_planner_agrees_with_the_hand_formula(tiny_workload: Workload) -> None:
    timer = PipelineTimer(tiny_workload, SHAPE)
    for n, m in [(2, 4), (2, 8), (1, 3), (2, 5)]:
        assert timer.baseline_iteration_s(n, 2, m) == pytest.approx(t1f1b(n, m))


@pytest.mark.parametrize("kind", list(SystemKind))
def test_no_failures_is_the_failure_free_rate(kind: SystemKind, tiny_workload: Workload,
                                              tiny_assumptions: Assumptions) -> None:
    r = _run(kind, tiny_workload, tiny_assumptions)
    recycle = SAMPLES / make_plan(2, 2, 4, tiny_workload.costs_at(2, 2)).time_per_iteration
    expected = {
        SystemKind.RECYCLE: recycle,
        SystemKind.RECYCLE_REPARTITION: recycle,
        SystemKind.BAMBOO: SAMPLES / t1f1b(2, 4) * (1 - tiny_assumptions.bamboo_overhead),
    }.get(kind, SAMPLES / t1f1b(2, 4))
    assert r.effective_rate == pytest.approx(expected)
    assert r.breakdown()[Phase.TRAINING if kind is not SystemKind.BAMBOO else Phase.DEGRADED] \
        == pytest.approx(1.0)


def test_recycle_is_faster_than_1f1b_failure_free(tiny_workload: Workload,
                                                   tiny_assumptions: Assumptions) -> None:
    recycle = _run(SystemKind.RECYCLE, tiny_workload, tiny_assumptions).effective_rate
    assert SAMPLES / t1f1b(2, 4) < recycle <= SAMPLES / 1.3 + 1e-9  # 1.3 s: the plan format's bound


def test_one_failure_recycle(tiny_workload: Workload, tiny_assumptions: Assumptions) -> None:
    r = _run(SystemKind.RECYCLE, tiny_workload, tiny_assumptions, f"{T_FAIL * 1000:.0f},remove,n1")
    costs = tiny_workload.costs_at(2, 2)
    t0 = make_plan(2, 2, 4, costs).time_per_iteration
    t1 = make_plan(2, 2, 4, costs, failed=[(0, 0)]).time_per_iteration
    partial = T_FAIL % t0
    useful = SAMPLES / t0 * (T_FAIL - partial) + SAMPLES / t1 * (HOUR - T_FAIL - 5.0)
    assert r.samples == pytest.approx(useful)
    assert r.breakdown()[Phase.LOST] == pytest.approx(partial / HOUR)
    assert r.breakdown()[Phase.RECONFIGURING] == pytest.approx(5.0 / HOUR)
    assert t1 > t0  # the failure costs throughput, and the planner says how much


def test_one_failure_checkpoint_restart(tiny_workload: Workload,
                                        tiny_assumptions: Assumptions) -> None:
    a = replace(tiny_assumptions, checkpoint_interval_s=600.0, checkpoint_cost_s=10.0)
    r = _run(SystemKind.CHECKPOINT, tiny_workload, a, f"{T_FAIL * 1000:.0f},remove,n1")
    # 0-600 train, 600-610 checkpoint, 610-1000 trained then lost, 1000-1100 restart, then one
    # pipeline (3 nodes left, 2 stages) running all 8 micro-batches: 600 s trained + 10 s saved, x4,
    # then 60 s of training to the end of the hour.
    full, shrunk = SAMPLES / t1f1b(2, 4), SAMPLES / t1f1b(2, 8)
    assert r.samples == pytest.approx(full * 600 + shrunk * (4 * 600 + 60))
    br = r.breakdown()
    assert br[Phase.LOST] == pytest.approx(390 / HOUR)
    assert br[Phase.RESTARTING] == pytest.approx(100 / HOUR)
    assert br[Phase.CHECKPOINTING] == pytest.approx(5 * 10 / HOUR)


def test_one_failure_oobleck(tiny_workload: Workload, tiny_assumptions: Assumptions) -> None:
    r = _run(SystemKind.OOBLECK, tiny_workload, tiny_assumptions, f"{T_FAIL * 1000:.0f},remove,n1")
    # pipelines of 1 and 2 nodes share 8 micro-batches: 3 on the 1-node one (3 x 0.6 s = 1.8 s),
    # 5 on the 2-node one ((5 + 1) x 0.3 = 1.8 s)
    partial = T_FAIL % t1f1b(2, 4)
    useful = SAMPLES / t1f1b(2, 4) * (T_FAIL - partial) + SAMPLES / 1.8 * (HOUR - T_FAIL - 5.0)
    assert r.samples == pytest.approx(useful)
    assert r.breakdown()[Phase.LOST] == pytest.approx(partial / HOUR)


def test_one_failure_bamboo(tiny_workload: Workload, tiny_assumptions: Assumptions) -> None:
    r = _run(SystemKind.BAMBOO, tiny_workload, tiny_assumptions, f"{T_FAIL * 1000:.0f},remove,n1")
    # failover loses nothing; 1 overloaded of 3 active > 5%: re-balance at once (50 s), then one
    # pipeline with the global batch, still paying the redundancy
    keep = 1 - tiny_assumptions.bamboo_overhead
    useful = SAMPLES / t1f1b(2, 4) * keep * T_FAIL + SAMPLES / t1f1b(2, 8) * keep * (HOUR - T_FAIL - 50)
    assert r.samples == pytest.approx(useful)
    assert r.breakdown()[Phase.LOST] == 0.0
    assert r.breakdown()[Phase.RECONFIGURING] == pytest.approx(50 / HOUR)


def test_bamboo_adjacent_failures_restart(tiny_workload: Workload,
                                          tiny_assumptions: Assumptions) -> None:
    a = replace(tiny_assumptions, bamboo_reconfigure_threshold=1.0)  # no re-balance in between
    r = _run(SystemKind.BAMBOO, tiny_workload, a, "1000000,remove,n2", "2000000,remove,n1")
    assert any("adjacent" in text for _, text in r.notes)
    assert r.breakdown()[Phase.LOST] == pytest.approx(2000 / HOUR)  # no checkpoint within the hour
    assert r.breakdown()[Phase.RESTARTING] == pytest.approx(100 / HOUR)


@pytest.mark.parametrize("kind, after_rate", [
    (SystemKind.DROP, 4 / t1f1b(2, 4)),      # one pipeline left, its own 4 samples
    (SystemKind.RECOVER, 8 / t1f1b(2, 8)),   # one pipeline left, all 8 samples
])
def test_one_failure_replica_dropping(kind: SystemKind, after_rate: float, tiny_workload: Workload,
                                      tiny_assumptions: Assumptions) -> None:
    r = _run(kind, tiny_workload, tiny_assumptions, f"{T_FAIL * 1000:.0f},remove,n1")
    partial = T_FAIL % t1f1b(2, 4)
    useful = SAMPLES / t1f1b(2, 4) * (T_FAIL - partial) + after_rate * (HOUR - T_FAIL - 5.0)
    assert r.samples == pytest.approx(useful)


def test_recycle_rejoin_restores_the_rate(tiny_workload: Workload,
                                          tiny_assumptions: Assumptions) -> None:
    r = _run(SystemKind.RECYCLE, tiny_workload, tiny_assumptions, "1000000,remove,n1",
             "1500000,add,n1")
    full = SAMPLES / make_plan(2, 2, 4, tiny_workload.costs_at(2, 2)).time_per_iteration
    # ready 45 s after the add, 1 s of state copy, then 5 s to rejoin
    assert r.segments[-1].rate == pytest.approx(full)
    assert r.segments[-1].start_s == pytest.approx(1500 + 45 + 1 + 5)
    assert any("rejoins" in text for _, text in r.notes)


def test_recycle_stage_lost_restarts_from_checkpoint(tiny_workload: Workload,
                                                     tiny_assumptions: Assumptions) -> None:
    a = replace(tiny_assumptions, checkpoint_interval_s=600.0, checkpoint_cost_s=10.0)
    # n1 and n3 are both stage 0: the second loss leaves stage 0 with no replica; n2 and n4 are left,
    # one per stage after reloading the checkpoint: restart at once
    r = _run(SystemKind.RECYCLE, tiny_workload, a, "1000000,remove,n1", "1200000,remove,n3")
    assert any("checkpoint fallback" in text for _, text in r.notes)
    br = r.breakdown()
    assert br[Phase.RESTARTING] == pytest.approx(100 / HOUR)
    assert br[Phase.WAITING] == 0.0
    # everything trained since the checkpoint that ended at 610 s is lost (less the 5 s re-plan)
    assert br[Phase.LOST] == pytest.approx((1200 - 610 - 5) / HOUR)


def test_recycle_stage_lost_waits_for_a_node(tiny_workload: Workload,
                                             tiny_assumptions: Assumptions) -> None:
    # n1, n2 (pipeline 0) then n3 (stage 0): only n4 is left, fewer nodes than stages
    r = _run(SystemKind.RECYCLE, tiny_workload, tiny_assumptions, "1000000,remove,n1",
             "1100000,remove,n2", "1200000,remove,n3", "1300000,add,n5")
    br = r.breakdown()
    # 5 s to detect and agree, then waiting until n5 is ready (1300 + 45 s)
    assert br[Phase.WAITING] == pytest.approx((1345 - 1205) / HOUR)
    restart = next(s for s in r.segments if s.phase is Phase.RESTARTING)
    assert (restart.start_s, restart.end_s) == pytest.approx((1345, 1445))
    assert br[Phase.LOST] == pytest.approx((1200 - 10) / HOUR)  # no checkpoint yet, two re-plans


def test_stage_rebalance_helps_recycle(tiny_workload: Workload, tiny_assumptions: Assumptions) -> None:
    """Two failures in stage 0 of a 2x3 job; moving a stage-1 node over evens the load."""
    from ds_recycle.cluster.timing import JobShape

    shape = JobShape(2, 3, 4)
    trace = parse_trace([f"0,add,n{i}" for i in range(1, 7)] + ["1000000,remove,n1",
                                                                "1100000,remove,n3"])
    plain = simulate(trace, tiny_workload, shape, [SystemKind.RECYCLE], hours=1.0,
                     assumptions=tiny_assumptions).systems[SystemKind.RECYCLE]
    moved = simulate(trace, tiny_workload, shape, [SystemKind.RECYCLE], hours=1.0,
                     assumptions=replace(tiny_assumptions, recycle_rebalance=True)
                     ).systems[SystemKind.RECYCLE]
    assert any("re-balance" in text for _, text in moved.notes)
    assert moved.effective_rate > plain.effective_rate


def test_checkpoint_restart_grows_back_with_a_planned_restart(tiny_workload: Workload,
                                                              tiny_assumptions: Assumptions) -> None:
    r = _run(SystemKind.CHECKPOINT, tiny_workload, tiny_assumptions, "1000000,remove,n1",
             "2000000,add,n5")
    # failure: everything since the start is lost (no checkpoint), 100 s restart on one pipeline;
    # n5 ready at 2045 s: a planned restart (save first, no loss) back to two pipelines
    restarts = [(s.start_s, s.end_s) for s in r.segments if s.phase is Phase.RESTARTING]
    assert restarts == [pytest.approx((1000, 1100)), pytest.approx((2045, 2045 + 100 + 10))]
    assert r.breakdown()[Phase.LOST] == pytest.approx(1000 / HOUR)
    assert r.segments[-1].rate == pytest.approx(SAMPLES / t1f1b(2, 4))


def test_checkpoint_restart_wait_policy_stops(tiny_workload: Workload,
                                              tiny_assumptions: Assumptions) -> None:
    from ds_recycle.cluster.assumptions import ShrinkPolicy

    a = replace(tiny_assumptions, shrink_policy=ShrinkPolicy.WAIT)
    r = _run(SystemKind.CHECKPOINT, tiny_workload, a, "1000000,remove,n1", "2000000,add,n5")
    br = r.breakdown()
    assert br[Phase.WAITING] == pytest.approx(1045 / HOUR)  # until n5 is ready
    assert br[Phase.RESTARTING] == pytest.approx(100 / HOUR)


def test_oobleck_merges_pipelines_below_the_minimum(tiny_workload: Workload,
                                                    tiny_assumptions: Assumptions) -> None:
    a = replace(tiny_assumptions, oobleck_min_nodes=2)
    r = _run(SystemKind.OOBLECK, tiny_workload, a, f"{T_FAIL * 1000:.0f},remove,n1")
    # the broken pipeline cannot borrow (the other has exactly the minimum): its survivor is merged
    # away, one 2-node pipeline runs all 8 micro-batches
    assert r.segments[-1].rate == pytest.approx(SAMPLES / t1f1b(2, 8))


@pytest.mark.parametrize("kind", list(SystemKind))
def test_a_spare_node_replaces_the_failed_one(kind: SystemKind, tiny_workload: Workload,
                                              tiny_assumptions: Assumptions) -> None:
    """With a fifth node waiting, every system is back at its failure-free rate after n1 fails."""
    trace = parse_trace([f"0,add,n{i}" for i in range(1, 6)] + ["1000000,remove,n1"])
    r = simulate(trace, tiny_workload, SHAPE, [kind], hours=1.0,
                 assumptions=tiny_assumptions).systems[kind]
    assert r.segments[-1].rate == pytest.approx(r.reference_rate * (
        1 - tiny_assumptions.bamboo_overhead if kind is SystemKind.BAMBOO else 1.0))
    assert r.segments[-1].start_s < 1000 + 120


def test_recycle_repartition_moves_layers_when_a_failure_lasts_and_back_on_rejoin(
        tiny_workload: Workload, tiny_assumptions: Assumptions) -> None:
    """2 x 2: node n1 (worker (0, 0)) fails at 1000 s and comes back at 2000 s. ReCycle + re-partition re-routes
    at once like ReCycle, moves layers once the failure lasted 3 iterations, and moves them back after the rejoin;
    its throughput while the failure lasts is the planner's for the moved partition, above ReCycle's."""
    trace = _trace("1000000,remove,n1", "2000000,add,n5")
    plain = simulate(trace, tiny_workload, SHAPE, [SystemKind.RECYCLE], hours=1.0,
                     assumptions=tiny_assumptions).systems[SystemKind.RECYCLE]
    moved = simulate(trace, tiny_workload, SHAPE, [SystemKind.RECYCLE_REPARTITION], hours=1.0,
                     assumptions=tiny_assumptions).systems[SystemKind.RECYCLE_REPARTITION]
    notes = [text for _, text in moved.notes if "re-partition" in text]
    assert len(notes) == 2, moved.notes  # there and back
    assert notes[0].startswith("re-partition [0, 16, 32] -> ") and "-> [0, 16, 32] (" in notes[1]
    timer = PipelineTimer(tiny_workload, SHAPE)
    layers, base = timer.layers()
    assert base == (0, 16, 32) and layers.layers == 32
    during = next(s for s in moved.segments if s.start_s <= 1500 < s.end_s)
    rerouted = next(s for s in plain.segments if s.start_s <= 1500 < s.end_s)
    assert during.rate > rerouted.rate
    choice = timer.repartition_choice(frozenset({(0, 0)}), base, tiny_assumptions.repartition_horizon)
    assert during.rate == pytest.approx(SAMPLES / choice.moved_iteration_s)
    assert rerouted.rate == pytest.approx(SAMPLES / choice.current_iteration_s)
    assert moved.effective_rate > plain.effective_rate
    assert moved.segments[-1].rate == pytest.approx(plain.segments[-1].rate)  # back on the job's own partition
