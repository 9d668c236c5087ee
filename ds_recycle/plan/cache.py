"""Failure normalization and the plan cache.

Pipelines are interchangeable, so a failure set and any renaming of its pipelines need one plan. A set
is normalized by sorting pipelines (those with failures first, by their tuple of failed stages), and
renaming pipeline ``p`` to its place ``perm[p]`` in that order; the key is the tuple of failed-stage tuples
of the failed pipelines. ``{(3, 1), (0, 2)}`` and ``{(1, 1), (2, 2)}`` share the key ``((1,), (2,))``.

    cache = PlanCache(8, 8, 32, CostModel.uniform(8), iterations=2)
    cache.precompute(max_failures=2)          # every single and double failure, ahead of time
    plan = cache.get([(5, 3)])                # a dict lookup plus renaming the pipelines back
    cache.save("plans.json.gz"); cache = PlanCache.load("plans.json.gz")
"""
from __future__ import annotations

import gc
import gzip
import itertools
import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from ds_recycle.plan._gc import gc_paused
from ds_recycle.plan.costs import CostModel
from ds_recycle.plan.errors import PlanError
from ds_recycle.plan.ops import Worker
from ds_recycle.plan.plan import Plan
from ds_recycle.plan.schedules import make_plan

__all__ = ["FailureKey", "normalize_failures", "PlanCache"]

FailureKey = tuple[tuple[int, ...], ...]
"""Normalized failure set: the failed stages of each failed pipeline, pipelines in canonical order."""


def normalize_failures(failed: Iterable[Worker], stages: int, pipelines: int) -> tuple[FailureKey, tuple[int, ...]]:
    """``(key, perm)``: pipeline ``p`` of ``failed`` is pipeline ``perm[p]`` of the normalized set."""
    by_pipe: dict[int, list[int]] = {p: [] for p in range(pipelines)}
    for p, s in set(map(tuple, failed)):
        if not (0 <= p < pipelines and 0 <= s < stages):
            raise PlanError(f"failed worker {p}:{s} is outside {pipelines} pipelines x {stages} stages")
        by_pipe[p].append(s)
    order = sorted(range(pipelines), key=lambda p: (not by_pipe[p], tuple(sorted(by_pipe[p])), p))
    perm = [0] * pipelines
    for place, p in enumerate(order):
        perm[p] = place
    key = tuple(tuple(sorted(by_pipe[p])) for p in order if by_pipe[p])
    return key, tuple(perm)


def _failed_of(key: FailureKey) -> frozenset[Worker]:
    return frozenset((p, s) for p, stages in enumerate(key) for s in stages)


