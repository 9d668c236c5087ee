"""Shared fixtures: the shipped traces folder and a tiny, hand-computable job."""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from ds_recycle.cluster.assumptions import Assumptions, resolve_assumptions
from ds_recycle.cluster.timing import JobShape
from ds_recycle.cluster.workload import Workload, workload_from_costs_file

REPO = Path(__file__).resolve().parents[2]
TRACES = REPO.parent / "shared" / "traces" / "oobleck"


@pytest.fixture(scope="session")
def traces_dir() -> Path:
    """The shipped Oobleck traces; a missing folder is an error naming the path, never a skip."""
    if not TRACES.is_dir():
        pytest.fail(f"the shipped traces are missing: expected the folder {TRACES} "
                    "(the repository's parent must hold shared/traces/oobleck/)")
    return TRACES


#: S=2, D=2, M=4, F=B=W=0.1 s, no comm, no optimizer cost: 1F1B takes (m + n - 1) * 0.6 / n s.
SHAPE = JobShape(stages=2, pipelines=2, microbatches=4)


@pytest.fixture()
def tiny_workload(tmp_path: Path) -> Workload:
    path = tmp_path / "costs.json"
    path.write_text(json.dumps({"F": [0.1, 0.1], "B": [0.1, 0.1], "W": [0.1, 0.1], "O": [0.0, 0.0],
                                "comm": 0.0, "note": "extra keys are ignored"}))
    return workload_from_costs_file(path, micro_batch=1, state_gb=1.0, reconfigure_s=5.0,
                                    restart_s=100.0)


@pytest.fixture()
def tiny_assumptions(tiny_workload: Workload) -> Assumptions:
    """Round numbers; no checkpoint within an hour unless a test sets one."""
    a = resolve_assumptions(tiny_workload, SHAPE, job_mtbf_s=3600.0)
    return replace(a, checkpoint_interval_s=1e9, checkpoint_cost_s=10.0, restart_s=100.0,
                   reconfigure_s=5.0, rejoin_copy_s=1.0, oobleck_reconfigure_s=5.0,
                   oobleck_min_nodes=1, bamboo_reconfigure_s=50.0, node_start_s=45.0)
