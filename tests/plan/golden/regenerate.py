"""Regenerate the golden plans of tests/plan/test_golden.py:

    PYTHONPATH=. python tests/plan/golden/regenerate.py
"""
from __future__ import annotations

import json
from pathlib import Path

from ds_recycle.plan import CostModel, make_plan

HERE = Path(__file__).parent

#: name -> (stages, pipelines, microbatches, (F, B, W, O, comm), failed, make_plan keywords)
CASES: dict[str, tuple] = {
    "1f1b_s4_d1_m8": (4, 1, 8, (1, 1, 1, 0, 0), [], {"schedule": "1f1b", "optimizer": "synchronous"}),
    "zbh1_s4_d1_m8": (4, 1, 8, (1, 1, 1, 0, 0), [], {"schedule": "zb-h1", "optimizer": "synchronous"}),
    "adaptive_s4_d2_m8_k2_fail_1_2": (4, 2, 8, (1, 1, 1, 0.5, 0.05), [(1, 2)], {"iterations": 2}),
    "adaptive_s3_d3_m4_fail_0_0_1_1_mem4": (3, 3, 4, (1, 2, 1, 0.5, 0.1), [(0, 0), (1, 1)], {"memory_limit": 4}),
}


def build(name: str) -> dict:
    """The plan document of one golden case."""
    stages, pipelines, microbatches, (f, b, w, o, comm), failed, kwargs = CASES[name]
    costs = CostModel.uniform(stages, f, b, w, o, comm)
    return make_plan(stages, pipelines, microbatches, costs, failed, **kwargs).to_json()


def main() -> None:
    for name in CASES:
        (HERE / f"{name}.json").write_text(json.dumps(build(name), indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
