from __future__ import annotations

import pytest

from ds_recycle.plan import CostModel, PlanCache, StageLostError, normalize_failures, validate_plan


def test_normalize_equivalent_sets() -> None:
    a, perm_a = normalize_failures([(3, 1), (0, 2)], 4, 4)
    b, perm_b = normalize_failures([(1, 1), (2, 2)], 4, 4)
    assert a == b == ((1,), (2,))
    assert perm_a[3] == 0 and perm_a[0] == 1
    assert sorted(perm_a) == list(range(4))
    same_pipe, _ = normalize_failures([(2, 1), (2, 2)], 4, 4)
    assert same_pipe == ((1, 2),) != a
    assert normalize_failures([], 4, 4)[0] == ()


def test_get_matches_exact_failures() -> None:
    cache = PlanCache(3, 3, 4, CostModel.uniform(3, o=0.5, comm=0.1), iterations=2)
    plan = cache.get([(2, 1)])
    validate_plan(plan)
    assert plan.failed == frozenset({(2, 1)})
    other = cache.get([(0, 1)])
    assert other.failed == frozenset({(0, 1)}) and len(cache) == 1     # one plan serves both
    validate_plan(other)
    assert cache.time_per_iteration([(1, 1)]) == plan.time_per_iteration


def test_precompute_counts_and_round_trip(tmp_path) -> None:
    cache = PlanCache(3, 2, 3, CostModel.uniform(3, comm=0.05))
    # keys: none (1); single: one per stage (3); double: same pipeline two stages (3);
    # two pipelines, different stages (3); two pipelines same stage loses the stage (skipped)
    assert cache.precompute(max_failures=2) == 10
    path = tmp_path / "cache.json.gz"
    cache.save(path)
    loaded = PlanCache.load(path)
    assert len(loaded) == 10
    for failed in ([], [(1, 2)], [(0, 0), (1, 2)], [(1, 0), (1, 1)]):
        assert loaded.get(failed).to_json() == cache.get(failed).to_json()
    with pytest.raises(StageLostError):
        loaded.get([(0, 1), (1, 1)])
