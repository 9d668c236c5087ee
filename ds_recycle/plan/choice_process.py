"""A partition choice made in a child process, so that the training process that asked for it goes on at full speed.

The planner is pure Python. A choice (:func:`~ds_recycle.plan.partition.choose_partition`: some 50 plans, seconds
to tens of seconds at 4 x 4 with M = 8) made in a thread of a training process holds that process's interpreter
while it runs, and the training thread beside it dispatches its work at a fraction of its pace. In a child process
the choice costs the training nothing but a core. The child reads one request (JSON) on stdin, writes one answer on
stdout, and leaves as soon as its parent is gone::

    python -m ds_recycle.plan.choice_process < request.json > answer.json

:func:`choice_request` builds a request, :func:`answer` computes one (what the child runs), :func:`choose_in_child`
runs the child and returns its answer.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from ds_recycle.plan.errors import PlanError
from ds_recycle.plan.partition import LayerCosts, Pinned, choose_partition, partitioned_plan

__all__ = ["choice_request", "answer", "choose_in_child"]

_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])
"""The folder that holds the ``ds_recycle`` package (the child imports it from there)."""


def choice_request(layers: LayerCosts, stages: int, pipelines: int, microbatches: int,
                   failed: Iterable[tuple[int, int]], current: Sequence[int], *, horizon: int,
                   pinned: Pinned | None = None, slow: Mapping[tuple[int, int], float] | None = None,
                   plan_options: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The JSON request for a choice: the arguments of ``choose_partition``, and ``plan_options`` for the plan
    made on the partition chosen (``partitioned_plan``; ``memory_limit`` among them also bounds the candidates)."""
    return {"layers": layers.to_json(), "stages": stages, "pipelines": pipelines, "microbatches": microbatches,
            "failed": sorted([int(p), int(s)] for p, s in failed), "current": [int(x) for x in current],
            "horizon": horizon, "pinned": sorted([int(i), int(s)] for i, s in (pinned or {}).items()),
            "slow": sorted([int(p), int(s), float(f)] for (p, s), f in (slow or {}).items()),
            "plan_options": dict(plan_options or {})}


def answer(request: Mapping[str, Any]) -> dict[str, Any]:
    """The choice for ``request``: ``partition`` (the one chosen; the current one to stay), ``plan`` (the plan
    format, None when staying), ``planned_before`` and ``planned_after`` (the planned iteration times), ``why``."""
    layers = LayerCosts(**request["layers"])
    S, D, M = int(request["stages"]), int(request["pipelines"]), int(request["microbatches"])
    failed = [(int(p), int(s)) for p, s in request["failed"]]
    current = tuple(int(x) for x in request["current"])
    pinned = {int(i): int(s) for i, s in request["pinned"]}
    slow = {(int(p), int(s)): float(f) for p, s, f in request["slow"]}
    options = dict(request["plan_options"])
    choice = choose_partition(layers, S, D, M, failed, current, horizon=int(request["horizon"]),
                              memory_limit=options.get("memory_limit"), pinned=pinned or None, slow=slow)
    plan = None
    if choice.partition != current:
        plan = partitioned_plan(layers, choice.partition, S, D, M, failed, slow, **options).to_json()
    return {"partition": list(choice.partition), "plan": plan, "planned_before": choice.current_iteration_s,
            "planned_after": choice.moved_iteration_s, "why": choice.describe()}


def choose_in_child(request: Mapping[str, Any], timeout_s: float) -> dict[str, Any]:
    """:func:`answer` for ``request``, computed by a child process (see the module docstring); :class:`PlanError`
    when the child fails or takes longer than ``timeout_s`` (it is then killed)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_PACKAGE_ROOT, env.get("PYTHONPATH", "")) if p)
    try:
        done = subprocess.run([sys.executable, "-m", "ds_recycle.plan.choice_process"], input=json.dumps(request),
                              capture_output=True, text=True, timeout=timeout_s, env=env, check=False)
    except subprocess.TimeoutExpired as e:
        raise PlanError(f"the partition choice took longer than {timeout_s:g} s (its child process was killed)") from e
    if done.returncode != 0:
        tail = done.stderr.strip().splitlines()[-1:] or ["no output"]
        raise PlanError(f"the partition choice's child process exited with {done.returncode}: {tail[0]}")
    out: dict[str, Any] = json.loads(done.stdout)
    return out


def _leave_with(parent: int) -> None:
    """Exit at once when ``parent`` is gone (re-parented: a killed worker leaves no planner behind for long)."""
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(1)


def main() -> int:
    threading.Thread(target=_leave_with, args=(os.getppid(),), daemon=True).start()
    sys.stdout.write(json.dumps(answer(json.loads(sys.stdin.read()))))
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