class PlanCache:
    """Plans of one topology and cost model, keyed by normalized failure set."""

    def __init__(self, stages: int, pipelines: int, microbatches: int, costs: CostModel, *, iterations: int = 1,
                 schedule: str = "adaptive", optimizer: str = "staggered", memory_limit: int | None = None) -> None:
        self.stages, self.pipelines, self.microbatches, self.costs = stages, pipelines, microbatches, costs
        self.iterations, self.schedule = iterations, schedule
        self.optimizer, self.memory_limit = optimizer, memory_limit
        self._plans: dict[FailureKey, Plan] = {}
        self._renamed: dict[frozenset[Worker], Plan] = {}
        self._slow: dict[tuple[frozenset[Worker], tuple[tuple[int, int, float], ...]], Plan] = {}
        """Plans with slow workers, by exact failure set and slow factors (made on demand, never normalised:
        which worker is slow matters beyond its pipeline's name)."""

    def __len__(self) -> int:
        return len(self._plans)

    def _plan(self, key: FailureKey) -> Plan:
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = self._make(key)
        return plan

    def get(self, failed: Iterable[Worker], slow: Mapping[Worker, float] | None = None) -> Plan:
        """The plan for exactly ``failed`` (made and stored on a miss). Raises :class:`StageLostError`.

        The renamed plan is kept too, so asking again for the same set is a dictionary lookup. ``slow``: live
        workers slower than their stage by the given factors (fail-slow; :attr:`CostModel.slow`).
        """
        exact = frozenset((int(p), int(s)) for p, s in failed)
        costs = self.costs.with_slow({w: f for w, f in (slow or {}).items() if w not in exact})
        if costs.slow:
            slow_key = (exact, costs.slow)
            if slow_key not in self._slow:
                self._slow[slow_key] = make_plan(self.stages, self.pipelines, self.microbatches, costs, exact,
                                            iterations=self.iterations, schedule=self.schedule,
                                            optimizer=self.optimizer, memory_limit=self.memory_limit)
            return self._slow[slow_key]
        hit = self._renamed.get(exact)
        if hit is not None:
            return hit
        key, perm = normalize_failures(exact, self.stages, self.pipelines)
        plan = self._plan(key)
        inverse = [0] * self.pipelines
        for p, place in enumerate(perm):
            inverse[place] = p
        plan = plan if perm == tuple(range(self.pipelines)) else plan.relabel(inverse)
        self._renamed[exact] = plan
        return plan

    def time_per_iteration(self, failed: Iterable[Worker]) -> float:
        """Planned time per iteration under ``failed`` (no renaming needed)."""
        return self._plan(normalize_failures(failed, self.stages, self.pipelines)[0]).time_per_iteration

    def keys_up_to(self, max_failures: int) -> list[FailureKey]:
        """Every normalized failure set of at most ``max_failures`` workers that loses no whole stage."""
        workers = [(p, s) for p in range(self.pipelines) for s in range(self.stages)]
        keys: dict[FailureKey, None] = {}
        for n in range(max_failures + 1):
            for combo in itertools.combinations(workers, n):
                counts = [0] * self.stages
                for _, s in combo:
                    counts[s] += 1
                if max(counts) < self.pipelines:
                    keys.setdefault(normalize_failures(combo, self.stages, self.pipelines)[0])
        return list(keys)

    def precompute(self, max_failures: int = 2) -> int:
        """Make the plan of every failure set of up to ``max_failures`` workers; returns how many distinct."""
        keys = self.keys_up_to(max_failures)
        with gc_paused():
            for key in keys:
                self._plan(key)
        if gc.isenabled():
            # the collector's first full pass over the new plans (~10^6 objects, about a second) happens now,
            # ahead of time, not in the first lookup after a failure; it then waits for as many new objects again
            gc.collect()
        return len(keys)

    def _make(self, key: FailureKey) -> Plan:
        return make_plan(self.stages, self.pipelines, self.microbatches, self.costs, _failed_of(key),
                         iterations=self.iterations, schedule=self.schedule, optimizer=self.optimizer,
                         memory_limit=self.memory_limit)

    def save(self, path: str | Path) -> None:
        """Write the cache as JSON (gzip-compressed when the name ends in ``.gz``)."""
        doc = {"format": "ds-recycle-plan-cache/1", "schedule": self.schedule,
               "plans": [{"key": [list(t) for t in key], "plan": plan.to_json()} for key, plan in self._plans.items()],
               **self._params()}
        data = json.dumps(doc).encode("utf-8")
        Path(path).write_bytes(gzip.compress(data, 6) if str(path).endswith(".gz") else data)

    def _params(self) -> dict[str, Any]:
        return {"stages": self.stages, "pipelines": self.pipelines, "microbatches": self.microbatches,
                "iterations": self.iterations, "optimizer": self.optimizer, "memory_limit": self.memory_limit,
                "costs": self.costs.to_json()}

    @classmethod
    def load(cls, path: str | Path) -> PlanCache:
        """Read a cache written by :meth:`save`."""
        raw = Path(path).read_bytes()
        try:
            doc = json.loads(gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw)
            cache = cls(doc["stages"], doc["pipelines"], doc["microbatches"], CostModel.from_json(doc["costs"]),
                        iterations=doc["iterations"], schedule=doc["schedule"], optimizer=doc["optimizer"],
                        memory_limit=doc["memory_limit"])
            for entry in doc["plans"]:
                key = tuple(tuple(t) for t in entry["key"])
                cache._plans[key] = Plan.from_json(entry["plan"], schedule=doc["schedule"])
        except (KeyError, TypeError, ValueError) as exc:
            if isinstance(exc, PlanError):
                raise
            raise PlanError(f"plan cache {str(path)!r} is malformed: {exc!r}. "
                            f"Fix: write it with PlanCache.save") from exc
        return cache


