"""Fail-slow detection (ds_recycle.resilience.speed): bounded latency, hysteresis, no verdict from noise."""
from __future__ import annotations

import random

import pytest

from ds_recycle.config import ConfigError, FailSlowConfig
from ds_recycle.resilience.speed import SpeedWatch

WORKERS = [(p, s) for s in range(4) for p in range(4)]
SLOW = (1, 2)


def _paces(rng: random.Random, jitter: float, slow: float = 1.0) -> dict[tuple[int, int], float]:
    return {w: (slow if w == SLOW else 1.0) * (1.0 + rng.uniform(-jitter, jitter)) * (1 + 0.2 * w[1])
            for w in WORKERS}


@pytest.mark.parametrize("seed", range(5))
def test_jitter_and_single_spikes_never_change_the_plan(seed: int) -> None:
    """+-20% noise on every worker every iteration, and a 3x spike of one random worker every 7th iteration,
    for 3,000 iterations: not one verdict."""
    rng, watch = random.Random(seed), SpeedWatch()
    for n in range(3000):
        paces = _paces(rng, 0.2)
        if n % 7 == 0:
            paces[rng.choice(WORKERS)] *= 3.0
        assert watch.observe(paces) == [], n
    assert watch.factors == {}


@pytest.mark.parametrize("factor", [1.5, 2.0, 3.0])
def test_slow_worker_found_within_seven_checks_and_back_within_seven(factor: float) -> None:
    rng, watch = random.Random(1), SpeedWatch()
    for _ in range(10):
        assert watch.observe(_paces(rng, 0.05)) == []
    checks = next(n for n in range(1, 11) if (verdicts := watch.observe(_paces(rng, 0.05, slow=factor))))
    assert checks <= 7, checks  # window 7 (four slow ratios move its median) + confirm 4 - 1
    (v,) = verdicts
    assert v.worker == SLOW and v.previous == 1.0 and v.factor == pytest.approx(factor, abs=0.25)
    assert watch.factors == {SLOW: v.factor}
    for _ in range(20):  # still slow, fewer micro-batches: its pace per micro-batch stays the same
        assert watch.observe(_paces(rng, 0.05, slow=factor)) == []
    checks = next(n for n in range(1, 11) if (verdicts := watch.observe(_paces(rng, 0.05))))
    assert checks <= 7 and verdicts[0].factor == 1.0 and watch.factors == {}


def test_a_changed_slowness_updates_the_factor_a_small_drift_does_not() -> None:
    watch = SpeedWatch()
    base = {w: 1.0 for w in WORKERS}
    for _ in range(10):
        watch.observe({**base, SLOW: 2.0})
    assert watch.factors == {SLOW: 2.0}
    for _ in range(10):
        assert watch.observe({**base, SLOW: 2.2}) == []  # within one step of 2.0
    changes = [v for _ in range(10) for v in watch.observe({**base, SLOW: 3.0})]
    assert [(c.previous, c.factor) for c in changes] == [(2.0, 3.0)]
    changes = [v for _ in range(10) for v in watch.observe({**base, SLOW: 1.25})]  # below enter: normal at once
    assert [(c.previous, c.factor) for c in changes] == [(3.0, 1.0)]


def test_hysteresis_between_leave_and_enter_keeps_the_verdict() -> None:
    watch = SpeedWatch()
    base = {w: 1.0 for w in WORKERS}
    assert all(watch.observe({**base, SLOW: 1.25}) == [] for _ in range(20))  # below enter: never slow
    for _ in range(10):
        watch.observe({**base, SLOW: 1.5})
    assert watch.factors == {SLOW: 1.5}
    assert all(watch.observe({**base, SLOW: 1.2}) == [] for _ in range(20))  # above leave: still slow


def test_unmeasured_and_lonely_workers_are_not_judged_and_reset_forgets() -> None:
    watch = SpeedWatch()
    for _ in range(10):
        assert watch.observe({(0, 0): 5.0, (0, 1): 0.0, (1, 1): 1.0}) == []  # (0, 0) has no live peer
    for _ in range(10):
        watch.observe({(0, 1): 3.0, (1, 1): 1.0, (2, 1): 1.0})
    assert watch.factors == {(0, 1): 3.0} and watch.assumed([(1, 1)]) == {}
    watch.reset()
    assert watch.factors == {} and watch.observe({(0, 1): 3.0, (1, 1): 1.0}) == []


def test_settings_are_checked() -> None:
    with pytest.raises(ConfigError, match="1 < leave < enter"):
        FailSlowConfig(enter=1.1, leave=1.2)
