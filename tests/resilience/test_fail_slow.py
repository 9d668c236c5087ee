"""Fail-slow end to end: a worker made slow (``--slow``) is found within the detector's bound, the plan moves some of
its micro-batches to its stage's peers, then a layer of its stage to the other stage, the worker is found normal again
when it speeds up and the plan and the layer go back;
the job ends at the failure-free model bit for bit. Timing noise alone never changes the plan (emulated
accelerators, whose op times are sleeps, with +-20% jitter on every op)."""
from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from ds_recycle.events import FailureEvent, PlanSwitchEvent, RepartitionEvent, SlowWorkerEvent, events_of  # noqa: E402
from tests.harness import assert_same_model, launch, tiny_config  # noqa: E402

pytestmark = [pytest.mark.multiprocess]

STEPS = 30
SLOW_AT, FAST_AT = 3, 14
BOUND = 10
"""Iterations from the first slow (or fast again) iteration to the plan that assumes it: 8 with the default
detector on steady paces (``ds_recycle.resilience.speed``: window 7, confirm 4, the exchange read one boundary
later); on a loaded 2-core machine a noisy ratio can break a confirmation streak (9 seen), so the tests allow the
issue's 10."""


@pytest.mark.timeout(300)
def test_slow_worker_found_planned_around_and_back_same_model(tmp_path: Path,
                                                              reference: Callable[[int, int, int], Path]) -> None:
    config = tiny_config(tmp_path, "c", 2, 3, failure_timeout_s=60.0)
    out, metrics = tmp_path / "slow.pt", tmp_path / "m.jsonl"
    job = launch(6, ["--deepspeed_config", str(config), "--steps", str(STEPS), "--save-final", str(out),
                     "--metrics", str(metrics), "--slow", f"1:1@{SLOW_AT}*3", "--slow", f"1:1@{FAST_AT}*1"],
                 timeout=240)
    assert job.returncode == 0, job.output[-4000:]
    records = job.metrics(metrics)
    verdicts = [e for e in events_of(records, SlowWorkerEvent) if e.worker == (1, 1)]
    assert len(verdicts) >= 2, verdicts
    slow, fast = verdicts[0], verdicts[1]
    assert slow.factor >= 2.5 and slow.previous == 1.0 and slow.rank == 4, slow
    assert SLOW_AT < slow.iteration <= SLOW_AT + BOUND, slow
    assert fast.factor == 1.0 and FAST_AT < fast.iteration <= FAST_AT + BOUND, verdicts
    switches = {e.iteration: e for e in events_of(records, PlanSwitchEvent)}
    assert (1, 1, slow.factor) in switches[slow.iteration].slow and switches[slow.iteration].rerouted > 0
    assert all(w[:2] != (1, 1) for w in switches[fast.iteration].slow)
    # the slow worker is partial capacity: its stage hands a block to the other stage once the plan that assumes it
    # has lasted (recycle.repartition: 3 iterations), and takes it back once the plan stops assuming it
    moves = [(e.iteration, e.before, e.after) for e in events_of(records, RepartitionEvent)]
    assert [(b, a) for _, b, a in moves] == [((0, 2, 4), (0, 3, 4)), ((0, 3, 4), (0, 2, 4))], moves
    assert slow.iteration < moves[0][0] < fast.iteration < moves[1][0], (moves, slow, fast)
    print(f"found slow at {slow.iteration} ({slow.ratio:.2f}x), layers moved at {moves[0][0]}, normal again at "
          f"{fast.iteration}, moved back at {moves[1][0]}")
    assert_same_model(out, reference(2, 3, STEPS))


@pytest.mark.timeout(300)
def test_worker_killed_while_a_slow_one_is_planned_around_same_model(tmp_path: Path,
                                                                     reference: Callable[[int, int, int], Path]) -> None:
    """Worker (0, 1) killed after the plan moved some of slow worker (1, 1)'s micro-batches to its peers: the failure's
    plan assumes normal speeds again (the handler redoes the interrupted iteration's partial sums rather than keep
    rows laid out for the other plan); the job goes on and ends at the failure-free model."""
    config = tiny_config(tmp_path, "c", 2, 3, failure_timeout_s=60.0)
    out, metrics = tmp_path / "k.pt", tmp_path / "m.jsonl"
    job = launch(6, ["--deepspeed_config", str(config), "--steps", str(STEPS), "--save-final", str(out),
                     "--metrics", str(metrics), "--slow", f"1:1@{SLOW_AT}*3", "--kill", f"0:1@{SLOW_AT + BOUND + 3}:backward-weight"],
                 timeout=240)
    assert job.returncode == 0, job.output[-4000:]
    records = job.metrics(metrics)
    slow = [e for e in events_of(records, SlowWorkerEvent) if e.worker == (1, 1)]
    assert slow and slow[0].iteration < SLOW_AT + BOUND + 3, slow  # planned around before the kill
    assert [e.lost_workers for e in events_of(records, FailureEvent)] == [((0, 1),)]
    assert_same_model(out, reference(2, 3, STEPS))


@pytest.mark.timeout(300)
def test_jitter_alone_never_changes_the_plan(tmp_path: Path) -> None:
    """+-20% jitter on every op of every worker for 30 iterations: no verdict; then worker (1, 1) turns 3x slower
    (the same noise on top): it alone is found, within the bound (the detector was watching all along)."""
    from benchmarks.emulated.profiles import profile, write_profile
    from benchmarks.emulated_figure import Case, run_case

    pfile = write_profile(tmp_path / "profile.json", profile("gpt3-2.7b", 2, 3, f_ms=20.0))
    steps, slow_at = 45, 30
    res = run_case(Case("jitter", "recycle", jitter=0.2, slow=(((1, 1), slow_at, 3.0),)), 2, 3, 4, steps, 2, pfile,
                   pfile, tmp_path / "job")
    assert res.ok, res.note
    changes = {(e.kind, e.iteration) for e in res.events if isinstance(e, (SlowWorkerEvent, PlanSwitchEvent))}
    verdicts = {(e.worker, e.factor, e.iteration) for e in res.events if isinstance(e, SlowWorkerEvent)}
    assert all(it is not None and it > slow_at for _, it in changes), sorted(changes, key=str)
    assert len(verdicts) == 1, verdicts
    ((worker, factor, iteration),) = verdicts
    assert worker == (1, 1) and factor >= 2.5 and iteration <= slow_at + BOUND
